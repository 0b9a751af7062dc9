"""Commands' modules are imported when a command runs: the map names every command, and a
command that only reads the journal imports neither the agent nor its adapters."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import click
from click.testing import CliRunner

from slurm_idle.cli import COMMAND_MODULES, load_all, main

from .test_cli_errors import write_config


def _config(tmp_path: Path, journal: Path) -> Path:
    return write_config(tmp_path, journal, tmp_path / "tick.lock")

def test_the_map_names_every_command_and_only_those() -> None:
    """A command added to a module but not to COMMAND_MODULES would vanish from the CLI."""
    load_all()
    assert set(main.commands) == set(COMMAND_MODULES)
    for name, module in COMMAND_MODULES.items():
        callback = main.commands[name].callback
        if isinstance(main.commands[name], click.Group):
            continue  # a group's callback may live in the same module; its commands do
        assert callback is not None and callback.__module__ == f"slurm_idle.cli.{module}", name


def test_help_lists_every_command() -> None:
    out = CliRunner().invoke(main, ["--help"]).output
    for name in COMMAND_MODULES:
        assert f"  {name} " in out, name


def test_explain_imports_neither_the_agent_nor_the_metrics(tmp_path: Path) -> None:
    journal = tmp_path / "journal.jsonl"
    journal.write_text('{"event": "transition", "ts": 1.0, "node": "gpu1", "model": "m", '
                       '"action": "lend", "from": "serving", "to": "retiring", "reason": "r", '
                       '"outcome": "ok", "duration_s": 0.1}\n')
    code = ("import sys\nfrom slurm_idle.cli import entry\n"
            "try:\n    entry()\nexcept SystemExit:\n    pass\n"
            "print(sorted(m for m in sys.modules if m in {'slurm_idle.wiring', 'slurm_idle.agent',"
            " 'slurm_idle.metrics.prometheus', 'slurm_idle.cli.simulate_cmd', 'requests'}))")
    proc = subprocess.run([sys.executable, "-c", code, "--config", str(_config(tmp_path, journal)),
                           "explain", "--json"], capture_output=True, text=True, timeout=60,
                          check=False)
    assert '"node": "gpu1"' in proc.stdout, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "[]", proc.stdout


def test_explain_of_an_unknown_node_answers_before_reading_the_journal(tmp_path: Path) -> None:
    """The journal path is a directory (unreadable as a journal): an unknown node is still just
    bad input (exit 2), so nothing was read."""
    journal = tmp_path / "journal-is-a-dir"
    journal.mkdir()
    proc = subprocess.run([sys.executable, "-m", "slurm_idle.cli", "--config",
                           str(_config(tmp_path, journal)), "explain", "gpu99"],
                          capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 2, proc.stderr
    assert "gpu99 is not a pool node" in proc.stderr
    known = subprocess.run([sys.executable, "-m", "slurm_idle.cli", "--config",
                            str(_config(tmp_path, journal)), "explain", "gpu1"],
                           capture_output=True, text=True, timeout=60, check=False)
    assert known.returncode != 0 and "journal" in known.stderr  # the same path, read: an error


def test_a_mistyped_command_still_gets_did_you_mean() -> None:
    """click suggests from the commands registered: a typo loads them all first."""
    out = CliRunner().invoke(main, ["explai"])
    assert out.exit_code == 2
    assert "Did you mean one of: 'explain'" in out.output
