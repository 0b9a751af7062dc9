"""The runner takes the job policy from the site's config only, never from a path the job's
environment names: a root-owned permissive config (an example, a test sandbox's) lying on the
node let a user's job pass the host network and /tmp mounts."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from slurm_idle.jobpolicy import ignored_config_env, trusted_config_path
from slurm_idle.runner import EXIT_START_FAILED, Signals
from slurm_idle.runner import cli as runner

USER = 1000
PERMISSIVE = ("engine: {kind: command, start_command: s, stop_command: t}\n"
              "models: [{name: m, nodes: gpu1}]\n"
              "job_policy: {mount_prefixes: [/tmp], networks: [none, host]}\n")
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="a root-owned config needs root")


def _root_config(tmp_path: Path) -> Path:
    cfg = tmp_path / "permissive.yaml"
    cfg.write_text(PERMISSIVE)
    cfg.chmod(0o644)
    tmp_path.chmod(0o755)
    return cfg


@needs_root
def test_a_users_job_cannot_name_a_root_owned_permissive_config(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfdbinary: pytest.CaptureFixture[bytes]
) -> None:
    """A user's job with $SLURM_IDLE_CONFIG at a root-owned config allowing the host network:
    the runner warns that it ignores it and refuses the spec (exit 70) on the site's policy."""
    cfg = _root_config(tmp_path)
    started: list[Any] = []
    monkeypatch.setattr(runner, "_client", lambda *a, **k: object())
    monkeypatch.setattr(runner, "run_container", lambda *a, **k: started.append(a) or 0)
    monkeypatch.setenv("SLURM_IDLE_CONFIG", str(cfg))
    monkeypatch.setattr(os, "geteuid", lambda: USER)
    job = tmp_path / "job.yaml"
    job.write_text("name: j\nimage: img:1\nnetwork: host\n")
    assert runner._main(["--spec", str(job), "--docker-host", "unix:///nowhere"],
                        Signals()) == EXIT_START_FAILED
    assert not started
    out = capfdbinary.readouterr().out.decode()
    assert f"warning: $SLURM_IDLE_CONFIG={cfg} ignored" in out
    assert "network 'host' is not allowed" in out


@needs_root
def test_the_site_names_the_runners_config_in_a_root_owned_file(tmp_path: Path) -> None:
    """runner.conf (root's) names the config for every job; a user's env changes nothing."""
    cfg = _root_config(tmp_path)
    conf = tmp_path / "runner.conf"
    conf.write_text(f"{cfg}\n")
    conf.chmod(0o644)
    env = {"SLURM_IDLE_CONFIG": "/tmp/elsewhere.yaml"}
    assert trusted_config_path(env, uid=USER, runner_conf=str(conf)) == str(cfg)
    assert "ignored" in (ignored_config_env(env, uid=USER, runner_conf=str(conf)) or "")
    assert ignored_config_env({"SLURM_IDLE_CONFIG": str(cfg)}, uid=USER,
                              runner_conf=str(conf)) is None
    conf.chmod(0o666)  # anyone could have written it: not the site's word
    assert trusted_config_path(env, uid=USER, runner_conf=str(conf)) != str(cfg)


@needs_root
def test_roots_own_job_may_name_its_config(tmp_path: Path) -> None:
    """A job of root's (the test sandbox's) follows $SLURM_IDLE_CONFIG: root's env is root's."""
    cfg = _root_config(tmp_path)
    env = {"SLURM_IDLE_CONFIG": str(cfg)}
    assert trusted_config_path(env, uid=0, runner_conf=str(tmp_path / "none")) == str(cfg)
    assert ignored_config_env(env, uid=0, runner_conf=str(tmp_path / "none")) is None


@needs_root
def test_a_site_config_others_could_write_is_refused(tmp_path: Path) -> None:
    """The site's own config must be root's and writable by root only: else no policy (an
    error, exit 70 in the runner), not the looser defaults nor its possibly forged content."""
    from slurm_idle.errors import ConfigError
    from slurm_idle.jobpolicy import site_policy

    cfg = _root_config(tmp_path)
    conf = tmp_path / "runner.conf"
    conf.write_text(f"{cfg}\n")
    assert site_policy({}, uid=USER, runner_conf=str(conf)).networks == ("none", "host")
    cfg.chmod(0o664)
    with pytest.raises(ConfigError, match="writable by group or others"):
        site_policy({}, uid=USER, runner_conf=str(conf))
