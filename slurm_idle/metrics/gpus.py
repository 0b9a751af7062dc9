"""GPU memory per node, as the site's GPU exporter reports it through Prometheus.

An empty `squeue` does not mean a free GPU: a leftover container or an untracked process may
still hold its memory. So the GPUs themselves are observed: ONE instant query per tick for every
GPU of the fleet (promql.Queries.gpus), read here into `GpuReading`s per node. Names are
dcgm-exporter's by default (`DCGM_FI_DEV_FB_USED`/`_FREE` in MiB, labels `Hostname`, `gpu`, and
`hpc_job` from its HPC job mapping, one series per job when several share a GPU); the `gpu`
config section names another exporter's metrics, labels and unit.

Only Prometheus has them: the scrape source and its fallback read vLLM's pages alone, so while
Prometheus is down no node has readings (`NodeView.gpus` is None), which callers must read as
"not observed", never as "free".
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from slurm_idle.config import Config, GpuConfig
from slurm_idle.errors import MetricsUnavailable
from slurm_idle.logs import get_logger
from slurm_idle.metrics.promql import Queries
from slurm_idle.model import GpuReading

if TYPE_CHECKING:  # prometheus_api_client is imported only where a source is built
    from slurm_idle.metrics.prometheus import PrometheusClient

log = get_logger(__name__)

MIB = 1 << 20

#: `host:port` (a node label that is `instance`): the port is not part of the node's name.
_PORT = re.compile(r":[0-9]{1,5}$")


@runtime_checkable
class GpuSource(Protocol):
    """Where the agent reads its nodes' GPU memory from."""

    def readings(self, nodes: Sequence[str], *, budget_s: float) -> dict[str, tuple[GpuReading, ...]]:
        """node -> its GPUs' fresh readings, by index, for the `nodes` that have any (a node
        without fresh series is left out). The whole call ends within `budget_s`;
        MetricsUnavailable when the source cannot be read."""
        ...


class PrometheusGpuSource:
    """GpuSource reading the GPU exporter's series in the Prometheus of `metrics`: the same
    adapter as the engines' load (prometheus.PrometheusSource), so its failures are the same
    one-line MetricsUnavailable."""

    def __init__(self, config: Config, prom: PrometheusClient | None = None) -> None:
        from slurm_idle.metrics.prometheus import PrometheusSource

        self.config = config
        self.source = PrometheusSource(config, prom=prom)
        self.promql = Queries.gpus(config.gpu)

    def readings(self, nodes: Sequence[str], *, budget_s: float) -> dict[str, tuple[GpuReading, ...]]:
        self.source.set_budget(budget_s)
        answer = self.source.query(self.promql)
        try:
            # Freshness on Prometheus' own clock (the answer's evaluation time), not ours.
            return parse_gpu_answer(answer.result, nodes, self.config.gpu,
                                    staleness_s=self.config.metrics.staleness_s, now=answer.eval_ts)
        except (ValueError, KeyError, TypeError, IndexError, AttributeError) as exc:
            raise MetricsUnavailable(
                f"unexpected answer from Prometheus at {self.source.url} to the GPU query: {exc!r}"
            ) from None


@dataclass
class _Gpu:
    """One GPU's series folded together (several jobs on it: one series each)."""

    used: float = 0.0
    sample_ts: float = 0.0
    holders: set[str] = field(default_factory=set)


def node_matcher(nodes: Iterable[str]) -> Mapping[str, str]:
    """Lower-case name -> node, for `match_node`."""
    return {n.lower(): n for n in nodes}


def match_node(names: Mapping[str, str], value: str) -> str | None:
    """The node a label value names: the node's name, its FQDN (node `gpu1` is
    `gpu1.cluster.local`), either with a `:port` (an `instance` label); None for any other."""
    v = _PORT.sub("", value.lower())
    if v in names:
        return names[v]
    short = v.split(".", 1)[0]
    if short != v and not v.replace(".", "").isdigit():  # an IP address has no short name
        return names.get(short)
    return None


def parse_gpu_answer(
    result: Iterable[Mapping[str, Any]],
    nodes: Sequence[str],
    gpu: GpuConfig,
    *,
    staleness_s: float,
    now: float | None,
) -> dict[str, tuple[GpuReading, ...]]:
    """The readings of `nodes` in one answer to `Queries.gpus` (pure).

    A `used` series counts only with the `ts` series of the same node, GPU and job, no older
    than `staleness_s` before `now` (an exporter that stopped updating is not a reading); series of a GPU held by several
    jobs fold into one reading naming them all. Total = the total series, else used + free.
    Values in bytes (`gpu.unit`) become MiB here. Series of other nodes, without an integer
    GPU index, or not finite and >= 0 are skipped.
    """
    names = node_matcher(nodes)
    matched: dict[str, str | None] = {}  # label value -> node, once per value (8 GPUs a node)
    scale = MIB if gpu.unit == "bytes" else 1
    # One `used` and one `ts` series per GPU and job mapped to it (the holder): paired by that.
    used: dict[tuple[str, int, str | None], float] = {}
    stamps: dict[tuple[str, int, str | None], float] = {}
    free: dict[tuple[str, int], float] = {}
    total: dict[tuple[str, int], float] = {}
    for item in result:
        labels = item["metric"]
        kind = labels.get("kind")
        named = str(labels.get(gpu.node_label, ""))
        node = matched[named] if named in matched else matched.setdefault(
            named, match_node(names, named))
        if node is None or kind is None:
            continue
        try:
            index = int(labels.get(gpu.index_label, ""))
        except ValueError:
            continue
        value = float(item["value"][1])
        if not 0 <= value < math.inf:
            continue
        if kind in {"used", "ts"}:
            key = (node, index, (labels.get(gpu.holder_label) or None) if gpu.holder_label else None)
            into = used if kind == "used" else stamps
            into[key] = max(into.get(key, 0.0), value / scale if kind == "used" else value)
        elif kind in {"free", "total"}:
            known = free if kind == "free" else total
            known[(node, index)] = max(known.get((node, index), 0.0), value / scale)
    gpus: dict[tuple[str, int], _Gpu] = {}
    stale = 0
    for (node, index, holder), value in used.items():
        ts = stamps.get((node, index, holder))
        if ts is None or now is None or now - ts > staleness_s:
            stale += 1
            continue
        one = gpus.setdefault((node, index), _Gpu())
        one.used = max(one.used, value)
        one.sample_ts = max(one.sample_ts, ts)
        if holder is not None:
            one.holders.add(holder)
    if stale:
        log.debug("GPU readings: %d series older than %gs dropped", stale, staleness_s)
    out: dict[str, list[GpuReading]] = {}
    for (node, index), one in sorted(gpus.items()):
        if (node, index) in total:
            whole: float | None = total[(node, index)]
        elif (node, index) in free:
            whole = one.used + free[(node, index)]
        else:
            whole = None
        out.setdefault(node, []).append(GpuReading(
            index=index, used_mib=round(one.used), total_mib=None if whole is None else round(whole),
            holder=", ".join(f"job {h}" for h in sorted(one.holders, key=_job_order)) or None,
            sample_ts=one.sample_ts))
    return {node: tuple(readings) for node, readings in out.items()}


def _job_order(job: str) -> tuple[int, str]:
    """Job ids by number (`9` before `10`), anything else after them."""
    return (int(job), "") if job.isdigit() else (1 << 62, job)
