"""Run a repository script under the project's own virtualenv (`.venv`), creating it if needed.

scripts/bench-tick, bench-sim and make-trace are Python files that import this tree's
slurm_idle, whose dependencies (pydantic, prometheus_client, ...) live in `.venv`, made by
scripts/lib/install.sh's `install_python_env` (as scripts/test, demo and sandbox do). Run from
a fresh clone with a bare `python3` (the shebang), a script calls `use_project_python()`
before importing slurm_idle: it makes or updates `.venv` and re-executes itself with
`.venv/bin/python`. Already in `.venv` (or loaded as a module by a test), it does nothing.
Standard library only: it runs before any dependency is importable.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def in_project_venv(root: Path = ROOT) -> bool:
    """True when this interpreter is the tree's own `.venv` python."""
    venv = root / ".venv"
    return venv.is_dir() and Path(sys.prefix).resolve() == venv.resolve()


def use_project_python(script: str, root: Path = ROOT) -> None:
    """Re-execute `script` (with the same arguments) under `root/.venv/bin/python`, after
    making or updating the venv; return at once when already running there."""
    if in_project_venv(root) or os.environ.get("SLURM_IDLE_NO_VENV") == "1":
        return
    install = f". {root / 'scripts/lib/install.sh'} && install_python_env"
    python = root / ".venv" / "bin" / "python"
    if not python.exists():
        print(f"slurm-idle: making {root / '.venv'} (once, a few minutes)", file=sys.stderr)
    done = subprocess.run(["bash", "-c", install], cwd=root, check=False)
    if done.returncode != 0 or not python.exists():
        sys.exit(f"slurm-idle: could not set up {root / '.venv'} (is python3-venv installed? "
                 "`apt-get install python3-venv`), see the messages above")
    # Re-exec once only: a venv that somehow is not recognised must not loop.
    os.environ["SLURM_IDLE_NO_VENV"] = "1"
    os.execv(str(python), [str(python), str(Path(script).resolve()), *sys.argv[1:]])
