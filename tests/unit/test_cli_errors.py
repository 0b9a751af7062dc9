"""Whatever goes wrong, the CLI says it in one line with a non-zero exit, never a traceback."""

from __future__ import annotations

from pathlib import Path

import pytest

from slurm_idle.errors import SlurmIdleError
from slurm_idle.journal import Journal

from .test_config import run_cli

CONFIG = """
engine: {{kind: command, start_command: "true {{node}}", stop_command: "true {{node}}"}}
models:
  - name: m
    nodes: gpu[1-2]
    url: "http://127.0.0.1:1/{{node}}"
slurm: {{bin_dir: {bin_dir}}}
paths:
  journal: {journal}
  lock: {lock}
"""


def write_config(tmp_path: Path, journal: Path, lock: Path) -> Path:
    path = tmp_path / "c.yaml"
    path.write_text(CONFIG.format(bin_dir=tmp_path / "no-slurm-here", journal=journal, lock=lock))
    return path


def one_line_error(proc, *words: str) -> None:
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if "error" in ln]
    assert lines and all(w in lines[-1] for w in words), proc.stderr


def test_unusable_lock_and_journal_paths_are_one_line(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    cfg = write_config(tmp_path, journal=tmp_path, lock=blocker / "tick.lock")
    one_line_error(run_cli("--config", str(cfg), "tick"), "lock file", str(blocker))
    one_line_error(run_cli("--config", str(cfg), "explain"), "journal", str(tmp_path))


def test_journal_write_error_is_a_slurm_idle_error(tmp_path: Path) -> None:
    with pytest.raises(SlurmIdleError, match="cannot write the journal"):
        Journal(tmp_path).append({"event": "x"})


def test_an_unexpected_exception_is_one_line_and_v_shows_the_traceback(tmp_path: Path) -> None:
    """The last resort of the error guard: a bug prints one line (exit 1); -v the traceback."""
    import subprocess
    import sys

    code = (
        "import click, sys\n"
        "from slurm_idle.cli import main\n"
        "from slurm_idle.cli.common import run_guarded\n"
        "@main.command(name='boom')\n"
        "def boom():\n"
        "    raise RuntimeError('kaboom')\n"
        "run_guarded(main, sys.argv[1:])\n"
    )
    plain = subprocess.run([sys.executable, "-c", code, "boom"], capture_output=True, text=True,
                           timeout=60, check=False)
    assert plain.returncode == 1 and "Traceback" not in plain.stderr
    assert "slurm-idle: error: RuntimeError: kaboom (run with -v for the traceback)" in plain.stderr
    verbose = subprocess.run([sys.executable, "-c", code, "boom", "-v"], capture_output=True, text=True,
                             timeout=60, check=False)
    assert verbose.returncode == 1 and "Traceback" in verbose.stderr


def test_a_failed_tick_says_so_once_and_prints_no_plan(tmp_path: Path) -> None:
    cfg = write_config(tmp_path, journal=tmp_path / "j.jsonl", lock=tmp_path / "l.lock")
    proc = run_cli("--config", str(cfg), "tick")
    assert proc.returncode == 1
    assert "no action" not in proc.stdout
    assert proc.stderr.count("tick failed") == 1, proc.stderr
