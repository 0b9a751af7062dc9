"""-v/-q/--syslog work before and after a command, and -v really adds debug lines."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import click
import pytest

from slurm_idle.cli import load_all, main
from slurm_idle.commands import SubprocessRunner
from slurm_idle.logs import LOGGER_NAME, setup_logging

from .test_config import EXAMPLE, run_cli


def leaf_commands(group: click.Group, prefix: str = "") -> Iterator[tuple[str, click.Command]]:
    for name, cmd in group.commands.items():
        if isinstance(cmd, click.Group):
            yield from leaf_commands(cmd, f"{prefix}{name} ")
        else:
            yield f"{prefix}{name}", cmd


def test_every_command_takes_the_logging_options() -> None:
    """`slurm-idle tick -v` must parse like `slurm-idle -v tick`, for every command."""
    load_all()  # the top group imports its command modules lazily
    leaves = dict(leaf_commands(main))
    assert {"tick", "status", "report", "config check", "pipeline run"} <= set(leaves)
    for name, cmd in leaves.items():
        opts = {o for p in cmd.params for o in getattr(p, "opts", [])}
        assert {"-v", "--verbose", "-q", "--quiet", "--syslog"} <= opts, name


@pytest.mark.parametrize("args", [
    ["config", "check", str(EXAMPLE), "-v"],
    ["-v", "config", "check", str(EXAMPLE)],
    ["config", "check", str(EXAMPLE), "--quiet", "--syslog"],
])
def test_logging_options_before_or_after_the_command(args: list[str]) -> None:
    proc = run_cli(*args)
    assert proc.returncode == 0, proc.stderr
    assert "OK" in proc.stdout


def test_verbose_logs_every_slurm_command_with_its_duration(
    caplog: pytest.LogCaptureFixture,
) -> None:
    setup_logging(verbose=1)
    logger = logging.getLogger(LOGGER_NAME)
    logger.propagate = True  # let caplog see it
    try:
        with caplog.at_level(logging.DEBUG, logger=LOGGER_NAME):
            SubprocessRunner().run(["true"])
        assert any(r.levelno == logging.DEBUG and r.getMessage().startswith("ran true: rc=0 in ")
                   for r in caplog.records), caplog.text
    finally:
        setup_logging()


def stderr_level() -> int:
    (handler,) = [h for h in logging.getLogger(LOGGER_NAME).handlers
                  if type(h) is logging.StreamHandler]
    return handler.level


def test_stderr_gets_warnings_by_default_decisions_with_v_and_errors_with_q() -> None:
    """The decision (INFO) lines are made at every level, for syslog; stderr shows them only
    with -v, and -q leaves it only the errors."""
    logger = logging.getLogger(LOGGER_NAME)
    try:
        setup_logging()
        assert logger.isEnabledFor(logging.INFO) and not logger.isEnabledFor(logging.DEBUG)
        assert stderr_level() == logging.WARNING
        setup_logging(verbose=1)
        assert logger.isEnabledFor(logging.DEBUG) and stderr_level() == logging.DEBUG
        setup_logging(quiet=True)
        assert logger.isEnabledFor(logging.INFO) and stderr_level() == logging.ERROR
    finally:
        setup_logging()


def test_syslog_without_a_socket_says_so(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """cron runs `--syslog tick`: a host without /dev/log gets a warning, not silence."""
    from slurm_idle import logs

    monkeypatch.setattr(logs, "SYSLOG_SOCKET", str(tmp_path / "no-such-socket"))
    try:
        problems = setup_logging(syslog=True)
        assert problems and "no syslog socket" in problems[0]
    finally:
        setup_logging()
