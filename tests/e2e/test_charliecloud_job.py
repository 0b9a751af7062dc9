"""A demo job under `job_policy.runtime: charliecloud` on the real sandbox, through a reclaim.

The image directory is exported from the demo image built locally in the sandbox's dockerd (no
registry). The node's policy for this job is a copy of the sandbox's config with the runtime
set to charliecloud, named by $SLURM_IDLE_CONFIG: the job is root's, whose environment the
runner follows (a user's would be ignored, and the machine's own /etc/slurm-idle is not a
test's to write). ch-run needs a user namespace, refused inside a chroot (`scripts/test --debian
13`): skipped there, saying so.
"""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from slurm_idle.charliecloud import CharliecloudClient
from slurm_idle.config import load_config
from slurm_idle.jobs import parse_job_spec
from slurm_idle.runner import Reporter, RunSettings, Signals, SlurmContext, run_container
from slurm_idle.testing.demo import reset_cluster
from slurm_idle.testing.images import DEMO_IMAGE, build_demo_image, export_image_dir
from slurm_idle.testing.waiting import poll

pytestmark = pytest.mark.sandbox

EXAMPLE = Path(__file__).resolve().parents[2] / "etc" / "examples" / "demo-job.yaml"
STEPS = 30


@pytest.fixture(scope="module")
def site(request: pytest.FixtureRequest) -> Iterator[dict[str, Any]]:
    if os.geteuid() != 0 or shutil.which("ch-run") is None:
        pytest.skip("needs root and ch-run (apt-get install charliecloud)")
    userns = subprocess.run(["unshare", "--user", "--map-root-user", "--net", "true"],
                            capture_output=True, text=True, timeout=30, check=False)
    if userns.returncode != 0:
        pytest.skip(f"ch-run cannot run here: no user namespace ({userns.stderr.strip()}; a "
                    "chroot, e.g. scripts/test --debian 13, is refused one by the kernel)")
    import docker

    sb: Any = request.getfixturevalue("sandbox")
    work = Path(tempfile.mkdtemp(prefix="slurm-idle-ch-e2e-"))
    work.chmod(0o755)  # the runner trusts a config only in a directory root alone may write
    client = docker.DockerClient(base_url=sb.docker_host, timeout=120)
    try:  # the work dir goes also when the build or the export fails
        build_demo_image(client)
        export_image_dir(client, DEMO_IMAGE, work / "images", force=True)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    finally:
        client.close()
    doc = yaml.safe_load(Path(sb.config_path).read_text())
    doc["job_policy"] = {**doc["job_policy"], "runtime": "charliecloud",
                         "charliecloud_images": str(work / "images")}
    config = work / "charliecloud.yaml"
    config.write_text(yaml.safe_dump(doc, sort_keys=False))
    config.chmod(0o644)
    yield {"sandbox": sb, "work": work, "config": config}
    shutil.rmtree(work, ignore_errors=True)


def demo_spec(work: Path, **params: Any) -> dict[str, Any]:
    spec = yaml.safe_load(EXAMPLE.read_text())
    spec["params"] = {**spec["params"], "steps": STEPS, **params}
    spec["mounts"]["checkpoint"]["source"] = str(work / "checkpoint-{job_id}")
    spec["log"] = str(work / "demo-%j.out")
    return spec


def uninterrupted_result(site: dict[str, Any]) -> str:
    """The last line of the same job run straight through ch-run (faster steps: pace is not
    output)."""
    spec = parse_job_spec(demo_spec(site["work"] / "ref", step_s=0.05))
    out = io.BytesIO()
    client = CharliecloudClient(str(site["work"] / "images"), "root")
    code = run_container(client, spec, SlurmContext(job_id="reference"),
                         RunSettings(grace_s=5, engine="charliecloud", pull="never"),
                         Signals(), Reporter(out))
    lines = [x for x in out.getvalue().decode().splitlines() if x.startswith("done ")]
    assert code == 0 and lines, out.getvalue().decode()
    return lines[-1]


def cli(sb: Any, *args: str, **env: str) -> str:
    proc = sb.run([sys.executable, "-m", "slurm_idle.cli", *args], env=env)
    assert proc.returncode == 0, (args, proc.stderr)
    return str(proc.stdout)


def runs_of(sb: Any, job_id: int) -> list[str]:
    """Every run's State|ExitCode|NodeList in sacct (-D: the requeued runs too)."""
    out = sb.run(["sacct", "-n", "-X", "-D", "-P", "-j", str(job_id), "-o",
                  "State,ExitCode,NodeList"])
    return [line for line in out.stdout.splitlines() if line.strip()]


def finished(sb: Any, job_id: int) -> str:
    out = sb.run(["sacct", "-n", "-X", "-P", "-j", str(job_id), "-o", "State,ExitCode"])
    line = out.stdout.strip().splitlines()[0] if out.stdout.strip() else ""
    return line if line and line.split("|")[0] not in {"PENDING", "RUNNING", "REQUEUED"} else ""


@pytest.mark.slow
def test_a_reclaimed_charliecloud_job_is_requeued_and_finishes_like_an_uninterrupted_run(
    site: dict[str, Any],
) -> None:
    """The demo under ch-run on a lent node; `slurm-idle reclaim` SIGTERMs it, its trap
    checkpoints, the job is requeued (never FAILED or CANCELLED), resumes from its checkpoint
    and ends with the line an uninterrupted run ends with."""
    sb = site["sandbox"]
    expected = uninterrupted_result(site)
    reset_cluster(sb, load_config(sb.config_path).paths.journal)
    cli(sb, "tick")  # every node serving
    closed = ",".join(getattr(sb, "all_nodes", sb.nodes)[len(sb.nodes):])
    if closed:
        sb.run(["scontrol", "update", f"nodename={closed}", "state=DRAIN",
                "reason=test_charliecloud_job: the job stays on gpu1"])
    for node in ("gpu2", "gpu3", "gpu4"):
        cli(sb, "pin", node)
    try:
        cli(sb, "lend", "gpu1")
        path = site["work"] / "job.yaml"
        path.write_text(yaml.safe_dump(demo_spec(site["work"])))
        job_id = int(json.loads(cli(sb, "submit", "--json", str(path),
                                    SLURM_IDLE_CONFIG=str(site["config"]),
                                    SLURM_IDLE_STATE_DIR=str(site["work"] / "state")))["job_id"])
        log = site["work"] / f"demo-{job_id}.out"

        def text() -> str:
            return log.read_text() if log.exists() else ""

        poll(lambda: "step=5" in text().splitlines(), 180, f"job {job_id} reaching step 5",
             interval_s=1.0)
        cli(sb, "reclaim", "gpu1")
        poll(lambda: "preempted at step=" in text(), 60, "the workload's SIGTERM", interval_s=1.0)
        cli(sb, "lend", "gpu1")
        state = poll(lambda: finished(sb, job_id), 240, f"job {job_id} finishing")
        lines = text().splitlines()
        runs = runs_of(sb, job_id)
        assert state.startswith("COMPLETED|0:0"), "\n".join([state, *runs, "--- log:", *lines])
        assert not any(r.split("|")[0] in {"FAILED", "CANCELLED"} for r in runs), runs
        assert "rootless podman" not in text() and "pulling" not in text(), lines
        resumed = [int(m) for m in re.findall(r"resumed_from=(\d+)", text())]
        assert resumed and resumed[0] >= 5, lines
        assert [x for x in lines if x.startswith("done ")] == [expected], lines
        assert "Traceback" not in text() and "could not signal" not in text(), lines
    finally:
        for node in ("gpu2", "gpu3", "gpu4"):
            cli(sb, "unpin", node)
        if closed:
            sb.run(["scontrol", "update", f"nodename={closed}", "state=RESUME"])


@pytest.mark.slow
def test_the_time_limit_warning_requeues_a_charliecloud_job_instead_of_timing_out(
    site: dict[str, Any],
) -> None:
    """A 1-minute job warned by SIGUSR1 (warn_s): Slurm's warning reaches the runner and, the
    workload being a process of the step, the workload too; either way the job is requeued
    (never TIMEOUT or FAILED), resumes from a checkpoint and finishes in a later run."""
    sb = site["sandbox"]
    reset_cluster(sb, load_config(sb.config_path).paths.journal)
    # slurmctld checks warning signals about every 30 s: 40 steps outlast the first check.
    spec = {**demo_spec(site["work"], steps=40), "time": "1", "warn_s": 55}
    spec["log"] = str(site["work"] / "limit-%j.out")
    path = site["work"] / "limit.yaml"
    path.write_text(yaml.safe_dump(spec))
    job_id = int(json.loads(cli(sb, "submit", "--json", str(path),
                                SLURM_IDLE_CONFIG=str(site["config"]),
                                SLURM_IDLE_STATE_DIR=str(site["work"] / "state")))["job_id"])
    log = site["work"] / f"limit-{job_id}.out"
    state = poll(lambda: finished(sb, job_id), 240, f"job {job_id} finishing")
    text = log.read_text() if log.exists() else ""
    runs = runs_of(sb, job_id)
    assert state.startswith("COMPLETED|0:0"), "\n".join([state, *runs, "--- log:", text])
    assert len(runs) >= 2 and not any(
        r.split("|")[0] in {"FAILED", "CANCELLED", "TIMEOUT"} for r in runs), runs
    assert "requeueing job" in text, text
    print("MEASURE charliecloud time-limit warning:", *[
        ln for ln in text.splitlines() if "SIGUSR1" in ln or "stop signal came" in ln
        or "exited with code" in ln or "stopped with code" in ln or "resumed_from" in ln])
    assert int(re.findall(r"resumed_from=(\d+)", text)[0]) > 0, text
    assert [x for x in text.splitlines() if x.startswith("done ")] == ["done steps=40 sum=820"]
