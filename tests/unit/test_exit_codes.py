"""One exit-code table for every command: 0 ok, 1 failed, 2 bad input, 3 refused, 130 interrupted."""

from __future__ import annotations

import re
import socket
from pathlib import Path
from typing import Any

import click
import pytest
from click.testing import CliRunner, Result

from slurm_idle import admin
from slurm_idle.agent import Agent
from slurm_idle.cli import main
from slurm_idle.cli.common import Context, run_guarded
from slurm_idle.config import Config
from slurm_idle.errors import (
    EXIT_CODE_MEANINGS,
    BadInput,
    ConfigError,
    ExitCode,
    NotBuiltYet,
    Refused,
)
from slurm_idle.lifecycle import IllegalTransition
from slurm_idle.logs import setup_logging

from .test_admin import CONFIG, adopted


class Guarded:
    """`slurm-idle` as the console script runs it (run_guarded: errors become exit codes), in
    a CliRunner so stdout and stderr are captured apart."""

    name = "slurm-idle"

    def __init__(self, obj: Context | None) -> None:
        self.obj = obj

    def main(self, args: Any, prog_name: str, **extra: Any) -> None:
        run_guarded(main, list(args), **({} if self.obj is None else {"obj": self.obj}))


def run(tmp_path: Path, agent: Agent | None, *args: str, **env: str) -> Result:
    path = tmp_path / "c.yaml"
    path.write_text(CONFIG.format(tmp=tmp_path))

    def factory(config: Config, *, read_only: bool = False) -> Agent:
        assert agent is not None
        return agent

    try:
        return CliRunner(env=env).invoke(Guarded(Context(agent_factory=factory)),  # type: ignore[arg-type]
                                         ["--config", str(path), *args])
    finally:
        setup_logging()


def test_help_shows_the_table_of_errors_py() -> None:
    """The epilog of `slurm-idle --help` lists exactly the codes and meanings of ExitCode."""
    text = CliRunner().invoke(main, ["--help"]).stdout
    shown = dict(re.findall(r"^\s+(\d+)  (.+)$", text.split("Exit codes")[1], re.MULTILINE))
    assert {int(code): meaning for code, meaning in shown.items()} == {
        int(code): meaning for code, meaning in EXIT_CODE_MEANINGS.items()}
    assert set(EXIT_CODE_MEANINGS) == set(ExitCode)
    assert [int(c) for c in ExitCode] == [0, 1, 2, 3, 130]


def test_the_docs_show_the_same_table() -> None:
    """The admin docs' exit-code table (README's commands section, or docs/ once the README is
    split) is EXIT_CODE_MEANINGS row for row: one table, written down once per audience."""
    root = Path(__file__).resolve().parents[2]
    want = [(int(code), text) for code, text in EXIT_CODE_MEANINGS.items()]
    found = []
    for doc in [root / "README.md", *sorted((root / "docs").glob("*.md"))]:
        rows = re.findall(r"^\| (\d+) \| ([^|]+?) \|$", doc.read_text(), re.MULTILINE)
        if rows and [int(c) for c, _ in rows][:2] == [0, 1]:
            found.append((doc.name, [(int(c), t) for c, t in rows]))
    assert [name for name, _ in found], "no exit-code table in README.md or docs/*.md"
    for name, rows in found:
        assert rows == want, name


def test_the_error_classes_carry_the_table_codes() -> None:
    """Bad input and config are 2; a safety refusal, an illegal transition and `not built` 3."""
    assert BadInput.exit_code == ConfigError.exit_code == ExitCode.BAD_INPUT == 2
    assert Refused.exit_code == NotBuiltYet.exit_code == IllegalTransition.exit_code == 3


@pytest.mark.parametrize("command", ["lend", "reclaim", "pin", "unpin", "explain"])
def test_an_unknown_node_is_bad_input(tmp_path: Path, command: str) -> None:
    """Every command that takes a node exits 2 for a name the pool does not have."""
    agent, _ = adopted(tmp_path)
    result = run(tmp_path, agent, command, "gpu99")
    assert result.exit_code == 2, result.output
    assert "gpu99 is not a pool node" in result.stderr and result.stdout == ""
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr


def test_an_unknown_replica_job_is_bad_input(tmp_path: Path) -> None:
    """MODEL#INDEX that names no `placement: jobs` replica is bad input too."""
    agent, _ = adopted(tmp_path)
    result = run(tmp_path, agent, "lend", "m#7")
    assert result.exit_code == 2 and "m#7 is not a replica" in result.stderr


def test_safety_refusals_exit_3(tmp_path: Path) -> None:
    """A pinned node's lend, an admin-drained node, a node in the wrong phase: refused, exit 3."""
    agent, slurm = adopted(tmp_path)
    admin.pin(agent, "gpu1")
    slurm.drain("gpu2", "admin: disk check")  # type: ignore[attr-defined]
    for args, words in [(("lend", "gpu1"), "pinned"), (("lend", "gpu2"), "admin"),
                        (("pin", "gpu2"), "admin"), (("reclaim", "gpu3"), "not lent")]:
        result = run(tmp_path, agent, *args)
        assert result.exit_code == 3, (args, result.output)
        assert words in result.stderr, (args, result.stderr)


def test_a_failed_action_exits_1(tmp_path: Path) -> None:
    """Slurm refusing the Reason write of a pin is an action that failed: exit 1."""
    agent, slurm = adopted(tmp_path)
    slurm.fail_on.add("drain")  # type: ignore[attr-defined]
    result = run(tmp_path, agent, "pin", "gpu3")
    assert result.exit_code == 1 and "drain failed" in result.stderr


def test_an_unknown_pipeline_is_bad_input(tmp_path: Path) -> None:
    """`pipeline status NAME` for a name never submitted here: exit 2, naming it."""
    result = run(tmp_path, None, "pipeline", "status", "nosuch",
                 SLURM_IDLE_STATE_DIR=str(tmp_path / "state"))
    assert result.exit_code == 2, result.output
    assert "no record of a pipeline named 'nosuch'" in result.stderr


def test_a_bad_flag_is_usage_exit_2(tmp_path: Path) -> None:
    result = run(tmp_path, None, "tick", "--no-such-flag")
    assert result.exit_code == 2 and "no-such-flag" in result.stderr


def test_simulate_names_the_missing_trace_before_the_fleet(tmp_path: Path) -> None:
    """`simulate missing.csv` without --fleet or a config: the missing file is the error (2)."""
    missing = tmp_path / "missing.csv"
    result = CliRunner(env={"SLURM_IDLE_CONFIG": str(tmp_path / "none.yaml")}).invoke(
        Guarded(None), ["simulate", str(missing)])  # type: ignore[arg-type]
    setup_logging()
    assert result.exit_code == 2, result.output
    assert f"{missing}: trace file not found" in result.stderr
    assert "fleet" not in result.stderr


def test_web_on_a_port_in_use_exits_2_before_claiming_to_serve(tmp_path: Path) -> None:
    """A port another process listens on: exit 2 naming it, and no `serving http://` line."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = run(tmp_path, None, "web", "--port", str(port))
    assert result.exit_code == 2, result.output
    assert f"127.0.0.1:{port}" in result.stderr and "in use" in result.stderr
    assert "serving" not in result.output


def test_an_interrupt_exits_130(capsys: pytest.CaptureFixture[str]) -> None:
    """Ctrl-C in any command is 130, without a traceback."""
    @click.command()
    def interrupted() -> None:
        raise KeyboardInterrupt

    with pytest.raises(SystemExit) as exit_:
        run_guarded(interrupted, [])
    assert exit_.value.code == ExitCode.INTERRUPTED == 130
    assert "Traceback" not in capsys.readouterr().err
