"""A job's own `--signal=[{R|B}:]SIG[@TIME]`, read back from its batch script (Slurm's job JSON does
not carry it): what the evictor sends before a requeue.
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class JobSignal:
    """A job's `--signal=[{R|B}:]SIG[@TIME]`: the signal it asked for before its end, and
    whether to the batch shell only (`B:`) or to its steps (Slurm's default)."""

    signal: str  # a name without SIG (USR2) or a number, as scancel --signal takes it
    batch_shell: bool = False


_SIGNAL_OPTION = re.compile(r"^(?:(?P<flags>[RB]+):)?(?P<sig>[A-Za-z0-9+]+)(?:@\d+)?$")


def parse_signal_option(value: str) -> JobSignal | None:
    """`B:USR2@60` -> JobSignal("USR2", batch_shell=True); None for anything else."""
    m = _SIGNAL_OPTION.match(value.strip())
    if m is None:
        return None
    sig = m.group("sig").upper().removeprefix("SIG")
    if not sig.replace("+", "").isalnum():
        return None
    return JobSignal(sig, batch_shell="B" in (m.group("flags") or ""))


def signal_from_script(script: str) -> JobSignal | None:
    """The `#SBATCH --signal` of a batch script, as sbatch reads it: `#SBATCH` lines up to the
    first command (submitit writes `#SBATCH --signal=USR2@90` there). Slurm's job JSON does
    not carry the option (neither 22.05 nor 24.11: checked on captured output), so the
    script is where it can be read back; `--signal` given on the sbatch command line is not
    visible anywhere and gets the configured default."""
    found: JobSignal | None = None
    for line in script.splitlines()[1:] if script.startswith("#!") else script.splitlines():
        stripped = line.strip()
        if not stripped or (stripped.startswith("#") and not stripped.startswith("#SBATCH")):
            continue
        if not stripped.startswith("#SBATCH"):
            break  # sbatch stops reading options at the first command
        words = stripped[len("#SBATCH"):].split()
        for i, word in enumerate(words):
            if word.startswith("--signal="):
                found = parse_signal_option(word.split("=", 1)[1]) or found
            elif word == "--signal" and i + 1 < len(words):
                found = parse_signal_option(words[i + 1]) or found
    return found
