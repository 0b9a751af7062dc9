"""The node driver's side of the GPU gate: read the pool's GPU memory once per poll for every
group waiting on it, and judge a group's GPUs by the pure rule of policy/gpus.py.

The readings come from a reader the agent wires in (the site's GPU exporter through
Prometheus). Without one, or when it fails, every GPU passes as unobserved: the gate never
blocks a reclaim on a monitoring outage (doctor fails instead, and the step says so).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, TypeAlias

from slurm_idle.config import Config, ReplicaConfig
from slurm_idle.engine_notes import EngineNotes
from slurm_idle.errors import SlurmIdleError
from slurm_idle.logs import get_logger
from slurm_idle.model import GpuReading
from slurm_idle.policy.gpus import GateVerdict, HeldGpu, allowance_mib, gate
from slurm_idle.steps import POLL_S, SharedPoll

if TYPE_CHECKING:
    from slurm_idle.engine import Engine

log = get_logger(__name__)

#: nodes -> each node's GPU readings (a node the exporter has no series for is left out).
GpuReader: TypeAlias = Callable[[Sequence[str]], Mapping[str, tuple[GpuReading, ...]]]


class GpuGate:
    """One shared read of the pool's GPU readings per POLL_S, judged per group."""

    def __init__(self, config: Config, read: GpuReader | None, clock: Callable[[], float],
                 notes: EngineNotes | None = None,
                 engine_for: Callable[[str], Engine] | None = None) -> None:
        self.config = config
        self._read = read
        self._notes = notes
        self._engine_for = engine_for
        self._nodes = sorted({n for m in config.models for r in m.replicas for n in _nodes_of(r)})
        self._poll = SharedPoll(self._read_all, POLL_S, clock)

    def _read_all(self) -> tuple[bool, Mapping[str, tuple[GpuReading, ...]]]:
        """(read, readings). A failed read is kept for the poll interval like a good one: in
        an outage every waiting group must not queue for its own timed-out query."""
        if self._read is None:
            return False, {}
        try:
            return True, self._read(self._nodes)
        except SlurmIdleError as exc:
            log.warning("GPU readings unavailable (%s): GPUs are not checked before a start", exc)
            return False, {}

    @property
    def active(self) -> bool:
        """A GPU source is wired (the gate and the residue measure read it)."""
        return self._read is not None

    def residue(self, replicas: Sequence[tuple[str, ReplicaConfig]],
                newer_than: float) -> dict[str, dict[int, int]] | None:
        """Per replica: the MiB on each of its GPUs in samples taken after `newer_than`; None
        while one of them has no such sample yet. A node without series (or no source) is
        not measured: its replicas get no entry."""
        read, readings = self._poll.get()
        if not read:
            return {}
        out: dict[str, dict[int, int]] = {}
        for _model, replica in replicas:
            per: dict[int, int] = {}
            for node in _nodes_of(replica):
                for gpu in readings.get(node, ()):
                    if replica.gpus is not None and gpu.index not in replica.gpus:
                        continue
                    if gpu.sample_ts is None or gpu.sample_ts < newer_than:
                        return None
                    per[gpu.index] = max(per.get(gpu.index, 0), gpu.used_mib)
            if per:
                out[replica.name] = per
        return out

    def verdict(self, replicas: Sequence[tuple[str, ReplicaConfig]], fresh_after: float | None) -> GateVerdict:
        """Every GPU of the replicas (model, config) over what its engine may find there."""
        if self._read is None:
            return GateVerdict()  # no GPU source wired: the gate is off
        read, readings = self._poll.get()
        if not read:  # nothing to judge by: every node unobserved, no engine asked
            return GateVerdict(unobserved=tuple(dict.fromkeys(n for _, r in replicas for n in _nodes_of(r))))
        held: list[HeldGpu] = []
        unobserved: list[str] = []
        for model, replica in replicas:
            # The engine's own memory is no leftover: a live engine on the replica's endpoint
            # (adopted with it running, a start of an earlier tick, one whose identity could
            # not be confirmed, or another agent's: the start replaces it, and the identity
            # check repairs it) needs no gate; one up but asleep, or whose sleep state is
            # unknown, keeps only its residue.
            health = self._engine_for(model).health(replica) if self._engine_for is not None else None
            if health is not None and health.live:
                continue
            residue = self._notes.residue(replica.name) if self._notes is not None else None
            allowed = allowance_mib(engine_up=health is not None and health.up,
                                    residue_mib=max(residue.values()) if residue else None,
                                    tolerance_mib=self.config.gpu.free_tolerance_mib,
                                    max_residue_mib=self.config.gpu.max_residue_mib)
            nodes = {n: readings.get(n) for n in _nodes_of(replica)}
            one = gate(nodes, replica.gpus, allowed, fresh_after)
            held.extend(g for g in one.held if g not in held)
            unobserved.extend(n for n in one.unobserved if n not in unobserved)
        return GateVerdict(tuple(held), tuple(unobserved))


def _nodes_of(replica: ReplicaConfig) -> tuple[str, ...]:
    return replica.nodes or (replica.node,)
