"""`slurm-idle tick` killed at random points of a jobs-mode lend and reclaim, on the real sandbox.

The jobs-mode agent is stateless: each replica job's phase is in Slurm (the job's state and our
Comment), so a tick SIGKILLed anywhere (between a Comment and its `scancel`, during `sbatch`,
while it waits for health) must leave nothing the next tick cannot finish. Here ticks are
started back to back, as cron would, and each is killed (its whole process group, as a timeout
or systemd would: a half-run `sbatch` dies with it) after a seeded random delay, >= 10 times
while one replica is lent (low load) and >= 10 times while it is reclaimed (high load, an
idle-partition job holding its GPUs). After every kill, from squeue and sacct: never two
replica jobs for one MODEL#INDEX, every replica in a phase of the lifecycle (serving, lent or
on its way), the other replica serving in the same job throughout, the idle job never FAILED
or CANCELLED; at the end clean ticks converge (both serving, the idle job requeued).
Runtime ~2.5-3 min on the session sandbox (2 shared cores). Seed: SLURM_IDLE_KILL_SEED (default 17).
"""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from slurm_idle.testing import sandboxconf
from slurm_idle.testing.waiting import poll
from tests.e2e.test_jobs_placement import (  # noqa: F401  (jobs_mode is a fixture)
    HIGH_RPS,
    IDLE_JOB,
    LOW_RPS,
    SETTLE_S,
    job_fields,
    jobs_mode,
    tick,
    tick_until,
)

pytestmark = pytest.mark.sandbox

KILLS_PER_PHASE = 10
PHASE_CAP_S = 240.0  # then clean ticks finish (SETTLE_S): CI runs two lanes on 2 cores
LIFECYCLE = {"serving", "retiring", "lending", "lent", "reclaiming", "starting"}
GONE = {"FAILED", "CANCELLED", "NODE_FAIL", "OUT_OF_MEMORY", "TIMEOUT"}


def killed_tick(sb: Any, delay_s: float) -> tuple[bool, float]:
    """Start one tick and SIGKILL its process group after `delay_s`: (killed, seconds it ran)."""
    start = time.monotonic()
    proc = subprocess.Popen(
        ["slurm-idle", "--config", str(sb.layout.jobs_config_path), "tick", "--json"],
        env={**os.environ, **sb.env()}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True)
    try:
        proc.wait(timeout=delay_s)
        return False, time.monotonic() - start
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        return True, time.monotonic() - start


class Delays:
    """Seeded kill delays scaled to how long a tick takes here (a quiet tick is ~1.5 s on an idle
    machine, several seconds under CI's load): two in three land inside a quiet tick's run, one
    in three up to three times later, so ticks doing real work (a drain, an sbatch and the wait
    for health) are cut at their later points too."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.tick_s = 3.0  # a quiet tick's duration, learnt from the ticks that finished

    def next(self) -> float:
        stretch = 1.1 if self.rng.random() < 2 / 3 else 3.0
        return self.rng.uniform(0.3, max(0.6, self.tick_s * stretch))

    def finished(self, took_s: float) -> None:
        self.tick_s = (self.tick_s + took_s) / 2


def replica_jobs(sb: Any) -> dict[int, list[tuple[str, str, str]]]:
    """Replica index -> (job id, state, our Comment's phase word) of every job squeue lists for
    it, in any state."""
    out = sb.run(["squeue", "-h", "-p", sandboxconf.JOBS_PARTITION, "-o", "%A|%T|%k"],
                 check=True).stdout
    found: dict[int, list[tuple[str, str, str]]] = {}
    for line in out.splitlines():
        job_id, state, comment = line.split("|", 2)
        m = re.fullmatch(r"[\w-]+:(\w+) since=\S+ index=(\d+) port=\d+(?: pinned)?(?: sig=[0-9a-f]+)? model="
                         + re.escape(sandboxconf.JOBS_MODEL), comment.strip())
        if m:
            found.setdefault(int(m.group(2)), []).append((job_id, state, m.group(1)))
    return found


def sacct_states(sb: Any, job_id: int) -> list[str]:
    return sb.run(["sacct", "-j", str(job_id), "-X", "-D", "-n", "-o", "State"]).stdout.split()


class Invariants:
    """What must hold after every kill. The planner lends one of the two replicas (the least
    busy); the other (the keeper) serves in the job it had at the start, throughout."""

    def __init__(self, sb: Any, first_jobs: dict[int, int]) -> None:
        self.sb, self.first_jobs = sb, first_jobs
        self.lent: int | None = None  # the index that left its first job
        self.idle_job: int | None = None
        self.seen: Counter[str] = Counter()

    def check(self, when: str, full: bool = True) -> dict[int, list[tuple[str, str, str]]]:
        """From squeue (and, after a kill, `full`, sacct of the idle job)."""
        jobs = replica_jobs(self.sb)
        dup = {i: ids for i, ids in jobs.items() if len(ids) > 1}
        assert not dup, f"{when}: two replica jobs for one replica: {dup}"
        moved = [i for i, job in self.first_jobs.items()
                 if [(j, s, w) for j, s, w in jobs.get(i, [])] != [(str(job), "RUNNING", "serving")]]
        assert len(moved) <= 1 and (self.lent is None or moved in ([], [self.lent])), \
            f"{when}: more than one replica left its first job {self.first_jobs}: {jobs}"
        if moved:
            self.lent = moved[0]
        for i in range(sandboxconf.JOBS_REPLICAS):
            phase = phase_of(jobs.get(i, []))
            assert phase in LIFECYCLE, f"{when}: replica {i} lost: {jobs}"
            if full:
                self.seen[phase] += 1
        if full and self.idle_job is not None:
            states = sacct_states(self.sb, self.idle_job)
            assert not GONE & set(states), f"{when}: idle job {self.idle_job}: {states}"
        return jobs


def phase_of(jobs: list[tuple[str, str, str]]) -> str:
    """A replica's phase as squeue shows it (replicajobs.derive_job_phase's rules): no job is
    lent, a pending one reclaiming, a running one what our Comment says (reclaiming: starting),
    a completing one lending; anything else is not a phase of the lifecycle."""
    if not jobs:
        return "lent"
    _, state, word = jobs[0]
    if state == "PENDING":
        return "reclaiming"
    if state == "COMPLETING":
        return "lending"
    if state == "RUNNING":
        return "starting" if word == "reclaiming" else word
    return f"job {state}"


def kill_until(sb: Any, inv: Invariants, delays: Delays, done: Any, phase: str) -> int:
    """Start ticks back to back, each SIGKILLed after a seeded random delay unless it ended
    first, until `done(jobs)` (squeue) after >= KILLS_PER_PHASE kills; checks after each.
    Returns the kills made."""
    kills, end = 0, time.monotonic() + PHASE_CAP_S
    while True:
        killed, took_s = killed_tick(sb, delays.next())
        if not killed:
            delays.finished(took_s)
        kills += killed
        jobs = inv.check(f"{phase}, after kill {kills}", full=killed)
        if kills >= KILLS_PER_PHASE and done(jobs):
            return kills
        if time.monotonic() > end:  # under heavy load: clean ticks finish what is left
            return kills


@pytest.mark.slow
def test_tick_killed_during_lend_and_reclaim(jobs_mode: Any, tmp_path: Path) -> None:  # noqa: F811
    """>= 20 SIGKILLed ticks across a jobs-mode lend and reclaim: no duplicate replica job, no
    replica lost, the idle job only ever preempted, and clean ticks converge."""
    sb = jobs_mode
    seed = int(os.environ.get("SLURM_IDLE_KILL_SEED", "17"))
    delays = Delays(seed)
    t_start = time.monotonic()
    names = [f"{sandboxconf.JOBS_MODEL}#{i}" for i in range(sandboxconf.JOBS_REPLICAS)]
    rows = tick_until(sb, dict.fromkeys(names, "serving"), SETTLE_S)
    inv = Invariants(sb, {i: int(rows[n]["job_id"]) for i, n in enumerate(names)})

    sb.load_jobs(LOW_RPS)
    lend_kills = kill_until(sb, inv, delays, lambda jobs: len(jobs) == 1, "lend")
    if inv.lent is None:  # under heavy load: the kills ran out of time before the lend
        poll(lambda: tick(sb) and inv.check("lend", full=False) and inv.lent is not None, SETTLE_S,
             "a replica lent")
    assert inv.lent is not None
    lent, keeper = names[inv.lent], names[1 - inv.lent]
    tick_until(sb, {keeper: "serving", lent: "lent"}, SETTLE_S)
    inv.check("lend converged")

    # An idle-partition job takes the freed GPUs: the reclaim must preempt it.
    out = tmp_path / "idle-%j.out"
    script = tmp_path / "idle.sh"
    script.write_text(IDLE_JOB.format(node=sandboxconf.JOBS_NODE, out=out))
    idle = int(sb.run(["sbatch", "--parsable", str(script)], check=True).stdout.strip().split(";")[0])
    try:
        poll(lambda: job_fields(sb, idle).get("JobState") == "RUNNING", 120, "idle job running on gpu8")
    except AssertionError as exc:
        queue = sb.run(["squeue", "-o", "%A %P %T %R %n %k"]).stdout
        raise AssertionError(f"{exc}; squeue:\n{queue}") from None
    inv.idle_job = idle

    sb.load_jobs(HIGH_RPS)
    lent_index = inv.lent
    reclaim_kills = kill_until(
        sb, inv, delays,
        lambda jobs: [(s, w) for _, s, w in jobs.get(lent_index, [])] == [("RUNNING", "serving")],
        "reclaim")
    rows = tick_until(sb, dict.fromkeys(names, "serving"), SETTLE_S)
    inv.check("reclaim converged")
    assert len(replica_jobs(sb)[lent_index]) == 1 and rows[lent]["job_id"]
    states = sacct_states(sb, idle)
    assert "PREEMPTED" in states and not GONE & set(states), states
    assert int(job_fields(sb, idle)["Restarts"]) >= 1
    print(f"MEASURE jobs-mode tick kills (seed {seed}): {lend_kills} during lend, "
          f"{reclaim_kills} during reclaim; replica phases seen after kills: {dict(inv.seen)}; "
          f"test {time.monotonic() - t_start:.0f}s")
    assert lend_kills + reclaim_kills >= 2 * KILLS_PER_PHASE
