"""`slurm-idle tick` as cron runs it: silent when nothing happened, each transition once."""

from __future__ import annotations

import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from slurm_idle.agent import Agent
from slurm_idle.cli import main
from slurm_idle.cli.common import Context
from slurm_idle.config import Config
from slurm_idle.logs import setup_logging
from slurm_idle.model import Action, ActionKind, Observation, Phase

from .test_admin import CONFIG, adopted

LEND_STEPS = ("serving -> retiring", "retiring -> lending", "lending -> lent")


def tick(tmp_path: Path, agent: Agent, *args: str) -> Result:
    """Run the CLI's tick on `agent` (the context's factory hands it in); stdout and stderr
    apart."""
    path = tmp_path / "c.yaml"
    path.write_text(CONFIG.format(tmp=tmp_path))

    def factory(config: Config, *, read_only: bool = False) -> Agent:
        return agent

    try:
        return CliRunner().invoke(main, ["--config", str(path), *args],
                                  obj=Context(agent_factory=factory))
    finally:
        setup_logging()  # the runner's stderr is gone: later tests get a fresh handler


def lend_gpu1_once(agent: Agent) -> None:
    """The agent's planner lends gpu1 at its next tick, then plans nothing."""
    done: list[bool] = []

    def planner(obs: Observation, cfg: Config, now: float) -> list[Action]:
        if done:
            return []
        done.append(True)
        return [Action(ActionKind.LEND, "gpu1", "m", Phase.SERVING, Phase.RETIRING, "idle for 30 min")]

    agent.planner = planner


def test_a_tick_with_nothing_to_do_prints_nothing(tmp_path: Path) -> None:
    """Cron mails only news: no transition means nothing on stdout, nothing on stderr, exit 0."""
    agent, _ = adopted(tmp_path)
    agent.planner = lambda obs, cfg, now: []
    result = tick(tmp_path, agent, "tick")
    assert (result.exit_code, result.stdout, result.stderr) == (0, "", "")


def test_a_tick_that_lends_prints_each_transition_once(tmp_path: Path) -> None:
    """One stdout line per transition, none of them repeated as a log line on stderr."""
    agent, _ = adopted(tmp_path)
    lend_gpu1_once(agent)
    result = tick(tmp_path, agent, "tick")
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert len(lines) == 3 and all(ln.startswith("lend gpu1: ") for ln in lines), lines
    for edge in LEND_STEPS:
        assert result.output.count(edge) == 1, result.output  # stdout and stderr together
    assert all("[ok]" in ln for ln in lines), lines
    assert result.stderr == ""


def test_a_step_still_waiting_is_not_news(tmp_path: Path) -> None:
    """An engine not healthy by the tick budget leaves its node starting: the edge taken
    (reclaiming -> starting) is printed, the wait for serving is not (no phase changed: a
    10-minute cold start must not mail every minute); exit 0; -v shows the waiting step's
    decision line on stderr."""
    from slurm_idle.lifecycle import format_reason

    from .test_agent import T0, continue_all, make_agent

    def waiting_agent() -> Agent:
        agent, slurm, engine, _, _ = make_agent(tmp_path, planner=continue_all)
        slurm.node_map["gpu3"] = slurm.node_map["gpu3"].__class__(
            name="gpu3", state="idle", flags=frozenset({"DRAIN"}),
            reason=format_reason("slurm-idle", Phase.RECLAIMING, T0))
        engine.up["gpu3"] = False
        engine.start_delay_polls = 50  # 50 s of polling > the 10 s budget
        return agent

    result = tick(tmp_path, waiting_agent(), "tick")
    assert result.exit_code == 0, result.output
    gpu3 = [ln for ln in result.stdout.splitlines() if ln.startswith("continue gpu3: ")]
    assert [ln.split(" [")[0] for ln in gpu3] == ["continue gpu3: reclaiming -> starting"], gpu3
    assert "[waiting]" not in result.stdout, result.stdout
    assert result.stderr == ""
    verbose = tick(tmp_path, waiting_agent(), "tick", "-v")
    assert "gpu3 starting -> serving" in verbose.stderr and "[waiting" in verbose.stderr, verbose.stderr


def test_verbose_adds_the_decision_lines_on_stderr(tmp_path: Path) -> None:
    """-v: the plan and step log lines appear on stderr (for a person at a terminal)."""
    agent, _ = adopted(tmp_path)
    lend_gpu1_once(agent)
    result = tick(tmp_path, agent, "tick", "-v")
    assert result.exit_code == 0, result.output
    assert "INFO plan: lend gpu1" in result.stderr
    assert len(result.stdout.splitlines()) == 3


def test_quiet_keeps_warnings_off_stderr_but_not_the_transitions(tmp_path: Path) -> None:
    """A metrics outage is a warning on stderr by default; -q hides it; stdout is the same."""
    agent, _ = adopted(tmp_path)
    agent.planner = lambda obs, cfg, now: []
    agent.metrics.fail = True  # type: ignore[attr-defined]
    loud = tick(tmp_path, agent, "tick")
    assert loud.exit_code == 0 and loud.stdout == ""
    assert loud.stderr.count("metrics unavailable") == 1, loud.stderr
    quiet = tick(tmp_path, agent, "tick", "-q")
    assert (quiet.exit_code, quiet.stdout, quiet.stderr) == (0, "", "")


def test_a_locked_out_tick_is_silent(tmp_path: Path) -> None:
    """Another tick holding the lock is routine under cron: exit 0, nothing printed (-v says it)."""
    from slurm_idle.lock import try_lock

    agent, _ = adopted(tmp_path)
    with try_lock(agent.config.paths.lock) as locked:
        assert locked
        result = tick(tmp_path, agent, "tick")
        verbose = tick(tmp_path, agent, "tick", "-v")
    assert (result.exit_code, result.stdout, result.stderr) == (0, "", "")
    assert verbose.exit_code == 0 and "another tick is running" in verbose.stderr


def test_dry_run_still_shows_the_plans(tmp_path: Path) -> None:
    """`tick --dry-run` is for a person: the model lines and what would be done."""
    agent, _ = adopted(tmp_path)
    lend_gpu1_once(agent)
    result = tick(tmp_path, agent, "tick", "--dry-run")
    assert result.exit_code == 0
    assert "would lend gpu1: serving -> retiring: idle for 30 min" in result.stdout
    assert result.stderr == ""


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


def test_syslog_gets_the_decisions_that_stderr_does_not(
    tmp_path: Path, syslog_socket: socket.socket
) -> None:
    """--syslog: the plan and each step reach syslog; stderr stays empty."""
    agent, _ = adopted(tmp_path)
    lend_gpu1_once(agent)
    result = tick(tmp_path, agent, "--syslog", "tick")
    assert result.exit_code == 0 and result.stderr == ""
    syslog_socket.setblocking(False)  # a unix datagram is queued once send() returns
    messages = []
    try:
        while True:
            messages.append(syslog_socket.recv(4096).decode())
    except BlockingIOError:
        pass
    assert any("plan: lend gpu1" in m for m in messages), messages
    assert sum("retiring -> lending" in m for m in messages) == 1, messages


def test_log_stderr_shows_the_decisions_without_debug(tmp_path: Path) -> None:
    """--log stderr: the plan and step lines on stderr (a person watching), no debug lines;
    stdout is the same one line per transition."""
    agent, _ = adopted(tmp_path)
    lend_gpu1_once(agent)
    result = tick(tmp_path, agent, "tick", "--log", "stderr")
    assert result.exit_code == 0, result.output
    assert "INFO plan: lend gpu1" in result.stderr and " DEBUG " not in result.stderr
    assert len(result.stdout.splitlines()) == 3


def test_log_syslog_is_syslog(tmp_path: Path, syslog_socket: socket.socket) -> None:
    """--log syslog sends the decisions where --syslog does; stderr stays empty."""
    agent, _ = adopted(tmp_path)
    lend_gpu1_once(agent)
    result = tick(tmp_path, agent, "--log", "syslog", "tick")
    assert result.exit_code == 0 and result.stderr == ""
    syslog_socket.setblocking(False)
    messages = []
    try:
        while True:
            messages.append(syslog_socket.recv(4096).decode())
    except BlockingIOError:
        pass
    assert any("plan: lend gpu1" in m for m in messages), messages


def test_a_tick_whose_step_failed_exits_1_and_says_it_once(tmp_path: Path) -> None:
    """A failed action exits 1 in every command (the exit-code table): a tick whose lend step
    errors (Slurm refused the drain) says so in exactly one line, on stderr (an error: even
    under -q), nothing on stdout (no phase changed), and exits 1 so a systemd timer shows the
    unit failed; the next tick retries it."""
    for flags in ((), ("-q",)):
        agent, slurm = adopted(tmp_path)
        lend_gpu1_once(agent)
        slurm.fail_on.add("drain")  # type: ignore[attr-defined]
        result = tick(tmp_path, agent, "tick", *flags)
        assert result.exit_code == 1, (flags, result.output)
        assert result.stdout == "", result.stdout
        assert result.output.count("drain failed (injected)") == 1, result.output
        (line,) = result.stderr.splitlines()
        assert "ERROR gpu1 serving -> retiring" in line and "[error" in line, line


def test_a_tick_json_with_a_failed_step_exits_1_too(tmp_path: Path) -> None:
    """--json does not change what the exit status means: the JSON, then exit 1."""
    import json

    agent, slurm = adopted(tmp_path)
    lend_gpu1_once(agent)
    slurm.fail_on.add("drain")  # type: ignore[attr-defined]
    result = tick(tmp_path, agent, "tick", "--json")
    assert result.exit_code == 1, result.output
    doc = json.loads(result.stdout)
    assert [s["outcome"] for s in doc["steps"]] == ["error"], doc["steps"]


def test_transitions_made_are_printed_even_when_the_tick_then_fails(tmp_path: Path) -> None:
    """A tick that lends gpu1 and then fails (writing the file_sd targets) still prints the three
    transitions it made, then its error line, and exits 1."""
    from slurm_idle.errors import SlurmIdleError

    agent, _ = adopted(tmp_path)
    lend_gpu1_once(agent)

    def broken(*args: object) -> None:
        raise SlurmIdleError("file_sd not writable (injected)")

    agent._write_file_sd = broken  # type: ignore[method-assign]
    result = tick(tmp_path, agent, "tick")
    assert result.exit_code == 1, result.output
    lines = result.stdout.splitlines()
    assert [ln.split(" [")[0] for ln in lines] == [f"lend gpu1: {e}" for e in LEND_STEPS], lines
    assert "file_sd not writable (injected)" in result.stderr
