"""A container job of an unprivileged user on the real sandbox (issue 11, items 5 and 6).

The user `sidle-ci` (made here with a home, or by another module) submits with sbatch; the runner
runs as that user on the node, starts a rootless podman API service of its own (the docker
socket, root on the node, is never used) and runs the container through the same docker SDK.
A job asking for what the node's job_policy forbids (outputs in /etc, the host network) is
refused by the runner itself: the batch script is the user's to write. A reclaim of the node
running such a job (issue 24, item 1) requeues it and leaves no container behind.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from slurm_idle.config import load_config
from slurm_idle.jobs import SubmitOptions, parse_job_spec, render_script
from slurm_idle.testing.demo import reset_cluster
from slurm_idle.testing.images import busybox_rootfs_tar
from slurm_idle.testing.waiting import poll

pytestmark = pytest.mark.sandbox

ROOT = Path(__file__).resolve().parents[2]
USER = "sidle-ci"
IMAGE = "localhost/slurm-idle/busybox:latest"


def as_user(argv: list[str], env: dict[str, str], **kw: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["runuser", "-u", USER, "--", "env", *(f"{k}={v}" for k, v in env.items()),
                           *argv], capture_output=True, text=True, timeout=kw.pop("timeout", 180),
                          check=False, **kw)


@pytest.fixture(scope="module")
def site(sandbox: Any) -> Iterator[dict[str, Any]]:
    if os.geteuid() != 0 or shutil.which("podman") is None or shutil.which("runuser") is None:
        pytest.skip("needs root, podman and runuser")
    from slurm_idle.testing.users import ensure_user

    pw = ensure_user(USER)  # with a home: the work lives there
    # Rootless podman needs a user namespace. The kernel refuses one to a process in a chroot
    # (clone(2): EPERM), which is how `scripts/test --debian 13` runs the suite: skip there,
    # saying so; the 22.05 lane runs these tests on the machine itself.
    userns = subprocess.run(["runuser", "-u", USER, "--", "unshare", "--user", "--map-root-user",
                             "true"], capture_output=True, text=True, timeout=30, check=False)
    if userns.returncode != 0:
        pytest.skip(f"rootless podman cannot run here: no user namespace for {USER} "
                    f"({userns.stderr.strip()}; a chroot, e.g. scripts/test --debian 13, is "
                    "refused one by the kernel)")
    # The node's policy is the site's (the runner ignores a user's $SLURM_IDLE_CONFIG): the
    # defaults here, rootless podman with mounts under /home, so the work is in the user's home.
    work = Path(tempfile.mkdtemp(prefix="h11-rootless-", dir=pw.pw_dir))
    work.chmod(0o755)
    # A python the user may run with this tree importable (the venv's may live under /root).
    python = sys.executable
    if as_user([python, "-c", "import slurm_idle"], {}).returncode != 0:
        python = str(work / "python")
        site_packages = next(p for p in sys.path if p.endswith("site-packages"))
        Path(python).write_text(f'#!/bin/sh\nexport PYTHONPATH={ROOT}:{site_packages}\n'
                                'exec /usr/bin/python3 "$@"\n')
        Path(python).chmod(0o755)
    env = {"HOME": pw.pw_dir, "SLURM_CONF": str(sandbox.slurm_conf),
           "PATH": "/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin",
           "CONTAINERS_CONF": str(ROOT / "etc" / "podman" / "containers.conf"),
           "CONTAINERS_STORAGE_CONF": str(ROOT / "etc" / "podman" / "storage.conf")}
    rundir = as_user([python, "-c", ("import os; from slurm_idle.podman import runtime_dir; "
                      "print(runtime_dir(os.geteuid(), os.environ))")], env)
    assert rundir.returncode == 0, rundir.stderr
    imported = subprocess.run(
        ["runuser", "-u", USER, "--", "env", *(f"{k}={v}" for k, v in env.items()),
         f"XDG_RUNTIME_DIR={rundir.stdout.strip()}", "podman", "import", "-", IMAGE],
        input=busybox_rootfs_tar(), capture_output=True, timeout=180, check=False)
    assert imported.returncode == 0, imported.stderr
    logs = work / "logs"
    logs.mkdir()
    os.chown(logs, pw.pw_uid, pw.pw_gid)
    yield {"work": work, "env": env, "python": python, "uid": pw.pw_uid, "sandbox": sandbox,
           "rundir": rundir.stdout.strip()}
    shutil.rmtree(work, ignore_errors=True)


def submit_as_user(site: dict[str, Any], name: str, **spec: Any) -> tuple[int, Path]:
    work: Path = site["work"]
    log = work / "logs" / f"{name}-%j.out"
    job = parse_job_spec({"name": name, "image": IMAGE, "grace_s": 5, "warn_s": 0,
                          "log": str(log), **spec})
    script = render_script(job, SubmitOptions(python=site["python"]))
    r = as_user(["sbatch", "--parsable"], site["env"], input=script, cwd=str(work))
    assert r.returncode == 0, r.stderr
    job_id = int(r.stdout.strip().split(";")[0])
    return job_id, work / "logs" / f"{name}-{job_id}.out"


def finished(site: dict[str, Any], job_id: int) -> str:
    out = site["sandbox"].run(["sacct", "-n", "-X", "-P", "-j", str(job_id), "-o", "State,ExitCode"])
    line = out.stdout.strip().splitlines()[0] if out.stdout.strip() else ""
    return line if line and line.split("|")[0] not in {"PENDING", "RUNNING", "REQUEUED"} else ""


def test_an_unprivileged_users_container_job_runs_under_rootless_podman(site: dict[str, Any]) -> None:
    """The job's container ran (root inside its user namespace = the user outside): its output
    file is the user's, and the runner said it used its own rootless podman service."""
    out = site["work"] / "out"
    out.mkdir()
    os.chown(out, site["uid"], site["uid"])
    job_id, log = submit_as_user(
        site, "rootless", command=["sh", "-c", "id -u; echo made-here > /out/result"],
        mounts={"outputs": [{"source": str(out), "target": "/out"}]})
    state = poll(lambda: finished(site, job_id), 180, f"job {job_id} finishing")
    text = log.read_text() if log.exists() else ""
    assert state.startswith("COMPLETED|0:0"), (state, text)
    assert "rootless podman service at unix://" in text, text
    assert (out / "result").read_text() == "made-here\n"
    assert (out / "result").stat().st_uid == site["uid"]


@pytest.mark.parametrize("name, spec, words", [
    ("etc", {"mounts": {"outputs": [{"source": "/etc", "target": "/out"}]}},
     "mount source /etc is outside"),
    ("hostnet", {"network": "host"}, "network 'host' is not allowed"),
])
def test_the_runner_on_the_node_refuses_what_the_site_forbids(
    site: dict[str, Any], name: str, spec: dict[str, Any], words: str
) -> None:
    """Submitted with a hand-rendered script (no `submit` check): the runner refuses, exit 70,
    before any engine is reached."""
    before = sorted(os.listdir("/etc"))
    job_id, log = submit_as_user(site, name, command=["sh", "-c", "echo x > /out/pwned"], **spec)
    state = poll(lambda: finished(site, job_id), 180, f"job {job_id} finishing")
    text = log.read_text() if log.exists() else ""
    assert state.split("|")[0] == "FAILED" and "70" in state, (state, text)
    assert words in text and "rootless podman service" not in text, text
    assert sorted(os.listdir("/etc")) == before


STEPS = 30
#: Counts to STEPS, one step a second, the step reached always on disk; resumes from it.
COUNTER = ("i=0; if [ -f /checkpoint/step ]; then i=$(cat /checkpoint/step); echo resumed_from=$i; fi; "
           "trap 'echo checkpointed at $i; exit 143' TERM; "
           f"while [ $i -lt {STEPS} ]; do i=$((i+1)); echo $i > /checkpoint/step; echo step=$i; "
           "sleep 1; done; echo done steps=$i")


def cli(sb: Any, *args: str) -> None:
    proc = sb.run([sys.executable, "-m", "slurm_idle.cli", *args], capture_output=True, text=True)
    assert proc.returncode == 0, (args, proc.stderr)


def runs_of(site: dict[str, Any], job_id: int) -> list[str]:
    """Every run's State|ExitCode|NodeList in sacct (-D: the requeued runs too)."""
    out = site["sandbox"].run(["sacct", "-n", "-X", "-D", "-P", "-j", str(job_id),
                               "-o", "State,ExitCode,NodeList"])
    return [line for line in out.stdout.splitlines() if line.strip()]


@pytest.mark.slow
def test_a_reclaimed_rootless_podman_job_is_requeued_and_leaves_no_container(
    site: dict[str, Any],
) -> None:
    """`slurm-idle reclaim NODE` of a node running the user's podman job: the container gets
    the SIGTERM (the API service outlives Slurm's signal to the step), the job is requeued
    (never FAILED), resumes from its checkpoint and completes; no container is left."""
    sb = site["sandbox"]
    reset_cluster(sb, load_config(sb.config_path).paths.journal)
    cli(sb, "tick")  # every node serving
    closed = ",".join(getattr(sb, "all_nodes", sb.nodes)[len(sb.nodes):])
    if closed:
        sb.run(["scontrol", "update", f"nodename={closed}", "state=DRAIN",
                "reason=test_rootless_job: the job stays on gpu1"])
    for node in ("gpu2", "gpu3", "gpu4"):
        cli(sb, "pin", node)
    try:
        cli(sb, "lend", "gpu1")
        ckpt = site["work"] / "ckpt"
        ckpt.mkdir()
        os.chown(ckpt, site["uid"], site["uid"])
        job_id, log = submit_as_user(
            site, "reclaimed", command=["sh", "-c", COUNTER], max_restarts=5,
            mounts={"checkpoint": {"source": str(ckpt / "checkpoint-{job_id}"),
                                   "target": "/checkpoint"}})

        def text() -> str:
            return log.read_text() if log.exists() else ""

        poll(lambda: "step=5" in text().splitlines(), 180, f"job {job_id} reaching step 5",
             interval_s=1.0)
        cli(sb, "reclaim", "gpu1")
        poll(lambda: "checkpointed at" in text(), 60, "the container's SIGTERM", interval_s=1.0)
        cli(sb, "lend", "gpu1")
        state = poll(lambda: finished(site, job_id), 240, f"job {job_id} finishing")
        lines = text().splitlines()
        assert state.startswith("COMPLETED|0:0"), "\n".join(
            [state, *runs_of(site, job_id), "--- the job's log:", *lines])
        assert not any(r.startswith("FAILED") for r in runs_of(site, job_id)), runs_of(site, job_id)
        resumed = [int(ln.split("=")[1]) for ln in lines if ln.startswith("resumed_from=")]
        assert resumed and resumed[0] >= 5, lines
        assert f"done steps={STEPS}" in lines, lines
        assert "Traceback" not in text() and "could not signal" not in text(), lines
        left = as_user(["podman", "ps", "-a", "--format", "{{.Names}} {{.Status}}"],
                       {**site["env"], "XDG_RUNTIME_DIR": site["rundir"]})
        assert left.returncode == 0 and left.stdout.strip() == "", (left.stdout, left.stderr)
    finally:
        for node in ("gpu2", "gpu3", "gpu4"):
            cli(sb, "unpin", node)
        if closed:
            sb.run(["scontrol", "update", f"nodename={closed}", "state=RESUME"])
