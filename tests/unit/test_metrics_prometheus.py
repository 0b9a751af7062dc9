"""PrometheusSource logic: constant fleet-wide queries, target mapping, staleness, errors."""

from __future__ import annotations

import math
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import requests
import yaml
from prometheus_api_client.exceptions import PrometheusApiClientException

from slurm_idle.config import Config, ReplicaConfig, parse_config
from slurm_idle.errors import MetricsUnavailable
from slurm_idle.metrics.prometheus import (
    PrometheusSource,
    forecast_inputs,
    forecast_leads,
    match_target,
    queries_for,
    target_index,
)
from slurm_idle.metrics.synthetic import SyntheticPrometheus
from slurm_idle.model import NodeView, Observation, Phase, ReplicaLoad, SlurmNode
from slurm_idle.policy import assess

CONFIG = """
metrics: {prometheus_url: "http://prom:9090", rate_window_s: 30, staleness_s: 60, job_label: vllm}
engine: {kind: command, start_command: "start", stop_command: "stop"}
policy: {scale_down_window_s: 600, prompt_token_weight: 0.1, forecast_lead_s: 300}
models:
  - name: llama
    nodes: gpu[1-3]
    url: "http://{node}.cluster:8000"
  - name: qwen
    replicas: [{node: inf9, url: "http://10.0.0.9:8001"}]
"""


def make(cfg: Config | None = None, **tables: Any) -> tuple[PrometheusSource, SyntheticPrometheus]:
    config = cfg or parse_config(CONFIG)
    fake = SyntheticPrometheus(
        queries_for(config),
        window_s=config.policy.scale_down_window_s,
        forecast_leads=forecast_leads(config, config.models).values() if config.policy.forecast else None,
        **tables,
    )
    return PrometheusSource(config, prom=fake), fake


def pairs(config: Config) -> list[tuple[str, ReplicaConfig]]:
    return [(m.name, r) for m in config.models for r in m.replicas]


FULL = {"waiting": 1.0, "kv": 0.5, "awake": 1.0, "prompt": 100.0, "generation": 40.0,
        "ttft": 0.2, "queue": 0.05}


def test_series_map_to_replicas_by_scrape_target() -> None:
    """instance=host:port of the replica URL (FQDN, short name or IP) finds the replica."""
    ts = 1_700_000_000.0
    src, _ = make(
        targets={
            "gpu1.cluster:8000": {"running": 3.0, "fresh": ts, **FULL},
            "gpu2:8000": {"running": {"0": 2.0, "1": 5.0}, "fresh": ts, **FULL},
            "10.0.0.9:8001": {"running": 1.0, "fresh": ts, **FULL, "awake": 0.0},
            "elsewhere:8000": {"running": 99.0, "fresh": ts, **FULL},
        },
        eval_ts=ts,
    )
    loads = {l.node: l for l in src.replica_loads(pairs(src.config))}
    assert loads["gpu1"].known and loads["gpu1"].running == 3.0
    assert loads["gpu1"].generation_tokens_per_s == 40.0 and loads["gpu1"].ttft_p95_s == 0.2
    assert loads["gpu2"].known and loads["gpu2"].running == 7.0  # DP engines summed
    assert src.last_engines[loads["gpu2"].url] == ("0", "1")
    assert not loads["gpu3"].known  # no series at all
    assert loads["inf9"].sleeping and loads["inf9"].model == "qwen"


def test_stale_series_make_a_replica_unknown() -> None:
    """A target whose last sample is older than staleness_s is known=False."""
    ts = 1_700_000_000.0
    src, _ = make(
        targets={
            "gpu1.cluster:8000": {"running": 3.0, "fresh": ts - 61, **FULL},
            "gpu2.cluster:8000": {"running": 3.0, "fresh": ts - 5, **FULL},
        },
        eval_ts=ts,
    )
    loads = {l.node: l for l in src.replica_loads(pairs(src.config))}
    assert not loads["gpu1"].known
    assert loads["gpu2"].known


def test_missing_rate_makes_a_replica_unknown() -> None:
    """A replica with gauges but no token rate yet (just started) is not known."""
    ts = 1_700_000_000.0
    partial = {k: v for k, v in FULL.items() if k != "generation"}
    src, _ = make(targets={"gpu1.cluster:8000": {"running": 0.0, "fresh": ts, **partial}}, eval_ts=ts)
    [l1, *_] = src.replica_loads(pairs(src.config))
    assert not l1.known


def test_nan_percentile_is_none() -> None:
    """histogram_quantile over no requests (NaN) reads as None, not a number."""
    ts = 1_700_000_000.0
    src, _ = make(targets={"gpu1.cluster:8000": {"running": 0.0, "fresh": ts, **FULL, "ttft": math.nan}},
                  eval_ts=ts)
    assert src.replica_loads(pairs(src.config))[0].ttft_p95_s is None


def test_query_count_does_not_grow_with_the_fleet() -> None:
    """replica_loads + model_loads cost the same number of queries for 4 and 400 replicas."""
    counts = []
    for n in (4, 400):
        cfg = parse_config(CONFIG.replace("gpu[1-3]", f"gpu[1-{n}]"))
        src, fake = make(cfg)
        src.replica_loads(pairs(cfg))
        src.model_loads(cfg.models, 1_700_000_000.0)
        counts.append(src.queries)
        assert fake.calls == src.queries
    assert counts[0] == counts[1] == 9 + 10


def test_queries_are_restricted_to_the_job_and_use_the_window() -> None:
    """job_label selects the scrape job; rates use rate_window_s; hysteresis the scale-down window."""
    cfg = parse_config(CONFIG)
    q = queries_for(cfg)
    assert 'vllm:num_requests_running{job="vllm"}' in q.replica()["running"]
    assert "[30s]" in q.replica()["generation"]
    model_q = q.model(600, [300])
    assert "[600s:" in model_q["demand_max"] and "0.1 *" in model_q["demand_max"]
    assert "offset 86100s" in model_q["forecast"] and "offset 604500s" in model_q["forecast"]
    assert "offset 85800s" in model_q["forecast"] and '"kind", "ahead_7d@300"' in model_q["forecast"]
    assert 'sleep_state="awake"' in q.replica()["asleep"] and q.replica()["asleep"].endswith("< 0.5")
    assert q.replica()["stale"].endswith("> 60")  # only stale targets come back


def test_model_loads_carry_window_and_forecast_fields() -> None:
    """Fleet-wide per model: rates, window max/min and the forecast; missing model -> unknown."""
    src, fake = make(
        models={
            "llama": {"generation": 50.0, "prompt": 500.0, "running": 8.0, "waiting": 2.0, "kv": 0.7,
                      "ttft": 0.3, "demand_max": 400.0, "demand_max:points": 40.0, "waiting_max": 5.0,
                      "waiting_min": 0.0, "waiting:recent_min": 1.0, "waiting:recent_points": 10.0,
                      "forecast": {"then_1d": 100.0, "ahead_1d": 600.0, "then_7d": 90.0}},
        }
    )
    llama, qwen = src.model_loads(src.config.models, 1_700_000_100.0)
    assert llama.known and llama.generation_tokens_per_s == 50.0
    assert llama.demand_tokens_per_s_max_window == 400.0
    assert (llama.waiting_max_window, llama.waiting_min_window) == (5.0, 0.0)
    assert (llama.waiting, llama.waiting_min_recent) == (2.0, 1.0)
    # today's demand (50 + 0.1*500 = 100) plus yesterday's rise over the lead (600 - 100);
    # last week has no `ahead` series, so it does not count
    assert llama.forecast_demand_tokens_per_s == pytest.approx(600.0)
    assert llama.kv_cache_usage_max == 0.7
    assert not qwen.known
    assert len(fake.seen) == 10


def test_forecast_queries_cover_lead_window_and_trend() -> None:
    """One forecast query per tick: per offset the demand then, its peak over the lead and over
    lead + scale-down window (one part per distinct lead), and deriv over the window."""
    q = queries_for(parse_config(CONFIG))
    text = q.model(600, [300, 150, 300])["forecast"]
    # The past as 600 s means centred on each moment: the demand 1 day ago is the mean up to
    # now-1d+300 s; its peak over the 300 s after that is of means ending up to now-1d+600 s,
    # over 300+600 s up to now-1d+1200 s
    assert "avg_over_time((sum by (model_name)" in text and "[600s:" in text
    assert '[600s:15s] offset 86100s), "kind", "then_1d"' in text
    assert "[300s:" in text and "offset 85800s" in text and '"ahead_1d@300"' in text
    assert "[900s:" in text and "offset 85200s" in text and '"later_1d@300"' in text
    assert "[150s:" in text and "offset 604350s" in text and '"ahead_7d@150"' in text
    assert text.count('"ahead_1d@300"') == 1  # equal leads share their parts
    assert 'label_replace(deriv((sum by (model_name)' in text and '[600s:' in text
    assert '"kind", "trend"' in text
    no_window = q.model(0, [300])["forecast"]
    assert "later_" not in no_window and "deriv(" not in no_window


def test_forecast_adds_trend_and_reaches_over_the_window() -> None:
    """The forecast takes the larger of yesterday's rise and trend x lead; the window's forecast
    uses the peak over lead + window and trend x (lead + window)."""
    src, _ = make(models={"llama": {
        "generation": 50.0, "prompt": 500.0, "running": 8.0, "demand_max": 100.0,
        "forecast": {"then_1d": 100.0, "ahead_1d": 300.0, "later_1d": 700.0, "trend": 1.0},
    }})
    [llama, _] = src.model_loads(src.config.models, 1_700_000_100.0)
    # demand now 100; lead 300 s, window 600 s
    assert llama.forecast_demand_tokens_per_s == pytest.approx(100 + max(200, 1.0 * 300))
    assert llama.forecast_demand_tokens_per_s_max_window == pytest.approx(100 + max(600, 1.0 * 900))


def test_falling_trend_and_missing_history_do_not_lower_the_forecast() -> None:
    """A negative deriv counts as no rise; with no trend and no history both forecasts are None."""
    src, _ = make(models={
        "llama": {"generation": 50.0, "prompt": 500.0, "running": 8.0, "forecast": {"trend": -5.0}},
        "qwen": {"generation": 50.0, "prompt": 500.0, "running": 8.0},
    })
    llama, qwen = src.model_loads(src.config.models, 1_700_000_100.0)
    assert llama.forecast_demand_tokens_per_s == llama.forecast_demand_tokens_per_s_max_window == 100.0
    assert qwen.forecast_demand_tokens_per_s is None
    assert qwen.forecast_demand_tokens_per_s_max_window is None


def test_each_model_reads_the_peaks_of_its_own_lead() -> None:
    """Models with different reclaim times (30 s grace + 300 s cold start or 30 s sleep-mode
    wake + a tick: 390 s vs 120 s) each get their own lead's peaks and trend extrapolation, from
    one query."""
    cfg = parse_config(CONFIG.replace("forecast_lead_s: 300", "forecast_lead_s: null").replace(
        'replicas: [{node: inf9, url: "http://10.0.0.9:8001"}]',
        'replicas: [{node: inf9, url: "http://10.0.0.9:8001"}]\n'
        '    engine: {kind: http-sleep, start_command: "s", stop_command: "t"}'))
    assert forecast_leads(cfg, cfg.models) == {"llama": 390, "qwen": 120}
    base = {"generation": 100.0, "prompt": 0.0, "running": 1.0}
    fc = {"then_1d": 100.0, "ahead_1d@390": 400.0, "ahead_1d@120": 250.0,
          "later_1d@390": 500.0, "later_1d@120": 260.0, "trend": 0.1}
    src, fake = make(cfg, models={"llama": {**base, "forecast": fc}, "qwen": {**base, "forecast": fc}})
    llama, qwen = src.model_loads(cfg.models, 1_700_000_100.0)
    assert llama.forecast_demand_tokens_per_s == pytest.approx(400.0)
    assert qwen.forecast_demand_tokens_per_s == pytest.approx(250.0)
    assert llama.forecast_demand_tokens_per_s_max_window == pytest.approx(100 + max(400, 0.1 * 990))
    assert qwen.forecast_demand_tokens_per_s_max_window == pytest.approx(100 + max(160, 0.1 * 720))
    assert src.queries == len(fake.seen) == 10


def test_window_forecast_never_below_the_lead_forecast() -> None:
    """A peak over lead + window sampled lower than the one over the lead (or missing) does not
    undercut it: the longer reach is at least the shorter one."""
    v = {"forecast:then_1d": 100.0, "forecast:ahead_1d@300": 500.0, "forecast:later_1d@300": 450.0,
         "forecast:then_7d": 100.0, "forecast:ahead_7d@300": 300.0}
    forecast, window = forecast_inputs(v, 100.0, 300, 600)
    assert forecast == window == 500.0


def test_forecast_matches_the_simulator_minute_by_minute() -> None:
    """Fed what Prometheus answers at each minute of a trace (the demand 1 day earlier, its peaks
    after that, deriv over the window), the adapter's forecast fields equal the simulator's."""
    import random
    import statistics

    from slurm_idle.sim import FleetModel, SimParams, Simulation
    from slurm_idle.sim.planner_driver import SIM_POLICY, PlannerPolicy, fleet_config
    from slurm_idle.traces import Series, Trace

    rnd = random.Random(7)
    minutes = 1440 + 120
    # noise and 90-minute waves every day; today a steady ramp from minute 1480 (trend dominates)
    rps = tuple(50 + 30 * rnd.random() + (m % 90) * rnd.random() + 3.0 * max(0, m - 1480)
                for m in range(minutes))
    trace = Trace(start=0.0, steps=minutes, series={"m": Series(rps, (0.0,) * minutes, (1.0,) * minutes)})
    fleet = [FleetModel("m", 8, 1, 40.0)]
    sim = Simulation(trace, fleet, SimParams())
    sim.serving["m"] = [8] * minutes  # the queue signals need a served past; not under test
    config = fleet_config(fleet, sim.params, SIM_POLICY)
    driver = PlannerPolicy(sim, config)
    demand = sim.demand["m"]
    lead = forecast_leads(config, config.models)["m"]
    window = config.policy.scale_down_window_s
    lead_min, window_min = lead // 60, window // 60
    half = window_min // 2
    for minute in range(1441 + half, minutes - 30, 7):
        seen = minute - 1
        then = seen - 1440
        past = range(max(0, seen - window_min + 1), seen + 1)
        slope = statistics.linear_regression([60.0 * i for i in past], [demand[i] for i in past]).slope
        # the past as Prometheus reads it: window means centred on each minute
        centred = lambda i: statistics.fmean(demand[i - half : i + half + 1])
        answers = {
            "forecast:then_1d": centred(then),
            f"forecast:ahead_1d@{lead}": max(centred(i) for i in range(then + 1, then + lead_min + 1)),
            f"forecast:later_1d@{lead}": max(
                centred(i) for i in range(then + 1, then + lead_min + window_min + 1)),
            "forecast:trend": slope,
        }
        expected = driver.load(sim, "m", minute)
        forecast, reach = forecast_inputs(answers, demand[seen], lead, window)
        assert forecast == pytest.approx(expected.forecast_demand_tokens_per_s)
        assert reach == pytest.approx(expected.forecast_demand_tokens_per_s_max_window)


def test_window_max_never_below_current_demand() -> None:
    """If the subquery's last point predates a jump, the window max still covers the present."""
    src, _ = make(models={"llama": {"generation": 500.0, "prompt": 0.0, "running": 1.0,
                                    "demand_max": 100.0, "demand_max:points": 40.0}})
    [llama, _] = src.model_loads(src.config.models, 1_700_000_100.0)
    assert llama.demand_tokens_per_s_max_window == 500.0


WINDOW = {"generation": 50.0, "prompt": 500.0, "running": 8.0, "waiting": 0.0,
          "demand_max": 400.0, "waiting_max": 0.0, "waiting_min": 0.0}


@pytest.mark.parametrize(("points", "covered"), [(None, False), (3.0, False), (35.0, False),
                                                 (36.0, True), (41.0, True)])
def test_window_fields_need_the_whole_window(points: float | None, covered: bool) -> None:
    """The 600 s window at 15 s steps has 40 points: with fewer than 90% of them (a Prometheus
    restarted 2 minutes ago, a new deployment) the window fields are None and nothing is lent."""
    table = dict(WINDOW) if points is None else {**WINDOW, "demand_max:points": points}
    src, _ = make(models={"llama": table})
    llama, _ = src.model_loads(src.config.models, 1_700_000_100.0)
    fields = (llama.demand_tokens_per_s_max_window, llama.waiting_max_window, llama.waiting_min_window)
    assert fields == ((400.0, 0.0, 0.0) if covered else (None, None, None))
    views = tuple(NodeView(SlurmNode(n, "idle", frozenset({"DRAIN"})), "llama", Phase.SERVING,
                           replica=ReplicaLoad(model="llama", node=n))
                  for n in ("gpu1", "gpu2", "gpu3"))
    [verdict, _] = assess(Observation(now=0.0, nodes=views, models=(llama,)), src.config, 0.0)
    assert ("no window maximum: nothing lent" in verdict.reason) is not covered


@pytest.mark.parametrize(
    ("table", "expected"),
    [
        ({"waiting": 2.0, "waiting:recent_min": 0.0, "waiting:recent_points": 10.0}, 0.0),  # a blip
        ({"waiting": 4.0, "waiting:recent_min": 3.0, "waiting:recent_points": 11.0}, 3.0),
        ({"waiting": 1.0, "waiting:recent_min": 3.0, "waiting:recent_points": 10.0}, 1.0),  # now counts
        ({"waiting": 4.0, "waiting:recent_min": 3.0, "waiting:recent_points": 5.0}, None),  # 30 s of data
        ({"waiting": 4.0}, None),
    ],
)
def test_queue_signal_is_the_minimum_over_the_sustain_span(
    table: dict[str, float], expected: float | None
) -> None:
    """waiting_min_recent is the queue's minimum over queue_sustain_s (60 s at 6 s steps), the
    present included, and None while Prometheus holds under 90% of that span."""
    src, _ = make(models={"llama": {**WINDOW, **table}})
    llama, _ = src.model_loads(src.config.models, 1_700_000_100.0)
    assert llama.waiting == table["waiting"]
    assert llama.waiting_min_recent == expected


def test_queue_sustain_zero_takes_the_queue_now() -> None:
    """With queue_sustain_s: 0 the waiting query is the plain sum and the recent minimum is now."""
    cfg = parse_config(CONFIG.replace("forecast_lead_s: 300", "forecast_lead_s: 300, queue_sustain_s: 0"))
    assert " or " not in queries_for(cfg).model(600, None)["waiting"]
    src, _ = make(cfg, models={"llama": {**WINDOW, "waiting": 2.0, "demand_max:points": 40.0}})
    llama, _ = src.model_loads(cfg.models, 1_700_000_100.0)
    assert llama.waiting_min_recent == 2.0


def test_window_and_sustain_queries_count_their_points() -> None:
    """The demand window and the queue's sustain span come with their count_over_time, in the
    same queries (the number of queries per tick does not change)."""
    model_q = queries_for(parse_config(CONFIG)).model(600, [300])
    assert "count_over_time((sum by (model_name) ((rate(" in model_q["demand_max"]
    assert '[600s:15s]), "kind", "points", "", "")' in model_q["demand_max"]
    waiting = model_q["waiting"]
    assert ('min_over_time(sum by (model_name) ((vllm:num_requests_waiting{job="vllm"} >= 0 < +Inf))'
            '[60s:6s])') in waiting
    assert '"kind", "recent_min"' in waiting and '"kind", "recent_points"' in waiting


def test_fleet_wide_series_are_checked_before_they_are_summed() -> None:
    """Every model-level query keeps only finite, non-negative series (`>= 0 < +Inf`) before
    summing: one NaN or negative series from a fake exporter cannot poison the model's load."""
    model_q = queries_for(parse_config(CONFIG)).model(600, [300])
    for name in ("generation", "prompt", "running", "demand_max"):
        assert ">= 0 < +Inf" in model_q[name], name


PROMTOOL = shutil.which("promtool")


def all_queries(cfg: Config) -> dict[str, str]:
    q = queries_for(cfg)
    leads = forecast_leads(cfg, cfg.models).values()
    return {
        **{f"replica_{k}": v for k, v in q.replica().items()},
        **{f"model_{k}": v for k, v in q.model(cfg.policy.scale_down_window_s, leads).items()},
        **{f"nowindow_{k}": v for k, v in q.model(0, None).items()},
    }


@pytest.mark.skipif(PROMTOOL is None, reason="promtool not installed")
def test_every_query_is_valid_promql(tmp_path: Path) -> None:
    """promtool accepts every query of a tick (as recording rules), with and without a job label."""
    assert PROMTOOL is not None
    rules = []
    for n, text in enumerate((CONFIG, CONFIG.replace(", job_label: vllm", ""))):
        queries = all_queries(parse_config(text))
        rules += [{"record": f"q{n}:{name}", "expr": expr} for name, expr in queries.items()]
    path = tmp_path / "rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "tick", "rules": rules}]}))
    done = subprocess.run([PROMTOOL, "check", "rules", str(path)], capture_output=True, text=True,
                          timeout=60, check=False)
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.skipif(PROMTOOL is None, reason="promtool not installed")
def test_prometheus_counts_the_window_as_covered_only_when_full(tmp_path: Path) -> None:
    """Evaluated by Prometheus' own engine (promtool test rules) on series that start at 0: the
    window's points reach 90% of 40 only after ~9 of its 10 minutes, and the queue's sustain span
    is covered after a minute; `Queries.covered` agrees with the numbers Prometheus returns."""
    assert PROMTOOL is not None
    cfg = parse_config(CONFIG.replace(", job_label: vllm", ""))
    q = queries_for(cfg)
    model_q = q.model(600, None)
    threshold = math.ceil(0.9 * 40)
    assert not q.covered(threshold - 1, 600) and q.covered(threshold, 600)
    assert not q.covered(8, 60) and q.covered(9, 60)
    labels = 'model_name="llama",instance="gpu1:8000"'

    def points_at(expr: str, kind: str, minimum: int, at: str, covered: bool) -> dict[str, Any]:
        """1 if the `kind` series has >= minimum points at `at`, 0 if not."""
        only = f'label_replace(vector(1), "kind", "{kind}", "", "")'
        return {"expr": f"count((({expr}) >= {minimum}) and on (kind) {only})", "eval_time": at,
                "exp_samples": [] if not covered else [{"labels": "{}", "value": 1}]}

    tests = [
        points_at(model_q["demand_max"], "points", threshold, at, covered)
        for at, covered in (("2m", False), ("8m", False), ("9m30s", True), ("15m", True))
    ] + [
        points_at(model_q["waiting"], "recent_points", 9, at, covered)
        for at, covered in (("30s", False), ("1m", True), ("5m", True))
    ]
    doc = {"evaluation_interval": "15s", "tests": [{
        "interval": "15s",
        "input_series": [
            {"series": f"vllm:generation_tokens_total{{{labels}}}", "values": "0+1500x100"},
            {"series": f"vllm:prompt_tokens_total{{{labels}}}", "values": "0+15000x100"},
            {"series": f"vllm:num_requests_waiting{{{labels}}}", "values": "2x100"},
        ],
        "promql_expr_test": tests,
    }]}
    path = tmp_path / "test.yml"
    path.write_text(yaml.safe_dump(doc))
    done = subprocess.run([PROMTOOL, "test", "rules", str(path)], capture_output=True, text=True,
                          timeout=60, check=False)
    assert done.returncode == 0, done.stdout + done.stderr


def test_target_matching_prefers_exact_host_port() -> None:
    """Exact host:port wins (a replica is known by its url); a node-name label (relabelled instance) also matches."""
    reps = [("m", ReplicaConfig(node="gpu1", url="http://gpu1:8000")),
            ("m", ReplicaConfig(node="gpu2", url="http://gpu2.x.y:8000"))]
    index = target_index(reps)
    assert match_target(index, "gpu1:8000") == "http://gpu1:8000"
    assert match_target(index, "GPU2.x.y:8000") == "http://gpu2.x.y:8000"
    assert match_target(index, "gpu2:8000") == "http://gpu2.x.y:8000"
    assert match_target(index, "gpu2") == "http://gpu2.x.y:8000"
    assert match_target(index, "gpu7:8000") is None


def test_a_url_with_a_port_matches_no_other_port() -> None:
    """gpu1:8001 is not the replica at http://gpu1:8000 (another vLLM may run there); only a
    URL without a port (a proxy on the scheme's port) takes its host's series on any port."""
    reps = [("m", ReplicaConfig(node="gpu1", url="http://gpu1:8000")),
            ("m", ReplicaConfig(node="gpu3", url="http://gpu3.x.y/")),
            ("m", ReplicaConfig(node="gpu4", url="https://10.0.0.4"))]
    index = target_index(reps)
    assert match_target(index, "gpu1:8001") is None
    assert match_target(index, "gpu1.x.y:8001") is None
    assert match_target(index, "gpu1") == "http://gpu1:8000"  # instance relabelled to the node name
    assert match_target(index, "gpu3.x.y:80") == "http://gpu3.x.y/"
    assert match_target(index, "gpu3.x.y:8000") == "http://gpu3.x.y/"
    assert match_target(index, "gpu3:8000") == "http://gpu3.x.y/"
    assert match_target(index, "10.0.0.4:443") == "https://10.0.0.4"
    assert match_target(index, "10.0.0.4:8000") == "https://10.0.0.4"
    assert match_target(index, "10.0.0.5:8000") is None


def test_series_of_another_vllm_on_the_node_are_not_the_replicas_load() -> None:
    """A foreign vLLM on gpu1.cluster:8001 (model_name "other") and a series of another model
    on the replica's own target do not add to gpu1's load; its own model's series do, and a
    series without model_name is taken on its target alone."""
    ts = 1_700_000_000.0
    src, _ = make(
        targets={
            "gpu1.cluster:8000": {"running": 3.0, "fresh": ts, **FULL},
            "gpu1.cluster:8000#other": {"running": 50.0, "fresh": ts, **FULL, "waiting": 40.0},
            "gpu1.cluster:8001": {"running": 99.0, "fresh": ts, **FULL, "waiting": 30.0},
            "gpu2.cluster:8001": {"running": 99.0, "fresh": ts, **FULL},
            "gpu3.cluster:8000": {"running": 2.0, "fresh": ts, **FULL},
        },
        served={"gpu1.cluster:8000": "llama", "gpu1.cluster:8000#other": "other",
                "gpu1.cluster:8001": "other", "gpu2.cluster:8001": "llama"},
        eval_ts=ts,
    )
    loads = {l.node: l for l in src.replica_loads(pairs(src.config))}
    assert loads["gpu1"].known and loads["gpu1"].running == 3.0 and loads["gpu1"].waiting == 1.0
    assert not loads["gpu2"].known  # its model, but on another port than its URL's
    assert loads["gpu3"].known and loads["gpu3"].running == 2.0  # no model_name label


class Failing:
    def __init__(self, exc: Exception) -> None:
        self.exc = exc

    def custom_query(self, query: str, params: dict[str, Any] | None = None) -> list[dict[str, Any]]:
        raise self.exc


@pytest.mark.parametrize(
    ("exc", "needle"),
    [
        (requests.exceptions.ConnectionError("Connection refused"), "cannot connect to Prometheus"),
        (requests.exceptions.ReadTimeout("timed out"), "did not answer within"),
        (PrometheusApiClientException("HTTP Status Code 404 (b'<html>')"), "HTTP 404"),
        (ValueError("Expecting value"), "did not answer like a Prometheus server"),
    ],
)
def test_errors_become_metrics_unavailable(exc: Exception, needle: str) -> None:
    """Connection, timeout, HTTP and garbage answers raise MetricsUnavailable naming the fix."""
    cfg = parse_config(CONFIG)
    src = PrometheusSource(cfg, prom=Failing(exc))
    with pytest.raises(MetricsUnavailable, match=needle) as info:
        src.replica_loads(pairs(cfg))
    assert "metrics.prometheus_url" in str(info.value) or "query_timeout_s" in str(info.value)


def test_model_loads_carry_the_adaptive_headroom_inputs() -> None:
    """The window's mean and slope and the hour's noise ride on the demand_max query (the query
    count does not grow); the noise counts only when its hour is covered."""
    base = {"generation": 50.0, "prompt": 500.0, "running": 8.0, "waiting": 0.0, "kv": 0.1,
            "demand_max": 400.0, "demand_max:points": 40.0, "demand_max:mean": 300.0,
            "demand_max:trend": 0.5, "demand_max:noise": 20.0, "waiting_max": 0.0,
            "waiting_min": 0.0, "waiting:recent_min": 0.0, "waiting:recent_points": 10.0}
    src, fake = make(models={"llama": {**base, "demand_max:noise_points": 240.0}})
    llama = src.model_loads(src.config.models, 1_700_000_100.0)[0]
    assert (llama.demand_tokens_per_s_mean_window, llama.demand_trend_per_s_window) == (300.0, 0.5)
    assert llama.demand_noise_tokens_per_s == 20.0
    assert len(fake.seen) == 10
    src, _ = make(models={"llama": {**base, "demand_max:noise_points": 10.0}})
    assert src.model_loads(src.config.models, 1_700_000_100.0)[0].demand_noise_tokens_per_s is None


def test_an_invalid_replica_series_is_dropped_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    """A NaN or negative series (a fake exporter on the port) makes that replica unknown on the
    signal and is named in a warning; the other replicas are untouched."""
    ts = 1_700_000_000.0
    src, _ = make(
        targets={
            "gpu1.cluster:8000": {"running": 3.0, "fresh": ts, **FULL},
            "gpu2:8000": {"running": 1.0, "fresh": ts, **FULL, "generation": math.nan},
            "gpu3:8000": {"running": 1.0, "fresh": ts, **FULL, "waiting": -50.0},
        },
        eval_ts=ts,
    )
    with caplog.at_level("WARNING"):
        loads = {l.node: l for l in src.replica_loads(pairs(src.config))}
    assert loads["gpu1"].known
    assert not loads["gpu2"].known and not loads["gpu3"].known
    assert {d.split()[0] for d in src.dropped} == {"gpu2", "gpu3"}
    assert "dropped an invalid generation series" in caplog.text
