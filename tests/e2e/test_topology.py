"""Fleets as they are, on the real sandbox (issue 13): gpu5 has 8 GPUs and two 4-GPU replicas on
two ports; one replica spans gpu[6-7] (its head on gpu6). The agent runs on the sandbox's
topology config (slurm-idle-topology.yaml: that model alone, floor 1).

Low load lends gpu6 and gpu7 together (the planner frees the most GPUs: 16), high load brings
both back together. With gpu6 pinned, low load retires both replicas of gpu5 and lends it as
one node; a job asking for all 8 GPUs runs there; high load brings both replicas back and the
job is requeued (sacct: never FAILED/CANCELLED). An admin drain on gpu5 is never touched.
`slurm-idle status --json` shows the replicas and groups at every step. The MEASURE line gives
the lend and reclaim times (pytest -s).
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from slurm_idle.config import load_config
from slurm_idle.journal import Journal
from slurm_idle.model import Phase
from slurm_idle.testing.sandboxconf import TOPOLOGY_MODEL, TOPOLOGY_NODES
from slurm_idle.testing.waiting import poll

pytestmark = pytest.mark.sandbox

LOW_RPS, HIGH_RPS = 0.0, 10.0  # 10 req/s is ~1200 tok/s: three replicas' worth at 80%
ADMIN_REASON = "admin: disk check"
TICK_EVERY_S = 1.0
GPU5_REPLICAS = ("gpu5-0", "gpu5-1")  # their emulators' (and HAProxy servers') names


@dataclass
class Run:
    """What the scenario saw, for the assertions below."""

    statuses: dict[str, dict[str, Any]] = field(default_factory=dict)  # step -> status --json
    apart: list[dict[str, str]] = field(default_factory=list)  # gpu6/gpu7 seen in two phases
    seconds: dict[str, float] = field(default_factory=dict)
    gpu5_lent_router: dict[str, str] = field(default_factory=dict)
    gpu5_lent_emulators: dict[str, bool] = field(default_factory=dict)
    job_id: int = 0
    job_node: str = ""
    job_restarts: int = 0
    job_states: list[str] = field(default_factory=list)  # sacct, after the reclaim
    serving_after_reclaim: dict[str, bool] = field(default_factory=dict)
    admin_reason_after: str = ""
    admin_transitions: list[dict[str, Any]] = field(default_factory=list)


class Scenario:
    """The agent on the topology config, ticked in-process; the CLI for status and pin."""

    def __init__(self, sb: Any) -> None:
        from slurm_idle.wiring import build_agent

        self.sb = sb
        os.environ.update(sb.env())
        self.env = {"SLURM_IDLE_CONFIG": str(sb.topology_config_path)}
        self.config = load_config(sb.topology_config_path)
        self.agent = build_agent(self.config)
        self.run = Run()

    def cli(self, *args: str) -> str:
        proc = self.sb.run([sys.executable, "-m", "slurm_idle.cli", *args], env=self.env)
        assert proc.returncode == 0, (args, proc.stderr)
        return str(proc.stdout)

    def phases(self) -> dict[str, Phase]:
        return {v.name: v.phase for v in self.agent.observe().nodes}

    def tick_until(self, what: str, cond: Callable[[dict[str, Phase]], bool],
                   timeout_s: float = 120) -> float:
        """Tick until cond(phases) holds; gpu6 and gpu7 must never be seen apart."""
        start = time.monotonic()
        while True:
            self.agent.tick()
            phases = self.phases()
            if phases["gpu6"] is not phases["gpu7"]:
                self.run.apart.append({n: p.value for n, p in phases.items()})
            if cond(phases):
                return round(time.monotonic() - start, 1)
            assert time.monotonic() - start < timeout_s, f"{what} not within {timeout_s}s: {phases}"
            time.sleep(TICK_EVERY_S)

    def status(self, step: str) -> None:
        self.run.statuses[step] = json.loads(self.cli("status", "--json"))

    def reset(self) -> None:
        """gpu5-gpu7 plain idle with every emulator up and no load; no jobs; a fresh journal."""
        sb = self.sb
        sb.run(["scancel", "--full", "-p", "idle", "-w", ",".join(TOPOLOGY_NODES)])
        for node in TOPOLOGY_NODES:
            sb.run(["scontrol", "update", f"nodename={node}", "comment="])
            sb.run(["scontrol", "update", f"nodename={node}", "state=RESUME"])
            sb.engine_start(node)
        sb.load(LOW_RPS, TOPOLOGY_MODEL)
        sb.router_ready_all()
        Path(self.config.paths.journal).unlink(missing_ok=True)

    def play(self) -> Run:
        r, sb = self.run, self.sb
        self.reset()
        self.tick_until("adoption", lambda p: all(p[n] is Phase.SERVING for n in TOPOLOGY_NODES))
        self.status("adopted")

        # Low load: the planner frees the most GPUs, the 16 of gpu[6-7], as one group.
        r.seconds["lend_gpu6_7"] = self.tick_until(
            "gpu6 and gpu7 lent", lambda p: p["gpu6"] is Phase.LENT and p["gpu7"] is Phase.LENT)
        self.status("gpu6_7_lent")
        sb.load(HIGH_RPS, TOPOLOGY_MODEL)
        r.seconds["reclaim_gpu6_7"] = self.tick_until(
            "gpu6 and gpu7 serving", lambda p: p["gpu6"] is Phase.SERVING and p["gpu7"] is Phase.SERVING)
        self.status("gpu6_7_reclaimed")

        # gpu6 pinned: low load must lend gpu5, both its replicas retired; an 8-GPU job waits.
        self.cli("pin", "gpu6")
        job = sb.run(["sbatch", "--parsable", "-p", "idle", "--requeue", "--gres=gpu:8",
                      "-o", "/dev/null", "--wrap", "sleep 600"])
        assert job.returncode == 0, job.stderr
        r.job_id = int(job.stdout.strip().split(";")[0])
        sb.load(LOW_RPS, TOPOLOGY_MODEL)
        r.seconds["lend_gpu5"] = self.tick_until("gpu5 lent", lambda p: p["gpu5"] is Phase.LENT)
        self.status("gpu5_lent")
        gpu5 = [rep.name for rep in self.config.models[0].replicas if rep.node == "gpu5"]
        assert self.agent.router is not None
        r.gpu5_lent_router = self.agent.router.states(gpu5)  # HAProxy's admin state, read back
        emulators = sb.status()["emulators"]
        r.gpu5_lent_emulators = {n: emulators[n]["healthy"] for n in GPU5_REPLICAS}
        r.job_node = poll(lambda: self.job_field("JobState") == "RUNNING" and self.job_field("NodeList"),
                          60, f"job {r.job_id} running", interval_s=1.0)
        self.status("job_running")

        sb.load(HIGH_RPS, TOPOLOGY_MODEL)
        r.seconds["reclaim_gpu5_with_job"] = self.tick_until(
            "gpu5 serving", lambda p: p["gpu5"] is Phase.SERVING)
        self.status("gpu5_reclaimed")
        r.serving_after_reclaim = {
            rep.name: bool(self.agent.engine_for(TOPOLOGY_MODEL).health(rep).serving)
            for rep in self.config.models[0].replicas if rep.node == "gpu5"}
        r.job_restarts = int(poll(lambda: int(self.job_field("Restarts") or 0), 30,
                                  f"job {r.job_id} requeued", interval_s=1.0))
        acct = sb.run(["sacct", "-D", "-X", "-n", "-P", "-j", str(r.job_id), "--format=State"])
        r.job_states = [s.strip() for s in acct.stdout.splitlines() if s.strip()]

        # An admin drains gpu5: a few ticks at low load must never touch it.
        self.cli("unpin", "gpu6")
        sb.run(["scontrol", "update", "nodename=gpu5", "state=DRAIN", f"reason={ADMIN_REASON}"])
        drained_at = time.time()
        sb.load(LOW_RPS, TOPOLOGY_MODEL)
        for _ in range(3):
            self.agent.tick()
            time.sleep(TICK_EVERY_S)
        self.status("gpu5_admin")
        r.admin_reason_after = next(v.node.reason for v in self.agent.observe().nodes
                                    if v.name == "gpu5")
        r.admin_transitions = [
            rec for rec in Journal(Path(self.config.paths.journal)).records()
            if rec.get("event") == "transition" and rec["ts"] > drained_at
            and "gpu5" in (rec.get("nodes") or [rec.get("node")])]
        return r

    def job_field(self, key: str) -> str:
        out = self.sb.run(["scontrol", "-o", "show", "job", str(self.run.job_id)]).stdout
        return dict(t.split("=", 1) for t in out.split() if "=" in t).get(key, "")


@pytest.fixture(scope="module")
def topology(sandbox: Any) -> Run:
    scenario = Scenario(sandbox)
    started = time.monotonic()
    try:
        run = scenario.play()
    finally:
        if scenario.run.job_id:
            sandbox.run(["scancel", str(scenario.run.job_id)])
        scenario.reset()
        sandbox.load(LOW_RPS, TOPOLOGY_MODEL)
    print(f"MEASURE topology_e2e_s={time.monotonic() - started:.1f} seconds={run.seconds}")
    return run


@pytest.mark.slow
def test_gpu6_and_gpu7_are_lent_and_reclaimed_together(topology: Run) -> None:
    """The replica over gpu[6-7] makes one group: no tick ever sees its nodes apart."""
    assert topology.apart == []
    lent = topology.statuses["gpu6_7_lent"]
    assert {n["name"]: n["phase"] for n in lent["nodes"]} == {
        "gpu5": "serving", "gpu6": "lent", "gpu7": "lent"}
    back = topology.statuses["gpu6_7_reclaimed"]
    assert {n["name"]: n["phase"] for n in back["nodes"]} == dict.fromkeys(TOPOLOGY_NODES, "serving")


def test_gpu5_is_lent_as_one_node_with_both_replicas_retired(topology: Run) -> None:
    """Both replicas of gpu5 stopped and out of the router when gpu5 is lent; an 8-GPU job
    runs on it."""
    assert topology.gpu5_lent_emulators == dict.fromkeys(GPU5_REPLICAS, False)
    assert list(topology.gpu5_lent_router.values()) == ["out", "out"]  # each its own server
    assert topology.job_node == "gpu5"
    status = topology.statuses["gpu5_lent"]
    [group] = [g for g in status["groups"] if g["nodes"] == ["gpu5"]]
    assert group["phase"] == "lent" and len(group["replicas"]) == 2


def test_high_load_brings_both_replicas_back_and_requeues_the_job(topology: Run) -> None:
    """Both of gpu5's replicas serve again; the job is requeued, never failed or cancelled."""
    assert topology.serving_after_reclaim and all(topology.serving_after_reclaim.values())
    assert len(topology.serving_after_reclaim) == 2
    assert topology.job_restarts >= 1
    assert topology.job_states and not {"FAILED", "CANCELLED", "NODE_FAIL"} & {
        s.split()[0] for s in topology.job_states}


def test_an_admin_drain_on_gpu5_is_never_touched(topology: Run) -> None:
    """The admin's Reason stays; no transition names gpu5 after the drain."""
    assert topology.admin_reason_after == ADMIN_REASON
    assert topology.admin_transitions == []
    status = topology.statuses["gpu5_admin"]
    assert {n["name"]: n["phase"] for n in status["nodes"]}["gpu5"] == "admin"


def test_status_json_shows_replicas_and_groups_throughout(topology: Run) -> None:
    """Every status --json of the run lists the three replicas and the two groups."""
    assert len(topology.statuses) == 7
    for step, status in topology.statuses.items():
        replicas = {r["name"]: r for r in status["replicas"]}
        assert len(replicas) == 3, step
        for rep in replicas.values():
            assert {"name", "model", "nodes", "gpus", "url", "phase", "healthy"} <= set(rep), step
            assert rep["model"] == TOPOLOGY_MODEL
        assert sorted(r["nodes"] for r in replicas.values()) == [["gpu5"], ["gpu5"], ["gpu6", "gpu7"]]
        assert sorted(r["gpus"] for r in replicas.values() if r["nodes"] == ["gpu5"]) == ["0-3", "4-7"]
        groups = {tuple(g["nodes"]): g for g in status["groups"]}
        assert set(groups) == {("gpu5",), ("gpu6", "gpu7")}, step
        assert len(groups[("gpu5",)]["replicas"]) == 2
        nodes = {n["name"]: n["phase"] for n in status["nodes"]}
        assert groups[("gpu6", "gpu7")]["phase"] == nodes["gpu6"] == nodes["gpu7"], step
