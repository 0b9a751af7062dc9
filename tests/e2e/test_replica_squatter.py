"""A job dressed as a replica job is not one, on the real sandbox (`placement: jobs`, gpu8).

Anyone who can submit to the serve partition can give a job our Comment
(`slurm-idle:serving since=... index=1 port=P model=jobs-model`). Such a job, submitted by
root without the agent's signature and (when the partition lets them) by the unprivileged
user `nobody` (through setpriv), is neither counted as serving nor written to Prometheus'
targets: the tick submits the real replica jobs as if the slots were empty, journals each look-alike once
(`foreign-replica-job`) and never cancels it (it is a user's job; the test does at the end).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from slurm_idle.config import load_config
from slurm_idle.journal import iso
from slurm_idle.replicatrust import load_trust
from slurm_idle.testing import sandboxconf
from slurm_idle.testing.waiting import poll
from tests.e2e.test_jobs_placement import HIGH_RPS, SETTLE_S, tick_until

pytestmark = pytest.mark.sandbox

USER = "nobody"  # an unprivileged user every Debian has
AS_USER = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--"]


@pytest.fixture(scope="module")
def jobs_mode(sandbox: Any) -> Iterator[Any]:
    """gpu8 opened at high load; every job on it or in the serve partition cancelled after."""
    sandbox.load_jobs(HIGH_RPS)
    sandbox.jobs_node(True)
    try:
        yield sandbox
    finally:
        ids = sandbox.run(["squeue", "-h", "-w", sandboxconf.JOBS_NODE, "-o", "%A"]).stdout.split()
        ids += sandbox.run(["squeue", "-h", "-p", sandboxconf.JOBS_PARTITION, "-o", "%A"]).stdout.split()
        if ids:
            sandbox.run(["scancel", *sorted(set(ids))])
        sandbox.load_jobs(0.0)
        sandbox.jobs_node(False)


def forge(sb: Any, tag: str, index: int, port: int, user: str | None) -> Any:
    """`sbatch -p serve -w gpu8 --comment=<our shape> --wrap ...`, as root or as `user`."""
    comment = (f"{tag}:serving since={iso(time.time())} index={index} port={port} "
               f"model={sandboxconf.JOBS_MODEL}")
    argv = ["sbatch", "--parsable", "-p", sandboxconf.JOBS_PARTITION, "-w", sandboxconf.JOBS_NODE,
            f"--comment={comment}", "--output=/dev/null", "--chdir=/tmp", "--wrap", "sleep 900"]
    if user is not None:
        argv = [*AS_USER, "env", f"SLURM_CONF={sb.env()['SLURM_CONF']}", *argv]
    return sb.run(argv)


def held_for_partition(sb: Any, job_id: int) -> bool:
    """The job is running (False) or held because its user may not use the partition (True);
    polled until one of the two, scontrol writing the reason with underscores for spaces."""
    def settled() -> str | None:
        out = str(sb.run(["scontrol", "show", "job", str(job_id)]).stdout)
        if "JobState=RUNNING" in out:
            return "running"
        if "not in group permitted to use this partition" in out.replace("_", " "):
            return "held"
        return None

    return bool(poll(settled, 90, f"forged job {job_id} running or held") == "held")


def state(sb: Any, job_id: int) -> str:
    return str(sb.run(["squeue", "-h", "-j", str(job_id), "-o", "%T"]).stdout.strip())


def test_forged_replica_jobs_are_ignored_and_the_real_replicas_start(jobs_mode: Any) -> None:
    """Look-alikes of both replicas run on gpu8; the ticks still start and count the two real
    replica jobs, the targets list only those, the look-alikes are journaled once, not cancelled."""
    sb = jobs_mode
    config = load_config(sb.layout.jobs_config_path)
    model = config.models[0]
    assert model.job is not None
    # The agent's key, as the first tick of this version makes it: a root job without its
    # signature submitted after it is not an older agent's replica (replicatrust.py).
    load_trust(config.paths.journal, create=True, now=time.time())
    time.sleep(1.5)  # Slurm's SubmitTime has whole seconds
    forged: dict[int, str] = {}
    r = forge(sb, config.slurm.tag, 1, model.job.port_base + 1, None)
    assert r.returncode == 0, r.stderr
    forged[int(r.stdout.strip().split(";")[0])] = "root"
    r = forge(sb, config.slurm.tag, 0, model.job.port_base, USER)
    if r.returncode == 0:
        forged[int(r.stdout.strip().split(";")[0])] = USER
    else:  # a serve partition closed to users is the first defence; the check is the second
        print(f"NOTE serve partition refused {USER}: {r.stderr.strip()}")
    try:
        for job_id, user in list(forged.items()):
            if user != "root" and held_for_partition(sb, job_id):
                # 24.11 without EnforcePartLimits accepts the job and never starts it
                # (AllowGroups checked at scheduling): the partition is the first defence
                print(f"NOTE serve partition holds {USER}'s job {job_id}: never runs")
                sb.run(["scancel", str(job_id)])
                del forged[job_id]
        for job_id in forged:
            poll(lambda j=job_id: state(sb, j) == "RUNNING", 90, f"forged job {job_id} running")
        r0, r1 = f"{sandboxconf.JOBS_MODEL}#0", f"{sandboxconf.JOBS_MODEL}#1"
        t0 = time.monotonic()
        rows = tick_until(sb, {r0: "serving", r1: "serving"}, SETTLE_S)
        print(f"MEASURE squatted slots -> both real replicas serving: {time.monotonic() - t0:.1f}s")
        real = {rows[n]["job_id"] for n in (r0, r1)}
        assert None not in real and not real & set(forged), (rows, forged)
        sd = json.loads(sb.layout.jobs_targets.read_text())
        assert {int(t["labels"]["slurm_job_id"]) for t in sd} == real, sd
        for job_id in forged:  # a user's job: reported, never cancelled
            assert state(sb, job_id) == "RUNNING", job_id
        lines = Path(config.paths.journal).read_text(encoding="utf-8").splitlines()
        journal = [json.loads(line) for line in lines if line.strip()]
        reports = [rec for rec in journal if rec.get("event") == "foreign-replica-job"]
        assert sorted(rec["job_id"] for rec in reports) == sorted(forged), reports
        assert {rec["job_id"]: rec["user"] for rec in reports} == forged, reports
    finally:
        sb.run(["scancel", *map(str, forged)])
