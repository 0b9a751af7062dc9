"""Rootless Podman for the in-job runner: a per-job API service as the job's user.

The docker socket is root on the node: a site that lets every researcher use it gives every
researcher root. Rootless Podman needs no daemon: the runner starts `podman system service`
as the job's own user on a socket of its own, talks to it through the same docker SDK
(Podman's Docker-compatible API), and stops it when the job step ends. The container's root
is the job's user outside (a user namespace over /etc/subuid), so it can write nothing the
user could not.

Site settings live in Podman's own files: `etc/podman/containers.conf` (network none, runc,
cgroupfs, ulimits a container may raise) and `etc/podman/storage.conf`, installed system-wide
(/etc/containers/) or named by CONTAINERS_CONF / CONTAINERS_STORAGE_CONF.
"""

from __future__ import annotations

import os
import stat
import subprocess
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from slurm_idle.errors import SlurmIdleError


def runtime_dir(uid: int, environ: Mapping[str, str]) -> str:
    """A private runtime directory of `uid` (XDG_RUNTIME_DIR, /run/user/UID, or one in /tmp).

    Podman keeps its per-user state there; it must be the user's own and closed to others.
    """
    for candidate in (environ.get("XDG_RUNTIME_DIR"), f"/run/user/{uid}"):
        if candidate and _private_to(candidate, uid):
            return candidate
    path = f"/tmp/slurm-idle-runtime-{uid}"
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    if not _private_to(path, uid):
        raise SlurmIdleError(
            f"{path} is not a private directory of uid {uid}: cannot run rootless podman "
            "(set XDG_RUNTIME_DIR to a 0700 directory of your own)"
        )
    return path


def _private_to(path: str, uid: int) -> bool:
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == uid and not st.st_mode & 0o077


@dataclass
class PodmanService:
    """`podman system service` on a socket of this job's, started and stopped by the runner."""

    socket: str
    env: dict[str, str]
    podman: str = "podman"
    clock: Callable[[], float] = time.monotonic
    process: subprocess.Popen[bytes] | None = field(default=None, init=False)

    @classmethod
    def for_job(cls, job_id: str, environ: Mapping[str, str]) -> PodmanService:
        rundir = runtime_dir(os.geteuid(), environ)
        env = {**environ, "XDG_RUNTIME_DIR": rundir}
        return cls(os.path.join(rundir, f"slurm-idle-{job_id or os.getpid()}.sock"), env)

    @property
    def base_url(self) -> str:
        return f"unix://{self.socket}"

    def start(self, timeout_s: float = 30.0) -> str:
        """Start the service (no idle timeout: the runner stops it) and wait for its socket."""
        if os.path.lexists(self.socket):
            os.unlink(self.socket)  # a killed run's leftover: ours, in our private directory
        try:
            self.process = subprocess.Popen(
                [self.podman, "system", "service", "--time=0", self.base_url],
                env=self.env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE, start_new_session=True,
            )
        except OSError as exc:
            raise SlurmIdleError(f"cannot start rootless podman ({self.podman}): {exc}") from None
        deadline = self.clock() + timeout_s
        while not os.path.exists(self.socket):
            if self.process.poll() is not None:
                err = (self.process.stderr.read() if self.process.stderr else b"").decode()
                raise SlurmIdleError(
                    f"rootless podman service exited ({self.process.returncode}): "
                    f"{' '.join(err.split())[-300:]}"
                )
            if self.clock() > deadline:
                self.stop()
                raise SlurmIdleError(f"rootless podman service gave no socket in {timeout_s:g} s")
            time.sleep(0.05)
        return self.base_url

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
