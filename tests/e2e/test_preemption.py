"""Preemptible container jobs on the real sandbox: preempted, requeued, resumed, nothing lost.

The demo workload (etc/examples/demo) counts steps with a checkpoint. It is submitted with
`slurm-idle submit`, then either preempted by an inference-partition job on its node (Slurm's
PreemptMode=REQUEUE with GraceTime) or requeued with `scontrol requeue` (what a reclaim does).
Each time it must come back with Restarts>=1, print resumed_from=K>0, end with exactly the
line an uninterrupted run prints, and leave no container behind. The work lost per preemption
is printed (run pytest with -s to see the MEASURE lines).
"""

from __future__ import annotations

import io
import json
import re
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from slurm_idle import runlog
from slurm_idle.config import load_config
from slurm_idle.jobs import parse_job_spec
from slurm_idle.runner import (
    LABEL_MANAGED,
    Reporter,
    RunSettings,
    Signals,
    SlurmContext,
    run_container,
)
from slurm_idle.testing.demo import reset_cluster
from slurm_idle.testing.images import build_demo_image
from slurm_idle.testing.waiting import poll

pytestmark = pytest.mark.sandbox

STEPS = 20
PREEMPT_AT_STEP = 7
EXAMPLE = Path(__file__).resolve().parents[2] / "etc" / "examples" / "demo-job.yaml"


def job_fields(sandbox: Any, job_id: int) -> dict[str, str]:
    out = sandbox.run(["scontrol", "show", "job", str(job_id)]).stdout
    return dict(w.split("=", 1) for w in out.split() if "=" in w)


@pytest.fixture(scope="module")
def docker_client(sandbox: Any) -> Any:
    import docker

    # Earlier e2e modules (agent ticks) may leave nodes drained as serving: start from a plain
    # cluster, or the jobs here queue for the one node left and the preemption comes too late.
    reset_cluster(sandbox, load_config(sandbox.config_path).paths.journal)
    client = docker.DockerClient(base_url=sandbox.docker_host, timeout=60)
    build_demo_image(client)
    yield client
    client.close()


def demo_spec(tmp_path: Path, **params: Any) -> dict[str, Any]:
    """The shipped demo job with a shorter run and private paths."""
    spec = yaml.safe_load(EXAMPLE.read_text())
    spec["params"] = {**spec["params"], "steps": STEPS, **params}
    spec["mounts"]["checkpoint"]["source"] = str(tmp_path / "checkpoint")
    spec["log"] = str(tmp_path / "demo-%j.out")
    return spec


def uninterrupted_result(docker_client: Any, tmp_path: Path) -> str:
    """The final line of the same job run straight through (faster steps: pace is not output)."""
    spec = parse_job_spec(demo_spec(tmp_path / "ref", step_s=0.05))
    out = io.BytesIO()
    code = run_container(docker_client, spec, SlurmContext(job_id="reference"),
                         RunSettings(grace_s=5), Signals(), Reporter(out))
    lines = [x for x in out.getvalue().decode().splitlines() if x.startswith("done ")]
    assert code == 0 and lines
    return lines[-1]


def submit(sandbox: Any, tmp_path: Path, spec: dict[str, Any]) -> int:
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(spec))
    r = sandbox.run([sys.executable, "-m", "slurm_idle.cli", "submit", "--json", str(path)],
                    env={"SLURM_IDLE_STATE_DIR": str(tmp_path / "state")})
    assert r.returncode == 0, r.stderr
    return int(json.loads(r.stdout)["job_id"])


def log_of(tmp_path: Path, job_id: int) -> str:
    p = tmp_path / f"demo-{job_id}.out"
    return p.read_text() if p.exists() else ""


def wait_for_step(tmp_path: Path, job_id: int, step: int, after: str = "") -> None:
    def seen() -> bool:
        text = log_of(tmp_path, job_id)
        text = text.split(after, 1)[1] if after and after in text else ("" if after else text)
        return f"step={step}\n" in text

    poll(seen, 90, f"step {step} of job {job_id}")


def wait_done(sandbox: Any, job_id: int, timeout_s: float = 150) -> dict[str, str]:
    return poll(lambda: (f := job_fields(sandbox, job_id)).get("JobState") in
                {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"} and f, timeout_s, f"end of job {job_id}")


def measure(log: str, label: str) -> dict[str, float]:
    """Work lost at the (first) preemption, from the demo's own timestamps."""
    head, _, _ = log.partition("preempted at step=")
    periodic = [(int(s), float(t)) for s, t in re.findall(r"checkpoint step=(\d+) t=(\d+)", head)]
    m = re.search(r"preempted at step=(\d+) t=(\d+)", log)
    resumed = re.search(r"resumed_from=(\d+)", log)
    grace = re.search(r"container stopped with code \d+ after ([\d.]+) s of grace", log)
    assert m and resumed and grace and periodic
    stop_step, stop_t = int(m.group(1)), float(m.group(2))
    last_periodic = [p for p in periodic if p[0] < stop_step] or [(0, stop_t)]
    res = {
        "steps_redone": stop_step - int(resumed.group(1)),
        "s_since_periodic_checkpoint": stop_t - last_periodic[-1][1],
        "sigterm_to_container_exit_s": float(grace.group(1)),
    }
    print(f"MEASURE {label}: {json.dumps(res)}")
    return res


def check_resumed(sandbox: Any, docker_client: Any, tmp_path: Path, job_id: int,
                  expected_done: str) -> str:
    fields = wait_done(sandbox, job_id)
    log = log_of(tmp_path, job_id)
    release = f"Slurm {sandbox.slurm_version}"
    assert fields["JobState"] == "COMPLETED", f"{release}: {log}"
    assert int(fields["Restarts"]) >= 1
    k = int(re.findall(r"resumed_from=(\d+)", log)[0])
    assert k > 0
    done = [x for x in log.splitlines() if x.startswith("done ")]
    assert done == [expected_done], f"{release}: the work finished {len(done)} times: {log}"
    # Slurm 24.05+ may start the finished job once more (docs/slurm-releases.md): that run
    # must find the completion marker and start no container.
    after_done = log.split(expected_done, 1)[1]
    assert "started container" not in after_done, f"{release}: {after_done}"
    print(f"RELEASE {release}: Restarts={fields['Restarts']}, runs that found the completion "
          f"marker: {after_done.count('already completed')}")
    assert docker_client.containers.list(all=True, filters={"label": [f"{LABEL_MANAGED}=true"]}) == []
    return log


@pytest.mark.slow
def test_job_preempted_by_inference_resumes_and_finishes_like_an_uninterrupted_run(
    sandbox: Any, docker_client: Any, tmp_path: Path
) -> None:
    """An inference job on its node preempts the demo job: requeued (Restarts>=1), resumed
    from its checkpoint, same final line as an uninterrupted run, no container left."""
    expected = uninterrupted_result(docker_client, tmp_path)
    job_id = submit(sandbox, tmp_path, demo_spec(tmp_path))
    wait_for_step(tmp_path, job_id, PREEMPT_AT_STEP)
    node = job_fields(sandbox, job_id)["NodeList"]
    r = sandbox.run(["sbatch", "--parsable", "-p", "inference", "-w", node, "--gres=gpu:4",
                     "-o", "/dev/null", "--wrap", "sleep 3"])
    assert r.returncode == 0, r.stderr
    inference = int(r.stdout.strip().split(";")[0])
    t_submit = time.time()
    poll(lambda: job_fields(sandbox, inference).get("JobState") in {"RUNNING", "COMPLETED"},
         60, "inference job running")
    node_back_s = time.time() - t_submit
    log = check_resumed(sandbox, docker_client, tmp_path, job_id, expected)
    assert "DUE TO JOB REQUEUE" in log or "DUE TO PREEMPTION" in log
    # The sandbox sends a preempted job its own --signal (send_user_signal): the runner's
    # USR1 comes with the preemption, and is taken as one, not as the time limit.
    assert "a preemption, not the time limit" in log, log
    ledger = runlog.read(tmp_path / "state", job_id, sandbox.layout.cluster_name)
    assert [r["why"] for r in ledger if r.get("event") == "end"][:1] == ["preempted"], ledger
    lost = measure(log, "preempted by an inference job")
    print(f"MEASURE inference job running {node_back_s:.1f}s after its submission (upper bound)")
    assert lost["steps_redone"] == 0  # the SIGTERM checkpoint keeps every finished step


@pytest.mark.slow
def test_job_requeued_by_scontrol_resumes(sandbox: Any, docker_client: Any, tmp_path: Path) -> None:
    """`scontrol requeue` (what a reclaim does) stops the container cleanly; the job comes back
    with Restarts>=1, resumes, finishes like an uninterrupted run; `slurm-idle jobs` shows it."""
    expected = uninterrupted_result(docker_client, tmp_path)
    job_id = submit(sandbox, tmp_path, demo_spec(tmp_path))
    wait_for_step(tmp_path, job_id, PREEMPT_AT_STEP)
    r = sandbox.run([sys.executable, "-m", "slurm_idle.cli", "jobs", "--json"],
                    env={"SLURM_IDLE_STATE_DIR": str(tmp_path / "state")})
    assert r.returncode == 0, r.stderr
    row = next(j for j in json.loads(r.stdout)["jobs"] if j["job_id"] == job_id)
    assert row["state"] == "RUNNING" and row["restarts"] == 0 and row["node"]
    assert row["checkpoint_age_s"] is not None and row["checkpoint_age_s"] < 10
    assert sandbox.run(["scontrol", "requeue", str(job_id)]).returncode == 0
    log = check_resumed(sandbox, docker_client, tmp_path, job_id, expected)
    lost = measure(log, "scontrol requeue")
    assert lost["steps_redone"] == 0


@pytest.mark.slow
def test_time_limit_warning_checkpoints_and_requeues_instead_of_timing_out(
    sandbox: Any, docker_client: Any, tmp_path: Path
) -> None:
    """A 1-minute job warned by SIGUSR1 (warn_s) checkpoints and requeues itself instead of
    ending as TIMEOUT, then finishes in a later run."""
    # The warning is due 5 s into the minute, but slurmctld sends it at its next time-limit
    # check (about every 30 s; later on a loaded machine: 40 steps once finished first, never
    # warned). 70 steps of 1 s cannot finish inside one 1-minute run: the job completes only
    # if each warning came and the runner requeued it, else it ends TIMEOUT.
    spec = demo_spec(tmp_path, steps=70)
    spec.update({"time": "1", "warn_s": 55})
    job_id = submit(sandbox, tmp_path, spec)
    fields = wait_done(sandbox, job_id, timeout_s=360)
    log = log_of(tmp_path, job_id)
    assert fields["JobState"] == "COMPLETED", log
    print(f"\ntime-limit warning: {fields['Restarts']} restart(s) to finish 70 steps in 1-minute runs")
    assert int(fields["Restarts"]) >= 1
    assert "SIGUSR1 (time limit near)" in log and "requeueing job" in log
    assert int(re.findall(r"resumed_from=(\d+)", log)[0]) > 0
    assert [x for x in log.splitlines() if x.startswith("done ")] == ["done steps=70 sum=2485"]
