"""The runner against the sandbox's real dockerd: container settings, signals, cleanup.

The runner runs here outside Slurm (as `python -m slurm_idle.job_step`, or in-process), with
SLURM_JOB_ID set by hand, against `sandbox.docker_host`; the images are the local test images
built by slurm_idle.testing.images (no registry involved).
"""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import yaml

from slurm_idle.jobs import parse_job_spec
from slurm_idle.runner import (
    EXIT_PREEMPTED,
    LABEL_JOB,
    LABEL_MANAGED,
    Reporter,
    RunSettings,
    Signals,
    SlurmContext,
    run_container,
)
from slurm_idle.testing.images import BUSYBOX_IMAGE, DEMO_IMAGE, build_demo_image

pytestmark = pytest.mark.sandbox


@pytest.fixture(scope="module")
def docker_client(sandbox: Any) -> Any:
    import docker

    client = docker.DockerClient(base_url=sandbox.docker_host, timeout=60)
    build_demo_image(client)
    yield client
    client.close()


def ours(client: Any, job_id: str | None = None) -> list[Any]:
    label = f"{LABEL_JOB}={job_id}" if job_id else f"{LABEL_MANAGED}=true"
    return client.containers.list(all=True, filters={"label": [label]})


def test_container_runs_as_job_user_with_env_params_and_readonly_inputs(
    docker_client: Any, tmp_path: Path
) -> None:
    """The workload sees its uid:gid, env, PARAM_* vars, the params file, a read-only input
    and a writable checkpoint dir; the runner exits with its code and removes it."""
    inputs = tmp_path / "in"
    inputs.mkdir()
    (inputs / "data.txt").write_text("input-data\n")
    ck = tmp_path / "ck"
    ck.mkdir(mode=0o777)
    ck.chmod(0o777)
    script = (
        "echo uid=$(id -u) gid=$(id -g); echo env=$GREETING param=$PARAM_LR;"
        " echo restart=$SLURM_RESTART_COUNT job=$SLURM_JOB_ID ckdir=$CHECKPOINT_DIR;"
        " cat $SLURM_IDLE_PARAMS_FILE | tr -d ' \\n'; echo;"
        " cat /in/data.txt; touch /in/nope 2>/dev/null && echo in=rw || echo in=ro;"
        " echo saved > $CHECKPOINT_DIR/state && echo ck=ok; exit 7"
    )
    spec = parse_job_spec({
        "name": "contract", "image": BUSYBOX_IMAGE, "command": ["/bin/sh", "-c", script],
        "env": {"GREETING": "hi there; $(echo not-run)"}, "params": {"lr": 0.25},
        "mounts": {"inputs": [{"source": str(inputs), "target": "/in"}],
                   "checkpoint": {"source": str(ck), "target": "/ckpt"}},
    })
    job_id = f"c{uuid.uuid4().hex[:8]}"
    out = io.BytesIO()
    code = run_container(
        docker_client, spec, SlurmContext(job_id=job_id, restart_count=2),
        RunSettings(grace_s=5, uid=65534, gid=65534), Signals(), Reporter(out),
    )
    log = out.getvalue().decode()
    assert code == 7, log
    assert "uid=65534 gid=65534" in log
    assert "env=hi there; $(echo not-run) param=0.25" in log
    assert f"restart=2 job={job_id} ckdir=/ckpt" in log
    assert '{"lr":0.25}' in log and "input-data" in log and "in=ro" in log and "ck=ok" in log
    assert (ck / "state").read_text() == "saved\n"
    assert ours(docker_client, job_id) == []


def _spec_file(tmp_path: Path, steps: int = 60) -> Path:
    spec = {
        "name": "sigterm", "image": DEMO_IMAGE,
        "params": {"steps": steps, "step_s": 0.2, "checkpoint_every": 1000},
        "mounts": {"checkpoint": {"source": str(tmp_path / "ck"), "target": "/checkpoint"}},
        "grace_s": 5,
    }
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def _runner(sandbox: Any, spec: Path, job_id: str) -> subprocess.Popen[str]:
    env = {**os.environ, **sandbox.env(), "SLURM_JOB_ID": job_id}
    return subprocess.Popen(
        [sys.executable, "-m", "slurm_idle.job_step", "--spec", str(spec)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )


def _read_until(proc: subprocess.Popen[str], needle: str, timeout_s: float = 60) -> str:
    seen = ""
    deadline = time.monotonic() + timeout_s
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        seen += line
        if needle in line:
            return seen
    pytest.fail(f"{needle!r} not seen; output so far:\n{seen}")


def test_sigterm_reaches_the_workload_which_checkpoints_within_grace(
    sandbox: Any, docker_client: Any, tmp_path: Path
) -> None:
    """SIGTERM to the runner process -> the workload's trap saves its step -> exit 143 in well
    under the grace period, container removed."""
    job_id = f"c{uuid.uuid4().hex[:8]}"
    proc = _runner(sandbox, _spec_file(tmp_path), job_id)
    _read_until(proc, "step=3")
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    rest, _ = proc.communicate(timeout=30)
    elapsed = time.monotonic() - t0
    assert proc.returncode == EXIT_PREEMPTED, rest
    assert "preempted at step=" in rest and "checkpoint saved" in rest
    step = int((tmp_path / "ck" / "state").read_text().split()[0])
    assert step >= 3
    assert elapsed < 5, f"stop took {elapsed:.1f}s"
    assert ours(docker_client, job_id) == []


def test_leftovers_of_the_job_are_swept_and_cleanup_mode_removes_them(
    sandbox: Any, docker_client: Any, tmp_path: Path
) -> None:
    """A container left by a killed run of the same job is removed at start; --cleanup JOBID
    removes a job's containers (for a Slurm Epilog)."""
    job_id = f"c{uuid.uuid4().hex[:8]}"
    labels = {LABEL_MANAGED: "true", LABEL_JOB: job_id}
    docker_client.containers.run(BUSYBOX_IMAGE, ["sleep", "300"], detach=True, labels=labels,
                                 network_mode="none", name=f"leftover-{job_id}")
    proc = _runner(sandbox, _spec_file(tmp_path, steps=2), job_id)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    assert f"removed leftover container leftover-{job_id}" in out
    assert ours(docker_client, job_id) == []
    docker_client.containers.run(BUSYBOX_IMAGE, ["sleep", "300"], detach=True, labels=labels,
                                 network_mode="none")
    env = {**os.environ, **sandbox.env()}
    done = subprocess.run([sys.executable, "-m", "slurm_idle.job_step", "--cleanup", job_id],
                          env=env, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0 and "removed container" in done.stdout
    assert ours(docker_client, job_id) == []


def test_engine_unreachable_is_exit_70_with_a_clear_line(tmp_path: Path) -> None:
    """No engine at DOCKER_HOST: the runner says so and exits 70 (the job fails, no traceback)."""
    env = {**os.environ, "DOCKER_HOST": f"unix://{tmp_path}/missing.sock"}
    done = subprocess.run(
        [sys.executable, "-m", "slurm_idle.job_step", "--spec", str(_spec_file(tmp_path))],
        env=env, capture_output=True, text=True, timeout=60, check=False,
    )
    assert done.returncode == 70
    assert "slurm-idle-run:" in done.stdout and "Traceback" not in done.stdout + done.stderr


def test_the_engine_refuses_to_signal_a_container_that_has_exited(docker_client: Any) -> None:
    """What the runner's stop path leans on (supervise.not_running): dockerd answers a kill of
    an exited container with an error, and the container's status then says `exited`. So a
    container that ends as a stop signal comes is seen to have ended, not to be stopping."""
    import docker.errors

    from slurm_idle.runner.supervise import not_running
    from slurm_idle.testing.images import import_busybox

    image = import_busybox(docker_client)
    container = docker_client.containers.create(image, ["true"], network_mode="none",
                                                labels={LABEL_MANAGED: "true"})
    try:
        container.start()
        assert container.wait(timeout=60)["StatusCode"] == 0
        with pytest.raises(docker.errors.APIError):
            container.kill(signal="SIGTERM")
        assert not_running(container)
    finally:
        container.remove(force=True)
