"""The sandbox's GPU exporter: DCGM's names and labels, figures found from /proc and records."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from slurm_idle.testing import fakegpu, gpu_exporter
from slurm_idle.testing.fakegpu import CONTEXT_MIB, TOTAL_MIB, Holding


class FakeProc:
    """A /proc of a table: pid -> (open files, environment)."""

    def __init__(self, table: dict[int, tuple[list[str], dict[str, str]]]) -> None:
        self.table = table

    def pids(self) -> Iterable[int]:
        return list(self.table)

    def fd_targets(self, pid: int) -> list[str]:
        return self.table[pid][0]

    def environ(self, pid: int) -> Mapping[str, str]:
        return self.table[pid][1]


def make_node(dev: Path, node: str, gpus: int) -> Path:
    d = dev / node
    fakegpu.held_dir(d).mkdir(parents=True)
    for i in range(gpus):
        fakegpu.device_path(d, i).touch()
    return d


def record(dev: Path, node: str, pid: int, mib: dict[int, int], job: str | None = None) -> None:
    (fakegpu.held_dir(dev / node) / f"{pid}.json").write_text(
        json.dumps({"pid": pid, "job": job, "mib": {str(i): m for i, m in mib.items()}}))


def series(text: str) -> list[tuple[str, dict[str, str], float]]:
    return [(s.name, s.labels, s.value) for f in text_string_to_metric_families(text)
            for s in f.samples]


def test_scan_finds_holders_by_their_open_device_files(tmp_path: Path) -> None:
    """A process with a node's device file open holds that GPU: its record's MiB, a bare CUDA
    context without a record; a record without an open file and files of no GPU count for
    nothing; the job is the record's, else the holder's SLURM_JOB_ID."""
    dev = tmp_path / "dev"
    make_node(dev, "gpu1", 4)
    make_node(dev, "gpu2", 4)
    record(dev, "gpu1", 10, {0: 20000, 1: 20000})
    record(dev, "gpu2", 11, {3: 40000}, job="7")
    record(dev, "gpu2", 99, {0: 60000})  # its process is gone
    proc = FakeProc({
        10: ([f"{dev}/gpu1/nvidia0", f"{dev}/gpu1/nvidia1", "socket:[1]"], {}),
        11: ([f"{dev}/gpu2/nvidia3", f"{dev}/gpu2/held/11.json"], {"SLURM_JOB_ID": "8"}),
        12: ([f"{dev}/gpu2/nvidia3"], {"SLURM_JOB_ID": "9"}),
        13: (["/dev/null", f"{dev}/gpu2"], {}),
    })
    assert fakegpu.scan(dev, proc) == [
        Holding("gpu1", 0, 10, 20000, None), Holding("gpu1", 1, 10, 20000, None),
        Holding("gpu2", 3, 11, 40000, "7"), Holding("gpu2", 3, 12, CONTEXT_MIB, "9")]


def test_page_has_dcgm_names_labels_and_figures(tmp_path: Path) -> None:
    """FB_USED is the sum of the holders' MiB (at most the GPU's total), FB_FREE the rest, with
    dcgm-exporter's labels; a GPU nobody holds reads 0 used; no hpc_job without a Slurm job."""
    dev = tmp_path / "dev"
    make_node(dev, "gpu2", 2)
    record(dev, "gpu2", 10, {0: 20000})
    record(dev, "gpu2", 11, {0: 70000})
    proc = FakeProc({10: ([f"{dev}/gpu2/nvidia0"], {}), 11: ([f"{dev}/gpu2/nvidia0"], {})})
    text = gpu_exporter.page(gpu_exporter.Scanner(dev, lambda d: fakegpu.scan(d, proc)), "gpu2")
    got = {(name, labels["gpu"]): (labels, value) for name, labels, value in series(text)}
    assert {k: v for k, (_, v) in got.items()} == {
        ("DCGM_FI_DEV_FB_USED", "0"): TOTAL_MIB, ("DCGM_FI_DEV_FB_FREE", "0"): 0,
        ("DCGM_FI_DEV_FB_USED", "1"): 0, ("DCGM_FI_DEV_FB_FREE", "1"): TOTAL_MIB}
    labels = got[("DCGM_FI_DEV_FB_USED", "1")][0]
    assert labels == {"gpu": "1", "UUID": gpu_exporter.gpu_uuid("gpu2", 1),
                      "pci_bus_id": "00000000:19:00.0", "device": "nvidia1",
                      "modelName": "NVIDIA H100 80GB HBM3", "Hostname": "gpu2"}
    assert gpu_exporter.gpu_uuid("gpu2", 1) != gpu_exporter.gpu_uuid("gpu3", 1)
    assert "# TYPE DCGM_FI_DEV_FB_USED gauge" in text


def test_one_series_per_job_each_with_the_whole_gpu(tmp_path: Path) -> None:
    """Two jobs on one GPU make two series (hpc_job 5 and 12), each the GPU's whole figure, as
    dcgm-exporter's HPC job mapping does; a holder outside Slurm adds to it unlabelled."""
    holdings = [Holding("gpu8", 0, 1, 1000, "12"), Holding("gpu8", 0, 2, 2000, "5"),
                Holding("gpu8", 0, 3, 500, None), Holding("gpu7", 0, 4, 9000, "6")]
    used = [(labels.get("hpc_job"), value) for name, labels, value
            in series(gpu_exporter.render("gpu8", [0], holdings)) if name == "DCGM_FI_DEV_FB_USED"]
    assert used == [("5", 3500), ("12", 3500)]


def test_exporter_off_hides_the_nodes_series(tmp_path: Path) -> None:
    """`{dev}/{node}/exporter-off` empties that node's page only."""
    dev = tmp_path / "dev"
    make_node(dev, "gpu1", 1)
    make_node(dev, "gpu2", 1)
    scanner = gpu_exporter.Scanner(dev, lambda d: [])
    (dev / "gpu1" / gpu_exporter.OFF_FILE).touch()
    assert gpu_exporter.page(scanner, "gpu1") == ""
    assert "Hostname=\"gpu2\"" in gpu_exporter.page(scanner, "gpu2")


def test_scans_are_cached_half_a_second() -> None:
    """Scrapes of every node's port within CACHE_S share one /proc scan."""
    now = [100.0]
    scans: list[Path] = []
    scanner = gpu_exporter.Scanner(Path("/x"), lambda d: scans.append(d) or [],
                                   clock=lambda: now[0])
    scanner.holdings()
    now[0] += gpu_exporter.CACHE_S / 2
    scanner.holdings()
    assert len(scans) == 1
    now[0] += gpu_exporter.CACHE_S
    scanner.holdings()
    assert len(scans) == 2
