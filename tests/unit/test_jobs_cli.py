"""The researcher commands' dry runs: what they print, with and without a config."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "etc" / "examples"

CONFIG = """
slurm: {lend_partition: lent, tag: acme}
engine: {kind: command, start_command: "start {node}", stop_command: "stop {node}"}
models: [{name: m, nodes: "gpu[1-2]", url: "http://{node}:8000"}]
job_policy: {allow_root: true, mount_prefixes: [/tmp]}
"""
# These tests run as root and the examples mount /tmp: a site policy that allows both (the
# defaults refuse them: tests/unit/test_job_policy.py).
SITE = """
engine: {kind: command, start_command: "start {node}", stop_command: "stop {node}"}
models: [{name: m, nodes: "gpu[1-2]", url: "http://{node}:8000"}]
job_policy: {allow_root: true, mount_prefixes: [/tmp]}
"""


def site_config(tmp_path: Path) -> Path:
    path = tmp_path / "site.yaml"
    path.write_text(SITE)
    return path


def cli(*args: str, config: Path | None = None) -> subprocess.CompletedProcess[str]:
    # HOME under /tmp: the demo example writes under `~`, and the site policy allows /tmp.
    env = {**{k: v for k, v in os.environ.items() if k != "SLURM_IDLE_CONFIG"},
           "HOME": "/tmp/slurm-idle-test-home"}
    argv = [sys.executable, "-m", "slurm_idle.cli"]
    if config:
        argv += ["--config", str(config)]
    return subprocess.run([*argv, *args], capture_output=True, text=True, env=env, timeout=60,
                          check=False)


def test_submit_dry_run_prints_the_script_and_submits_nothing(tmp_path: Path) -> None:
    """`submit --dry-run` prints the batch script (idle partition by default), exit 0."""
    r = cli("submit", "--dry-run", str(EXAMPLES / "demo-job.yaml"), config=site_config(tmp_path))
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("#!/bin/bash\n") and "#SBATCH --partition=idle" in r.stdout
    assert f"srun --ntasks=1 --kill-on-bad-exit=1 {sys.executable} -m slurm_idle.job_step" in r.stdout


def test_submit_takes_partition_and_tag_from_the_config(tmp_path: Path) -> None:
    """With a config, the lend partition and tag are the config's."""
    cfg = tmp_path / "c.yaml"
    cfg.write_text(CONFIG)
    r = cli("submit", "--dry-run", "--json", str(EXAMPLES / "demo-job.yaml"), config=cfg)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert "--partition=lent" in doc["sbatch_args"] and "--comment=acme:job" in doc["sbatch_args"]


def test_pipeline_dry_run_json_has_exactly_the_documented_keys(tmp_path: Path) -> None:
    """`pipeline run --dry-run --json` -> {"steps":[{"name","depends_on","sbatch_args"}]}."""
    r = cli("pipeline", "run", "--dry-run", "--json", str(EXAMPLES / "pipeline.yaml"),
            config=site_config(tmp_path))
    assert r.returncode == 0, r.stderr
    steps = json.loads(r.stdout)["steps"]
    assert [s["name"] for s in steps] == ["pre-process", "pre-train", "sft", "rl", "eval"]
    assert all(set(s) == {"name", "depends_on", "sbatch_args"} for s in steps)


def test_bad_spec_is_one_line_and_exit_2(tmp_path: Path) -> None:
    """An invalid spec is reported on one line with exit 2, no traceback."""
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nimage: a\nbogus: 1\n")
    r = cli("submit", "--dry-run", str(bad))
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0
    assert "unknown key 'bogus'" in r.stderr and "Traceback" not in r.stderr


def test_submit_warns_when_grace_outlasts_the_sites_requeue_grace(tmp_path: Path) -> None:
    """A grace_s the reclaim will not wait for is named on stderr; the dry run still renders."""
    from click.testing import CliRunner

    from slurm_idle.cli import main as cli_main

    cfg = tmp_path / "site.yaml"
    cfg.write_text(Path("etc/slurm-idle.yaml").read_text().replace(
        "requeue_grace_s: 30", "requeue_grace_s: 10").replace(
        "allow_root: false", "allow_root: true"))  # these tests run as root
    res = CliRunner().invoke(cli_main, ["--config", str(cfg), "submit", "--dry-run",
                                        "etc/examples/train-job.yaml"])
    assert res.exit_code == 0, res.output
    assert "warning" in res.stderr and "grace_s 25" in res.stderr and "10" in res.stderr
    assert "#SBATCH" in res.stdout


def test_pipeline_params_and_matrix_in_the_dry_run(tmp_path: Path) -> None:
    """-p overrides reach the steps; the matrix example fans out into 3 train jobs; a bad
    -p is one line and exit 2."""
    site = site_config(tmp_path)
    r = cli("pipeline", "run", "--dry-run", "--json", "-p", "lr=1e-4",
            str(EXAMPLES / "sweep.yaml"), config=site)
    assert r.returncode == 0, r.stderr
    steps = json.loads(r.stdout)["steps"]
    assert [s["name"] for s in steps] == ["prep", "train-0", "train-1", "train-2", "eval"]
    assert steps[-1]["depends_on"] == ["train-0", "train-1", "train-2"]
    r = cli("pipeline", "run", "--dry-run", "-p", "nope=1", str(EXAMPLES / "sweep.yaml"),
            config=site)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1
    assert "unknown pipeline parameter" in r.stderr


def test_web_without_the_extra_or_with_help() -> None:
    """`web --help` documents the safe default bind and the missing-login caveat."""
    r = cli("web", "--help")
    assert r.returncode == 0 and "127.0.0.1" in r.stdout and "SSO" in r.stdout


def test_jobs_without_accounting_lists_the_queue_and_says_why(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """sacct failing (no slurmdbd): the queue's jobs are listed, unknown counts as `-` (text)
    and null (JSON), a warning says why, exit 0; -u and --all filter by user."""
    from click.testing import CliRunner

    from slurm_idle.cli import jobs_cmd
    from slurm_idle.cli import main as cli_main
    from slurm_idle.model import SlurmJob
    from slurm_idle.testing.fakes import FakeSlurm

    me = jobs_cmd._me()
    fake = FakeSlurm(job_list=[
        SlurmJob(job_id=5, name="mine", partition="idle", state="PENDING", user=me,
                 state_reason="Resources"),
        SlurmJob(job_id=6, name="theirs", partition="idle", state="RUNNING", user="zed")],
        fail_on={"accounting"})
    monkeypatch.setattr(jobs_cmd, "_slurm", lambda cfg: fake)
    monkeypatch.setenv("SLURM_IDLE_STATE_DIR", str(tmp_path / "state"))
    cfg = site_config(tmp_path)
    res = CliRunner().invoke(cli_main, ["--config", str(cfg), "jobs"])
    assert res.exit_code == 0, res.output
    assert "listing the queue only" in res.stderr
    assert "mine" in res.stdout and "theirs" not in res.stdout and "Resources" in res.stdout
    res = CliRunner().invoke(cli_main, ["--config", str(cfg), "jobs", "--all", "--json"])
    doc = json.loads(res.stdout)
    rows = {r["job_id"]: r for r in doc["jobs"]}
    assert sorted(rows) == [5, 6] and doc["accounting"].startswith("no job history")
    assert rows[5]["runs"] is None and rows[5]["preemptions"] is None
    assert rows[6]["reason"] is None and doc["until"] is None
