"""Pipelines that survive weeks of preemption, on the real sandbox.

- a step that fails once then succeeds passes with `retries: 1` (the runner requeues it);
- a job requeued 25 times (what 25 nightly reclaims do) completes with max_restarts: 2,
  because the runner's ledger records each run as preempted;
- outputs flow: prep's /outputs is readable (read-only) in each matrix job at /inputs/prep,
  a matrix of 3 values runs 3 jobs and the join sees all 3 outputs under /inputs/train;
- `pipeline retry` resubmits only the failed step and its downstream, keeping the others.
"""

from __future__ import annotations

import functools
import json
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from slurm_idle import runlog
from slurm_idle.testing.images import BUSYBOX_IMAGE, build_demo_image
from slurm_idle.testing.waiting import poll as _poll

pytestmark = pytest.mark.sandbox
poll = functools.partial(_poll, interval_s=1.0)
ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"}


@pytest.fixture(scope="module")
def images(sandbox: Any) -> None:
    import docker

    client = docker.DockerClient(base_url=sandbox.docker_host, timeout=60)
    build_demo_image(client)
    client.close()


def cli(sandbox: Any, tmp_path: Path, *args: str) -> Any:
    r = sandbox.run([sys.executable, "-m", "slurm_idle.cli", *args],
                    env={"SLURM_IDLE_STATE_DIR": str(tmp_path / "state")})
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def status(sandbox: Any, tmp_path: Path, name: str) -> dict[str, dict[str, Any]]:
    doc = cli(sandbox, tmp_path, "pipeline", "status", "--json", name)
    return {s["name"]: s for s in doc["steps"]}


def sh(script: str, **over: Any) -> dict[str, Any]:
    return {"image": BUSYBOX_IMAGE, "command": ["/bin/sh", "-c", script], **over}


def run_pipeline(sandbox: Any, tmp_path: Path, pipe: dict[str, Any], *extra: str) -> Any:
    path = tmp_path / f"{pipe['name']}.yaml"
    path.write_text(yaml.safe_dump(pipe))
    return cli(sandbox, tmp_path, "pipeline", "run", "--json", str(path), *extra)


def job_state(sandbox: Any, job_id: int) -> dict[str, str]:
    out = sandbox.run(["scontrol", "show", "job", str(job_id)]).stdout
    return dict(w.split("=", 1) for w in out.split() if "=" in w)


def test_a_step_failing_once_passes_with_one_retry(
    sandbox: Any, images: None, tmp_path: Path
) -> None:
    """exit 1 on the first run, 0 on the next: retries: 1 requeues it once and it completes;
    the ledger says one failure, and the step downstream runs after it."""
    flaky = sh("if [ -f /ck/once ]; then echo second; exit 0; fi; touch /ck/once; echo first; "
               "exit 1", mounts={"checkpoint": {"source": f"{tmp_path}/ck", "target": "/ck"}},
               retry_backoff_s=1)
    pipe = {"name": "flaky", "defaults": {"log": f"{tmp_path}/{{step}}-%j.out", "grace_s": 5},
            "steps": [{"name": "a", "retries": 1, "job": flaky},
                      {"name": "b", "depends_on": ["a"], "job": sh("echo after")}]}
    run = run_pipeline(sandbox, tmp_path, pipe)
    ids = {s["name"]: s["job_id"] for s in run["steps"]}
    try:
        final = poll(lambda: (st := status(sandbox, tmp_path, "flaky"))["b"]["state"] in ENDED
                     and st, 150, "b ended")
    finally:
        cli(sandbox, tmp_path, "pipeline", "cancel", "--json", "flaky")
    log = next(tmp_path.glob("a-*.out")).read_text()
    assert final["a"]["state"] == "COMPLETED" and final["b"]["state"] == "COMPLETED", log
    assert "retry 1 of 1" in log and "second" in log
    summary = runlog.summarize(runlog.read(tmp_path / "state", ids["a"]))
    assert (summary.failures, summary.completed, summary.preemptions) == (1, 1, 0)


@pytest.mark.slow
def test_a_job_requeued_25_times_completes_with_max_restarts_2(
    sandbox: Any, images: None, tmp_path: Path
) -> None:
    """25 requeues (reclaims) of a running job never use up max_restarts: 2; the 26th run
    completes, the ledger holds 25 preemptions and no failure."""
    n = 25
    spec = sh(f'if [ "$SLURM_RESTART_COUNT" -ge {n} ]; then echo finished; exit 0; fi; '
              "sleep 300 & wait", max_restarts=2, grace_s=2,
              log=f"{tmp_path}/long-%j.out")
    path = tmp_path / "long.yaml"
    path.write_text(yaml.safe_dump({"name": "long", **spec}))
    job_id = cli(sandbox, tmp_path, "submit", "--json", str(path))["job_id"]
    log = tmp_path / f"long-{job_id}.out"
    t0 = time.monotonic()
    try:
        for restart in range(n):
            poll(lambda r=restart: log.exists() and f"restart={r} " in log.read_text(), 90,
                 f"run {restart} started its container")
            assert sandbox.run(["scontrol", "requeue", str(job_id)]).returncode == 0
            # Skip the requeue's BeginTime wait (cred_expire) where Slurm allows it.
            poll(lambda: job_state(sandbox, job_id).get("JobState") == "PENDING", 30, "pending")
            sandbox.run(["scontrol", "update", f"jobid={job_id}", "starttime=now"])
        final = poll(lambda: (f := job_state(sandbox, job_id)).get("JobState") in ENDED and f,
                     120, "the job's end")
    finally:
        sandbox.run(["scancel", str(job_id)])
    print(f"MEASURE {n} requeues and the final run took {time.monotonic() - t0:.0f}s")
    assert final["JobState"] == "COMPLETED", log.read_text()[-2000:]
    assert int(final["Restarts"]) == n
    assert "finished" in log.read_text()
    summary = runlog.summarize(runlog.read(tmp_path / "state", job_id))
    assert (summary.failures, summary.completed) == (0, 1)
    # Every requeued run is in the ledger as preempted, or as killed: Slurm SIGKILLs the step
    # KillWait after the requeue, and on a loaded machine that can come before the runner has
    # removed its container and written the end (CI once: run 19 of 25, docker's removal slow
    # while a real vLLM loaded its model). Neither counts against max_restarts.
    assert summary.preemptions + summary.killed == n, summary
    assert summary.killed <= 2, summary


def test_outputs_flow_to_a_matrix_and_the_join_sees_all_three(
    sandbox: Any, images: None, tmp_path: Path
) -> None:
    """prep's outputs are at /inputs/prep (read-only) in each of 3 matrix jobs; the join
    reads the 3 outputs at /inputs/train/<i>; -p overrides the pipeline's parameter."""
    pipe = {
        "name": "fan", "data_dir": f"{tmp_path}/data/{{pipeline}}",
        "params": {"greeting": "hello"},
        "defaults": {"log": f"{tmp_path}/{{step}}-%j.out", "grace_s": 5},
        "steps": [
            {"name": "prep", "outputs": True,
             "job": sh('echo "{params.greeting}" > /outputs/word')},
            {"name": "train", "depends_on": ["prep"], "outputs": True,
             "matrix": {"seed": [1, 2, 3]},
             "job": sh('w=$(cat /inputs/prep/word); if touch /inputs/prep/x; then echo writable; '
                       'exit 9; fi; echo "$w-{matrix.seed}" > /outputs/result')},
            {"name": "join", "depends_on": ["train"],
             "job": sh('echo "seen $(ls /inputs/train | wc -l):" $(cat /inputs/train/*/result)')},
        ],
    }
    run = run_pipeline(sandbox, tmp_path, pipe, "-p", "greeting=bonjour")
    assert [s["name"] for s in run["steps"]] == ["prep", "train-0", "train-1", "train-2", "join"]
    try:
        final = poll(lambda: (st := status(sandbox, tmp_path, "fan"))["join"]["state"] in ENDED
                     and st, 150, "join ended")
    finally:
        cli(sandbox, tmp_path, "pipeline", "cancel", "--json", "fan")
    assert {n: s["state"] for n, s in final.items()} == {n: "COMPLETED" for n in final}, final
    join_log = next(tmp_path.glob("join-*.out")).read_text()
    assert "seen 3: bonjour-1 bonjour-2 bonjour-3" in join_log


def test_pipeline_retry_resubmits_only_the_failed_step_and_its_downstream(
    sandbox: Any, images: None, tmp_path: Path
) -> None:
    """b fails (a flag file is missing) -> c cancelled, d completes; after the fix,
    `pipeline retry` resubmits b and c only, a and d keep their jobs, all complete."""
    (tmp_path / "flag").mkdir()
    flag = {"mounts": {"inputs": [{"source": f"{tmp_path}/flag", "target": "/flag"}]}}
    pipe = {"name": "fixme", "defaults": {"log": f"{tmp_path}/{{step}}-%j.out", "grace_s": 5},
            "steps": [
                {"name": "a", "job": sh("echo a")},
                {"name": "b", "depends_on": ["a"], "job": sh("test -f /flag/ok", **flag)},
                {"name": "c", "depends_on": ["b"], "job": sh("echo c")},
                {"name": "d", "depends_on": ["a"], "job": sh("echo d")},
            ]}
    run = run_pipeline(sandbox, tmp_path, pipe)
    first = {s["name"]: s["job_id"] for s in run["steps"]}
    try:
        poll(lambda: (st := status(sandbox, tmp_path, "fixme"))["c"]["state"] == "CANCELLED"
             and st["d"]["state"] == "COMPLETED", 120, "b failed, c cancelled, d done")
        (tmp_path / "flag" / "ok").write_text("fixed\n")
        retried = cli(sandbox, tmp_path, "pipeline", "retry", "--json", "fixme")
        assert sorted(retried["resubmitted"]) == ["b", "c"] and retried["kept"] == ["a", "d"]
        final = poll(lambda: (st := status(sandbox, tmp_path, "fixme"))["c"]["state"] in ENDED
                     and st, 120, "c ended after the retry")
    finally:
        cli(sandbox, tmp_path, "pipeline", "cancel", "--json", "fixme")
    assert {n: s["state"] for n, s in final.items()} == {n: "COMPLETED" for n in first}
    assert final["a"]["job_id"] == first["a"] and final["d"]["job_id"] == first["d"]
    assert final["b"]["job_id"] != first["b"] and final["c"]["job_id"] != first["c"]
