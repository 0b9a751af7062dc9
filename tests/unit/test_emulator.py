"""The vLLM emulator without daemons: its metric page, capacity model, load sharing, HTTP API."""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from slurm_idle.testing.emulator import Emulator, count_awake, read_rps
from slurm_idle.testing.emulator_http import serve_in_thread
from slurm_idle.testing.engine_model import Capacity, EngineModel

LABELS = {"model_name": "m", "engine": "0"}


def families(model: EngineModel) -> dict[str, object]:
    return {f.name: f for f in text_string_to_metric_families(model.render().decode())}


def sample(model: EngineModel, name: str, **labels: str) -> float:
    want = {**LABELS, **labels}
    for fam in text_string_to_metric_families(model.render().decode()):
        for s in fam.samples:
            if s.name == name and s.labels == want:
                return float(s.value)
    raise KeyError(f"{name} {want}")


def run(model: EngineModel, seconds: float, rps: float, dt: float = 0.1) -> None:
    for _ in range(round(seconds / dt)):
        model.step(dt, rps)


def test_metric_page_has_vllm_v1_names_and_types() -> None:
    """/metrics parses and carries vLLM v1 gauges, counters and histograms with their types."""
    fams = families(EngineModel("m"))
    expected = {
        "vllm:num_requests_running": "gauge", "vllm:num_requests_waiting": "gauge",
        "vllm:kv_cache_usage_perc": "gauge", "vllm:engine_sleep_state": "gauge",
        "vllm:prompt_tokens": "counter", "vllm:generation_tokens": "counter",
        "vllm:num_preemptions": "counter", "vllm:request_success": "counter",
        "vllm:time_to_first_token_seconds": "histogram",
        "vllm:inter_token_latency_seconds": "histogram",
        "vllm:e2e_request_latency_seconds": "histogram",
        "vllm:request_queue_time_seconds": "histogram",
    }
    assert {name: fams[name].type for name in expected} == expected  # type: ignore[attr-defined]


def test_metric_samples_carry_model_and_engine_labels() -> None:
    """Every sample is labelled model_name and engine="0"; counters export _total and _created."""
    page = EngineModel("m").render().decode()
    names = set()
    for fam in text_string_to_metric_families(page):
        for s in fam.samples:
            assert s.labels["model_name"] == "m" and s.labels["engine"] == "0", s
            names.add(s.name)
    for counter in ("vllm:prompt_tokens", "vllm:generation_tokens", "vllm:request_success"):
        assert {f"{counter}_total", f"{counter}_created"} <= names
    for hist in ("vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds"):
        assert {f"{hist}_bucket", f"{hist}_sum", f"{hist}_count"} <= names
    assert 'finished_reason="length"' in page and 'sleep_state="awake"' in page


def test_light_load_is_served_without_queueing() -> None:
    """At 0.2 req/s one replica keeps up: nothing waits and every request completes."""
    m = EngineModel("m")
    run(m, 60, 0.2)
    assert sample(m, "vllm:num_requests_waiting") == 0
    assert sample(m, "vllm:request_success_total", finished_reason="length") >= 10
    assert sample(m, "vllm:prompt_tokens_total") == pytest.approx(12 * 200)
    assert sample(m, "vllm:request_queue_time_seconds_sum") == 0


def test_overload_builds_a_queue_and_fills_the_kv_cache() -> None:
    """500 req/s spread over 4 replicas (125 each) saturates a replica: queue grows, KV cache full."""
    m = EngineModel("m")
    run(m, 5, 125.0)
    cap = Capacity()
    assert sample(m, "vllm:num_requests_running") == cap.max_num_seqs
    assert sample(m, "vllm:kv_cache_usage_perc") == 1.0
    assert sample(m, "vllm:num_requests_waiting") > 500
    gen = sample(m, "vllm:generation_tokens_total")
    assert gen <= cap.tokens_per_s * 5 + 1e-6  # throughput is capped


def test_throughput_matches_the_planner_capacity() -> None:
    """At saturation a replica generates tokens_per_s, i.e. weighted_tokens_per_s in planner units."""
    m = EngineModel("m")
    run(m, 20, 10.0)
    before_gen = sample(m, "vllm:generation_tokens_total")
    run(m, 10, 10.0)
    rate = (sample(m, "vllm:generation_tokens_total") - before_gen) / 10
    assert rate == pytest.approx(Capacity().tokens_per_s, rel=0.02)
    assert Capacity().weighted_tokens_per_s(0.1) == pytest.approx(600.0)


def test_a_queue_times_out_its_simulated_clients_not_the_real_ones() -> None:
    """Simulated requests queued past client_timeout_s are given up (abort); a request that a
    real client sent stays queued: that client decides when to give up (and the emulator then
    cancels it, which frees its place at once)."""
    m = EngineModel("m", Capacity(max_num_seqs=1), client_timeout_s=5.0)
    running = m.submit(10, 10_000)  # holds the only place for 200 s
    queued = m.submit(10, 10)
    run(m, 10, 2.0)  # 20 simulated requests queue behind it; those older than 5 s give up
    assert queued.finished_reason is None and queued in m.waiting
    assert 0 < sample(m, "vllm:request_success_total", finished_reason="abort") <= 20
    waiting = len(m.waiting)
    m.cancel(queued)
    assert queued.finished_reason == "abort" and queued not in m.waiting
    assert len(m.waiting) == waiting - 1
    m.cancel(running)
    assert running not in m.running and len(m.running) == 1  # the next one took its place


def test_sleep_aborts_work_and_stops_arrivals() -> None:
    """Sleeping aborts in-flight requests (counted as abort), flips the sleep gauge, takes no load."""
    m = EngineModel("m")
    run(m, 2, 5.0)
    assert sample(m, "vllm:num_requests_running") > 0
    aborted = m.abort_all()
    m.go_to_sleep(1)
    assert sample(m, "vllm:request_success_total", finished_reason="abort") == len(aborted)
    assert sample(m, "vllm:engine_sleep_state", sleep_state="weights_offloaded") == 1
    assert sample(m, "vllm:engine_sleep_state", sleep_state="awake") == 0
    run(m, 2, 5.0)
    assert sample(m, "vllm:num_requests_running") == 0
    m.wake_up()
    assert sample(m, "vllm:engine_sleep_state", sleep_state="awake") == 1


def test_load_is_shared_by_fresh_awake_replicas(tmp_path: Path) -> None:
    """count_awake counts only awake replicas with a fresh heartbeat and a live pid."""
    now = 1000.0
    entries = {"a": (True, now, 1), "b": (True, now - 10, 2), "c": (False, now, 3), "d": (True, now, 4)}
    for node, (awake, ts, pid) in entries.items():
        (tmp_path / f"{node}.json").write_text(json.dumps({"awake": awake, "ts": ts, "pid": pid}))
    assert count_awake(tmp_path, now, pid_alive=lambda pid: pid != 4) == 1


def test_read_rps_tolerates_missing_and_bad_files(tmp_path: Path) -> None:
    """The load file gives the total rate; missing or garbage means no load."""
    f = tmp_path / "load.json"
    assert read_rps(f) == 0.0
    f.write_text("{not json")
    assert read_rps(f) == 0.0
    f.write_text('{"rps": 2.5}')
    assert read_rps(f) == 2.5


@pytest.fixture
def served(tmp_path: Path):  # type: ignore[no-untyped-def]
    emu = Emulator(EngineModel("m"), "gpu1", tmp_path, None)
    port, stop = serve_in_thread(emu)
    threading.Thread(target=emu.run, daemon=True).start()
    yield f"http://127.0.0.1:{port}", emu
    emu.stop.set()
    stop()


def _call(url: str, data: bytes | None = None) -> tuple[int, bytes]:
    req = urllib.request.Request(url, data=data, method="POST" if data is not None else "GET")
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def test_http_completion_and_sleep_api(served) -> None:  # type: ignore[no-untyped-def]
    """Completions return usage; /sleep makes /is_sleeping true and completions 503; /wake_up undoes it."""
    url, _ = served
    assert _call(f"{url}/health")[0] == 200
    assert json.loads(_call(f"{url}/v1/models")[1])["data"][0]["id"] == "m"
    t0 = time.monotonic()
    code, body = _call(f"{url}/v1/completions", json.dumps({"model": "m", "prompt": "a b c", "max_tokens": 5}).encode())
    assert code == 200
    assert json.loads(body)["usage"] == {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8}
    assert time.monotonic() - t0 >= 0.05  # 5 tokens at 50 tok/s take ~0.1 s
    assert _call(f"{url}/v1/completions", b'{"model": "other"}')[0] == 404
    assert _call(f"{url}/sleep?level=1&mode=wait", b"")[0] == 200
    assert json.loads(_call(f"{url}/is_sleeping")[1]) == {"is_sleeping": True}
    assert _call(f"{url}/v1/completions", b'{"prompt": "x"}')[0] == 503
    assert _call(f"{url}/sleep?level=3", b"")[0] == 400
    assert _call(f"{url}/wake_up", b"")[0] == 200
    assert json.loads(_call(f"{url}/is_sleeping")[1]) == {"is_sleeping": False}
