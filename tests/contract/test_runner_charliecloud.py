"""The runner over the real `ch-run` (charliecloud.py), as an unprivileged user (uid 65534).

The image directories are exported from the demo and busybox images built locally in the
sandbox's dockerd (slurm_idle.testing.images: `docker export` of a container, unpacked, its
config kept in ch/config.pulled.json): no registry, nothing off the machine. The runner is
driven in-process by a small script run as the user (the node's policy is the site's, which a
test cannot write for a user on a shared machine: the policy's own path is tested in unit tests).
ch-run needs a user namespace, which the kernel refuses inside a chroot (`scripts/test --debian
13`): these tests skip there, saying so.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from slurm_idle.jobs import EXIT_PREEMPTED
from slurm_idle.runner import EXIT_START_FAILED
from slurm_idle.testing.images import BUSYBOX_IMAGE, DEMO_IMAGE, build_demo_image, export_image_dir

ROOT = Path(__file__).resolve().parents[2]
UID = 65534
#: The runner over ch-run, as the user: spec file, images root, grace; exits with its code.
DRIVER = """
import os, sys
from slurm_idle.charliecloud import CharliecloudClient
from slurm_idle.jobs import load_job_spec
from slurm_idle.runner import Reporter, RunSettings, Signals, run_container, slurm_context
signals = Signals()
signals.install()
settings = RunSettings(grace_s=float(sys.argv[3]), engine="charliecloud", pull="never", poll_s=0.05)
client = CharliecloudClient(sys.argv[2], os.environ["USER"])
sys.exit(run_container(client, load_job_spec(sys.argv[1]), slurm_context(os.environ), settings,
                       signals, Reporter(sys.stdout.buffer)))
"""


def as_user(argv: list[str]) -> list[str]:
    return ["setpriv", f"--reuid={UID}", f"--regid={UID}", "--clear-groups", *argv]


@pytest.fixture(scope="module")
def site(request: pytest.FixtureRequest) -> Iterator[dict[str, Any]]:
    if os.geteuid() != 0 or not all(shutil.which(p) for p in ("ch-run", "setpriv", "unshare")):
        pytest.skip("needs root (to act as uid 65534), ch-run (apt-get install charliecloud), "
                    "setpriv and unshare")
    userns = subprocess.run(as_user(["unshare", "--user", "--map-root-user", "--net", "true"]),
                            capture_output=True, text=True, timeout=30, check=False)
    if userns.returncode != 0:
        pytest.skip(f"ch-run cannot run here: no user namespace for uid {UID} "
                    f"({userns.stderr.strip()}; a chroot, e.g. scripts/test --debian 13, is "
                    "refused one by the kernel)")
    import docker

    sandbox: Any = request.getfixturevalue("sandbox")
    work = Path(tempfile.mkdtemp(prefix="slurm-idle-ch-"))
    work.chmod(0o755)
    client = docker.DockerClient(base_url=sandbox.docker_host, timeout=120)
    try:  # the work dir goes also when the build or the export fails
        build_demo_image(client)
        for tag in (BUSYBOX_IMAGE, DEMO_IMAGE):
            export_image_dir(client, tag, work / "images", force=True)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    finally:
        client.close()
    # A python the user may run with this tree importable (the venv's may live under /root).
    site_packages = next(p for p in sys.path if p.endswith("site-packages"))
    reachable = subprocess.run(as_user(["env", "-i", sys.executable, "-c", "pass"]),
                               capture_output=True, timeout=60, check=False).returncode == 0
    python = sys.executable if reachable else "/usr/bin/python3"
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "USER": "nobody", "HOME": "/nonexistent",
           "PYTHONPATH": f"{ROOT}:{site_packages}", "SLURMD_NODENAME": "gpu9",
           "SLURM_JOB_ID": "ch1", "CUDA_VISIBLE_DEVICES": "1", "SLURM_JOB_GPUS": "1",
           "DOCKER_HOST": sandbox.docker_host}
    yield {"work": work, "images": work / "images", "python": python, "env": env}
    shutil.rmtree(work, ignore_errors=True)


def user_dir(site: dict[str, Any], name: str) -> Path:
    d = site["work"] / name
    d.mkdir()
    os.chown(d, UID, UID)
    return d


def runner(site: dict[str, Any], name: str, grace_s: float = 5, **spec: Any) -> subprocess.Popen[str]:
    path = site["work"] / f"{name}.yaml"
    path.write_text(yaml.safe_dump({"name": name, **spec}))
    argv = [site["python"], "-c", DRIVER, str(path), str(site["images"]), str(grace_s)]
    return subprocess.Popen(as_user(["env", "-i", *(f"{k}={v}" for k, v in site["env"].items()),
                                     *argv]),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_the_workload_runs_as_the_caller_with_writable_outputs_read_only_inputs_no_network(
        site: dict[str, Any]) -> None:
    """uid 65534 inside and out (ch-run is unprivileged); the output mount is writable and
    its file the user's, the input (the user's own, writable outside) is read-only inside;
    only a loopback, up, in the network namespace; GPUs by environment;
    nothing of the runner's environment (DOCKER_HOST) inside."""
    out = user_dir(site, "out")
    data = user_dir(site, "data")
    (data / "f").write_text("input\n")
    os.chown(data / "f", UID, UID)
    script = ("echo uid=$(id -u) gid=$(id -g); id -u > /checkpoint/uid; "
              "echo x > /mnt/g 2>/dev/null && echo in=rw || echo in=ro; cat /mnt/f; "
              "echo nets=$(tail -n +3 /proc/net/dev | cut -d: -f1 | tr -d ' ' | tr '\\n' ,); "
              "ip link show lo | grep -q ',UP' && echo lo=up; "
              "echo cuda=$CUDA_VISIBLE_DEVICES nv=$NVIDIA_VISIBLE_DEVICES host=${DOCKER_HOST:-none}; "
              "exit 5")
    proc = runner(site, "who", image=BUSYBOX_IMAGE, command=["/bin/sh", "-c", script],
                  mounts={"outputs": [{"source": str(out), "target": "/checkpoint"}],
                          "inputs": [{"source": str(data), "target": "/mnt"}]})
    log, _ = proc.communicate(timeout=60)
    assert proc.returncode == 5, log
    assert f"uid={UID} gid={UID}" in log and "nets=lo," in log and "lo=up" in log, log
    assert "cuda=1 nv=1 host=none" in log, log
    assert "in=ro" in log and "input" in log and not (data / "g").exists(), log
    assert (out / "uid").read_text() == f"{UID}\n" and (out / "uid").stat().st_uid == UID


def test_sigterm_reaches_the_workloads_trap_and_the_runner_exits_143(site: dict[str, Any]) -> None:
    """The demo image's own entrypoint (from its exported config) checkpoints on the SIGTERM
    the runner forwards, at once: exit 143 well inside the grace, the step on disk."""
    ck = user_dir(site, "ck")
    proc = runner(site, "demo", grace_s=20, image=DEMO_IMAGE,
                  params={"steps": 600, "step_s": 0.2, "checkpoint_every": 1000},
                  mounts={"checkpoint": {"source": str(ck), "target": "/checkpoint"}})
    assert proc.stdout is not None
    seen = ""
    deadline = time.monotonic() + 60
    while "step=3\n" not in seen and time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        seen += line
    assert "step=3\n" in seen, seen
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    rest, _ = proc.communicate(timeout=30)
    elapsed = time.monotonic() - t0
    assert proc.returncode == EXIT_PREEMPTED, seen + rest
    assert "preempted at step=" in rest and "container stopped with code 143" in rest, rest
    assert int((ck / "state").read_text().split()[0]) >= 3
    assert elapsed < 5, f"stop took {elapsed:.1f}s"


def test_a_missing_image_directory_fails_70_in_one_line(site: dict[str, Any]) -> None:
    """Before anything runs: the image, the node, its directory and how to make it."""
    proc = runner(site, "absent", image="slurm-idle/absent:1", command=["true"])
    log, _ = proc.communicate(timeout=60)
    assert proc.returncode == EXIT_START_FAILED, log
    (line,) = [ln for ln in log.splitlines() if "could not run" in ln]
    assert "image slurm-idle/absent:1 is not on node gpu9" in line, line
    assert str(site["images"] / "slurm-idle%absent+1") in line and "ch-convert" in line, line
