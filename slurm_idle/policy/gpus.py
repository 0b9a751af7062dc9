"""The GPU gate: is a reclaimed group's GPU memory free enough to start or wake an engine on? Pure.

Slurm says a node is empty when no job of its is left; a process Slurm no longer tracks (a
rootless container whose conmon escaped the job's cgroup, a docker container whose runner was
killed where no Epilog cleans up) still holds GPU memory. vLLM woken on such a GPU fails with
`CUDA error: out of memory` and leaks what it had mapped, so later wakes can keep failing after
the holder is gone. So before an engine starts or wakes, every GPU of its replicas must hold no
more than what the engine itself left there (a sleeping engine keeps its CUDA context and
whatever sleep did not free; a stopped one nothing), plus `gpu.free_tolerance_mib`.

Readings come from the site's GPU exporter through Prometheus (metrics/gpus.py), so they lag
the GPUs by the exporter's interval plus a scrape: a reading taken before the node's last job
ended still shows that job's memory. A held reading is evidence of a leftover only once it was
sampled after the group was seen empty (`fresh_after`); an older one means "wait for the next
sample", never "held". A node without any reading passes (fail-open, journaled, and doctor
fails): blocking every reclaim on a Prometheus outage would keep the service short.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass

from slurm_idle.model import GpuReading


@dataclass(frozen=True)
class HeldGpu:
    """A GPU holding more than its engine may find there."""

    node: str
    index: int
    used_mib: int
    allowed_mib: int
    holder: str | None
    sample_ts: float | None
    fresh: bool  # sampled after the group was seen empty: a leftover, not a lagging reading


@dataclass(frozen=True)
class GateVerdict:
    """The gate's answer for one group: the GPUs over their allowance, which of them are fresh
    evidence, and the nodes the exporter said nothing about."""

    held: tuple[HeldGpu, ...] = ()
    unobserved: tuple[str, ...] = ()

    @property
    def clear(self) -> bool:
        """Nothing over its allowance: the engine may start (unobserved nodes pass)."""
        return not self.held

    @property
    def leftover(self) -> tuple[HeldGpu, ...]:
        """The held GPUs whose reading was taken after the group was seen empty."""
        return tuple(g for g in self.held if g.fresh)


def allowance_mib(*, engine_up: bool, residue_mib: int | None, tolerance_mib: int,
                  max_residue_mib: int) -> int:
    """What one GPU may hold when its engine starts or wakes: the residue of an engine that is
    up (asleep: its CUDA context and what sleep did not free), as recorded when it was lent or,
    without a record, what a lend accepts (`gpu.max_residue_mib`); nothing of a stopped one
    (its process is gone); plus the tolerance."""
    if not engine_up:
        residue_mib = 0
    elif residue_mib is None:
        residue_mib = max_residue_mib
    return residue_mib + tolerance_mib


def gate(readings: dict[str, tuple[GpuReading, ...] | None], indexes: Collection[int] | None,
         allowed_mib: int, fresh_after: float | None) -> GateVerdict:
    """Per node of a group: its GPUs (`indexes` on each node; None: every GPU it reports) over
    `allowed_mib`. `readings[node]` None (or missing): the exporter has no series for it."""
    held: list[HeldGpu] = []
    unobserved: list[str] = []
    for node, gpus in readings.items():
        if gpus is None:
            unobserved.append(node)
            continue
        for gpu in gpus:
            if indexes is not None and gpu.index not in indexes:
                continue
            if gpu.used_mib > allowed_mib:
                fresh = fresh_after is None or (gpu.sample_ts is not None and gpu.sample_ts >= fresh_after)
                held.append(HeldGpu(node, gpu.index, gpu.used_mib, allowed_mib, gpu.holder,
                                    gpu.sample_ts, fresh))
    return GateVerdict(tuple(held), tuple(unobserved))


def describe(held: Iterable[HeldGpu]) -> str:
    """The one text naming held GPUs (explain, the journal, the admin's Reason, status):
    `gpu2 GPU 0: 20480 MiB held (allowed 1024), holder job 123`."""
    return "; ".join(
        f"{g.node} GPU {g.index}: {g.used_mib} MiB held (allowed {g.allowed_mib}), "
        f"holder {g.holder or 'unknown (not a Slurm job)'}" for g in held)


def holders(held: Sequence[HeldGpu]) -> list[str]:
    """The distinct holders named by the exporter, in GPU order."""
    return list(dict.fromkeys(g.holder for g in held if g.holder))
