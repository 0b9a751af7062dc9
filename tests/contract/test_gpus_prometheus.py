"""Contract: PrometheusGpuSource against a real Prometheus scraping a static GPU exporter page.

The page has dcgm-exporter's names and labels (two jobs mapped to one GPU, a node named by its
FQDN, a node whose samples carry a timestamp 3 minutes old, as an exporter that stopped
updating would) and a bytes exporter's series beside them. No Slurm sandbox: one Prometheus and
one 127.0.0.1 file server, stopped by pid.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from slurm_idle.config import Config, parse_config
from slurm_idle.metrics.gpus import PrometheusGpuSource
from slurm_idle.metrics.promql import Queries
from slurm_idle.model import GpuReading
from slurm_idle.testing import procs

from .test_agent_metrics_prometheus import FileServer, free_port, query, start_prometheus, wait

#: The timestamp of gpu3's samples: 180 s before the page is written (in ms, the text format's).
STALE_AGE_S = 180


def page(now: float) -> str:
    old = int((now - STALE_AGE_S) * 1000)
    h100 = 'modelName="NVIDIA H100 80GB HBM3"'
    lines = ["# TYPE DCGM_FI_DEV_FB_USED gauge", "# TYPE DCGM_FI_DEV_FB_FREE gauge"]
    for metric, job1, job2, idle in (("DCGM_FI_DEV_FB_USED", 20480, 20480, 812),
                                     ("DCGM_FI_DEV_FB_FREE", 61079, 61079, 80747)):
        lines += [
            f'{metric}{{gpu="0",UUID="GPU-a0",device="nvidia0",{h100},Hostname="gpu1",hpc_job="123"}} {job1}',
            f'{metric}{{gpu="0",UUID="GPU-a0",device="nvidia0",{h100},Hostname="gpu1",hpc_job="77"}} {job2}',
            f'{metric}{{gpu="1",UUID="GPU-a1",device="nvidia1",{h100},Hostname="gpu1"}} {idle}',
            f'{metric}{{gpu="0",UUID="GPU-b0",device="nvidia0",{h100},Hostname="gpu2.cluster.local"}} {idle}',
            f'{metric}{{gpu="0",UUID="GPU-c0",device="nvidia0",{h100},Hostname="gpu3"}} {idle} {old}',
        ]
    lines += ["# TYPE nvidia_gpu_memory_used_bytes gauge",
              f'nvidia_gpu_memory_used_bytes{{minor_number="2",node="gpu4"}} {1024 * 2**20}',
              "# TYPE nvidia_gpu_memory_total_bytes gauge",
              f'nvidia_gpu_memory_total_bytes{{minor_number="2",node="gpu4"}} {81559 * 2**20}']
    return "\n".join(lines) + "\n"


def config(prom: str, gpu: str = "") -> Config:
    return parse_config(f"""
metrics: {{prometheus_url: "{prom}", staleness_s: 120, job_label: vllm}}
engine: {{kind: command, start_command: a, stop_command: b}}
models: [{{name: m, nodes: 'gpu[1-4]'}}]
{gpu}""")


@pytest.fixture()
def prom(tmp_path: Path) -> Iterator[str]:
    """A Prometheus scraping the static GPU page every second."""
    path = tmp_path / "gpus.prom"
    path.write_text(page(time.time()))
    pids: list[int] = []
    port = free_port()
    server = FileServer(path, port)
    try:
        url = start_prometheus(tmp_path, free_port(), port, pids)
        # every series, the 3-minute-old ones included, is in Prometheus before the tests read
        wait(lambda: len(query(url, "DCGM_FI_DEV_FB_USED")) == 5
             and query(url, "nvidia_gpu_memory_total_bytes"), 40, "the GPU page scraped")
        yield url
    finally:
        server.stop()
        left = procs.terminate(pids)
        assert not left, f"had to SIGKILL {left}"


def test_dcgm_series_read_per_node_with_holders_and_stale_dropped(prom: str) -> None:
    """DCGM's names: gpu1's GPU 0 held by two jobs is one reading naming both, GPU 1 free; gpu2
    found by its FQDN; gpu3's samples are 3 minutes old: Prometheus still returns them (within
    its 5-minute lookback) and the source drops them (metrics.staleness_s 120)."""
    src = PrometheusGpuSource(config(prom))
    got = src.readings(["gpu1", "gpu2", "gpu3", "gpu4"], budget_s=10.0)
    assert set(got) == {"gpu1", "gpu2"}
    assert [(g.index, g.used_mib, g.total_mib, g.holder) for g in got["gpu1"]] == [
        (0, 20480, 81559, "job 77, job 123"), (1, 812, 81559, None)]
    assert [(g.index, g.used_mib, g.total_mib, g.holder) for g in got["gpu2"]] == [(0, 812, 81559, None)]
    now = time.time()
    assert all(g.sample_ts is not None and now - 30 < g.sample_ts <= now + 1 for g in got["gpu1"])
    raw = query(prom, Queries.gpus(src.config.gpu))
    stale = [s for s in raw if s["metric"].get("Hostname") == "gpu3" and s["metric"]["kind"] == "ts"]
    assert stale and now - float(stale[0]["value"][1]) >= STALE_AGE_S - 1  # there, and old


def test_a_bytes_exporter_is_read_in_mib(prom: str) -> None:
    """Another exporter named in `gpu:` (bytes, its total metric, the node in a `node` label):
    MiB readings through the same real Prometheus."""
    src = PrometheusGpuSource(config(prom, """gpu: {used_metric: nvidia_gpu_memory_used_bytes,
  free_metric: null, total_metric: nvidia_gpu_memory_total_bytes, unit: bytes, node_label: node,
  index_label: minor_number, holder_label: null}"""))
    got = src.readings(["gpu1", "gpu4"], budget_s=10.0)
    assert list(got) == ["gpu4"]
    [reading] = got["gpu4"]
    assert (reading.index, reading.used_mib, reading.total_mib, reading.holder) == (2, 1024, 81559, None)
    assert isinstance(reading, GpuReading)
