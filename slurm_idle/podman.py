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
import shutil
import signal
import stat
import subprocess
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from slurm_idle.errors import SlurmIdleError

#: Where the runtime directory is looked for: a per-user one (systemd-logind's), else shared.
RUN_USER = "/run/user"
SHARED_TMP = "/tmp"


def runtime_dir(uid: int, environ: Mapping[str, str],
                say: Callable[[str], None] | None = None) -> str:
    """A private runtime directory of `uid` (XDG_RUNTIME_DIR, /run/user/UID, or one in /tmp).

    Podman keeps its per-user state there; it must be the user's own and closed to others.
    Each candidate is checked with lstat (a directory, not a symlink, owned by `uid`, mode
    0700). The /tmp name is predictable, so another user may create it first: then a fresh
    directory with an unpredictable name is made instead (and `say` is told), rather than
    failing every podman job of the user (or using a directory someone else controls).
    """
    for candidate in (environ.get("XDG_RUNTIME_DIR"), f"{RUN_USER}/{uid}"):
        if candidate and _private_to(candidate, uid):
            return candidate
    shared = path = f"{SHARED_TMP}/slurm-idle-runtime-{uid}"
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    if _private_to(path, uid):
        return path
    path = tempfile.mkdtemp(prefix=f"slurm-idle-runtime-{uid}-", dir=SHARED_TMP)
    if not _private_to(path, uid):
        os.rmdir(path)
        raise SlurmIdleError(f"cannot make a private runtime directory of uid {uid} in {SHARED_TMP} "
                             "(set XDG_RUNTIME_DIR to a 0700 directory of your own)")
    if say is not None:
        say(f"{shared} is not a private directory of uid {uid} "
            f"(someone else's, a symlink or open to others): using {path} instead")
    return path


def _private_to(path: str, uid: int) -> bool:
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == uid and not st.st_mode & 0o077


class ServiceExitedSilently(SlurmIdleError):
    """The service ended before its socket and wrote nothing on stderr (a transient end)."""


#: Starts "$@" (the service) in the background and prints its pid, plus a background watchdog
#: that SIGTERMs it once the runner is gone (SIGKILLed: no `stop` ran), then exits: both are
#: left to init, in the shell's new session, outside the job step's process tree.
_DETACHED = (
    '"$@" </dev/null >/dev/null 2>"$0" & svc=$!; echo $svc; '
    '(while kill -0 {runner} && kill -0 $svc; do sleep 2; done; kill $svc) '
    '</dev/null >/dev/null 2>&1 &'
)


@dataclass
class PodmanService:
    """`podman system service` on a socket of this job's, started and stopped by the runner."""

    socket: str
    env: dict[str, str]
    podman: str = "podman"
    clock: Callable[[], float] = time.monotonic
    pid: int | None = field(default=None, init=False)

    @classmethod
    def for_job(cls, job_id: str, environ: Mapping[str, str],
                say: Callable[[str], None] | None = None) -> PodmanService:
        rundir = runtime_dir(os.geteuid(), environ, say)
        env = {**environ, "XDG_RUNTIME_DIR": rundir}
        return cls(os.path.join(rundir, f"slurm-idle-{job_id or os.getpid()}.sock"), env)

    @property
    def base_url(self) -> str:
        return f"unix://{self.socket}"

    def start(self, timeout_s: float = 30.0, attempts: int = 2) -> str:
        """_start_once, once more when the service exits without a word before its socket
        (seen once in CI on a loaded machine: a requeued job's service gone 9 s after its
        start, nothing on its stderr, the job failed with 70). A service that says why it
        cannot start (no user namespace, ...) says it again: that is not retried."""
        for attempt in range(1, attempts + 1):
            try:
                return self._start_once(timeout_s)
            except ServiceExitedSilently:
                if attempt == attempts:
                    raise
                time.sleep(1.0)
        raise AssertionError("unreachable")

    def _start_once(self, timeout_s: float) -> str:
        """Start the service (no idle timeout: the runner stops it) and wait for its socket.

        The service is started detached (a shell starts it in the background in a session of
        its own and exits), so it is neither in the job step's process group nor one of the
        runner's descendants: Slurm's SIGTERM at a preemption or reclaim reaches the runner
        (and, with proctrack/linuxproc or pgid, nothing of the service), which still needs the
        API to stop and remove the container within the grace. Measured before this: the
        service died with the runner's SIGTERM and the container outlived the job.
        """
        if shutil.which(self.podman, path=self.env.get("PATH")) is None:
            raise SlurmIdleError(f"cannot start rootless podman: {self.podman} not found")
        for leftover in (self.socket, self.err_path):
            if os.path.lexists(leftover):
                os.unlink(leftover)  # a killed run's leftover: ours, in our private directory
        try:
            launched = subprocess.run(
                ["sh", "-c", _DETACHED.format(runner=os.getpid()), self.err_path,
                 self.podman, "system", "service", "--time=0", self.base_url],
                env=self.env, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                timeout=30, start_new_session=True, check=False,
            )
            self.pid = int(launched.stdout.strip())
        except (OSError, ValueError, subprocess.SubprocessError) as exc:
            raise SlurmIdleError(f"cannot start rootless podman ({self.podman}): {exc}") from None
        deadline = self.clock() + timeout_s
        while not os.path.exists(self.socket):
            if not self.running():
                errors = self._errors()
                if errors in ("", "(no error output)"):
                    raise ServiceExitedSilently("rootless podman service exited without an "
                                                "error message before its socket")
                raise SlurmIdleError(f"rootless podman service exited: {errors}")
            if self.clock() > deadline:
                self.stop()
                raise SlurmIdleError(f"rootless podman service gave no socket in {timeout_s:g} s")
            time.sleep(0.05)
        return self.base_url

    @property
    def err_path(self) -> str:
        return f"{self.socket}.err"

    def _errors(self) -> str:
        try:
            with open(self.err_path, errors="replace") as f:
                return " ".join(f.read().split())[-300:]
        except OSError:
            return "(no error output)"

    def running(self) -> bool:
        """Is our service (this pid, serving this socket; not a zombie, not a reused pid) up?"""
        if self.pid is None:
            return False
        try:
            with open(f"/proc/{self.pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
            with open(f"/proc/{self.pid}/cmdline", "rb") as f:
                ours = self.base_url.encode() in f.read()
        except (OSError, IndexError):
            return False
        return ours and state not in ("Z", "X")

    def stop(self, wait_s: float = 10.0) -> None:
        """SIGTERM the service (SIGKILL after `wait_s`); it is not our child: poll, not wait."""
        for signum in (signal.SIGTERM, signal.SIGKILL):
            if not self.running():
                break
            assert self.pid is not None
            try:
                os.kill(self.pid, signum)
            except OSError:
                break
            deadline = self.clock() + wait_s
            while self.running() and self.clock() < deadline:
                time.sleep(0.05)
        for leftover in (self.socket, self.err_path):
            if os.path.lexists(leftover):
                os.unlink(leftover)

    def remove_labelled(self, label: str, grace_s: float, timeout_s: float = 60.0) -> list[str]:
        """Stop (SIGTERM, `grace_s`, SIGKILL) and remove the containers with `label` through
        the podman command line: what is left when the API service is gone (killed with the
        job step where Slurm signals every process of it). Returns the names removed."""
        def podman(*argv: str) -> str:
            return subprocess.run([self.podman, *argv], env=self.env, capture_output=True,
                                  text=True, timeout=timeout_s, check=True).stdout

        try:
            names = podman("ps", "-a", "--filter", f"label={label}", "--format", "{{.Names}}").split()
            if names:
                podman("rm", "--force", "--time", str(max(int(grace_s), 0)), *names)
        except (OSError, subprocess.SubprocessError) as exc:
            detail = exc.stderr if isinstance(exc, subprocess.CalledProcessError) else exc
            raise SlurmIdleError(f"podman could not remove containers {label}: "
                                 f"{' '.join(str(detail).split())[-300:]}") from None
        return names
