"""Serving and counted are per replica, never per node (issue 13): two replicas on one node, or
one spanning two nodes, each count (or not) on their own; a foreign or unhealthy replica never
drops or doubles its neighbour's demand, and a lent node's port never counts."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest

from slurm_idle.agent import observe
from slurm_idle.config import Config, ReplicaConfig, parse_config
from slurm_idle.engine import EngineHealth
from slurm_idle.lifecycle import format_lent_comment, format_reason
from slurm_idle.metrics.prometheus import match_target, target_index
from slurm_idle.metrics.scrape import HttpResponse, ScrapeSource
from slurm_idle.model import ModelLoad, Phase, ReplicaLoad, SlurmNode
from slurm_idle.testing.fakes import FakeMetrics, FakeSlurm

T0 = 1_796_205_600.0
MODEL = "meta-llama/Llama-3.1-8B-Instruct"  # the model of the captured pages below
PAGES = Path(__file__).resolve().parents[1] / "data" / "vllm"
A, B, BIG = "http://gpu5:8000", "http://gpu5:8001", "http://gpu6:9000"
CONFIG = f"""
engine: {{kind: command, start_command: "start {{node}} {{port}}", stop_command: "stop"}}
metrics: {{source: scrape, staleness_s: 120, scrape_interval_s: 10}}
models:
  - name: {MODEL}
    tokens_per_s_per_replica: 1000
    nodes: gpu5
    replicas_per_node: 2
    ports: [8000, 8001]
    url: "http://{{node}}:{{port}}"
  - name: big
    gpus_per_replica: 8
    replicas: [{{nodes: "gpu[6-7]", url: "{BIG}"}}]
policy: {{scale_down_window_s: 0, queue_sustain_s: 0, forecast: false}}
"""


def config() -> Config:
    return parse_config(CONFIG)


def pool(lent: Sequence[str] = ()) -> FakeSlurm:
    """gpu5, gpu6, gpu7 serving (drained with our Reason); `lent` nodes lent instead."""
    slurm = FakeSlurm.with_nodes(["gpu5", "gpu6", "gpu7"], gpus=8)
    for name in list(slurm.node_map):
        if name in lent:
            slurm.node_map[name] = SlurmNode(name=name, state="mixed", gpus_total=8,
                                             comment=format_lent_comment("slurm-idle", T0))
        else:
            slurm.node_map[name] = SlurmNode(
                name=name, state="idle", flags=frozenset({"DRAIN"}), gpus_total=8,
                reason=format_reason("slurm-idle", Phase.SERVING, T0))
    return slurm


def foreign(*urls: str) -> object:
    def probe(model: str, replica: ReplicaConfig) -> EngineHealth:
        if replica.url in urls:
            return EngineHealth(up=False, awake=None, foreign="/v1/models lists x", foreign_proven=True)
        return EngineHealth(up=True, awake=True)
    return probe


def load(url: str, gen: float) -> ReplicaLoad:
    node = url.split("//")[1].split(":")[0]
    return ReplicaLoad(model=MODEL, node=node, url=url, generation_tokens_per_s=gen)


class Recording(FakeMetrics):
    """FakeMetrics that keeps the `serving` set it was given."""

    seen: set[str] | None = None

    def replica_loads(self, replicas, *, budget_s=None, serving=None):  # type: ignore[no-untyped-def]
        self.seen = None if serving is None else set(serving)
        return super().replica_loads(replicas, budget_s=budget_s, serving=serving)


def test_one_foreign_replica_leaves_its_neighbours_demand_counted_once() -> None:
    """gpu5:8000 is not our engine: gpu5:8001's demand is the model's, exactly once, and only
    gpu5:8001 (by name) is handed to the metrics source as serving."""
    metrics = Recording(
        replicas={"gpu5:8000": load(A, 900.0), "gpu5:8001": load(B, 700.0)},
        models={MODEL: ModelLoad(model=MODEL, generation_tokens_per_s=1600.0)},
    )
    obs = observe(config(), pool(lent=("gpu6", "gpu7")), metrics, T0, probe=foreign(A))  # type: ignore[arg-type]
    model = obs.model_load(MODEL)
    assert model is not None and model.known and model.generation_tokens_per_s == 700.0
    assert metrics.seen == {"gpu5:8001"}
    [gpu5] = [v for v in obs.nodes if v.name == "gpu5"]
    assert [(r.name, r.foreign) for r in gpu5.loads()] == [("gpu5:8000", True), ("gpu5:8001", False)]


@pytest.mark.parametrize(("probe", "expected"), [
    (None, 500.0),  # A counted once, never again for B whose reading is missing
    (foreign(A), None),  # A is not ours: B (unread) must not take A's load by node name
])
def test_a_replica_without_a_reading_never_takes_its_neighbours(
    probe: object, expected: float | None
) -> None:
    """Only gpu5:8000's load comes back: gpu5:8001 has none (it is not read as gpu5's)."""
    metrics = FakeMetrics(replicas={"gpu5:8000": load(A, 500.0)},
                          models={MODEL: ModelLoad(model=MODEL, known=False)})
    obs = observe(config(), pool(lent=("gpu6", "gpu7")), metrics, T0, probe=probe)  # type: ignore[arg-type]
    model = obs.model_load(MODEL)
    assert model is not None
    if expected is None:
        assert not model.known  # nothing of ours was read: unknown, never A's 500
    else:
        assert model.known and model.generation_tokens_per_s == expected


class Web:
    """Fake HTTP for the scrape source: a page per URL (None: connection refused)."""

    def __init__(self, pages: dict[str, str | None]) -> None:
        self.pages = pages
        self.got: list[str] = []

    def __call__(self, url: str, timeout_s: float) -> HttpResponse:
        self.got.append(url)
        text = self.pages.get(url)
        if text is None:
            raise ConnectionRefusedError(111, "Connection refused")
        return HttpResponse(200, text.encode())


class Clock:
    def __init__(self) -> None:
        self.t = T0

    def __call__(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        self.t += s


def scrape_source(cfg: Config, web: Web) -> ScrapeSource:
    clock = Clock()
    return ScrapeSource(cfg, http=web, clock=clock, sleep=clock.sleep, state_path=None)


def test_the_scrape_source_never_reads_a_foreign_neighbour() -> None:
    """Direct scrapes: the foreign gpu5:8000 is never scraped (its load reaches no figure of
    the source, windows included); gpu5:8001 is, and is the model's whole present."""
    page = (PAGES / "v1_recent.txt").read_text()
    web = Web({f"{A}/metrics": page, f"{B}/metrics": page, f"{BIG}/metrics": None})
    cfg = config()
    obs = observe(cfg, pool(lent=("gpu6", "gpu7")), scrape_source(cfg, web), T0,
                  probe=foreign(A))  # type: ignore[arg-type]
    assert f"{A}/metrics" not in web.got and f"{B}/metrics" in web.got
    assert f"{BIG}/metrics" not in web.got  # a lent node's port: never read
    model = obs.model_load(MODEL)
    assert model is not None and model.known and model.running == 7.0


def test_an_unhealthy_replica_beside_a_foreign_one_makes_the_model_unknown() -> None:
    """gpu5:8001 does not answer and gpu5:8000 is foreign: the model reads unknown (nothing is
    lent on it), never as the foreign endpoint's figures."""
    page = (PAGES / "v1_recent.txt").read_text()
    web = Web({f"{A}/metrics": page, f"{B}/metrics": None})
    cfg = config()
    obs = observe(cfg, pool(lent=("gpu6", "gpu7")), scrape_source(cfg, web), T0,
                  probe=foreign(A))  # type: ignore[arg-type]
    model = obs.model_load(MODEL)
    assert model is not None and not model.known


def test_a_spanning_replica_with_one_node_lent_is_not_serving() -> None:
    """gpu7 is lent, gpu6 (the head) still reads serving: the replica over both is not whole;
    its endpoint is neither checked nor read."""
    page = (PAGES / "v1_recent.txt").read_text()
    web = Web({f"{A}/metrics": page, f"{B}/metrics": page, f"{BIG}/metrics": page})
    checked: list[str] = []

    def probe(model: str, replica: ReplicaConfig) -> EngineHealth:
        checked.append(replica.name)
        return EngineHealth(up=True, awake=True)

    cfg = config()
    observe(cfg, pool(lent=("gpu7",)), scrape_source(cfg, web), T0, probe=probe)
    assert f"{BIG}/metrics" not in web.got
    assert sorted(checked) == ["gpu5:8000", "gpu5:8001"]


def test_a_node_name_heading_two_replicas_matches_neither() -> None:
    """Prometheus series labelled only `gpu5` (instance relabelled to the node) could be either
    replica's: they match none; host:port still tells them apart."""
    reps = [(MODEL, r) for m in config().models for r in m.replicas]
    index = target_index(reps)
    assert match_target(index, "gpu5") is None
    assert match_target(index, "gpu5:8000") == A and match_target(index, "gpu5:8001") == B
    assert match_target(index, "gpu6") == BIG  # one replica headed there: its name is its key
