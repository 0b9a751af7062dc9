"""The simulator with several replicas per node: whole nodes lent, node GPUs harvested, the
oracle bound on whole nodes."""

from __future__ import annotations

import pytest

from slurm_idle.config import parse_config
from slurm_idle.errors import ConfigError
from slurm_idle.sim import POLICIES, FleetModel, SimParams, fleet_from_config, parse_fleet, simulate
from slurm_idle.traces import Series, Trace, synthetic_trace


def needs_trace(needs: list[int]) -> Trace:
    """Minute m needs exactly needs[m] replicas (1 token/s per rps, 1 tok/s replicas)."""
    n = len(needs)
    return Trace(start=0.0, steps=n,
                 series={"m": Series(tuple(float(x) for x in needs), (0.0,) * n, (1.0,) * n)})


def test_fleet_spec_takes_replicas_per_node() -> None:
    """`MODEL=R:G:T:PER_NODE`; replicas that do not fill whole nodes are refused."""
    assert parse_fleet("llama=16:4:2500:2") == FleetModel("llama", 16, 4, 2500.0, 2)
    assert parse_fleet("llama=16:4:2500").per_node == 1
    with pytest.raises(ConfigError, match="do not fill nodes of 2"):
        parse_fleet("llama=15:4:2500:2")


def test_fleet_from_config_reads_replicas_per_node() -> None:
    """A config with two replicas per node simulates as PER_NODE 2."""
    cfg = parse_config("""
engine: {kind: command, start_command: a, stop_command: b}
models:
  - name: m
    nodes: gpu[1-4]
    replicas_per_node: 2
    url: "http://{node}:800{index}"
""")
    assert fleet_from_config(cfg) == [FleetModel("m", 8, 4, 2000.0, 2)]


@pytest.mark.parametrize("policy", POLICIES)
def test_only_whole_nodes_are_lent(policy: str) -> None:
    """With two replicas per node, lent replicas come in pairs every minute, and the replicas
    are conserved."""
    fleet = [FleetModel("llama-70b", 20, 4, 2500.0, 2)]
    result = simulate(synthetic_trace(days=1, seed=4), fleet, SimParams(), policy)
    rows = result.timeline["llama-70b"]
    assert all(sum(row) == 20 for row in rows)
    assert all(lent % 2 == 0 for _, _, lent, _ in rows)
    assert any(lent for _, _, lent, _ in rows)


def test_harvest_and_oracle_count_whole_node_gpus() -> None:
    """4 x 1-GPU replicas, 2 per node, needing 1 replica: only 1 node can go (the other holds the
    needed replica and its partner); 2 GPUs lent per minute, and the oracle bound agrees."""
    trace = needs_trace([1] * 120)
    fleet = [FleetModel("m", 4, 1, 1.0, 2)]
    params = SimParams(start_s=0.0, grace_s=0.0, drain_s=0.0, utilisation=1.0, floor=0)
    oracle = simulate(trace, fleet, params, "oracle")
    assert oracle.oracle_gpu_hours == pytest.approx(120 * 2 / 60)
    assert oracle.harvested_gpu_hours == pytest.approx(120 * 2 / 60)
    ours = simulate(trace, fleet, params, "slurm-idle")
    assert ours.slo_violation_minutes == 0
    assert ours.harvested_gpu_hours <= oracle.oracle_gpu_hours + 1e-9
