"""Several agents, one actor: a lease kept in Slurm's own state, with an epoch that fences.

Why Slurm: every host that may run an agent (typically the slurmctld primary and backup) already
trusts slurmctld, whose state survives its own failover (StateSaveLocation). A file on NFS would be
one more thing to fail, and flock over NFS lies. The lease is the Comment of one held job of the
lend partition (`slurm-idle-lease`, never runs, holds nothing): one record slurmctld serializes.

Slurm has no compare-and-swap, so a claim follows Fischer's timed mutual exclusion: a candidate
that read the lease stale writes its claim (epoch + 1) within `settle_s / 2` of that read, waits
`settle_s`, reads again and leads only if its claim is still there. Two candidates racing: the
later write wins and the earlier sees it. The timing is checked, not assumed: a candidate whose
read-to-write gap was longer gives the attempt up.

Stale means what Kubernetes' leader election means: the record did not change for `lease_s` as
this process watched it (its monotonic clock, no clock skew involved), or it was written longer
than 2 x `lease_s` ago by the wall clock (a one-shot `tick` has no time to watch), or its holder
released it on a clean stop. The leader renews every `lease_s / 3` and stops acting `lease_s -
margin` after the start of its last successful renewal: a candidate can only claim after watching
the record unchanged for `lease_s`, so the two never act at once while clocks tick at one rate.

Fencing: every Slurm and engine write of the actor asks `fence()` first, which refuses (raises
`Deposed`) once the lease is no longer surely held, so a deposed actor's late write cannot undo
its successor's; the journal's records carry the epoch they were written under.
"""

from __future__ import annotations

import json
import math
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from slurm_idle.errors import SlurmIdleError
from slurm_idle.logs import get_logger
from slurm_idle.model import SlurmJob

log = get_logger(__name__)

#: The held job whose Comment is the lease.
LEASE_JOB_NAME = "slurm-idle-lease"
#: The Comment's prefix, so a stranger's comment is never read as a lease.
LEASE_PREFIX = "slurm-idle-lease "


class Deposed(SlurmIdleError):
    """This agent no longer surely holds the lease: the write it was about to make is refused."""


@dataclass(frozen=True)
class Lease:
    """Who acts (`instance` on `host`) under which `epoch`, since when, renewed when (unix s)."""

    instance: str
    host: str
    epoch: int
    since: float
    renewed: float
    released: bool = False  # its holder stopped cleanly: anyone may take over at once

    def comment(self) -> str:
        body = {"instance": self.instance, "host": self.host, "epoch": self.epoch,
                "since": self.since, "renewed": self.renewed}
        if self.released:
            body["released"] = True
        return LEASE_PREFIX + json.dumps(body, separators=(",", ":"))

    @classmethod
    def parse(cls, text: str) -> Lease | None:
        """The lease in a job's Comment, or None when it holds none (or a damaged one)."""
        if not text.startswith(LEASE_PREFIX):
            return None
        try:
            body = json.loads(text[len(LEASE_PREFIX):])
            lease = cls(str(body["instance"]), str(body.get("host", "")), int(body["epoch"]),
                        float(body["since"]), float(body["renewed"]), bool(body.get("released")))
        except (ValueError, KeyError, TypeError):
            return None
        # NaN never equals itself (a watcher would never see it unchanged), infinity never ages.
        return lease if math.isfinite(lease.since) and math.isfinite(lease.renewed) else None

    def age_s(self, now: float) -> float:
        """Seconds since its last renewal, by the reader's wall clock."""
        return max(0.0, now - self.renewed)

    def as_json(self, now: float) -> dict[str, Any]:
        return {"instance": self.instance, "host": self.host, "since": self.since,
                "epoch": self.epoch, "renewed": self.renewed,
                "age_s": round(self.age_s(now), 1), "released": self.released}


class LeaseStore(Protocol):
    """Where the lease lives: one register, read and written whole."""

    def read(self) -> Lease | None:
        """The lease now (None: there is none yet)."""
        ...

    def write(self, lease: Lease) -> None:
        """Replace the lease."""
        ...


class LeaseSlurm(Protocol):
    """What the Slurm lease store needs of a backend."""

    def jobs(self) -> list[SlurmJob]: ...

    def submit(self, script: str, extra_args: tuple[str, ...] | list[str] = ()) -> int: ...

    def set_job_comment(self, job_id: int, comment: str) -> None: ...

    def cancel(self, job_ids: list[int], signal: str | None = None) -> None: ...


#: The held job's script: it never runs; if an admin releases it, it ends at once and the next
#: claim makes a new one.
LEASE_SCRIPT = "#!/bin/sh\n# slurm-idle's leadership lease: held, never runs (docs/architecture.md)\nexit 0\n"


@dataclass
class SlurmLeaseStore:
    """The lease as the Comment of a held job of `partition`.

    With several lease jobs (two candidates made one each), the lowest job id is the lease for
    every reader, and the others are cancelled by whoever sees them.
    """

    slurm: LeaseSlurm
    partition: str
    job_id: int | None = None
    tidy: bool = True  # cancel extra lease jobs (the agents; `status` and watchdogs only read)

    def lease_jobs(self) -> list[SlurmJob]:
        named = getattr(self.slurm, "jobs_named", None)  # the CLI backend: one short squeue
        jobs: list[SlurmJob] = named(LEASE_JOB_NAME) if callable(named) else self.slurm.jobs()
        return sorted((j for j in jobs if j.name == LEASE_JOB_NAME and j.state == "PENDING"),
                      key=lambda j: j.job_id)

    def read(self) -> Lease | None:
        jobs = self.lease_jobs()
        if not jobs:
            self.job_id = None
            return None
        self.job_id = jobs[0].job_id
        if len(jobs) > 1 and self.tidy:
            extra = [j.job_id for j in jobs[1:]]
            log.info("leadership: cancelling extra lease job(s) %s (the lease is job %d)",
                     extra, self.job_id)
            try:
                self.slurm.cancel(extra)
            except SlurmIdleError as exc:
                log.warning("leadership: could not cancel extra lease jobs %s: %s", extra, exc)
        lease = Lease.parse(jobs[0].comment)
        if lease is None:  # a held job of that name without a lease: an empty lease
            return Lease("", "", 0, 0.0, 0.0, released=True)
        return lease

    def write(self, lease: Lease) -> None:
        if self.job_id is None:
            self.job_id = self.slurm.submit(LEASE_SCRIPT, [
                "--hold", f"--job-name={LEASE_JOB_NAME}", f"--partition={self.partition}",
                "--nodes=1", "--ntasks=1", "--time=1",
                "--output=/dev/null", "--error=/dev/null", f"--comment={lease.comment()}"])
            log.info("leadership: made the lease job %d", self.job_id)
            return
        self.slurm.set_job_comment(self.job_id, lease.comment())


@dataclass
class Leadership:
    """This agent's side of the election: `step()` before each pass, `fence()` before each write."""

    store: LeaseStore
    instance: str
    host: str
    lease_s: float = 30.0
    settle_s: float = 2.0
    clock: Callable[[], float] = time.time
    mono: Callable[[], float] = time.monotonic
    sleep: Callable[[float], None] = time.sleep
    on_event: Callable[[dict[str, Any]], None] | None = None  # the journal's leadership records
    epoch: int | None = None  # this agent's epoch while it leads
    since: float | None = None
    last: Lease | None = None  # the lease as last read
    highest: int = 0  # the highest epoch seen: a new lease job never goes back
    error: str | None = None  # why the last step could not read or write the lease
    on_gain: Callable[[], None] | None = None  # e.g. forget what the last leader here knew
    _valid_until: float = 0.0
    _renewed_at: float = float("-inf")
    _seen: Lease | None = None
    _seen_at: float = 0.0
    _written: Lease | None = None  # this process's last write
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def margin_s(self) -> float:
        """How much earlier than a watcher could claim the leader stops trusting its lease."""
        return max(self.settle_s, 0.1 * self.lease_s)

    def valid(self) -> bool:
        """True while this agent surely holds the lease (its own clock, no I/O)."""
        return self.epoch is not None and self.mono() < self._valid_until

    def fence(self) -> None:
        """Refuse a write once the lease is no longer surely ours."""
        if not self.valid():
            raise Deposed(f"{self.instance} no longer holds the leadership lease (epoch "
                          f"{self.epoch}): write refused, the new leader carries on")

    def stamp(self) -> Mapping[str, Any]:
        """What every journal record of this agent carries (nothing while it does not lead)."""
        return {"epoch": self.epoch, "instance": self.instance} if self.epoch is not None else {}

    def step(self) -> bool:
        """Renew, claim or watch: whether this agent leads now. A Slurm error: leading only
        while the lease is still surely held, and `error` says why (the pass reports it)."""
        with self._lock:
            self.error = None
            try:
                return self._step()
            except SlurmIdleError as exc:
                self.error = f"cannot read or write the leadership lease: {exc}"
                log.warning("leadership: %s", exc)
                return self.valid()

    def renew(self) -> bool:
        """Renew if this agent leads (the renewal thread during a long pass); never claims."""
        with self._lock:
            if self.epoch is None:
                return False
            try:
                return self._step(may_claim=False)
            except SlurmIdleError as exc:
                log.warning("leadership: renewal failed: %s", exc)
                return self.valid()

    def _step(self, may_claim: bool = True) -> bool:
        t0 = self.mono()
        if self.valid() and t0 < self._renewed_at + self.lease_s / 3:
            return True
        lease = self.store.read()
        read_at = self.mono()  # a watch starts once the read is back: it saw a write before now
        self.last = lease
        if lease is not None:
            self.highest = max(self.highest, lease.epoch)
        if self.epoch is not None:
            if self.valid() and self._mine(lease):
                assert lease is not None
                renewed = replace(lease, renewed=self.clock())
                self._write(renewed)
                self.last = renewed
                if self.mono() >= self._valid_until:
                    # It landed after this agent's trust lapsed: a successor may have claimed
                    # meanwhile and been overwritten. Not trusted; watch like anyone else.
                    self._written = None
                    self._lose(renewed)
                    return False
                self._trust_from(t0)
                return True
            self._lose(lease)
        if not may_claim or not self._may_claim(lease, read_at):
            return False
        return self._claim(lease, t0)

    def _write(self, lease: Lease) -> None:
        self.store.write(lease)
        self._written = lease

    def _mine(self, lease: Lease | None) -> bool:
        return (lease is not None and not lease.released and lease.instance == self.instance
                and lease.epoch == self.epoch)

    def _trust_from(self, t0: float) -> None:
        self._renewed_at = t0
        self._valid_until = t0 + self.lease_s - self.margin_s

    def _may_claim(self, lease: Lease | None, read_at: float) -> bool:
        if lease is None:
            return True
        if lease.released and (self._saw_live(lease) or lease.age_s(self.clock()) > self.lease_s):
            return True
        if lease == self._written:  # ours, unchanged since: nobody took it (Fischer checks a racer)
            return True
        if lease.age_s(self.clock()) > 2 * self.lease_s:
            return True
        if lease != self._seen:
            self._seen, self._seen_at = lease, read_at
            return False
        return read_at - self._seen_at >= self.lease_s

    def _saw_live(self, released: Lease) -> bool:
        """A release is taken at once only by a watcher that saw that very lease live (its
        instance and epoch, nothing newer since): a release written late, over a successor's
        claim, is then watched for lease_s like any record, while the successor notices. A
        release older than lease_s (a one-shot cron tick's, the next minute) is anyone's: a
        successor it overwrote has read it by then and stopped."""
        seen = self._seen
        return (seen is not None and not seen.released and seen.instance == released.instance
                and seen.epoch == released.epoch and released.epoch >= self.highest)

    def _claim(self, lease: Lease | None, t0: float) -> bool:
        now = self.clock()
        claim = Lease(self.instance, self.host, self.highest + 1, now, now)
        self._write(claim)
        gap = self.mono() - t0
        if gap > self.settle_s / 2:
            self._written = None  # it may have overwritten a successor's claim: not ours to reuse
            log.warning("leadership: the claim took %.1f s from read to write (over %.1f s): "
                        "given up, tried again later", gap, self.settle_s / 2)
            return False
        self.sleep(self.settle_s)
        check = self.store.read()
        self.last = check
        if check != claim:
            self._written = None
            self._seen, self._seen_at = check, self.mono()
            return False
        self.epoch, self.since = claim.epoch, claim.since
        self.highest = claim.epoch
        self._trust_from(t0)
        previous = lease if lease is not None and lease.instance else None
        why = ("no lease yet" if previous is None else
               "released by " + previous.instance if previous.released else
               f"{previous.instance} stopped renewing ({previous.age_s(now):.0f} s)")
        log.warning("leadership: %s leads from now on, epoch %d (%s)", self.instance, claim.epoch, why)
        self._event("leader", why, previous)
        if self.on_gain is not None:
            self.on_gain()
        return self.valid()

    def _lose(self, lease: Lease | None) -> None:
        why = ("the lease is gone" if lease is None else
               f"{lease.instance} holds it now (epoch {lease.epoch})" if not self._mine(lease)
               else "its renewal came too late")
        log.warning("leadership: %s no longer leads (epoch %s): %s", self.instance, self.epoch, why)
        self._event("deposed", why, lease)
        self.epoch, self.since = None, None
        self._valid_until = 0.0

    @contextmanager
    def renewing(self) -> Iterator[None]:
        """A thread renews the lease every lease_s / 3 while this agent leads, so a pass longer
        than the lease (a reclaim waits up to the tick budget) keeps it; on leaving, the lease
        is handed back so a standby takes over now, not lease_s from now."""
        done = threading.Event()

        def renew() -> None:
            while not done.wait(self.lease_s / 3):
                try:
                    self.renew()
                except Exception:  # the thread must not die quietly: the lease would lapse
                    log.exception("leadership: renewal failed unexpectedly")

        thread = threading.Thread(target=renew, name="lease-renewal", daemon=True)
        thread.start()
        try:
            yield
        finally:
            done.set()
            thread.join(timeout=self.lease_s)
            self.release()

    def release(self) -> None:
        """On a clean stop: hand the lease back so a standby takes over at once."""
        with self._lock:
            if not self.valid():
                return
            self._valid_until = 0.0  # from now on nothing of ours is trusted, the write included
            try:
                lease = self.store.read()
                if self._mine(lease):
                    assert lease is not None
                    self._write(replace(lease, renewed=self.clock(), released=True))
                    self._written = None
                    self._event("released", "stopped", lease)
            except SlurmIdleError as exc:
                log.warning("leadership: could not release the lease: %s", exc)
            self.epoch, self.since = None, None

    def _event(self, kind: str, why: str, other: Lease | None) -> None:
        if self.on_event is None:
            return
        record: dict[str, Any] = {"ts": self.clock(), "event": "leadership", "change": kind,
                                  "instance": self.instance, "host": self.host,
                                  "epoch": self.epoch if kind != "deposed" else None,
                                  "why": why}
        if kind == "deposed":
            record["lost_epoch"] = self.epoch
        if other is not None and other.instance:
            record["other"] = {"instance": other.instance, "host": other.host, "epoch": other.epoch}
        self.on_event(record)


#: The Slurm backend's calls that change the cluster, and the engines' (fenced).
SLURM_WRITES = frozenset({"drain", "resume", "power_up", "set_comment", "requeue", "signal",
                          "cancel", "submit", "set_job_comment"})
ENGINE_WRITES = frozenset({"start", "stop", "cold_restart"})
ROUTER_WRITES = frozenset({"call_target", "remove", "add", "warm_up", "warm_up_target",
                           "reconcile"})


class Fenced:
    """An adapter whose writes ask `fence()` first; reads and everything else pass through.

    The agent's Slurm backend and engines are wrapped this way when it runs under a lease: a
    write the actor makes after it lost the lease (a pause, a partition) raises `Deposed`
    instead of undoing what its successor did.
    """

    def __init__(self, inner: Any, writes: frozenset[str], fence: Callable[[], None]) -> None:
        self._inner = inner
        self._writes = writes
        self._fence = fence

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._inner, name)
        if name not in self._writes or not callable(value):
            return value
        fence = self._fence

        def fenced(*args: Any, **kwargs: Any) -> Any:
            fence()
            return value(*args, **kwargs)

        return fenced

    def __repr__(self) -> str:
        return f"Fenced({self._inner!r})"
