"""Contract: the metrics adapters against the sandbox's real Prometheus and vLLM emulators.

Prometheus scrapes the 4 emulators every second; the sandbox config uses rate_window_s 10 and a
20 s scale-down window, so every wait below is bounded polling for the windows to fill, never a
blind sleep. Each test leaves the simulated load at 0.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from slurm_idle.config import Config, load_config
from slurm_idle.metrics.prometheus import PrometheusSource
from slurm_idle.metrics.scrape import ScrapeSource
from slurm_idle.model import ModelLoad, ReplicaLoad
from slurm_idle.testing.sandbox import Sandbox

pytestmark = pytest.mark.sandbox

KEYS = {"url", "model", "engine", "running", "waiting", "kv_cache_usage", "sleeping",
        "generation_tokens_per_s", "prompt_tokens_per_s", "ttft_p95_s", "queue_time_p95_s"}


def poll(check: Callable[[], Any], timeout_s: float, what: str, interval_s: float = 1.0) -> Any:
    """The first truthy value of check(); fails the test after timeout_s with the last value."""
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(interval_s)
    pytest.fail(f"{what} not seen within {timeout_s}s (last: {last!r})")


@pytest.fixture()
def config(sandbox: Sandbox) -> Iterator[Config]:
    sandbox.load(0.0)
    yield load_config(sandbox.config_path)
    sandbox.load(0.0)


def pairs(config: Config) -> list[tuple[str, Any]]:
    return [(m.name, r) for m in config.models for r in m.replicas]


def model_load(src: PrometheusSource, config: Config) -> ModelLoad:
    [load] = src.model_loads(config.models, time.time())
    return load


def demand(load: ModelLoad) -> float:
    return load.generation_tokens_per_s + 0.1 * load.prompt_tokens_per_s


def test_prometheus_source_sees_every_emulator(sandbox: Sandbox, config: Config) -> None:
    """Under load, all 4 replicas are known with running requests and token rates, in 9 queries."""
    src = PrometheusSource(config)
    sandbox.load(6.0)

    def all_busy() -> list[ReplicaLoad] | None:
        loads = src.replica_loads(pairs(config))
        ok = all(l.known and l.generation_tokens_per_s > 0 and l.prompt_tokens_per_s > 0 for l in loads)
        return loads if ok else None

    before = src.queries
    loads = poll(all_busy, 60, "token rates on all 4 replicas")
    assert len(loads) == 4 and {l.node for l in loads} == set(config.pool_nodes)
    assert (src.queries - before) % 9 == 0  # 9 fleet-wide queries per call, whatever the fleet
    assert sum(l.running for l in loads) > 0
    assert all(0 <= l.kv_cache_usage <= 1 and not l.sleeping for l in loads)
    assert all(src.last_engines[l.node] == ("0",) for l in loads)


def test_demand_follows_the_load_up_and_down(sandbox: Sandbox, config: Config) -> None:
    """model_loads' demand rises with the load, and after a drop the window max keeps it (hysteresis)."""
    src = PrometheusSource(config)
    sandbox.load(1.5)
    low = poll(lambda: (d := demand(model_load(src, config))) > 50 and d, 60, "demand at 1.5 req/s")
    time.sleep(config.metrics.rate_window_s)  # let the rate window fill with the low load only
    low = demand(model_load(src, config))

    def load_if(ok: Callable[[ModelLoad], bool]) -> Callable[[], ModelLoad | None]:
        def check() -> ModelLoad | None:
            m = model_load(src, config)
            return m if ok(m) else None
        return check

    sandbox.load(8.0)
    high_load = poll(load_if(lambda m: demand(m) > 2.5 * low), 60,
                     f"demand above {2.5 * low:.0f} tok/s at 8 req/s")
    high = demand(high_load)
    assert high_load.running > 0
    assert high_load.demand_tokens_per_s_max_window is not None
    assert high_load.demand_tokens_per_s_max_window >= high * 0.99

    sandbox.load(0.0)
    dropped = poll(load_if(lambda m: demand(m) < 0.2 * high), 60, "demand falling after the load stopped")
    # The scale-down window (20 s) still remembers the peak: nothing may be lent yet.
    assert dropped.demand_tokens_per_s_max_window is not None
    assert dropped.demand_tokens_per_s_max_window > 0.5 * high
    # ...until the whole window has passed with low load.
    poll(load_if(lambda m: m.demand_tokens_per_s_max_window is not None
                 and m.demand_tokens_per_s_max_window < 0.2 * high), 90, "window max forgetting the peak")


def test_forecast_query_is_valid_promql(sandbox: Sandbox, config: Config) -> None:
    """With forecast on, the 1d/7d offset query runs on real Prometheus; no history means None."""
    doc = config.model_dump()
    doc["policy"].update(forecast=True, forecast_lead_s=30)
    forecasting = Config.model_validate(doc)
    src = PrometheusSource(forecasting)
    load = poll(lambda: next((m for m in [model_load(src, forecasting)] if m.known), None), 60,
                "model load known")
    assert load.forecast_demand_tokens_per_s is None


def test_scrape_source_reads_the_emulators(sandbox: Sandbox, config: Config) -> None:
    """Direct scrape of the 4 emulators: all known, sleeping false, rates from two scrapes."""
    sandbox.load(6.0)
    src = ScrapeSource(config, state_path=None)

    def busy() -> list[ReplicaLoad] | None:
        loads = src.replica_loads(pairs(config))
        return loads if all(l.known and l.generation_tokens_per_s > 0 for l in loads) else None

    loads = poll(busy, 30, "token rates by direct scrape")
    assert [l.node for l in loads] == list(config.pool_nodes)


def test_cli_query_and_scrape(sandbox: Sandbox, config: Config) -> None:
    """`metrics query --json` lists every replica; `metrics scrape URL --json` reads one emulator."""
    res = sandbox.run(["slurm-idle", "metrics", "query", "--json"])
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    assert {r["node"] for r in doc["replicas"]} == set(config.pool_nodes)
    assert all(KEYS <= set(r) for r in doc["replicas"])
    assert doc["queries"] == 9 + 9  # 9 per-replica + 9 per-model (forecast off in the sandbox)

    node = config.pool_nodes[0]
    res = sandbox.run(["slurm-idle", "metrics", "scrape", sandbox.emulator_url(node), "--json",
                       "--interval", "0.5"])
    assert res.returncode == 0, res.stderr
    [entry] = json.loads(res.stdout)["replicas"]
    assert KEYS <= set(entry)
    assert entry["model"] == config.models[0].name and entry["engine"] == "0"
