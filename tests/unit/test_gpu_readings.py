"""GPU memory read from the GPU exporter's series: one query, DCGM's names by default or another
exporter's (bytes), one reading per GPU (several jobs on it named together), stale series and
other nodes' series dropped, failures the metrics' one-line MetricsUnavailable."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import requests
import yaml

from slurm_idle.config import Config, GpuConfig, parse_config
from slurm_idle.errors import MetricsUnavailable
from slurm_idle.metrics.gpus import GpuSource, PrometheusGpuSource, match_node, parse_gpu_answer
from slurm_idle.metrics.promql import Queries
from slurm_idle.model import GpuReading
from slurm_idle.testing.fakes import FakeGpus

NOW = 1_796_205_600.0
DCGM = GpuConfig()
BYTES = GpuConfig(used_metric="nvidia_gpu_memory_used_bytes", free_metric=None,
                  total_metric="nvidia_gpu_memory_total_bytes", unit="bytes",
                  node_label="instance", index_label="minor_number", holder_label=None)
MIB = 1 << 20


def dcgm(kind: str, value: float, host: str = "gpu1", gpu: int | str = 0, job: str | None = None,
         ts: float = NOW) -> dict[str, Any]:
    """One series of an answer to Queries.gpus, with dcgm-exporter's labels."""
    labels = {"Hostname": host, "gpu": str(gpu), "UUID": f"GPU-{host}-{gpu}", "device": f"nvidia{gpu}",
              "modelName": "NVIDIA H100 80GB HBM3", "kind": kind}
    if kind != "ts":
        labels["__name__"] = {"used": "DCGM_FI_DEV_FB_USED", "free": "DCGM_FI_DEV_FB_FREE"}[kind]
    if job is not None:
        labels["hpc_job"] = job
    return {"metric": labels, "value": [ts, str(value)]}


def gpu_series(used: float, free: float, sample_ts: float = NOW - 5, **labels: Any) -> list[dict[str, Any]]:
    """A GPU's used, free and timestamp(used) series, evaluated at NOW."""
    return [dcgm("used", used, **labels), dcgm("free", free, **labels),
            dcgm("ts", sample_ts, **labels)]


def parse(result: list[dict[str, Any]], nodes: tuple[str, ...] = ("gpu1", "gpu2"),
          gpu: GpuConfig = DCGM, staleness_s: float = 120.0) -> dict[str, tuple[GpuReading, ...]]:
    return parse_gpu_answer(result, nodes, gpu, staleness_s=staleness_s, now=NOW)


def test_one_query_reads_used_free_and_the_sample_time() -> None:
    """The GPU query is one PromQL expression: used, free (or total) and timestamp(used) told
    apart by `kind`; not restricted to the vLLM scrape job."""
    q = Queries.gpus(DCGM)
    assert q == ('label_replace(DCGM_FI_DEV_FB_USED, "kind", "used", "", "") or '
                 'label_replace(DCGM_FI_DEV_FB_FREE, "kind", "free", "", "") or '
                 'label_replace(timestamp(DCGM_FI_DEV_FB_USED), "kind", "ts", "", "")')
    other = Queries.gpus(BYTES)
    assert '"kind", "total"' in other and "free" not in other
    assert "timestamp(nvidia_gpu_memory_used_bytes)" in other


def test_a_dcgm_answer_in_mib() -> None:
    """DCGM's MiB figures: used as given, total = used + free, the holder its hpc_job, the
    sample time that of `used`; one tuple per node, by GPU index."""
    answer = [*gpu_series(20480, 61079, gpu=1, job="123"), *gpu_series(812, 80747, gpu=0),
              *gpu_series(0, 81559, host="gpu2", gpu=0)]
    readings = parse(answer)
    assert readings["gpu1"] == (
        GpuReading(index=0, used_mib=812, total_mib=81559, holder=None, sample_ts=NOW - 5),
        GpuReading(index=1, used_mib=20480, total_mib=81559, holder="job 123", sample_ts=NOW - 5))
    assert readings["gpu2"] == (GpuReading(0, 0, 81559, None, NOW - 5),)


def test_a_bytes_exporter_with_its_total_metric() -> None:
    """An exporter in bytes (nvidia_gpu_memory_used_bytes, its total metric, the node in
    `instance` as host:port) reads in MiB; no holder label, no holder."""
    def series(kind: str, value: float) -> dict[str, Any]:
        return {"metric": {"instance": "gpu2.cluster.local:9445", "minor_number": "3", "kind": kind},
                "value": [NOW, str(value)]}

    answer = [series("used", 1024 * MIB), series("total", 81559 * MIB), series("ts", NOW - 10)]
    assert parse(answer, gpu=BYTES) == {"gpu2": (GpuReading(3, 1024, 81559, None, NOW - 10),)}


def test_several_jobs_on_one_gpu_are_one_reading_naming_them_all() -> None:
    """dcgm-exporter's HPC job mapping emits one series per job sharing a GPU: one reading,
    holder "job 9, job 12" (by job number)."""
    answer = [*gpu_series(30000, 51559, job="12"), *gpu_series(30000, 51559, job="9")]
    [reading] = parse(answer)["gpu1"]
    assert reading.holder == "job 9, job 12" and reading.used_mib == 30000
    assert reading.total_mib == 81559


def test_a_stale_series_is_dropped() -> None:
    """A used series sampled more than metrics.staleness_s before the evaluation is no reading
    (the exporter stopped updating); a fresh one beside it on the same GPU still counts."""
    stale = gpu_series(40000, 41559, sample_ts=NOW - 121, job="7")
    fresh = gpu_series(1000, 80559, sample_ts=NOW - 119, gpu=1)
    readings = parse([*stale, *fresh])
    assert [g.index for g in readings["gpu1"]] == [1]
    assert parse(stale) == {}
    # the job that ended (stale series) is not named beside the current one
    both = parse([*stale, *gpu_series(1000, 80559, sample_ts=NOW - 1, job="8")])
    assert [g.holder for g in both["gpu1"]] == ["job 8"]


def test_a_used_series_without_its_timestamp_is_not_a_reading() -> None:
    """Freshness cannot be told without timestamp(used): the series does not count."""
    assert parse([dcgm("used", 10), dcgm("free", 81549)]) == {}


@pytest.mark.parametrize(("value", "node"), [
    ("gpu1", "gpu1"), ("GPU1", "gpu1"), ("gpu1.cluster.local", "gpu1"), ("gpu1:9400", "gpu1"),
    ("gpu1.cluster.local:9400", "gpu1"), ("gpu10", None), ("gpu", None), ("10.0.0.1", None),
    ("", None)])
def test_the_node_label_names_a_node_by_name_fqdn_or_host_port(value: str, node: str | None) -> None:
    """Node gpu1's series: `gpu1`, its FQDN, either with a port; never gpu10's, nor an IP's."""
    assert match_node({"gpu1": "gpu1", "10": "10"}, value) == node


def test_series_of_other_nodes_and_without_an_index_are_skipped() -> None:
    """Only the nodes asked for; a GPU index that is not a number, a NaN or negative value is
    not a reading."""
    answer = [*gpu_series(5, 81554, host="gpu9"), *gpu_series(5, 81554, gpu="all"),
              *gpu_series(float("nan"), 81554, gpu=2), *gpu_series(-1, 81554, gpu=3)]
    assert parse(answer) == {}


def test_without_free_or_total_the_total_is_unknown() -> None:
    """An exporter with the used figure alone: total_mib None, the reading still there."""
    alone = DCGM.model_copy(update={"free_metric": None})
    answer = [dcgm("used", 812), dcgm("ts", NOW - 1)]
    assert parse(answer, gpu=alone)["gpu1"] == (GpuReading(0, 812, None, None, NOW - 1),)
    assert "FB_FREE" not in Queries.gpus(alone)


class Answer:
    """A Prometheus client answering every query with one result list."""

    def __init__(self, result: list[dict[str, Any]] | Exception) -> None:
        self.result = result
        self.queries: list[str] = []

    def custom_query(self, query: str, params: dict[str, Any] | None = None) -> list[dict[str, Any]]:
        self.queries.append(query)
        if isinstance(self.result, Exception):
            raise self.result
        return self.result


def config() -> Config:
    return parse_config(
        "metrics: {prometheus_url: 'http://prom:9090', staleness_s: 60, job_label: vllm}\n"
        "engine: {kind: command, start_command: a, stop_command: b}\n"
        "models: [{name: m, nodes: 'gpu[1-2]'}]\n")


def test_the_prometheus_source_sends_one_query_and_judges_freshness_on_its_clock() -> None:
    """PrometheusGpuSource sends Queries.gpus once per call; staleness is metrics.staleness_s
    against the answer's own evaluation time (Prometheus' clock)."""
    answer = [*gpu_series(812, 80747, sample_ts=NOW - 30),
              *gpu_series(900, 80659, host="gpu2", sample_ts=NOW - 61)]
    prom = Answer(answer)
    src = PrometheusGpuSource(config(), prom=prom)
    assert isinstance(src, GpuSource)
    assert src.readings(["gpu1", "gpu2"], budget_s=5.0) == {
        "gpu1": (GpuReading(0, 812, 81559, None, NOW - 30),)}
    assert prom.queries == [Queries.gpus(DCGM)]


@pytest.mark.parametrize(("answer", "needle"), [
    (requests.exceptions.ConnectionError("Connection refused"), "cannot connect to Prometheus"),
    ([{"metric": {"Hostname": "gpu1", "gpu": "0", "kind": "used"}, "value": [NOW]}],
     "unexpected answer"),
])
def test_failures_are_metrics_unavailable(answer: Any, needle: str) -> None:
    """A Prometheus that does not answer, or answers garbage: MetricsUnavailable in one line."""
    src = PrometheusGpuSource(config(), prom=Answer(answer))
    with pytest.raises(MetricsUnavailable, match=needle):
        src.readings(["gpu1"], budget_s=5.0)


def test_no_time_left_is_metrics_unavailable_without_a_query() -> None:
    """A budget already spent asks nothing (the tick's observe share is gone)."""
    prom = Answer([])
    with pytest.raises(MetricsUnavailable, match="no time left"):
        PrometheusGpuSource(config(), prom=prom).readings(["gpu1"], budget_s=0.0)
    assert prom.queries == []


def test_fake_gpus_answers_the_nodes_asked_for() -> None:
    """FakeGpus is a GpuSource: the nodes it was given that were asked for; a failure like the
    real one's."""
    fake = FakeGpus()
    fake.hold("gpu1", 1, 20480, "job 5")
    fake.hold("gpu1", 0, 10)
    assert isinstance(fake, GpuSource)
    assert fake.readings(["gpu1", "gpu2"], budget_s=1.0) == {
        "gpu1": (GpuReading(0, 10, 81559), GpuReading(1, 20480, 81559, "job 5"))}
    fake.fail = True
    with pytest.raises(MetricsUnavailable):
        fake.readings(["gpu1"], budget_s=1.0)


PROMTOOL = shutil.which("promtool")


@pytest.mark.skipif(PROMTOOL is None, reason="promtool not installed")
def test_the_gpu_queries_are_valid_promql(tmp_path: Path) -> None:
    """promtool accepts the GPU query for DCGM's names and for a bytes exporter's."""
    assert PROMTOOL is not None
    rules = [{"record": f"gpu:q{i}", "expr": Queries.gpus(g)} for i, g in enumerate((DCGM, BYTES))]
    path = tmp_path / "rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "gpus", "rules": rules}]}))
    done = subprocess.run([PROMTOOL, "check", "rules", str(path)], capture_output=True, text=True,
                          timeout=60, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
