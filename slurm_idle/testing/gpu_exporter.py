"""The sandbox's GPU exporter: what NVIDIA's dcgm-exporter would say of each node's fake GPUs.

One process serves one port per node (`--node NAME=PORT`, the sandbox's port plan), each port
that node's `/metrics`, as one dcgm-exporter runs per node. The figures are found, not declared:
fakegpu.scan reads /proc/*/fd for the device files under `--dev` and the holders' records
(cached CACHE_S, so Prometheus' scrapes of every port share one scan).

The text keeps DCGM's names: gauges DCGM_FI_DEV_FB_USED and DCGM_FI_DEV_FB_FREE in MiB, labels
`gpu` (index), `UUID`, `pci_bus_id`, `device` (nvidiaN), `modelName`, `Hostname`; and, as its HPC
job mapping does, `hpc_job` = the job of each holder that has one, ONE SERIES PER JOB (each
with the GPU's whole figure) and none of them when no holder is a Slurm job.
A file `{dev}/{node}/exporter-off` hides that node's series (an exporter down, a node whose
GPUs nobody watches), the port still answering.

Run: python -m slurm_idle.testing.gpu_exporter --dev DIR --node gpu1=PORT [--node ...]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path

from slurm_idle.testing import asynchttp, fakegpu
from slurm_idle.testing.asynchttp import HttpRequest, Reply
from slurm_idle.testing.fakegpu import Holding

CACHE_S = 0.5
OFF_FILE = "exporter-off"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
#: dcgm-exporter's default counters (etc/default-counters.csv): name, help.
METRICS = (("DCGM_FI_DEV_FB_FREE", "Framebuffer memory free (in MiB)."),
           ("DCGM_FI_DEV_FB_USED", "Framebuffer memory used (in MiB)."))


def gpu_uuid(node: str, index: int) -> str:
    """A fake GPU's UUID, the same on every run (nvidia-smi's shape: GPU-8-4-4-4-12)."""
    return "GPU-" + str(uuid.uuid5(uuid.NAMESPACE_DNS, f"{node}.gpu{index}.slurm-idle.sandbox"))


def render(node: str, indexes: Sequence[int], holdings: Sequence[Holding]) -> str:
    """`node`'s page: each of its GPUs, its used and free MiB, a series per holder's job."""
    lines: list[str] = []
    for name, help_text in METRICS:
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} gauge"]
        for index in indexes:
            mine = [h for h in holdings if h.node == node and h.index == index]
            used = min(fakegpu.TOTAL_MIB, sum(h.mib for h in mine))
            value = fakegpu.TOTAL_MIB - used if name == "DCGM_FI_DEV_FB_FREE" else used
            labels = (f'gpu="{index}",UUID="{gpu_uuid(node, index)}",'
                      f'pci_bus_id="00000000:{0x18 + index:02X}:00.0",device="nvidia{index}",'
                      f'modelName="{fakegpu.MODEL_NAME}",Hostname="{node}"')
            jobs = sorted({h.job for h in mine if h.job is not None}, key=_job_order)
            for extra in [f',hpc_job="{job}"' for job in jobs] or [""]:
                lines.append(f"{name}{{{labels}{extra}}} {value}")
    return "\n".join(lines) + "\n"


def _job_order(job: str) -> tuple[int, str]:
    return (int(job), "") if job.isdigit() else (sys.maxsize, job)


class Scanner:
    """fakegpu.scan of `dev`, at most once per CACHE_S (`scan` and `clock` injectable)."""

    def __init__(self, dev: Path, scan: Callable[[Path], list[Holding]] = fakegpu.scan,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.dev = dev
        self._scan = scan
        self._clock = clock
        self._at: float | None = None
        self._last: list[Holding] = []

    def holdings(self) -> list[Holding]:
        now = self._clock()
        if self._at is None or now - self._at >= CACHE_S:
            self._last = self._scan(self.dev)
            self._at = now
        return self._last


def page(scanner: Scanner, node: str) -> str:
    """What `node`'s port answers at /metrics ('' while its exporter-off file exists)."""
    node_dir = scanner.dev / node
    if (node_dir / OFF_FILE).exists():
        return ""
    return render(node, fakegpu.node_indexes(node_dir), scanner.holdings())


async def serve(dev: Path, ports: dict[str, int], host: str = "127.0.0.1") -> None:
    scanner = Scanner(dev)
    servers = []
    for node, port in ports.items():
        async def handle(request: HttpRequest, node: str = node) -> Reply:
            if request.target.split("?")[0] != "/metrics":
                return 404, b"Not Found\n", "text/plain"
            return 200, page(scanner, node).encode(), CONTENT_TYPE

        servers.append(await asynchttp.start(handle, host, port))
    print(f"gpu-exporter: {len(servers)} nodes on {host}: "
          + " ".join(f"{n}={p}" for n, p in ports.items()), flush=True)
    await asyncio.Event().wait()  # until SIGTERM


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m slurm_idle.testing.gpu_exporter",
                                description=(__doc__ or "").splitlines()[0])
    p.add_argument("--dev", type=Path, required=True, help="the sandbox's fake GPU root")
    p.add_argument("--node", action="append", default=[], metavar="NAME=PORT", required=True)
    p.add_argument("--host", default="127.0.0.1")
    args = p.parse_args(argv)
    ports = {}
    for item in args.node:
        name, _, port = item.partition("=")
        ports[name] = int(port)
    try:
        asyncio.run(serve(args.dev, ports, args.host))
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
