"""The simulator with `placement: jobs` models: a reclaim costs grace + queue + start, a lend
drain + scancel, and each replica is its own lend unit."""

from __future__ import annotations

import pytest

from slurm_idle.config import parse_config
from slurm_idle.errors import ConfigError
from slurm_idle.model import Action, ActionKind, Phase
from slurm_idle.sim import FleetModel, SimParams, fleet_from_config, parse_fleet
from slurm_idle.sim.baselines import Oracle
from slurm_idle.sim.engine import Simulation
from slurm_idle.sim.jobs_mode import (
    job_lend_s,
    job_phase_latency,
    job_reclaim_s,
    job_reclaim_steps,
)
from slurm_idle.traces import Series, Trace

PARAMS = SimParams(start_s=120.0, grace_s=60.0, drain_s=30.0, queue_s=45.0, cancel_s=20.0)


def test_phase_latencies_follow_the_job_edges() -> None:
    """Each replica-job phase lasts what its JOB_EDGES wait costs; settled phases have none."""
    assert job_phase_latency(PARAMS, Phase.RETIRING) == 30.0  # drain
    assert job_phase_latency(PARAMS, Phase.LENDING) == 20.0  # scancel -> job gone
    assert job_phase_latency(PARAMS, Phase.RECLAIMING) == 105.0  # queue + grace
    assert job_phase_latency(PARAMS, Phase.STARTING) == 120.0  # engine start
    with pytest.raises(KeyError):
        job_phase_latency(PARAMS, Phase.LENT)
    assert job_reclaim_s(PARAMS) == 60.0 + 45.0 + 120.0
    assert job_lend_s(PARAMS) == 30.0 + 20.0
    assert job_reclaim_steps(PARAMS) == 2 + 2


def trace(minutes: int) -> Trace:
    return Trace(start=0.0, steps=minutes,
                 series={"m": Series((1.0,) * minutes, (0.0,) * minutes, (1.0,) * minutes)})


@pytest.mark.parametrize(("placement", "serving_at_s"), [("nodes", 180.0), ("jobs", 225.0)])
def test_reclaim_takes_queue_longer_in_jobs_mode(placement: str, serving_at_s: float) -> None:
    """A reclaimed jobs-mode replica serves grace + queue + start after the decision (the
    nodes-mode one grace + start): the queue delay is charged on RECLAIMING."""
    sim = Simulation(trace(10), [FleetModel("m", 1, 4, 1.0, 1, placement)], PARAMS)
    node = sim.nodes["m"][0]
    node.phase = Phase.LENT
    assert sim.apply(Action(ActionKind.RECLAIM, node.name, "m", Phase.LENT, Phase.RECLAIMING, "t"), 0.0)
    reached = None
    for now in range(0, 600, 15):
        nxt = {Phase.RECLAIMING: Phase.STARTING, Phase.STARTING: Phase.SERVING}.get(node.phase)
        if nxt is not None:
            sim.apply(Action(ActionKind.CONTINUE, node.name, "m", node.phase, nxt, "t"), float(now))
        if node.phase is Phase.SERVING:
            reached = float(now)
            break
    assert reached == serving_at_s


def test_fleet_of_a_jobs_placement_config() -> None:
    """A `placement: jobs` model of a config simulates as its replica jobs, one per lend unit;
    --fleet with placement jobs refuses PER_NODE."""
    cfg = parse_config("""
engine: {kind: command, start_command: a, stop_command: b}
slurm: {serve_partition: serve}
models:
  - name: jm
    placement: jobs
    tokens_per_s_per_replica: 100
    job: {replicas: 3, command: "serve --port {port}"}
""")
    assert fleet_from_config(cfg) == [FleetModel("jm", 3, 4, 100.0, 1, "jobs")]
    assert parse_fleet("m=4:4:100", "jobs").placement == "jobs"
    with pytest.raises(ConfigError, match="no PER_NODE"):
        parse_fleet("m=4:4:100:2", "jobs")


def test_cli_simulates_jobs_placement_and_refuses_bad_input() -> None:
    """`simulate --placement jobs --queue-s N` runs (the --json shape unchanged); a PER_NODE
    fleet in jobs placement and a negative queue are one line and exit 2."""
    import json
    import subprocess
    import sys

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "slurm_idle.cli", "simulate", "--synthetic",
                               "--days", "1", "--policy", "reactive", *args],
                              check=False, capture_output=True, text=True, timeout=120)

    done = run("--fleet", "m=4:4:2500", "--placement", "jobs", "--queue-s", "30", "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["minutes"] == 1440
    for bad in (["--fleet", "m=4:4:2500:2", "--placement", "jobs"],
                ["--fleet", "m=4:4:2500", "--placement", "jobs", "--queue-s", "-1"]):
        done = run(*bad)
        assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr


def needs(values: list[int]) -> Trace:
    n = len(values)
    return Trace(start=0.0, steps=n, series={"m": Series(tuple(float(v) for v in values),
                                                         (0.0,) * n, (1.0,) * n)})


@pytest.mark.parametrize(("placement", "lendable_minutes"), [("nodes", 20 - 3),
                                                             ("jobs", 20 - 1 - 4)])
def test_the_oracle_bound_counts_a_replica_jobs_own_reclaim_and_cancel(
        placement: str, lendable_minutes: int) -> None:
    """A replica free for 20 minutes between two needed ones (it drains during the last
    needed minute): as a node it must be reclaimed 3 minutes before the need (grace 60 s,
    start 120 s); as a job 4 (grace + queue 105 s is 2 whole minutes, start 2), and a
    replica job is lent only once its scancel is done (1 minute). The oracle harvests
    exactly that, with no violation."""
    params = SimParams(start_s=120.0, grace_s=60.0, drain_s=30.0, queue_s=45.0, cancel_s=20.0,
                       floor=0, utilisation=1.0, prompt_weight=0.0)
    sim = Simulation(needs([1] + [0] * 20 + [1]), [FleetModel("m", 1, 4, 1.0, 1, placement)],
                     params)
    assert sim.oracle_bound() == pytest.approx(lendable_minutes * 4 / 60)
    result = sim.run(Oracle())
    assert result.slo_violation_steps == 0
    assert result.harvested_gpu_hours == pytest.approx(sim.oracle_bound())


def test_the_queue_makes_a_jobs_reclaim_longer_than_a_nodes_in_steps() -> None:
    """In 15 s steps a job's queue shows: grace + queue 105 s is 7 steps, grace alone 4."""
    params = SimParams(start_s=120.0, grace_s=60.0, queue_s=45.0, step_s=15, tick_s=60)
    assert job_reclaim_steps(params) == 7 + 8 and params.reclaim_steps == 4 + 8


JOBS_CONFIG = """
engine: {kind: command, start_command: a, stop_command: b, expected_start_s: 120}
slurm: {serve_partition: serve, requeue_grace_s: 60}
models:
  - name: m
    placement: jobs
    tokens_per_s_per_replica: 100
    job: {replicas: 3, command: "serve --port {port}", expected_queue_s: 30}
"""


def test_the_planner_lead_of_a_jobs_model_counts_slurms_queue() -> None:
    """default_forecast_lead_s: grace + the replica job's expected queue + start + a tick."""
    from slurm_idle.config import parse_config
    from slurm_idle.policy import default_forecast_lead_s
    from slurm_idle.policy.capacity import TICK_S

    cfg = parse_config(JOBS_CONFIG)
    assert default_forecast_lead_s(cfg, "m") == 60.0 + 30.0 + 120.0 + TICK_S
