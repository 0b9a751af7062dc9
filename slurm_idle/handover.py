"""The Reason of a node handed to the admin: a GPU still held past `timeouts.gpu_free_s`, or an
engine whose starts or wakes kept failing (start_retry.py).

Once handed over, the node is the admin's: its Reason is not one of our phase Reasons
(lifecycle.derive_phase reads it as ADMIN, so nothing of ours touches it again and the planner
no longer counts it), but it starts with our tag and names what holds it, so `status`, the
textfile (`slurm_idle_gpu_held`, alert SlurmIdleGpuHeld) and the admin can read it back:

    slurm-idle:gpu-held since=2026-12-06T23:00:00Z GPU 0: 20480 MiB, holder job 123;
    GPU 1: 512 MiB, holder unknown -- free them, then: scontrol update nodename=gpu2 state=resume

    slurm-idle:wake-failed since=2026-12-06T23:00:00Z replica gpu2: POST /wake_up answered
    500 ... -- fix it, then: scontrol update nodename=gpu2 state=resume

Resuming the node makes it an unmanaged pool node, which the planner adopts back into serving.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

from slurm_idle.journal import iso
from slurm_idle.policy.gpus import HeldGpu

WORD = "gpu-held"
_TAIL = " -- free them, then: scontrol update nodename="
WAKE_WORD = "wake-failed"
_WAKE_TAIL = " -- fix it, then: scontrol update nodename="
_REPLICA = re.compile(r"replica (\S+): (.*)")
_GPU = re.compile(r"GPU (\d+): (\d+) MiB, holder (.+)")
UNKNOWN_HOLDER = "unknown"
#: A node handed over with no reading of its own GPUs (another node of its group, or none).
_UNNAMED = "GPU not named (no reading of it)"


@dataclass(frozen=True)
class HeldEntry:
    """One GPU named in a hand-over Reason."""

    node: str
    gpu: int
    used_mib: int
    holder: str


def format_reason(tag: str, node: str, since: float, held: Iterable[HeldGpu]) -> str:
    """The Reason written on `node` (its own GPUs of `held`)."""
    gpus = "; ".join(f"GPU {g.index}: {g.used_mib} MiB, holder {g.holder or UNKNOWN_HOLDER}"
                     for g in held if g.node == node) or _UNNAMED
    return f"{tag}:{WORD} since={iso(since)} {gpus}{_TAIL}{node} state=resume"


def parse_reason(tag: str, node: str, reason: str) -> list[HeldEntry] | None:
    """The GPUs a hand-over Reason names; None when `reason` is not one."""
    head = f"{tag}:{WORD} since="
    if not reason.startswith(head) or _TAIL not in reason:
        return None
    body = reason[len(head):].split(_TAIL, 1)[0]
    _, _, gpus = body.partition(" ")
    out = []
    for part in gpus.split("; "):
        match = _GPU.fullmatch(part.strip())
        if match:
            out.append(HeldEntry(node, int(match.group(1)), int(match.group(2)), match.group(3)))
    # Handed over all the same: one entry (GPU -1, "unknown"), so the alert still fires.
    return out or [HeldEntry(node, -1, 0, UNKNOWN_HOLDER)]


@dataclass(frozen=True)
class WakeFailedEntry:
    """The replica named in a wake-failed Reason and the engine's last error."""

    node: str
    replica: str
    error: str


def format_wake_failed(tag: str, node: str, since: float, replica: str, error: str) -> str:
    """The Reason written on `node` when `replica`'s starts or wakes are given up."""
    text = " ".join(error.split())[:400]
    return f"{tag}:{WAKE_WORD} since={iso(since)} replica {replica}: {text}{_WAKE_TAIL}{node} state=resume"


def parse_wake_failed(tag: str, node: str, reason: str) -> WakeFailedEntry | None:
    """The replica and error a wake-failed Reason names; None when `reason` is not one."""
    head = f"{tag}:{WAKE_WORD} since="
    if not reason.startswith(head) or _WAKE_TAIL not in reason:
        return None
    body = reason[len(head):].split(_WAKE_TAIL, 1)[0]
    match = _REPLICA.fullmatch(body.partition(" ")[2])
    return WakeFailedEntry(node, match.group(1), match.group(2)) if match else None
