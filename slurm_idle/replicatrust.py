"""Which replica-looking jobs are the agent's own (`placement: jobs`): never the Comment alone.

Any user may submit a job into the serve partition with a Comment in our shape; adopted, it
would count as serving, be written to Prometheus' targets, and keep the real replica from
being started. So a job is a replica only when both hold:

1. its user is the one the agent runs as (slurmctld sets a job's user: no one can forge it),
   and its account is the model's `--account` when `job.sbatch_args` sets one;
2. its Comment carries `sig=`, an HMAC-SHA256 of the rest of the Comment under a key only the
   agent can read (`replica-jobs.key` beside the journal, 0600, made by the first tick that
   needs it). A Comment is public in `squeue`, but a copied sig is only ever accepted on a job
   of the agent's own user, which (1) already requires.

A job failing either is foreign: not counted, not a target, never cancelled (it is a user's
job); the real replica is started as if the slot were empty (replicajobs.replica_views).
Migration: a job of the agent's own user with no sig, submitted before the key was made, is
an older agent version's replica and is adopted (its next Comment write signs it). A reader
that cannot read the key (`status` run as another user) checks the user only.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import pwd
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from slurm_idle import safefiles
from slurm_idle.errors import SlurmIdleError
from slurm_idle.logs import get_logger
from slurm_idle.model import SlurmJob

if TYPE_CHECKING:
    from slurm_idle.config import Config

log = get_logger(__name__)

KEY_FILE = "replica-jobs.key"
SIG_LEN = 16  # hex digits of the HMAC kept in the Comment (64 bits: no guessing in squeue)


@dataclass(frozen=True)
class ReplicaTrust:
    """The agent's identity as replica jobs carry it: its user and its signing key."""

    user: str
    key: bytes | None = None  # None: signatures are not checked (nor written)
    key_since: float | None = None  # when the key was made: unsigned jobs older than it pass

    def sign(self, text: str) -> str:
        """The sig of a Comment's text (without its sig), "" with no key."""
        if self.key is None:
            return ""
        return hmac.new(self.key, text.encode(), hashlib.sha256).hexdigest()[:SIG_LEN]

    def foreign_reason(self, job: SlurmJob, unsigned_text: str, sig: str | None,
                       account: str | None) -> str | None:
        """Why `job` (its Comment parsed) is not ours, None when it is."""
        if job.user != self.user:
            return f"user {job.user or '?'} is not the agent's ({self.user})"
        if account is not None and job.account != account:
            return f"account {job.account or '?'} is not the model's ({account})"
        if self.key is None:
            return None
        if sig is None:
            older = (self.key_since is not None and job.submit_time is not None
                     and job.submit_time < self.key_since)
            return None if older else "its Comment has no signature"
        if not hmac.compare_digest(sig, self.sign(unsigned_text)):
            return "its Comment's signature is wrong"
        return None


def agent_user() -> str:
    """The name of the user this process runs as (the one its sbatch jobs belong to)."""
    uid = os.geteuid()
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def _owner(path: Path) -> str:
    """A reader's view of the agent's user: the key's owner (the agent made it), else ours."""
    try:
        uid = path.stat().st_uid
        return pwd.getpwuid(uid).pw_name
    except (OSError, KeyError):
        return agent_user()


def key_path(journal: str) -> Path:
    return Path(journal).parent / KEY_FILE


def _make_key(path: Path, now: float) -> None:
    """Make the key only if none exists, so that two first ticks (a cron tick and an admin
    command, each building its agent before the tick lock) end with one key: each writes its
    own under a private name and links it to the key's name, which fails when one is there
    (link(2) never replaces). The caller reads back whichever won: a job signed with a key that
    lost would never be recognised again, and its GPUs would be held twice."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
    text = json.dumps({"key": secrets.token_hex(32), "created": now})
    safefiles.atomic_write(tmp, text + "\n", mode=0o600)
    try:
        os.link(tmp, path)
    except FileExistsError:
        pass  # another agent made it first: its key is the one
    finally:
        tmp.unlink(missing_ok=True)


def load_trust(journal: str, create: bool, now: float, user: str | None = None) -> ReplicaTrust:
    """The agent's trust: its user and the key beside `journal` (made, 0600, when missing and
    `create`). A key that cannot be read or made leaves signatures unchecked (logged): the
    user check still holds."""
    path = key_path(journal)
    if user is None:
        user = agent_user() if create else _owner(path)
    try:
        text = safefiles.read_text(path)
        if text is None and create:
            _make_key(path, now)
            text = safefiles.read_text(path)
        if text is None:
            return ReplicaTrust(user)
        doc = json.loads(text)
        return ReplicaTrust(user, bytes.fromhex(doc["key"]), float(doc["created"]))
    except (OSError, SlurmIdleError, ValueError, KeyError, TypeError) as exc:
        if create:
            log.error("replica jobs' key %s unusable (%s): replica jobs are recognised by their "
                      "user alone", path, exc)
        return ReplicaTrust(user)


REPORTED_FILE = "foreign-replica-jobs.json"


def not_yet_reported(journal: str, job_ids: set[int]) -> set[int]:
    """Of the foreign look-alikes seen now, those no earlier tick reported (each is logged and
    journaled once: cron ticks are separate processes, so the ids reported are kept beside the
    key, pruned to those still in the queue)."""
    path = Path(journal).parent / REPORTED_FILE
    try:
        text = safefiles.read_text(path)
        before = {int(i) for i in json.loads(text)} if text else set()
    except (OSError, ValueError, TypeError):
        before = set()
    if before != job_ids:
        try:
            safefiles.atomic_write(path, json.dumps(sorted(job_ids)) + "\n", mode=0o600)
        except (OSError, SlurmIdleError) as exc:
            log.warning("cannot record the foreign replica-like jobs reported in %s: %s", path, exc)
    return job_ids - before


def trust_for(config: Config, create: bool, now: float) -> ReplicaTrust:
    """The trust of an agent on `config`: with a key only when a model is `placement: jobs`
    (a nodes-only site gets no key file). `create`: the acting agent (not `status`)."""
    if not any(m.placement == "jobs" for m in config.models):
        return ReplicaTrust(agent_user())
    return load_trust(config.paths.journal, create, now)
