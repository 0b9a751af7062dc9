"""Under cron stderr is discarded: fatal errors must reach syslog (`--syslog`) as well."""

from __future__ import annotations

import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from slurm_idle.cli import main
from slurm_idle.cli.common import run_guarded
from slurm_idle.logs import setup_logging


@pytest.fixture
def syslog_socket(monkeypatch: pytest.MonkeyPatch) -> Iterator[socket.socket]:
    """A real datagram socket standing in for /dev/log (short path: AF_UNIX has a limit)."""
    from slurm_idle import logs

    with tempfile.TemporaryDirectory(prefix="si-log") as tmp:
        path = str(Path(tmp) / "log")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        sock.bind(path)
        sock.settimeout(5)
        monkeypatch.setattr(logs, "SYSLOG_SOCKET", path)
        try:
            yield sock
        finally:
            sock.close()
            setup_logging()


def test_a_fatal_config_error_goes_to_syslog_once_and_to_stderr_once(
    syslog_socket: socket.socket, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--syslog` with a broken config: one `error:` line on stderr, and the same in syslog."""
    bad = tmp_path / "c.yaml"
    bad.write_text("models: [\n")
    with pytest.raises(SystemExit) as exit_:
        run_guarded(main, ["--syslog", "--config", str(bad), "tick"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and "YAML syntax error" in err
    message = syslog_socket.recv(4096).decode()
    assert "slurm-idle[" in message and "error:" in message and "YAML syntax error" in message
    assert message.startswith("<11>")  # facility user, severity error


def test_without_syslog_nothing_is_sent(
    syslog_socket: socket.socket, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Without `--syslog` the error is printed on stderr only."""
    with pytest.raises(SystemExit):
        run_guarded(main, ["--config", str(tmp_path / "missing.yaml"), "tick"])
    assert capsys.readouterr().err.count("error:") == 1
    syslog_socket.settimeout(0.2)
    with pytest.raises(TimeoutError):
        syslog_socket.recv(4096)


def test_a_missing_syslog_socket_is_said_once_per_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`slurm-idle --syslog config check X -v` sets logging up twice (the options after the
    command too): on a host without /dev/log the warning is one line, not one per setup (cron
    would mail it every minute twice)."""
    from slurm_idle import logs

    monkeypatch.setattr(logs, "SYSLOG_SOCKET", str(tmp_path / "no-log"))
    monkeypatch.setattr(logs, "_warned", set())
    good = tmp_path / "c.yaml"
    good.write_text("models: []\n")
    try:
        run_guarded(main, ["--syslog", "--config", str(good), "config", "check", str(good), "-v"])
    except SystemExit:
        pass
    finally:
        setup_logging()
    assert capsys.readouterr().err.count("no syslog socket") == 1
