"""`placement: jobs`: a job with our Comment's shape that the agent did not submit (another
user's, or its own user's without the agent's signature) is never adopted as a replica: the
real replica is started, the look-alike is reported once and never cancelled."""

from __future__ import annotations

import json
import os
import stat
from dataclasses import replace
from pathlib import Path

import pytest

from slurm_idle.journal import ForeignReplicaJobRecord, iso
from slurm_idle.model import Phase, SlurmJob
from slurm_idle.replicajobs import account_of, format_comment, replica_views
from slurm_idle.replicatrust import ReplicaTrust, agent_user, key_path, load_trust
from tests.unit.test_agent_jobs import T0, active, make_agent, make_config, phases

FORGED_ID = 77


def forged(user: str, comment: str, submitted: float | None = None) -> SlurmJob:
    """What `sbatch -p serve -w gpu8 --comment=... --wrap ...` of `user` looks like, running."""
    return SlurmJob(FORGED_ID, "wrap", "serve", "RUNNING", nodes=("gpu8",), start_time=T0 - 60,
                    gpus=4, comment=comment, user=user, submit_time=submitted)


UNSIGNED = f"slurm-idle:serving since={iso(T0 - 60)} index=1 port=9101 model=jm"
WRONG_SIG = f"slurm-idle:serving since={iso(T0 - 60)} index=1 port=9101 sig=0123456789abcdef model=jm"


def copied_sig(tmp_path: Path) -> str:
    """A genuine Comment of the agent (as anyone can read it in squeue), copied verbatim."""
    trust = load_trust(str(tmp_path / "journal.jsonl"), create=True, now=T0)
    return format_comment("slurm-idle", Phase.SERVING, T0 - 60, "jm", 1, 9101, trust=trust)


CASES = {
    "other user, unsigned": lambda tmp: forged("mallory", UNSIGNED),
    "other user, a copied genuine signature": lambda tmp: forged("mallory", copied_sig(tmp)),
    "own user, no signature": lambda tmp: forged(agent_user(), UNSIGNED, submitted=T0 + 1),
    "own user, a wrong signature": lambda tmp: forged(agent_user(), WRONG_SIG),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_forged_replica_job_is_not_adopted_and_the_real_one_starts(tmp_path: Path,
                                                                      case: str) -> None:
    """The look-alike of jm#1 counts for nothing: both real replica jobs are submitted and
    serve, the targets name the real jobs only, the look-alike is journaled once (not on
    every tick) and never cancelled."""
    agent, slurm, _, _ = make_agent(tmp_path, demand=150.0)
    slurm.job_list.append(CASES[case](tmp_path))
    for _ in range(3):
        agent.tick()
    assert phases(agent) == [Phase.SERVING, Phase.SERVING]
    ours = [j for j in active(slurm) if j.job_id != FORGED_ID]
    assert len(ours) == 2 and {r.job_id for r in agent.observe().replica_jobs} == {
        j.job_id for j in ours}
    assert all(("cancel", str(FORGED_ID)) != e[:2] for e in slurm.log)
    assert FORGED_ID in {j.job_id for j in active(slurm)}
    sd = json.loads((tmp_path / "targets.json").read_text())
    assert sorted(t["labels"]["slurm_job_id"] for t in sd) == sorted(str(j.job_id) for j in ours)
    reports = [r for r in agent.journal.records() if r.get("event") == "foreign-replica-job"]
    assert len(reports) == 1 and reports[0]["job_id"] == FORGED_ID
    assert reports[0]["replica"] == "jm#1" and reports[0]["nodes"] == ["gpu8"]
    typed = [r for r in agent.journal.typed() if isinstance(r, ForeignReplicaJobRecord)]
    assert [(r.job_id, r.replica, r.nodes) for r in typed] == [(FORGED_ID, "jm#1", ("gpu8",))]


def test_an_older_agents_unsigned_replica_job_is_adopted(tmp_path: Path) -> None:
    """Migration: a replica job of the agent's own user with no signature, submitted before
    the key was made (an older agent version's), stays the replica: no second job for it."""
    agent, slurm, _, cluster = make_agent(tmp_path, demand=150.0)
    slurm.job_list.append(forged(agent_user(), UNSIGNED, submitted=T0 - 3600))
    cluster.engine.up["jm#1"] = True  # its vLLM runs: it answers the tick's probe
    for _ in range(3):
        agent.tick()
    assert phases(agent) == [Phase.SERVING, Phase.SERVING]
    assert agent.observe().replica_jobs[1].job_id == FORGED_ID
    assert len(active(slurm)) == 2
    assert not [r for r in agent.journal.records() if r.get("event") == "foreign-replica-job"]


def test_the_key_is_made_once_private_and_signs_submitted_jobs(tmp_path: Path) -> None:
    """The first tick makes the key (0600) beside the journal; later ticks keep it; every
    replica job's Comment carries its signature."""
    agent, slurm, _, _ = make_agent(tmp_path, demand=150.0)
    agent.tick()
    path = key_path(agent.config.paths.journal)
    first = path.read_text()
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    make_agent(tmp_path, demand=150.0)[0].tick()
    assert path.read_text() == first
    assert all(" sig=" in j.comment for j in active(slurm))


def test_trust_checks_user_account_and_signature() -> None:
    """The rule itself: the user first, then the account when the model sets one, then the
    signature; without a key (a reader that cannot read it) the user alone."""
    trust = ReplicaTrust("svc", b"k" * 32, T0)
    text = format_comment("slurm-idle", Phase.SERVING, T0, "jm", 0, 9100)
    job = SlurmJob(1, "x", "serve", "RUNNING", user="svc", account="inference")
    signed = trust.sign(text)
    assert trust.foreign_reason(job, text, signed, None) is None
    assert trust.foreign_reason(job, text, signed, "inference") is None
    assert "account" in str(trust.foreign_reason(job, text, signed, "other"))
    assert "user mallory" in str(trust.foreign_reason(replace(job, user="mallory"), text, signed, None))
    assert "wrong" in str(trust.foreign_reason(job, text + "x", signed, None))
    assert "no signature" in str(trust.foreign_reason(job, text, None, None))
    assert ReplicaTrust("svc").foreign_reason(job, text, None, None) is None


def test_account_of_reads_sbatch_args() -> None:
    """The model's account comes from its sbatch_args in any of sbatch's spellings."""
    cfg = make_config(Path("/nonexistent"))
    model = cfg.models[0]
    assert model.job is not None
    for args, want in [((), None), (("--account=inf",), "inf"), (("-A", "inf"), "inf"),
                       (("-Ainf",), "inf"), (("--qos=x", "--account", "inf"), "inf")]:
        m = model.model_copy(update={"job": model.job.model_copy(update={"sbatch_args": args})})
        assert account_of(m) == want, args


def test_a_job_of_another_account_is_foreign(tmp_path: Path) -> None:
    """With `--account=inference` in sbatch_args, a signed job of the agent's user under
    another account is not a replica."""
    cfg = make_config(tmp_path)
    model = cfg.models[0]
    assert model.job is not None
    job_cfg = model.job.model_copy(update={"sbatch_args": ("--account=inference",)})
    cfg = cfg.model_copy(update={"models": (model.model_copy(update={"job": job_cfg}),)})
    trust = ReplicaTrust("svc", b"k" * 32, T0)
    text = format_comment("slurm-idle", Phase.SERVING, T0, "jm", 0, 9100, trust=trust)
    job = SlurmJob(5, "x", "serve", "RUNNING", nodes=("gpu8",), comment=text, user="svc")
    assert replica_views(cfg, [replace(job, account="inference")], trust)[0].phase is Phase.SERVING
    assert replica_views(cfg, [replace(job, account="other")], trust)[0].phase is Phase.LENT


def test_a_look_only_reader_makes_no_key(tmp_path: Path) -> None:
    """`status` (create=False) makes no key: without one it checks users alone; with one it
    reads it and takes the agent's user from the key's owner."""
    journal = str(tmp_path / "journal.jsonl")
    reader = load_trust(journal, create=False, now=T0)
    assert reader.key is None and not key_path(journal).exists()
    made = load_trust(journal, create=True, now=T0)
    again = load_trust(journal, create=False, now=T0 + 5)
    assert made.key is not None and (again.key, again.key_since, again.user) == (
        made.key, T0, agent_user())


def test_two_first_ticks_racing_end_with_one_key(tmp_path: Path) -> None:
    """Two agents that both found no key (a cron tick and an admin command, each before the
    tick lock) each make one: the second never replaces the first, and both sign with the one
    on disk (a job signed with a replaced key would never be recognised again)."""
    from slurm_idle.replicatrust import _make_key

    journal = str(tmp_path / "journal.jsonl")
    _make_key(key_path(journal), T0)  # the first agent, between our read and our make
    first = key_path(journal).read_text()
    _make_key(key_path(journal), T0 + 1)  # ours: too late
    assert key_path(journal).read_text() == first
    assert stat.S_IMODE(key_path(journal).stat().st_mode) == 0o600
    assert load_trust(journal, create=True, now=T0 + 2).key == bytes.fromhex(json.loads(first)["key"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["replica-jobs.key"]  # no temp left
