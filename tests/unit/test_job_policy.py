"""The site's job policy (issue 11, item 5): a job spec cannot reach outside its mounts.

Before: `outputs: /etc` and `log: /etc/cron.d/x` were accepted (a root-submitted container
wrote into the host's /etc) and `network: host` let a job reach Prometheus and the engines.
Checked at submit (exit 2, one line) and again by the runner on the node.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from slurm_idle.config import JobPolicyConfig, parse_config
from slurm_idle.errors import ConfigError
from slurm_idle.jobpolicy import check_spec, site_policy, trusted_config_path
from slurm_idle.jobs import parse_job_spec
from slurm_idle.runner import EXIT_START_FAILED, Signals
from slurm_idle.runner import cli as runner

USER = 1000
POLICY = JobPolicyConfig(mount_prefixes=("/scratch",))


def spec(**extra: Any):
    return parse_job_spec({"name": "j", "image": "img:1", **extra})


def out(source: str) -> dict[str, Any]:
    return {"outputs": [{"source": source, "target": "/out"}]}


@pytest.mark.parametrize("extra, words", [
    ({"mounts": out("/etc")}, "mount source /etc is outside"),
    ({"mounts": out("/scratch/../etc")}, "outside"),
    ({"mounts": out("/scratchy/x")}, "outside"),
    ({"mounts": {"inputs": [{"source": "/usr", "target": "/in"}]}}, "outside"),
    ({"mounts": {"checkpoint": {"source": "/root/ck", "target": "/ck"}}}, "outside"),
    ({"log": "/etc/cron.d/x"}, "log /etc/cron.d/x is outside"),
    ({"network": "host"}, "network 'host' is not allowed"),
])
def test_what_the_site_does_not_allow_is_refused(extra: dict[str, Any], words: str) -> None:
    with pytest.raises(ConfigError) as err:
        check_spec(spec(**extra), POLICY, USER, cwd="/scratch/u")
    assert words in str(err.value) and "\n" not in str(err.value)


def test_root_may_not_submit_unless_the_site_allows_it() -> None:
    with pytest.raises(ConfigError, match="may not run as root"):
        check_spec(spec(), POLICY, 0)
    check_spec(spec(), JobPolicyConfig(allow_root=True), 0)


def test_what_the_site_allows_passes() -> None:
    check_spec(spec(mounts={**out("/scratch/u/run"),
                            "checkpoint": {"source": "/scratch/u/ck-{job_id}", "target": "/ck"}},
                    log="/scratch/u/logs/%j.out"), POLICY, USER, cwd="/scratch/u")
    check_spec(spec(network="host"), JobPolicyConfig(networks=("none", "host")), USER, cwd="/home/u")


def test_a_relative_log_lands_in_the_submit_directory() -> None:
    check_spec(spec(log="x.out"), POLICY, USER, cwd="/scratch/u")
    with pytest.raises(ConfigError, match="log /etc/x.out"):
        check_spec(spec(log="x.out"), POLICY, USER, cwd="/etc")


def test_the_runner_resolves_symlinks_under_an_allowed_prefix(tmp_path: Path) -> None:
    """`/scratch/u/link -> /etc` passes the text check, not the runner's resolved one."""
    allowed = tmp_path / "scratch"
    allowed.mkdir()
    (allowed / "link").symlink_to("/etc")
    policy = JobPolicyConfig(mount_prefixes=(str(allowed),))
    sp = spec(mounts=out(str(allowed / "link")))
    check_spec(sp, policy, USER)
    with pytest.raises(ConfigError, match="really /etc"):
        check_spec(sp, policy, USER, resolve=True)


def test_defaults_are_safe() -> None:
    p = JobPolicyConfig()
    assert p.networks == ("none",) and not p.allow_root and p.runtime == "podman"
    assert "/" not in p.mount_prefixes and "/etc" not in p.mount_prefixes


@pytest.mark.parametrize("prefix", ["/", "etc", "/data/../etc", "/data/"])
def test_a_prefix_must_be_a_clean_absolute_directory(prefix: str) -> None:
    with pytest.raises(ConfigError, match="mount prefix"):
        parse_config("engine: {kind: command, start_command: s, stop_command: t}\n"
                     "models: [{name: m, nodes: gpu1}]\n"
                     f"job_policy: {{mount_prefixes: ['{prefix}']}}\n", "c.yaml")


def test_submit_refuses_outputs_in_etc_in_one_line(tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("engine: {kind: command, start_command: s, stop_command: t}\n"
                   "models: [{name: m, nodes: gpu1}]\n"
                   f"job_policy: {{mount_prefixes: ['{tmp_path}'], allow_root: true}}\n")
    for extra, words in (("mounts: {outputs: [{source: /etc, target: /out}]}", "/etc"),
                         ("log: /etc/cron.d/x", "/etc/cron.d/x"),
                         ("network: host", "network 'host'")):
        job = tmp_path / "job.yaml"
        job.write_text(f"name: j\nimage: img:1\n{extra}\n")
        proc = subprocess.run([sys.executable, "-m", "slurm_idle.cli", "--config", str(cfg),
                               "submit", "--dry-run", str(job)], capture_output=True, text=True,
                              timeout=60, check=False, cwd=tmp_path)
        assert proc.returncode == 2, proc.stdout + proc.stderr
        (line,) = proc.stderr.strip().splitlines()
        assert words in line and "Traceback" not in line


def test_the_runner_refuses_what_the_nodes_policy_forbids(tmp_path: Path, monkeypatch, capfdbinary) -> None:
    """A hand-written batch script can skip `submit`: the runner on the node refuses to start
    a container whose spec breaks the node's policy (exit 70), before any engine call."""
    started: list[Any] = []
    monkeypatch.setattr(runner, "_client", lambda *a, **k: object())
    monkeypatch.setattr(runner, "run_container", lambda *a, **k: started.append(a) or 0)
    monkeypatch.setattr(runner, "site_policy", lambda env: POLICY)
    job = tmp_path / "job.yaml"
    job.write_text("name: j\nimage: img:1\nmounts: {outputs: [{source: /etc, target: /out}]}\n")
    monkeypatch.setattr(os, "geteuid", lambda: USER)
    assert runner._main(["--spec", str(job)], Signals()) == EXIT_START_FAILED
    assert not started
    assert b"outside the allowed prefixes" in capfdbinary.readouterr().out


def test_the_runner_trusts_only_a_root_owned_config(tmp_path: Path) -> None:
    """$SLURM_IDLE_CONFIG is the user's to set: a config they wrote (or could write) is not
    the node's policy."""
    cfg = tmp_path / "c.yaml"
    cfg.write_text("engine: {kind: command, start_command: s, stop_command: t}\n"
                   "models: [{name: m, nodes: gpu1}]\n"
                   "job_policy: {allow_root: true, networks: [none, host]}\n")
    cfg.chmod(0o644)
    if os.geteuid() == 0:
        assert trusted_config_path({"SLURM_IDLE_CONFIG": str(cfg)}) == str(cfg)
        assert site_policy({"SLURM_IDLE_CONFIG": str(cfg)}).allow_root
    cfg.chmod(0o666)
    assert trusted_config_path({"SLURM_IDLE_CONFIG": str(cfg)}) != str(cfg)
    os.chown(cfg, 65534, 65534) if os.geteuid() == 0 else None
    cfg.chmod(0o644)
    assert trusted_config_path({"SLURM_IDLE_CONFIG": str(cfg)}) != str(cfg)
