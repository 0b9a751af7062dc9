"""Contract: the metrics adapters against the sandbox's real Prometheus and vLLM emulators.

Prometheus scrapes the 4 emulators every second; the sandbox config uses rate_window_s 10 and a
20 s scale-down window, so every wait below is bounded polling for the windows to fill, never a
blind sleep. Each test leaves the simulated load at 0.
"""

from __future__ import annotations

import functools
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
from slurm_idle.testing.waiting import poll as _poll

pytestmark = pytest.mark.sandbox

KEYS = {"url", "model", "engine", "engine_index", "running", "waiting", "kv_cache_usage", "sleeping",
        "generation_tokens_per_s", "prompt_tokens_per_s", "ttft_p95_s", "queue_time_p95_s"}


poll = functools.partial(_poll, interval_s=1.0)


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
        # `running` is a gauge sampled at scrape time: at 6 rps of short requests a scrape can
        # land between requests, so wait for one that caught some in flight.
        return loads if ok and sum(l.running for l in loads) > 0 else None

    before = src.queries
    loads = poll(all_busy, 60, "token rates on all 4 replicas")
    assert len(loads) == 4 and {l.node for l in loads} == set(config.pool_nodes)
    assert (src.queries - before) % 9 == 0  # 9 fleet-wide queries per call, whatever the fleet
    assert sum(l.running for l in loads) > 0
    assert all(0 <= l.kv_cache_usage <= 1 and not l.sleeping for l in loads)
    assert all(src.last_engines[l.url] == ("0",) for l in loads)  # keyed by replica url


@pytest.mark.slow
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
    # the adaptive headroom's window inputs ride on the same query (real PromQL, real answers);
    # the noise needs an hour on record, so it is still None here
    assert high_load.demand_tokens_per_s_mean_window is not None
    assert high_load.demand_trend_per_s_window is not None
    assert high_load.demand_noise_tokens_per_s is None

    sandbox.load(0.0)
    dropped = poll(load_if(lambda m: demand(m) < 0.2 * high), 60, "demand falling after the load stopped")
    # The scale-down window (20 s) still remembers the peak: nothing may be lent yet.
    assert dropped.demand_tokens_per_s_max_window is not None
    assert dropped.demand_tokens_per_s_max_window > 0.5 * high
    # ...until the whole window has passed with low load.
    poll(load_if(lambda m: m.demand_tokens_per_s_max_window is not None
                 and m.demand_tokens_per_s_max_window < 0.2 * high), 90, "window max forgetting the peak")


def forecasting(config: Config, lead_s: float) -> Config:
    doc = config.model_dump()
    doc["policy"].update(forecast=True, forecast_lead_s=lead_s)
    return Config.model_validate(doc)


def test_forecast_follows_a_rising_trend(sandbox: Sandbox, config: Config) -> None:
    """With forecast on, the one forecast query runs on real Prometheus; without day-old history
    a ramp of the load forecasts above today's demand (deriv x lead), the window's even more."""
    cfg = forecasting(config, 30)
    src = PrometheusSource(cfg)
    sandbox.load(1.0)
    poll(lambda: (m := model_load(src, cfg)).known and demand(m) > 0, 60, "demand at 1 req/s")
    for rps in (3.0, 6.0, 9.0):  # a ramp: the 10 s rates keep rising for ~20 s
        sandbox.load(rps)
        time.sleep(2)

    def rising() -> ModelLoad | None:
        m = model_load(src, cfg)
        f, w = m.forecast_demand_tokens_per_s, m.forecast_demand_tokens_per_s_max_window
        return m if f is not None and w is not None and f > 1.02 * demand(m) and w > f else None

    poll(rising, 40, "a forecast above the demand while the load ramps up")
    assert src.queries % 10 == 0  # 10 per-model queries per tick with the forecast, whatever the fleet


@pytest.mark.slow
def test_forecast_offsets_land_on_the_right_windows(sandbox: Sandbox, config: Config) -> None:
    """Evaluated one day after a moment T, the forecast query's 1d parts equal the demand's
    window mean centred on T and the peaks of that mean over the lead and lead + window after
    T, as queried directly at T (the past is read smoothed: Queries.forecast)."""
    lead, window = 5, 10  # any lengths do (the offsets are checked), and short ones wait less
    half = window // 2
    cfg = forecasting(config, lead)
    src = PrometheusSource(cfg)
    q, model = src.q, cfg.models[0].name
    sandbox.load(5.0)
    poll(lambda: (m := model_load(src, cfg)).known and demand(m) > 0, 60, "demand at 5 req/s")
    # T - window/2 .. T + lead + window + window/2 must all be in the past
    time.sleep(lead + 2 * window + 2)
    t = float(int(time.time()) - lead - window - half - 1)

    def one(promql: str, at: float, kind: str | None = None) -> float:
        values = [v for labels, v in src.query(promql, time=at).values()
                  if labels.get("model_name") == model and (kind is None or labels.get("kind") == kind)]
        assert len(values) == 1, (promql, kind, values)
        return values[0]

    from slurm_idle.metrics.prometheus import subquery_step

    text = q.forecast([lead], window)
    day_later = t + 86_400
    mean = f"avg_over_time({q.demand()}[{window}s:{subquery_step(window, q.rate_window_s)}s])"
    assert one(text, day_later, "then_1d") == pytest.approx(one(mean, t + half))
    step = subquery_step(lead, q.rate_window_s)
    ahead = one(f"max_over_time(({mean})[{lead}s:{step}s])", t + lead + half)
    assert one(text, day_later, f"ahead_1d@{lead}") == pytest.approx(ahead)
    step = subquery_step(lead + window, q.rate_window_s)
    later = one(f"max_over_time(({mean})[{lead + window}s:{step}s])", t + lead + window + half)
    assert one(text, day_later, f"later_1d@{lead}") == pytest.approx(later)
    assert ahead > 0 and later > 0


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
    assert entry["model"] == config.models[0].name and entry["engine_index"] == "0"
    # The server: vLLM (the emulator says its version as vLLM does, on GET /version).
    assert entry["engine"] == "vllm" and entry["version"]
    assert {(r["engine"], r["engine_index"]) for r in doc["replicas"]} == {("vllm", "0")}
