"""Only replicas we know are ours and serving count toward a model's demand (issue 11: 1, 7, 8):
metrics.serving, the observation's identity check, the Prometheus -> scrape fallback."""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from pathlib import Path

import pytest

from slurm_idle.agent import observe
from slurm_idle.config import ModelConfig, ReplicaConfig, parse_config
from slurm_idle.engine import CommandEngine, EngineConfig, EngineHealth, HttpResponse
from slurm_idle.errors import EngineError, MetricsUnavailable
from slurm_idle.lifecycle import format_lent_comment, format_reason
from slurm_idle.metrics.fallback import FallbackSource
from slurm_idle.metrics.scrape import invalid_reading
from slurm_idle.metrics.serving import serving_model_load, usable
from slurm_idle.model import ModelLoad, Phase, ReplicaLoad
from slurm_idle.policy import plan
from slurm_idle.testing.fakes import FakeMetrics, FakeSlurm

T0 = 1_796_205_600.0
CONFIG = """
engine: {kind: command, start_command: "start {node}", stop_command: "stop {node}"}
models:
  - name: m
    tokens_per_s_per_replica: 1000
    nodes: gpu[1-3]
    url: "http://127.0.0.1:1/{node}"
policy: {scale_down_window_s: 0, queue_sustain_s: 0, forecast: false}
"""


def pool(lent: Sequence[str] = ("gpu3",)) -> FakeSlurm:
    slurm = FakeSlurm.with_nodes(["gpu1", "gpu2", "gpu3"])
    for name, node in list(slurm.node_map.items()):
        if name in lent:
            slurm.node_map[name] = node.__class__(name=name, state="mixed",
                                                  comment=format_lent_comment("slurm-idle", T0))
        else:
            slurm.node_map[name] = node.__class__(
                name=name, state="idle", flags=frozenset({"DRAIN"}),
                reason=format_reason("slurm-idle", Phase.SERVING, T0, False))
    return slurm


def load(node: str, gen: float = 100.0, **kw: float) -> ReplicaLoad:
    return ReplicaLoad(model="m", node=node, generation_tokens_per_s=gen, **kw)  # type: ignore[arg-type]


def test_a_lent_nodes_metrics_never_count_toward_demand() -> None:
    """The fleet-wide figure includes a fake exporter on lent gpu3 (NaN): the observation's
    model load is the serving replicas' sum, known, and the planner reclaims on it."""
    cfg = parse_config(CONFIG)
    metrics = FakeMetrics(
        replicas={"gpu1": load("gpu1", 900, waiting=50, running=16), "gpu2": load("gpu2", 900),
                  "gpu3": load("gpu3", math.nan)},
        models={"m": ModelLoad(model="m", known=False, generation_tokens_per_s=math.nan)},
    )
    obs = observe(cfg, pool(), metrics, T0)
    model = obs.model_load("m")
    assert model is not None and model.known
    assert model.generation_tokens_per_s == 1800 and model.waiting == 50
    actions = plan(obs, cfg, T0)
    assert [(a.node, a.to_phase) for a in actions] == [("gpu3", Phase.RECLAIMING)]


def test_invalid_figures_are_never_usable() -> None:
    """NaN, infinite or negative figures make a replica load unusable for the sum."""
    assert usable(load("gpu1"))
    for bad in ({"gen": math.nan}, {"gen": -5.0}, {"waiting": math.inf}, {"running": -1.0}):
        assert not usable(load("gpu1", **bad))
    assert not usable(ReplicaLoad(model="m", node="gpu1", foreign=True))


def test_a_poisoned_replica_is_left_out_and_windows_never_fall_below_now() -> None:
    """Only usable replicas are summed; the window maxima are raised to the present."""
    base = ModelLoad(model="m", demand_tokens_per_s_max_window=10.0, waiting_max_window=0.0,
                     waiting_min_recent=99.0)
    out = serving_model_load(base, [load("gpu1", 300, waiting=4), load("gpu2", -1e9)], 0.1)
    assert out.generation_tokens_per_s == 300 and out.waiting == 4
    assert out.demand_tokens_per_s_max_window == 300 and out.waiting_max_window == 4
    assert out.waiting_min_recent == 4
    assert serving_model_load(base, [None, load("gpu2", math.nan)], 0.1) is base


def test_invalid_scrape_readings_are_named() -> None:
    """The scrape source's check names the bad figure."""
    from slurm_idle.metrics.parse import ServerReading

    good = ServerReading("m", ("0",), 1.0, 0.0, 0.1, False, 10.0, 10.0, None, None, True)
    assert invalid_reading(good) is None
    bad = ServerReading("m", ("0",), math.nan, 0.0, 0.1, False, 10.0, 10.0, None, None, True)
    assert invalid_reading(bad) == "running=nan"


def test_a_foreign_endpoint_is_not_counted_as_serving() -> None:
    """A serving-phase replica whose endpoint is not the expected engine reads as `foreign`:
    its metrics leave the demand, it is not capacity, and a lent node comes back for it."""
    cfg = parse_config(CONFIG)
    metrics = FakeMetrics(
        replicas={"gpu1": load("gpu1", 1400), "gpu2": load("gpu2", 700)},
        models={"m": ModelLoad(model="m", generation_tokens_per_s=2100)},
    )

    def probe(model: str, replica: ReplicaConfig) -> EngineHealth:
        if replica.node == "gpu2":
            return EngineHealth(up=False, awake=None, foreign="/v1/models lists x", foreign_proven=True)
        return EngineHealth(up=True, awake=True)

    obs = observe(cfg, pool(), metrics, T0, probe=probe)
    view = {v.name: v for v in obs.nodes}
    assert view["gpu2"].replica is not None and view["gpu2"].replica.foreign
    assert any("gpu2: its endpoint is not the expected engine" in e for e in obs.errors)
    model = obs.model_load("m")
    assert model is not None and model.generation_tokens_per_s == 1400
    actions = plan(obs, cfg, T0)
    assert ("gpu3", Phase.RECLAIMING) in [(a.node, a.to_phase) for a in actions]


def test_an_identity_check_without_answer_excludes_nothing() -> None:
    """An identity check that cannot tell (no answer in time) leaves the replica to its
    metrics: not foreign, and live when /health answered."""
    cfg = parse_config(CONFIG)
    metrics = FakeMetrics(replicas={"gpu1": load("gpu1"), "gpu2": load("gpu2")},
                          models={"m": ModelLoad(model="m")})
    untold = EngineHealth(up=True, awake=None, foreign="timeout", foreign_proven=False)
    obs = observe(cfg, pool(), metrics, T0, probe=lambda m, r: untold)
    assert not any(v.replica is not None and v.replica.foreign for v in obs.nodes)
    assert all(v.replica is not None and v.replica.healthy for v in obs.nodes if v.name != "gpu3")


class Http:
    """Answers per path; records the calls."""

    def __init__(self, answers: dict[str, tuple[int, bytes]]) -> None:
        self.answers = answers
        self.calls: list[str] = []

    def request(self, method: str, url: str, timeout: float) -> HttpResponse:
        path = "/" + url.split("/", 3)[3] if url.count("/") >= 3 else "/"
        self.calls.append(path)
        if path not in self.answers:
            raise EngineError(f"{url}: connection refused")
        status, body = self.answers[path]
        return HttpResponse(status, body)


REPLICA = ReplicaConfig(node="gpu1", url="http://gpu1:8000")
VLLM_MODELS = b'{"object": "list", "data": [{"id": "m", "object": "model"}]}'


@pytest.mark.parametrize(("answer", "ours"), [
    ((200, VLLM_MODELS), True),
    ((200, b'{"data": [{"id": "other"}]}'), False),
    ((200, b"ok"), False),
    ((404, b"not found"), False),
])
def test_identity_is_the_model_list(answer: tuple[int, bytes], ours: bool) -> None:
    """/v1/models must list the configured model; anything else is not our engine."""
    engine = CommandEngine(EngineConfig(kind="command", start_command="s", stop_command="t"), "m",
                           http=Http({"/v1/models": answer}))
    assert engine.identify(REPLICA).ours is ours


def test_a_foreign_health_200_is_not_serving_and_the_start_is_issued() -> None:
    """/health 200 from something that is not vLLM: health() says not serving (foreign), so
    start() runs the start command instead of skipping it."""
    from slurm_idle.commands import ReplayRunner

    http = Http({"/health": (200, b"ok"), "/v1/models": (404, b"")})
    runner = ReplayRunner({("sh",): ""})
    engine = CommandEngine(EngineConfig(kind="command", start_command="start {node}",
                                        stop_command="stop"), "m", runner=runner, http=http)
    health = engine.health(REPLICA)
    assert health.up and not health.serving and health.foreign
    engine.start(REPLICA)
    assert runner.calls and runner.calls[0][0][:2] == ("sh", "-c")


class Failing:
    def __init__(self) -> None:
        self.calls = 0

    def replica_loads(self, replicas: Sequence[tuple[str, ReplicaConfig]], *,
                      budget_s: float | None = None,
                      serving: Collection[str] | None = None) -> list[ReplicaLoad]:
        self.calls += 1
        raise MetricsUnavailable("cannot connect to Prometheus")

    def model_loads(self, models: Sequence[ModelConfig], now: float, *,
                    budget_s: float | None = None,
                    serving: Collection[str] | None = None) -> list[ModelLoad]:
        raise MetricsUnavailable("cannot connect to Prometheus")


def test_prometheus_down_falls_back_to_the_scrape_source(tmp_path: Path) -> None:
    """When Prometheus does not answer, the scrape source's loads are used, only for the
    serving replicas, and `source` says so; with neither, the error names both."""
    cfg = parse_config(CONFIG)
    scrape = FakeMetrics(replicas={"gpu1": load("gpu1", 900)},
                         models={"m": ModelLoad(model="m", generation_tokens_per_s=900)})
    src = FallbackSource(Failing(), scrape)
    obs = observe(cfg, pool(), src, T0)
    assert obs.metrics_source == "scrape"
    assert any("planned on direct scrapes" in e for e in obs.errors)
    model = obs.model_load("m")
    assert model is not None and model.known
    scrape.fail = True
    obs = observe(cfg, pool(), src, T0)
    assert obs.metrics_source == "none"
    assert any("direct scrape failed too" in e for e in obs.errors)
