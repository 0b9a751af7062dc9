"""The GPUs' memory in the tick's snapshot and in `status`: one call for the pool's nodes and the
jobs placement's, None where not observed, a failure reported and never the tick's end."""

from __future__ import annotations

import json
from pathlib import Path

from slurm_idle.agent import Agent
from slurm_idle.config import Config, parse_config
from slurm_idle.lifecycle import format_reason
from slurm_idle.metrics.gpus import PrometheusGpuSource
from slurm_idle.model import GpuReading, ModelLoad, Phase
from slurm_idle.status import node_rows, render_status
from slurm_idle.testing.fakes import FakeEngine, FakeGpus, FakeMetrics, FakeSlurm
from slurm_idle.wiring import make_gpu_source

from .test_agent import Clock


def make_config(tmp_path: Path, jobs: bool = False) -> Config:
    job_model = ("  - {name: jm, placement: jobs, job: {replicas: 1, command: serve, port_base: 9100,"
                 " url: 'http://127.0.0.1:{port}'}}\n") if jobs else ""
    return parse_config(f"""
engine: {{kind: command, start_command: "true", stop_command: "true"}}
models:
  - {{name: m, nodes: 'gpu[1-2]', url: "http://127.0.0.1:1/{{node}}"}}
{job_model}paths: {{journal: {tmp_path}/journal.jsonl, lock: {tmp_path}/tick.lock}}
timeouts: {{tick_budget_s: 10}}
""")


def make_agent(tmp_path: Path, gpus: FakeGpus, jobs: bool = False) -> Agent:
    slurm = FakeSlurm.with_nodes(["gpu1", "gpu2", "gpu8"] if jobs else ["gpu1", "gpu2"])
    clock = Clock()
    slurm.drain("gpu1", format_reason("slurm-idle", Phase.RECLAIMING, clock() - 60))
    return Agent(config=make_config(tmp_path, jobs), slurm=slurm,
                 metrics=FakeMetrics(models={"m": ModelLoad(model="m")}),
                 engine_for=lambda model: FakeEngine(), planner=lambda obs, cfg, now: [],
                 assessor=lambda obs, cfg, now: [], clock=clock, sleep=clock.sleep, gpus=gpus)


HELD = GpuReading(index=0, used_mib=20480, total_mib=81559, holder="job 123", sample_ts=1.0)
FREE = GpuReading(index=1, used_mib=0, total_mib=81559)


def test_each_pool_node_carries_its_gpus_and_none_where_not_observed(tmp_path: Path) -> None:
    """gpu1's readings land on its NodeView; gpu2 has no series: None (not observed, not free)."""
    gpus = FakeGpus(nodes={"gpu1": (HELD, FREE)})
    obs = make_agent(tmp_path, gpus).observe()
    by_name = {v.name: v for v in obs.nodes}
    assert by_name["gpu1"].gpus == (HELD, FREE)
    assert by_name["gpu2"].gpus is None
    assert gpus.asked == [("gpu1", "gpu2")] and not obs.errors


def test_the_jobs_placement_nodes_are_read_in_the_same_call(tmp_path: Path) -> None:
    """With a `placement: jobs` model, its partition's nodes (gpu8 here, and the pool nodes it
    shares) are asked in the same one call, each once, and carry their readings."""
    gpus = FakeGpus(nodes={"gpu8": (FREE,), "gpu1": (HELD,)})
    obs = make_agent(tmp_path, gpus, jobs=True).observe()
    assert gpus.asked == [("gpu1", "gpu2", "gpu8")]
    placed = {v.name: v.gpus for v in obs.placement_nodes}
    assert placed == {"gpu1": (HELD,), "gpu2": None, "gpu8": (FREE,)}


def test_a_gpu_source_down_is_an_observation_error_not_the_ticks_end(tmp_path: Path) -> None:
    """The exporter's Prometheus down: every node's gpus None, one line in the errors, and the
    tick still plans and ends without an error of its own."""
    agent = make_agent(tmp_path, FakeGpus(fail=True))
    result = agent.tick()
    assert result.error is None and result.observation is not None
    assert all(v.gpus is None for v in result.observation.nodes)
    assert result.observation.errors == (
        "GPU memory unavailable (no node's GPUs observed): fake GPU exporter is down",)


def test_status_json_rows_carry_each_gpu_and_the_gpu_counts(tmp_path: Path) -> None:
    """`status --json` node rows: `gpus` a list of {index, used_mib, total_mib, holder}, null
    when not observed; Slurm's counts as `gpus_total` and `gpus_used`."""
    obs = make_agent(tmp_path, FakeGpus(nodes={"gpu1": (HELD, FREE)})).observe()
    rows = {r["name"]: r for r in json.loads(json.dumps(node_rows(obs)))}
    assert rows["gpu1"]["gpus"] == [
        {"index": 0, "used_mib": 20480, "total_mib": 81559, "holder": "job 123"},
        {"index": 1, "used_mib": 0, "total_mib": 81559, "holder": None}]
    assert rows["gpu2"]["gpus"] is None
    assert (rows["gpu1"]["gpus_total"], rows["gpu1"]["gpus_used"]) == (4, 0)


def test_the_table_names_a_gpu_a_job_holds_on_a_node_drained_for_us(tmp_path: Path) -> None:
    """Under gpu1 (reclaiming) one line per GPU the exporter says a job holds; the GPUS column
    still reads used/total from Slurm. The same hold on a lent node is its job's: no line."""
    obs = make_agent(tmp_path, FakeGpus(nodes={"gpu1": (HELD, FREE), "gpu2": (HELD,)})).observe()
    rows = node_rows(obs)
    table = render_status(rows, [], []).splitlines()
    gpu1 = next(i for i, line in enumerate(table) if line.startswith("gpu1 "))
    assert table[gpu1].split()[3] == "0/4"
    assert table[gpu1 + 1] == "  └ GPU 0: 20480/81559 MiB, holder job 123"
    assert not any("GPU 1:" in line for line in table)
    lent = [dict(r, phase="lent") if r["name"] == "gpu1" else r for r in rows]
    assert not any("holder" in line for line in render_status(lent, [], []).splitlines())


def test_gpu_memory_is_read_from_prometheus_only(tmp_path: Path) -> None:
    """The agent's GPU source is Prometheus' (metrics.source prometheus); the scrape source
    has no GPU data: no source, every node's gpus None."""
    cfg = make_config(tmp_path)
    assert isinstance(make_gpu_source(cfg), PrometheusGpuSource)
    scrape = cfg.model_copy(update={"metrics": cfg.metrics.model_copy(update={"source": "scrape"})})
    assert make_gpu_source(scrape) is None
