"""The site's job policy (config `job_policy`) applied to a job spec, at submit and on the node.

`submit` checks the spec as written (exit 2, one line). The runner checks it again on the node
before it starts anything, with the mount sources resolved (a symlink under an allowed prefix
that points to /etc is outside it), against the policy of the node's own config: the batch
script is the user's to edit, the node's config is not. Which config the runner trusts: the
site's, never one the job's environment names: the path in RUNNER_CONF when root wrote it,
else the system path; without any, the safe defaults. The site's config itself must be root's
and writable by root only (and its directory), else the job is refused. $SLURM_IDLE_CONFIG
counts only in a job of root's (root's environment is root's own: the test sandbox runs its
jobs so); any other job's is ignored with a warning in the job log. Checking that root owns
the file it names was not enough: a root-owned permissive config (an example, a test
sandbox's in /tmp) exists on many nodes, and naming it let a user's job pass the host network
and /tmp mounts.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Mapping
from pathlib import Path

from slurm_idle.config import (
    CONFIG_ENV,
    DEFAULT_CONFIG_PATH,
    Config,
    JobPolicyConfig,
    load_config,
)
from slurm_idle.errors import ConfigError
from slurm_idle.jobs import JobSpec


def _under(path: str, prefixes: tuple[str, ...]) -> bool:
    return any(path == p or path.startswith(p.rstrip("/") + "/") for p in prefixes)


def _clean(path: str) -> str | None:
    """The normalised absolute path, or None if it climbs with `..` (never allowed)."""
    if ".." in path.split("/"):
        return None
    return os.path.normpath(path)


def check_spec(
    spec: JobSpec,
    policy: JobPolicyConfig,
    uid: int,
    *,
    cwd: str | None = None,
    resolve: bool = False,
) -> None:
    """Raise ConfigError naming the first thing `spec` asks that the site does not allow.

    `cwd`: where a relative `log:` lands (the submit directory); None skips relative logs.
    `resolve`: check mount sources by their real path too (the runner, on the node).
    """
    where = f"job {spec.name!r}"
    if uid == 0 and not policy.allow_root:
        raise ConfigError(
            f"{where}: jobs may not run as root on this site (job_policy.allow_root): submit as "
            "your own user"
        )
    if spec.network not in policy.networks:
        raise ConfigError(
            f"{where}: network {spec.network!r} is not allowed here (job_policy.networks: "
            f"{', '.join(policy.networks)}); the host network reaches the node's services"
        )
    mounts = [*spec.mounts.inputs, *spec.mounts.outputs]
    if spec.mounts.checkpoint:
        mounts.append(spec.mounts.checkpoint)
    allowed = ", ".join(policy.mount_prefixes) or "(none)"
    for m in mounts:
        clean = _clean(m.source)
        real = os.path.realpath(clean) if resolve and clean else clean
        if clean is None or real is None or not (_under(clean, policy.mount_prefixes)
                                                  and _under(real, policy.mount_prefixes)):
            shown = m.source if real in (None, clean) else f"{m.source} (really {real})"
            raise ConfigError(
                f"{where}: mount source {shown} is outside the allowed prefixes "
                f"(job_policy.mount_prefixes: {allowed})"
            )
    log = spec.log if spec.log.startswith("/") else (os.path.join(cwd, spec.log) if cwd else None)
    if log is not None:
        clean = _clean(log)
        if clean is None or not _under(clean, policy.mount_prefixes):
            raise ConfigError(
                f"{where}: log {log} is outside the allowed prefixes "
                f"(job_policy.mount_prefixes: {allowed})"
            )


#: Where an admin names the runner's config when it is not the system path: one line, the
#: config's path. Read only when root owns it and its directory and nobody else can write them.
RUNNER_CONF = "/etc/slurm-idle/runner.conf"


def site_config_path(runner_conf: str = RUNNER_CONF) -> str:
    """The config the site names for the runner: RUNNER_CONF's line, else the system path."""
    if _root_only(runner_conf) and _root_only(os.path.dirname(os.path.abspath(runner_conf))):
        try:
            named = Path(runner_conf).read_text().strip()
        except (OSError, UnicodeDecodeError):
            named = ""
        if named:
            return named
    return DEFAULT_CONFIG_PATH


def trusted_config_path(environ: Mapping[str, str], uid: int | None = None,
                        runner_conf: str = RUNNER_CONF) -> str | None:
    """The config whose policy binds the runner (see the module docstring), None without one."""
    candidate = environ.get(CONFIG_ENV)
    if (candidate and (os.geteuid() if uid is None else uid) == 0 and _root_only(candidate)
            and _root_only(os.path.dirname(os.path.abspath(candidate)))):
        return candidate
    site = site_config_path(runner_conf)
    return site if os.path.exists(site) else None


def ignored_config_env(environ: Mapping[str, str], uid: int | None = None,
                       runner_conf: str = RUNNER_CONF) -> str | None:
    """The warning for a $SLURM_IDLE_CONFIG the runner does not follow (None: nothing to say)."""
    candidate = environ.get(CONFIG_ENV)
    used = trusted_config_path(environ, uid, runner_conf)
    if not candidate or candidate == used or (used and os.path.abspath(candidate) == used):
        return None
    return (f"${CONFIG_ENV}={candidate} ignored: the job policy comes from the site's config "
            f"({used or 'none: the defaults'}), never from the job's environment")


def _root_only(path: str) -> bool:
    try:
        st = os.stat(path)
    except OSError:
        return False
    return st.st_uid == 0 and not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)


def site_policy(environ: Mapping[str, str], uid: int | None = None,
                runner_conf: str = RUNNER_CONF) -> JobPolicyConfig:
    """The node's job policy (see trusted_config_path); the defaults without a config.

    A site config someone other than root could have written is refused (ConfigError), not
    replaced by the defaults: its policy may be stricter than theirs.
    """
    path = trusted_config_path(environ, uid, runner_conf)
    if path is None:
        return JobPolicyConfig()
    if not (_root_only(path) and _root_only(os.path.dirname(os.path.abspath(path)))):
        raise ConfigError(f"the site's config {path} (or its directory) is not root's or is "
                          "writable by group or others: the runner takes no job policy from it; "
                          "chown root and chmod go-w it")
    config: Config = load_config(path)
    return config.job_policy
