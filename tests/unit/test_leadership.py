"""Leader election (leadership.py): one actor at a time, in simulated time.

Nothing sleeps: every Leadership gets `clock`, `mono` and `sleep` reading and advancing one fake
time. Races are played by `Gated` agents, whose step() runs on a thread stopped before each store
access and each sleep, so a test (or hypothesis) chooses the interleaving of two or three agents.
"""

from __future__ import annotations

import queue
import random
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from slurm_idle.leadership import (
    LEASE_JOB_NAME,
    LEASE_PREFIX,
    SLURM_WRITES,
    Deposed,
    Fenced,
    Leadership,
    Lease,
    SlurmLeaseStore,
)
from slurm_idle.model import SlurmJob

LEASE_S = 30.0
SETTLE_S = 2.0
WALL0 = 1_700_000_000.0
IO_MAX = SETTLE_S / 4  # a read or a write that takes longer is `slow_io`


@dataclass
class Time:
    """One simulated time for every agent: monotonic from 0, wall clock from WALL0."""

    t: float = 0.0

    def mono(self) -> float:
        return self.t

    def wall(self) -> float:
        return WALL0 + self.t

    def sleep(self, s: float) -> None:
        self.t += s

    def run(self, seconds: float, every: float, fn: Callable[[], None]) -> None:
        """Call fn every `every` seconds for `seconds` (time moves between the calls)."""
        end = self.t + seconds
        while self.t < end:
            self.t += every
            fn()


@dataclass
class MemStore:
    """The lease register in memory; it notes when each write landed."""

    time: Time
    lease: Lease | None = None
    writes: list[tuple[float, Lease]] = field(default_factory=list)
    before_write: Callable[[Lease], None] | None = None  # a race's other side, run mid-claim

    def read(self) -> Lease | None:
        return self.lease

    def write(self, lease: Lease) -> None:
        hook, self.before_write = self.before_write, None
        if hook is not None:
            hook(lease)
        self.lease = lease
        self.writes.append((self.time.t, lease))


def agent(store: Any, time: Time, name: str, events: list[dict[str, Any]] | None = None,
          skew: float = 0.0) -> Leadership:
    return Leadership(store, name, f"host-{name}", lease_s=LEASE_S, settle_s=SETTLE_S,
                      clock=lambda: time.wall() + skew, mono=time.mono, sleep=time.sleep,
                      on_event=None if events is None else events.append)


def assert_true(value: bool) -> None:
    assert value


def changes(events: list[dict[str, Any]]) -> list[str]:
    return [e["change"] for e in events]


# --- one agent ---------------------------------------------------------------------------------


def test_a_single_agent_claims_an_empty_store_at_once() -> None:
    """No lease yet: nobody to wait for, the first step leads with epoch 1 and says so."""
    time, events = Time(), list[dict[str, Any]]()
    store = MemStore(time)
    a = agent(store, time, "a", events)
    assert a.stamp() == {}
    with pytest.raises(Deposed):
        a.fence()
    assert a.step() is True
    assert a.epoch == 1 and a.valid()
    assert store.lease is not None and store.lease.instance == "a" and store.lease.epoch == 1
    assert changes(events) == ["leader"]
    assert events[0]["epoch"] == 1 and events[0]["why"] == "no lease yet"
    assert a.stamp() == {"epoch": 1, "instance": "a"}
    a.fence()


def test_the_leader_renews_every_third_of_the_lease_only() -> None:
    """Stepping every second must not write Slurm every second: one renewal per lease_s / 3."""
    time = Time()
    store = MemStore(time)
    a = agent(store, time, "a")
    assert a.step()
    time.run(100, 1.0, lambda: assert_true(a.step()))  # steps at 3, 4, ... 102 s
    assert [t for t, _ in store.writes] == [0.0, 10.0, 20.0, 30.0, 40.0, 50.0, 60.0, 70.0,
                                            80.0, 90.0, 100.0]
    assert all(lease.epoch == 1 and lease.instance == "a" for _, lease in store.writes)
    assert store.lease is not None and store.lease.since == store.writes[0][1].since


# --- a standby ---------------------------------------------------------------------------------


def test_a_standby_waits_for_a_whole_lease_of_silence_and_never_overlaps() -> None:
    """The standby claims only after watching the record unchanged for lease_s; by then the paused
    leader already stopped trusting its lease, and on waking it learns it was deposed."""
    time = Time()
    store = MemStore(time)
    a_events: list[dict[str, Any]] = []
    b_events: list[dict[str, Any]] = []
    a, b = agent(store, time, "a", a_events), agent(store, time, "b", b_events)
    assert a.step()

    def both() -> None:
        assert a.step()
        assert not b.step()

    time.run(200, 1.0, both)
    assert b.epoch is None and changes(b_events) == []

    # a pauses (a GC, SIGSTOP, a hung call): no more steps; b keeps watching every second
    last_write = store.writes[-1][0]
    while not b.step():
        assert not (a.valid() and b.valid())
        time.t += 1.0
        assert time.t < last_write + 3 * LEASE_S, "the standby never took over"
    assert not a.valid(), "the old leader still trusted its lease when the standby took over"
    assert time.t - last_write >= LEASE_S
    assert b.epoch == 2 and store.lease is not None and store.lease.instance == "b"
    assert changes(b_events) == ["leader"] and "stopped renewing" in b_events[0]["why"]
    assert b_events[0]["other"] == {"instance": "a", "host": "host-a", "epoch": 1}

    with pytest.raises(Deposed):
        a.fence()
    assert a.step() is False
    assert changes(a_events) == ["leader", "deposed"]
    assert a_events[-1]["lost_epoch"] == 1 and a_events[-1]["epoch"] is None
    assert a.epoch is None and a.stamp() == {}
    with pytest.raises(Deposed):
        a.fence()
    assert b.step() and b.valid()


def test_a_standby_restarts_its_watch_when_the_record_changes() -> None:
    """Silence must be lease_s of one unchanged record: a renewal seen late restarts the count."""
    time = Time()
    store = MemStore(time)
    a, b = agent(store, time, "a"), agent(store, time, "b")
    assert a.step()
    assert not b.step()
    time.t += LEASE_S - 1
    assert a.step()  # renewed at 29 s: b saw the old record 29 s ago, the new one not yet
    time.t += 2
    assert not b.step()  # 31 s after its first look, but the record changed: watch again
    assert b.epoch is None and a.valid()


def test_a_release_lets_a_standby_take_over_at_once() -> None:
    """A clean stop hands the lease back: the standby needs no lease_s of silence."""
    time = Time()
    store = MemStore(time)
    a_events: list[dict[str, Any]] = []
    a, b = agent(store, time, "a", a_events), agent(store, time, "b")
    assert a.step()
    assert not b.step()
    time.t += 1
    a.release()
    assert not a.valid() and a.epoch is None
    assert changes(a_events) == ["leader", "released"]
    assert store.lease is not None and store.lease.released
    with pytest.raises(Deposed):
        a.fence()
    t_release = time.t
    assert b.step()
    assert b.epoch == 2 and time.t - t_release <= SETTLE_S
    a.release()  # no longer leading: nothing to hand back, nothing written
    assert store.lease.instance == "b" and not store.lease.released


def test_a_lease_older_than_two_leases_by_the_wall_clock_is_claimed_at_once() -> None:
    """A one-shot `tick` cannot watch for lease_s: a record 2 x lease_s old is dead already."""
    time = Time(t=1000.0)
    store = MemStore(time)
    store.lease = Lease("gone", "host-gone", 7, WALL0, WALL0 + 1000.0 - 2 * LEASE_S - 1)
    b = agent(store, time, "b")
    assert b.step()
    assert b.epoch == 8


def test_a_younger_lease_is_not_claimed_by_a_fresh_process() -> None:
    """Just under 2 x lease_s old: a process that just started must watch it first."""
    time = Time(t=1000.0)
    store = MemStore(time)
    store.lease = Lease("other", "host-other", 7, WALL0, WALL0 + 1000.0 - 2 * LEASE_S + 1)
    b = agent(store, time, "b")
    assert not b.step()
    assert b.epoch is None and store.writes == []


# --- Fischer's claim ---------------------------------------------------------------------------


def test_a_claim_slower_than_half_the_settle_time_is_given_up() -> None:
    """Read-to-write over settle_s / 2: a racer's check may have passed already, so no lead."""
    time = Time()
    store = MemStore(time)
    a = agent(store, time, "a")
    store.before_write = lambda _: time.sleep(SETTLE_S / 2 + 0.01)  # a slow sbatch
    assert a.step() is False
    assert a.epoch is None and not a.valid()


def test_a_claim_just_inside_half_the_settle_time_leads() -> None:
    """The bound is settle_s / 2 itself: a claim that takes exactly that still counts."""
    time = Time()
    store = MemStore(time)
    a = agent(store, time, "a")
    store.before_write = lambda _: time.sleep(SETTLE_S / 2)
    assert a.step() is True


def test_a_racer_that_claims_inside_a_slow_claim_keeps_the_lead() -> None:
    """b reads, writes, settles and leads while a's write hangs; a's late write must not make it
    a second leader (the read-to-write gap check is what stops it)."""
    time = Time()
    store = MemStore(time)
    a, b = agent(store, time, "a"), agent(store, time, "b")
    store.before_write = lambda _: assert_true(b.step())
    a_leads = a.step()
    assert b.valid()
    assert not (a_leads and b.valid())
    assert not a.valid()


class Gated:
    """An agent whose step() (or release()) runs on a thread stopped before each store access and
    each sleep: `go()` lets it run to its next stop."""

    def __init__(self, name: str, store: MemStore, time: Time, skew: float = 0.0,
                 events: list[dict[str, Any]] | None = None) -> None:
        self.name, self.store, self.time = name, store, time
        self.at: queue.Queue[str | None] = queue.Queue()
        self.resume: queue.Queue[bool] = queue.Queue()
        self.thread: threading.Thread | None = None
        self.result: bool | None = None
        self.stop = ""  # where it waits now: read, write, sleep ("" when idle)
        self.stopped = 0.0  # since when
        self.wake = 0.0  # the end of its sleep
        outer = self

        class Store:
            def read(self) -> Lease | None:
                outer.gate("read")
                return store.read()

            def write(self, lease: Lease) -> None:
                outer.gate("write")
                store.write(lease)

        def sleep(s: float) -> None:
            self.wake = time.t + s
            self.gate("sleep")
            time.t = max(time.t, self.wake)

        self.me = Leadership(Store(), name, f"host-{name}", lease_s=LEASE_S, settle_s=SETTLE_S,
                             clock=lambda: time.wall() + skew, mono=time.mono, sleep=sleep,
                             on_event=None if events is None else events.append)

    def gate(self, what: str) -> None:
        self.at.put(what)
        self.resume.get()

    @property
    def busy(self) -> bool:
        return self.thread is not None

    def start(self, call: str = "step") -> None:
        assert self.thread is None

        def run() -> None:
            try:
                if call == "release":
                    self.me.release()
                    self.result = False
                else:
                    self.result = self.me.step()
            finally:
                self.at.put(None)

        self.result = None
        self.thread = threading.Thread(target=run, name=f"agent-{self.name}", daemon=True)
        self.thread.start()
        self._wait()

    def go(self) -> None:
        assert self.thread is not None
        self.resume.put(True)
        self._wait()

    def _wait(self) -> None:
        stop = self.at.get(timeout=10)
        if stop is None:
            assert self.thread is not None
            self.thread.join(timeout=10)
            self.thread, self.stop = None, ""
        else:
            self.stop, self.stopped = stop, self.time.t

    def act(self) -> None:
        """Start a step when idle, else let the running one on to its next stop."""
        if self.busy:
            self.go()
        else:
            self.start()

    def finish(self) -> None:
        while self.busy:
            self.go()


def test_two_candidates_racing_for_an_empty_lease_elect_exactly_one() -> None:
    """Both read it free, both write within settle_s / 2, both check: the later write wins."""
    time = Time()
    store = MemStore(time)
    a, b = Gated("a", store, time), Gated("b", store, time)
    a.start()
    b.start()
    assert (a.stop, b.stop) == ("read", "read")
    for who, stop in [(a, "write"), (b, "write"), (a, "sleep"), (b, "sleep"),
                      (a, "read"), (b, "read")]:
        who.go()
        assert who.stop == stop
    a.go()
    b.go()
    assert not a.busy and not b.busy
    assert [a.result, b.result] == [False, True]
    assert not a.me.valid() and b.me.valid() and b.me.epoch == 1


def test_two_candidates_racing_for_a_released_lease_elect_exactly_one() -> None:
    """The same race on a lease handed back: whatever the order of the writes, one leads."""
    for order in ([0, 1], [1, 0]):
        time = Time()
        store = MemStore(time)
        store.lease = Lease("old", "host-old", 4, WALL0, WALL0)
        gs = [Gated("a", store, time), Gated("b", store, time)]
        for g in gs:  # both watch the live lease: a release of it is theirs to take at once
            g.start()
            g.finish()
        store.lease = Lease("old", "host-old", 4, WALL0, WALL0 + 1, released=True)
        for g in gs:
            g.start()
        for g in gs:
            g.go()  # both read it released
        for i in order:
            gs[i].go()  # both write their claim, in this order
        for g in gs:
            g.finish()
        assert sorted(g.result for g in gs if g.result is not None) == [False, True]
        winner = gs[order[-1]].me
        assert winner.valid() and winner.epoch == 5
        assert not gs[order[0]].me.valid()


# --- the Slurm store ---------------------------------------------------------------------------


@dataclass
class FakeSlurm:
    """Just enough of a Slurm backend: jobs, sbatch, scontrol update Comment, scancel."""

    job_list: list[SlurmJob] = field(default_factory=list)
    next_id: int = 100
    submitted: list[tuple[str, list[str]]] = field(default_factory=list)
    comments_set: list[tuple[int, str]] = field(default_factory=list)
    cancelled: list[int] = field(default_factory=list)

    def jobs(self) -> list[SlurmJob]:
        return list(self.job_list)

    def submit(self, script: str, extra_args: tuple[str, ...] | list[str] = ()) -> int:
        args = list(extra_args)
        self.submitted.append((script, args))

        def opt(name: str) -> str:
            return next(a.split("=", 1)[1] for a in args if a.startswith(f"--{name}="))

        job = SlurmJob(self.next_id, opt("job-name"), opt("partition"), "PENDING",
                       comment=opt("comment"))
        self.job_list.append(job)
        self.next_id += 1
        return job.job_id

    def set_job_comment(self, job_id: int, comment: str) -> None:
        self.comments_set.append((job_id, comment))
        self.job_list = [SlurmJob(j.job_id, j.name, j.partition, j.state, comment=comment)
                         if j.job_id == job_id else j for j in self.job_list]

    def cancel(self, job_ids: list[int], signal: str | None = None) -> None:
        self.cancelled.extend(job_ids)
        self.job_list = [j for j in self.job_list if j.job_id not in job_ids]


def test_the_first_write_submits_a_held_lease_job_and_later_ones_set_its_comment() -> None:
    """The lease is the Comment of one held job: made once, then only its Comment changes."""
    slurm = FakeSlurm(job_list=[SlurmJob(5, "someone-else", "lend", "PENDING", comment="hi")])
    store = SlurmLeaseStore(slurm, "lend")
    assert store.read() is None
    first = Lease("a", "host-a", 1, WALL0, WALL0)
    store.write(first)
    [(script, args)] = slurm.submitted
    assert "--hold" in args
    assert f"--job-name={LEASE_JOB_NAME}" in args and "--partition=lend" in args
    assert f"--comment={first.comment()}" in args
    assert script.startswith("#!")
    assert store.job_id == 100
    assert store.read() == first
    second = Lease("a", "host-a", 1, WALL0, WALL0 + 10)
    store.write(second)
    assert len(slurm.submitted) == 1 and slurm.comments_set == [(100, second.comment())]
    assert SlurmLeaseStore(slurm, "lend").read() == second


def test_with_two_lease_jobs_the_lowest_id_is_the_lease_and_the_other_is_cancelled() -> None:
    """Two candidates each made a lease job: every reader agrees on the lowest id."""
    low = Lease("b", "host-b", 3, WALL0, WALL0 + 5)
    high = Lease("a", "host-a", 3, WALL0, WALL0 + 6)
    slurm = FakeSlurm(job_list=[
        SlurmJob(12, LEASE_JOB_NAME, "lend", "PENDING", comment=high.comment()),
        SlurmJob(11, LEASE_JOB_NAME, "lend", "PENDING", comment=low.comment()),
        SlurmJob(10, LEASE_JOB_NAME, "lend", "RUNNING", comment=high.comment()),  # not held
    ])
    store = SlurmLeaseStore(slurm, "lend")
    assert store.read() == low
    assert store.job_id == 11 and slurm.cancelled == [12]
    store.write(high)
    assert slurm.comments_set == [(11, high.comment())] and len(slurm.submitted) == 0


def test_a_stranger_comment_is_not_a_lease() -> None:
    """Only our prefix and a whole record count; a held job of that name without one is free."""
    assert Lease.parse("hello") is None
    assert Lease.parse('{"instance":"a","host":"h","epoch":1,"since":1,"renewed":1}') is None
    assert Lease.parse(LEASE_PREFIX + "{not json") is None
    assert Lease.parse(LEASE_PREFIX + '{"instance":"a"}') is None
    assert Lease.parse(LEASE_PREFIX + '{"instance":"a","epoch":"x","since":1,"renewed":1}') is None
    slurm = FakeSlurm(job_list=[SlurmJob(9, LEASE_JOB_NAME, "lend", "PENDING", comment="mine")])
    lease = SlurmLeaseStore(slurm, "lend").read()
    assert lease is not None and lease.released and lease.epoch == 0 and lease.instance == ""


@settings(max_examples=200, deadline=None)
@given(st.text(), st.text(), st.integers(0, 2**53),
       st.floats(allow_nan=False, allow_infinity=False),
       st.floats(allow_nan=False, allow_infinity=False), st.booleans())
def test_comment_and_parse_round_trip_exactly(instance: str, host: str, epoch: int,
                                              since: float, renewed: float,
                                              released: bool) -> None:
    """A renewal compares whole records: a float that came back changed would depose."""
    lease = Lease(instance, host, epoch, since, renewed, released)
    assert Lease.parse(lease.comment()) == lease


def test_an_election_through_the_slurm_store() -> None:
    """Two agents on one fake Slurm: one held job, one leader, the standby only watches."""
    slurm, time = FakeSlurm(), Time()
    a = agent(SlurmLeaseStore(slurm, "lend"), time, "a")
    b = agent(SlurmLeaseStore(slurm, "lend"), time, "b")
    assert a.step() and not b.step()
    time.run(60, 1.0, lambda: assert_true(a.step() and not b.step()))
    assert len(slurm.submitted) == 1 and len(slurm.job_list) == 1
    assert len(slurm.comments_set) >= 5


# --- random schedules --------------------------------------------------------------------------


@dataclass
class Election:
    """Two or three gated agents on one store, driven by a schedule, watched at every stop."""

    n: int
    skews: Sequence[float] = ()
    slow_io: bool = False  # may a read or write take longer than IO_MAX?
    time: Time = field(default_factory=Time)
    leaders: list[tuple[str, int]] = field(default_factory=list)  # each leadership as it began
    log: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.store = MemStore(self.time)
        skews = list(self.skews) + [0.0] * self.n
        self.agents = [Gated(chr(ord("a") + i), self.store, self.time, skews[i])
                       for i in range(self.n)]
        self.was: dict[str, int | None] = {g.name: None for g in self.agents}

    def check(self) -> None:
        valid = [g.name for g in self.agents if g.me.valid()]
        assert len(valid) <= 1, (f"t={self.time.t}: {valid} valid at once\n"
                                 + "\n".join(self.log[-40:]))
        for g in self.agents:
            epoch = g.me.epoch if g.me.valid() else None
            if epoch is not None and epoch != self.was[g.name]:
                # a new leadership, or one that lapsed and came back: either needs a higher epoch
                if self.leaders:
                    assert epoch > self.leaders[-1][1], (self.leaders, g.name, epoch,
                                                         "\n".join(self.log[-40:]))
                self.leaders.append((g.name, epoch))
            self.was[g.name] = epoch

    def do(self, who: int, action: str, dt: float) -> None:
        g = self.agents[who % self.n]
        if action == "wait":
            if not self.slow_io:  # each Slurm call takes IO_MAX at most
                dt = min([dt] + [g.stopped + IO_MAX - self.time.t for g in self.agents
                                 if g.stop in ("read", "write")])
            self.time.t += max(dt, 0.0)
            self.log.append(f"t={self.time.t:.2f} wait {dt:.2f}")
        elif action == "release" and not g.busy:
            g.start("release")
            self.log.append(f"t={self.time.t:.2f} {g.name} release -> {g.stop or 'done'}")
        else:
            if g.stop == "sleep" and not self.slow_io:  # the others' calls end before it wakes
                while late := [h for h in self.agents
                               if h.stop in ("read", "write") and h.stopped + IO_MAX < g.wake]:
                    self.do(ord(late[0].name) - ord("a"), "act", 0.0)
            before = g.stop or "start"
            g.act()
            self.log.append(f"t={self.time.t:.2f} {g.name} {before} -> "
                            f"{g.stop or f'done {g.result}'} (epoch {g.me.epoch}, "
                            f"lease {self.store.lease})")
        self.check()

    def finish(self) -> None:
        while busy := [i for i, g in enumerate(self.agents) if g.busy]:
            self.do(busy[0], "act", 0.0)


ACTIONS = st.tuples(st.integers(0, 2), st.sampled_from(["act"] * 6 + ["wait"] * 3 + ["release"]),
                    st.sampled_from([0.1, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 35.0, 70.0]))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(2, 3), st.lists(st.floats(-LEASE_S / 2, LEASE_S / 2), max_size=3),
       st.lists(ACTIONS, min_size=1, max_size=120))
def test_random_schedules_never_have_two_leaders(n: int, skews: list[float],
                                                 schedule: list[tuple[int, str, float]]) -> None:
    """Whatever the order of reads, writes, sleeps and pauses (wall clocks off by up to half a
    lease): never two valid leaders at one instant, and each new leader's epoch is higher.
    Each Slurm call takes IO_MAX at most here; slower ones are the test below."""
    election = Election(n, skews)
    for who, action, dt in schedule:
        election.do(who, action, dt)
    election.finish()


def run_seeded(seed: int, slow_io: bool = False) -> Election:
    rng = random.Random(seed)
    election = Election(rng.choice([2, 3]), slow_io=slow_io)
    for _ in range(1000):
        if rng.random() < 0.3:
            election.do(0, "wait", rng.choice([0.1, 0.3, 1.0, 3.0, 12.0, 40.0]))
        else:
            election.do(rng.randrange(3), "release" if rng.random() < 0.01 else "act", 0.0)
    election.finish()
    return election


@pytest.mark.parametrize("seed", range(20))
def test_seeded_long_schedules_elect_and_never_overlap(seed: int) -> None:
    """Long random runs (1000 moves) where agents step often: safety holds and someone leads."""
    assert run_seeded(seed, slow_io=False).leaders


def test_seeded_long_schedules_with_slow_io_never_overlap() -> None:
    """The same with Slurm calls of any length (squeue, sbatch, scontrol hung on slurmctld)."""
    for seed in range(20):
        run_seeded(seed, slow_io=True)


# --- slow Slurm calls (found by the schedules above, fixed) ---------------------------------------


def test_a_slow_read_does_not_shorten_the_watch() -> None:
    """b's squeue starts at 1 s and returns at 12 s with a's renewal of 10 s: b must count its
    lease_s of silence from when it saw that record, not from 1 s (it claims at 31 s and leads at
    33 s while a, paused since its renewal, trusts it until 37 s)."""
    time = Time()
    store = MemStore(time)
    a, b = Gated("a", store, time), Gated("b", store, time)
    a.start()
    a.finish()
    time.t = 1.0
    b.start()
    assert b.stop == "read"
    time.t = 10.0
    a.start()
    a.finish()
    assert a.me.valid()
    time.t = 12.0
    b.finish()
    time.t = 31.0
    b.start()
    b.finish()
    assert not (a.me.valid() and b.me.valid()), f"both lead at {time.t} s"



def test_a_renewal_that_lands_after_the_lease_lapsed_is_not_trusted() -> None:
    """a reads its lease to renew it at 10 s and its write hangs until 34 s; meanwhile b watched
    the record unchanged for 30 s and leads from 34 s. a's late write must not make a valid again
    (it trusts it from the read at 10 s, until 37 s: two leaders from 34 to 37 s)."""
    time = Time()
    store = MemStore(time)
    a, b = Gated("a", store, time), Gated("b", store, time)
    a.start()
    a.finish()
    assert a.result and a.me.valid()
    b.start()
    b.finish()  # b starts watching at 2 s
    time.t = 10.0
    a.start()
    a.go()
    assert a.stop == "write"  # the renewal, still valid when it read
    time.t = 32.0
    b.start()
    b.finish()
    assert b.result and b.me.valid() and not a.me.valid()
    a.finish()  # the renewal lands over b's claim
    assert not (a.me.valid() and b.me.valid()), f"both lead at {time.t} s"



def test_a_claim_given_up_does_not_let_its_writer_claim_at_once() -> None:
    """c's claim (read at 31 s) hangs until 34 s: b claimed at 31.5 s and leads. c's late write
    replaces b's claim and c gives it up, but on its next step c finds `its own last write` in the
    store and claims at once: c leads from 37 s while b trusts its lease until 58.5 s."""
    time = Time()
    store = MemStore(time)
    a, b, c = (Gated(n, store, time) for n in "abc")
    a.start()
    a.finish()
    time.t = 1.0
    for g in (b, c):
        g.start()
        g.finish()  # both watch a's record from 1 s; a pauses for good
    time.t = 31.0
    c.start()
    c.go()
    assert c.stop == "write"
    time.t = 31.5
    b.start()
    b.finish()
    assert b.result and b.me.valid()
    time.t = 34.0
    c.finish()
    assert c.result is False  # the gap check gives the late claim up
    time.t = 35.0
    c.start()
    c.finish()
    assert not (b.me.valid() and c.me.valid()), f"both lead at {time.t} s"


@pytest.mark.xfail(strict=True, reason=(
    "known limit (docs/architecture.md): with three agents, a release write that hangs past "
    "lease_s - margin while a second agent took over is taken at once by a third that did not "
    "look in between"))
def test_a_release_that_lands_late_does_not_hand_over_a_successors_lease() -> None:
    """a releases at 10 s but the write hangs until 40 s; b took over at 32 s (a looked dead).
    The late `released` record lets c claim at once while b still trusts its lease."""
    time = Time()
    store = MemStore(time)
    a, b, c = (Gated(n, store, time) for n in "abc")
    a.start()
    a.finish()
    for g in (b, c):
        g.start()
        g.finish()
    time.t = 10.0
    a.start("release")
    a.go()
    assert a.stop == "write"
    time.t = 32.0
    b.start()
    b.finish()
    assert b.result and b.me.valid()
    time.t = 40.0
    a.finish()
    c.start()
    c.finish()
    assert not (b.me.valid() and c.me.valid()), f"both lead at {time.t} s"


# --- renewal thread and fencing ------------------------------------------------------------------


def test_renew_never_claims() -> None:
    """The renewal thread keeps a lease; it must not make a standby claim a free one."""
    time = Time()
    store = MemStore(time)
    store.lease = Lease("old", "host-old", 3, WALL0, WALL0, released=True)
    b = agent(store, time, "b")
    assert b.renew() is False
    assert store.writes == [] and b.epoch is None


def test_renew_keeps_the_lease_of_a_leader() -> None:
    """Once lease_s / 3 passed, renew() writes like step() would."""
    time = Time()
    store = MemStore(time)
    a = agent(store, time, "a")
    assert a.step()
    time.t = 11.0
    assert a.renew() is True
    assert [t for t, _ in store.writes] == [0.0, 11.0]


def test_leaving_renewing_hands_the_lease_back() -> None:
    """A clean stop of the agent's pass: the standby need not wait lease_s."""
    time = Time()
    store = MemStore(time)
    a = agent(store, time, "a")
    assert a.step()
    with a.renewing():
        assert a.valid()
    assert not a.valid() and store.lease is not None and store.lease.released


def test_fenced_writes_ask_the_fence_and_reads_do_not() -> None:
    """A deposed actor's Slurm writes raise Deposed before reaching Slurm; its reads still work."""
    time = Time()
    slurm = FakeSlurm(job_list=[SlurmJob(5, "x", "lend", "PENDING")])
    a = agent(MemStore(time), time, "a")
    fenced: Any = Fenced(slurm, SLURM_WRITES, a.fence)
    assert [j.job_id for j in fenced.jobs()] == [5]
    with pytest.raises(Deposed):
        fenced.cancel([5])
    assert slurm.cancelled == []
    assert a.step()
    fenced.cancel([5])
    assert slurm.cancelled == [5]
    time.t += LEASE_S  # paused past its lease: the next write is refused again
    with pytest.raises(Deposed):
        fenced.set_job_comment(5, "late")
    assert slurm.comments_set == []
