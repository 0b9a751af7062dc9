"""`placement: jobs` on the real sandbox: vLLM replicas (emulators) as Slurm jobs on gpu8.

Low load: one replica job is cancelled and an idle-partition job starts on its 4 GPUs while the
other replica keeps serving on the same node. High load: the replica job is submitted again,
Slurm preempts the idle job (sacct PREEMPTED, requeued with Restarts >= 1, its step got SIGTERM
within GraceTime), the replica serves again, and Prometheus' file_sd targets follow. The reclaim
time (load rise -> serving) is printed (pytest -s: MEASURE lines).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from slurm_idle.testing import sandboxconf
from slurm_idle.testing.waiting import poll

pytestmark = pytest.mark.sandbox

HIGH_RPS, LOW_RPS = 20.0, 0.5
#: Upper bound for each phase change. Alone these take 10-40 s; CI runs two Slurm lanes side by
#: side on 2 cores, where a tick (a Python start, squeue/sacct calls, a Slurm scheduling pass)
#: can take many times longer. The reclaim time is measured and printed, never asserted here.
SETTLE_S = 300.0
IDLE_JOB = """#!/bin/bash
#SBATCH -p idle
#SBATCH --gres=gpu:4
#SBATCH --requeue
#SBATCH -w {node}
#SBATCH --open-mode=append
#SBATCH --output={out}
echo "start restart=${{SLURM_RESTART_COUNT:-0}} gpus=$CUDA_VISIBLE_DEVICES"
srun bash -c 'trap "echo got SIGTERM \\$(date +%s)" TERM; while true; do sleep 0.2; done'
"""


@pytest.fixture(scope="module")
def jobs_mode(sandbox: Any) -> Iterator[Any]:
    """gpu8 opened for the test, everything on it cancelled and the node closed afterwards."""
    sandbox.load_jobs(HIGH_RPS)
    sandbox.jobs_node(True)
    try:
        yield sandbox
    finally:
        cancel_gpu8_jobs(sandbox)
        sandbox.load_jobs(0.0)
        sandbox.jobs_node(False)


def cancel_gpu8_jobs(sb: Any) -> None:
    """Cancel every job on gpu8, in the serve partition, or asked for gpu8."""
    ids = sb.run(["squeue", "-h", "-w", sandboxconf.JOBS_NODE, "-o", "%A"]).stdout.split()
    ids += sb.run(["squeue", "-h", "-p", sandboxconf.JOBS_PARTITION, "-o", "%A"]).stdout.split()
    # ... and the idle jobs asked for gpu8 (a preempted one waits PENDING, on no node: it
    # would take the GPUs the next module's lend frees before that module's own idle job).
    asked = sb.run(["squeue", "-h", "-o", "%A %n"]).stdout.splitlines()
    ids += [line.split()[0] for line in asked if sandboxconf.JOBS_NODE in line.split()[1:]]
    if ids:
        sb.run(["scancel", *sorted(set(ids))])


def tick(sb: Any, config: Path | None = None) -> dict[str, Any]:
    r = sb.run(["slurm-idle", "--config", str(config or sb.layout.jobs_config_path), "tick", "--json"],
               timeout=120)
    assert r.returncode in (0, 1), r.stderr
    return dict(json.loads(r.stdout))


def replicas(sb: Any, config: Path | None = None) -> dict[str, dict[str, Any]]:
    r = sb.run(["slurm-idle", "--config", str(config or sb.layout.jobs_config_path), "status", "--json"])
    return {row["name"]: row for row in json.loads(r.stdout)["replicas"]}


def tick_until(sb: Any, want: dict[str, str] | list[str], timeout_s: float,
               config: Path | None = None) -> dict[str, dict[str, Any]]:
    """Tick (as cron would, back to back) until the replicas' phases are `want` (a dict by
    replica, or a list of phases in any order: which replica the policy lends is its choice)."""
    end = time.monotonic() + timeout_s
    while True:
        tick(sb, config)
        rows = replicas(sb, config)
        if isinstance(want, dict):
            if {n: rows[n]["phase"] for n in want} == want:
                return rows
        elif sorted(r["phase"] for r in rows.values()) == sorted(want):
            return rows
        assert time.monotonic() < end, f"replicas never reached {want}: {rows}"
        time.sleep(1)


def job_fields(sb: Any, job_id: int) -> dict[str, str]:
    out = sb.run(["scontrol", "show", "job", str(job_id)]).stdout
    return dict(w.split("=", 1) for w in out.split() if "=" in w)


def prometheus_targets(sb: Any) -> set[str]:
    import urllib.request

    with urllib.request.urlopen(f"{sb.prometheus_url}/api/v1/targets", timeout=5) as resp:
        data = json.loads(resp.read())
    return {t["labels"]["instance"] for t in data["data"]["activeTargets"]
            if t["labels"].get("job") == "vllm-jobs" and t["health"] == "up"}


@pytest.mark.slow
def test_lend_and_reclaim_replica_jobs(jobs_mode: Any, tmp_path: Path) -> None:
    """One replica job lent GPU-granularly and taken back by Slurm's own preemption."""
    sb = jobs_mode
    r0, r1 = f"{sandboxconf.JOBS_MODEL}#0", f"{sandboxconf.JOBS_MODEL}#1"
    rows = tick_until(sb, {r0: "serving", r1: "serving"}, SETTLE_S)
    assert all(rows[n]["placement"] == "jobs" and rows[n]["job_id"] for n in (r0, r1))
    assert rows[r0]["nodes"] == rows[r1]["nodes"] == [sandboxconf.JOBS_NODE]
    ports = {str(rows[n]["port"]) for n in (r0, r1)}

    # Low load: one replica job is cancelled, the other keeps serving on the same node. Which
    # one the planner lends depends on their load (the least busy, then the highest index).
    sb.load_jobs(LOW_RPS)
    rows = tick_until(sb, ["lent", "serving"], SETTLE_S)
    r0, r1 = sorted((r0, r1), key=lambda n: rows[n]["phase"] != "serving")  # r0 serves, r1 lent
    assert rows[r1]["job_id"] is None
    serving_job = rows[r0]["job_id"]
    sd = json.loads(sb.layout.jobs_targets.read_text())
    assert [t["labels"]["slurm_idle_replica"] for t in sd] == [r0]

    # An idle-partition job takes the 4 GPUs the lend freed, beside the serving replica.
    out = tmp_path / "idle-%j.out"
    script = tmp_path / "idle.sh"
    script.write_text(IDLE_JOB.format(node=sandboxconf.JOBS_NODE, out=out))
    idle = int(sb.run(["sbatch", "--parsable", str(script)], check=True).stdout.strip().split(";")[0])
    poll(lambda: job_fields(sb, idle).get("JobState") == "RUNNING", 90, "idle job running on gpu8")
    assert job_fields(sb, serving_job).get("JobState") == "RUNNING"
    log = Path(str(out).replace("%j", str(idle)))
    poll(lambda: log.exists() and "start" in log.read_text(), 60, "idle job started")
    # ... on the GPUs the cancelled replica freed: none of the serving replica's (as each
    # process saw them from Slurm: CUDA_VISIBLE_DEVICES).
    idle_gpus = set(log.read_text().split("gpus=")[1].split()[0].split(","))
    replica_log = sb.layout.log / f"replica-{serving_job}.out"
    serving_gpus = set(replica_log.read_text().split("gpus=")[1].split()[0].split(","))
    assert len(idle_gpus) == 4 and len(serving_gpus) == 4 and not idle_gpus & serving_gpus

    # High load: the replica job is submitted, Slurm preempts the idle job, the replica serves.
    sb.load_jobs(HIGH_RPS)
    t0 = time.monotonic()
    rows = tick_until(sb, {r0: "serving", r1: "serving"}, SETTLE_S)
    reclaim_s = time.monotonic() - t0
    print(f"MEASURE jobs-mode reclaim (load rise -> serving, ticks back to back): {reclaim_s:.1f}s")
    # Steered to gpu8 (its idle job loses the least work) by --prefer (slurm.prefer_feature,
    # replicajobs.steer_args), never a hard --nodelist; Slurm's queue delay printed for simulate.
    # (Slurm moves a satisfied --prefer into the job's Features when it starts the job.)
    fields = job_fields(sb, rows[r1]["job_id"])
    assert sandboxconf.JOBS_NODE in (fields.get("Prefer"), fields.get("Features")), fields
    assert fields.get("ReqNodeList") == "(null)", fields
    print(f"MEASURE jobs-mode replica job SubmitTime {fields['SubmitTime']} StartTime "
          f"{fields['StartTime']} (sbatch -> running, GraceTime {sandboxconf.GRACE_TIME_S}s included)")
    states = sb.run(["sacct", "-j", str(idle), "-X", "-D", "-n", "-o", "State"]).stdout.split()
    assert "PREEMPTED" in states, states
    assert not {"FAILED", "CANCELLED"} & set(states), states
    fields = job_fields(sb, idle)
    assert int(fields["Restarts"]) >= 1 and fields["JobState"] in {"PENDING", "RUNNING"}, fields
    text = log.read_text()
    # Its step was signalled when the preemption began, before GraceTime ran out.
    assert "got SIGTERM" in text and "DUE TO PREEMPTION" in text, text
    assert text.index("got SIGTERM") < text.index("DUE TO PREEMPTION"), text
    # Prometheus' targets follow the replica jobs (file_sd, rewritten each tick).
    poll(lambda: {t.split(":")[1] for t in prometheus_targets(sb)} == ports, 90,
         "Prometheus scraping both replica jobs")
    # `report`: the replica jobs' (inference) GPU-hours from sacct beside the lent ones.
    r = sb.run(["slurm-idle", "--config", str(sb.layout.jobs_config_path), "report", "--json"])
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["inference_gpu_hours"] > 0 and doc["lent_gpu_hours"] > 0, doc


def listening(port: int) -> bool:
    import socket

    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    except OSError:
        return False
    return True


@pytest.mark.slow
def test_a_replica_job_waits_for_its_held_gpus_then_serves(jobs_mode: Any, tmp_path: Path) -> None:
    """Every GPU of gpu8 held by a process outside Slurm when a replica job starts there: its
    script waits before vLLM (its stderr names the GPU and MiB), the replica is `held` and
    `explain` says what holds it, no emulator listens on its port; once the hold ends, the
    script starts the emulator and the replica serves."""
    import yaml

    sb = jobs_mode
    sb.load_jobs(HIGH_RPS)
    # Ticks of 15 s: a tick of a held replica waits its whole budget for the GPUs.
    doc = yaml.safe_load(sb.layout.jobs_config_path.read_text())
    doc["timeouts"]["tick_budget_s"] = 15
    config = tmp_path / "slurm-idle-jobs.yaml"
    config.write_text(yaml.safe_dump(doc))
    first = f"{sandboxconf.JOBS_MODEL}#0"  # the floor: submitted first, whatever the load says
    sb.gpu_hold(sandboxconf.JOBS_NODE, mib=20000)
    try:
        cancel_gpu8_jobs(sb)  # the replica jobs start again, on the held GPUs
        rows = tick_until(sb, {first: "held"}, SETTLE_S, config)
        held = [n for n, row in rows.items() if row["phase"] == "held"]
        for name in held:
            assert not listening(rows[name]["port"]), f"{name}: an engine started on a held GPU"
            out = (sb.layout.log / f"replica-{rows[name]['job_id']}.out").read_text()
            assert "holds 20000 MiB (allowed 1024): not starting vLLM" in out, out
            assert "vllm-emulator" not in out, out  # the emulator never ran (nor failed OOM)
        r = sb.run(["slurm-idle", "--config", str(config), "explain", first])
        assert r.returncode == 0, r.stderr
        assert "waits for its GPUs before vLLM starts: gpu8 GPU" in r.stdout, r.stdout
        assert "20000 MiB held (allowed 1024)" in r.stdout, r.stdout
    finally:
        sb.gpu_release(sandboxconf.JOBS_NODE)
    t0 = time.monotonic()
    tick_until(sb, {first: "serving"}, SETTLE_S, config)
    print(f"MEASURE jobs-mode held -> serving after the hold ends: {time.monotonic() - t0:.1f}s")
