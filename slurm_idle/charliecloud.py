"""Charliecloud for the in-job runner: `ch-run` as a child process behind the container protocol.

Charliecloud has no daemon, no image store the runner must ask and no root: `ch-run DIR -- CMD`
runs CMD in a user namespace of the caller's over a flattened image directory, as the caller,
and execs in place (the child's pid is the workload's). So the runner keeps its one supervisor
(supervise.py: SIGTERM, grace, urgent stop, SIGKILL, exit codes): this module answers the few
docker SDK calls run.py and supervise.py make (`images.get`, `containers.create/get/list`,
`start`, `wait`, `logs`, `kill`, `reload`, `remove`, `info`) with that child process.

What differs from an engine, and why:
- The image is a directory under `job_policy.charliecloud_images`, named as `ch-image` names
  its storage (`/` -> `%`, `:` -> `+`). Nothing is ever pulled: no registry, no network.
  Its command, environment and working directory come from `ch/config.pulled.json` (the image
  config, as `ch-image pull` and the project's export keep it), else `ch/metadata.json`.
- ch-run passes its whole environment through: the child gets exactly the container
  environment run.py computed (under the image's), plus `USER` (ch-run needs it), never the
  runner's own (DOCKER_HOST, SLURM_IDLE_CONFIG, the step's SLURM_*).
- ch-run shares the host network and binds read-write (0.31): ch-run starts inside `unshare
  --user --map-root-user --mount` (plus `--net` for `network: none`), whose root makes each
  read-only mount's source read-only in that mount namespace (ch-run's bind inherits it),
  brings the loopback up, and execs ch-run with the caller's uid and gid (`-u`, `-g`): inputs
  read-only and a network namespace with only a loopback, as an engine's, and files written in
  the mounts still the caller's.
- /tmp is the container's own (`--private-tmp`): the host's /tmp is outside every mount prefix.
- A bind target must exist in the (read-only) image: a missing one fails the start (exit 70)
  naming it.
- Nothing outlives the job step: the workload is the step's own process, killed with it, so
  there are no leftovers to sweep (`containers.list` is empty).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slurm_idle.errors import SlurmIdleError

#: ch-run's own default PATH is the caller's: a container without one in its image gets this.
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
#: Run as root of the caller's own user and mount namespaces before ch-run: `sh -c PREPARE sh
#: NETWORK RO... -- CH-RUN...`. A source it cannot make read-only stops the start (exit 70); a
#: node without `ip` keeps the loopback down, said in the job log, and runs anyway.
PREPARE = '''net=$1; shift; p=/usr/sbin:/usr/bin:/sbin:/bin  # its own tools, not the image's PATH
while [ "$1" != -- ]; do
  PATH=$p mount --bind "$1" "$1" && PATH=$p mount -o remount,bind,ro "$1" || {
    echo "slurm-idle-run: cannot make $1 read-only: not starting the container" >&2; exit 70; }
  shift
done
shift
if [ "$net" = none ]; then PATH=$p ip link set lo up 2>/dev/null ||
  echo "slurm-idle-run: the loopback stays down (ip link failed)" >&2; fi
exec "$@"'''
UNSHARE = ("unshare", "--user", "--map-root-user", "--mount")


def namespaces_argv(network: str, read_only: Sequence[str], unshare: str = "unshare") -> list[str]:
    """The prefix that prepares the namespaces ch-run then runs in (PREPARE)."""
    return [unshare, *UNSHARE[1:], *(["--net"] if network != "host" else []), "--",
            "/bin/sh", "-c", PREPARE, "sh", network, *read_only, "--"]


class ChRunError(SlurmIdleError):
    """ch-run cannot run this container (its image, its mounts, the program itself)."""


def image_name(image: str) -> str:
    """The directory name of `image`, as ch-image names its storage (`a/b:t` -> `a%b+t`);
    an image without a tag or digest is `:latest`, as for docker."""
    if "@" not in image and ":" not in image.rsplit("/", 1)[-1]:
        image += ":latest"
    return image.replace("/", "%").replace(":", "+")


def image_dir(root: str | Path, image: str) -> Path:
    return Path(root) / image_name(image)


@dataclass(frozen=True)
class ImageConfig:
    """What an image directory records of its docker image config (all optional)."""

    entrypoint: tuple[str, ...] = ()
    cmd: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    workdir: str = ""


def read_image_config(path: Path) -> ImageConfig:
    """The image's config from `ch/config.pulled.json`, else `ch/metadata.json` (env and cwd
    only: ch-image records no entrypoint), else nothing."""
    try:
        pulled = json.loads((path / "ch" / "config.pulled.json").read_text())
        cfg = pulled.get("config") or {}
        env = tuple((k, v) for k, _, v in (str(e).partition("=") for e in cfg.get("Env") or ()))
        return ImageConfig(tuple(map(str, cfg.get("Entrypoint") or ())),
                           tuple(map(str, cfg.get("Cmd") or ())), env,
                           str(cfg.get("WorkingDir") or ""))
    except (OSError, ValueError, AttributeError):
        pass
    try:
        meta = json.loads((path / "ch" / "metadata.json").read_text())
        return ImageConfig(env=tuple((str(k), str(v)) for k, v in (meta.get("env") or {}).items()),
                           workdir=str(meta.get("cwd") or ""))
    except (OSError, ValueError, AttributeError):
        return ImageConfig()


def command_of(kwargs: Mapping[str, Any], image: ImageConfig) -> list[str]:
    """The workload's argv with docker's rule: an entrypoint given drops the image's CMD."""
    if "entrypoint" in kwargs:
        argv = [*kwargs["entrypoint"], *kwargs.get("command", ())]
    else:
        argv = [*image.entrypoint, *kwargs.get("command", image.cmd)]
    if not argv:
        raise ChRunError("the image records no command (no entrypoint or CMD in its "
                         "ch/config.pulled.json): give `command:` in the job spec")
    return argv


def child_env(kwargs: Mapping[str, Any], image: ImageConfig, user: str) -> dict[str, str]:
    """The environment ch-run gets: the image's, then the container's; nothing of ours."""
    env = {"PATH": DEFAULT_PATH, **dict(image.env), **kwargs.get("environment", {})}
    env["USER"] = user
    return env


def chrun_argv(kwargs: Mapping[str, Any], path: Path, image: ImageConfig,
               ch_run: str = "ch-run", unshare: str | None = "unshare") -> list[str]:
    """The command line for docker-style create() `kwargs` over the image at `path` (pure
    but for checking the bind targets exist in the image). `unshare` None: ch-run alone
    (tests with a fake ch-run: no namespaces, no network or read-only rule)."""
    read_only = [str(m["Source"]) for m in kwargs.get("mounts", ()) if m.get("ReadOnly")]
    argv = [] if unshare is None else namespaces_argv(
        str(kwargs.get("network_mode", "none")), read_only, unshare)
    argv += [ch_run, "--private-tmp"]
    if kwargs.get("user"):  # the caller's own: needed where ch-run starts as the userns' root
        uid, _, gid = str(kwargs["user"]).partition(":")
        argv += ["-u", uid, "-g", gid or uid]
    for m in kwargs.get("mounts", ()):
        target = str(m["Target"])
        if ".." in target.split("/"):  # ch-run would join it to the image path as it is
            raise ChRunError(f"mount target {target} climbs out with '..': name it plainly")
        if not os.path.lexists(path / target.lstrip("/")):
            raise ChRunError(
                f"mount target {target} is not in the image {path}: ch-run cannot create it in "
                f"a read-only image; make it there (mkdir -p, or touch for a file)")
        argv += ["-b", f"{m['Source']}:{target}"]
    workdir = kwargs.get("working_dir") or image.workdir
    if workdir:
        argv += ["-c", workdir]
    return [*argv, str(path), "--", *command_of(kwargs, image)]


def exit_code(returncode: int) -> int:
    """A child's status as an engine reports a container's: killed by signal N is 128 + N."""
    return 128 - returncode if returncode < 0 else returncode


class ChImages:
    """`images.get` finds the image directory; there is nothing to pull."""

    def __init__(self, root: str) -> None:
        self.root = root

    def get(self, image: str) -> Path:
        import docker.errors

        path = image_dir(self.root, image)
        if not path.is_dir():
            # ensure_image's one rule: a missing image fails the job before anything starts.
            raise docker.errors.ImageNotFound(f"no image directory {path}", explanation=str(path))
        return path

    def pull(self, image: str) -> None:
        raise ChRunError(f"charliecloud images are directories on the node: {image} is never "
                         "pulled (no registry is asked)")


@dataclass
class ChContainer:
    """One `ch-run` child: the workload itself once started (ch-run execs in place)."""

    name: str
    argv: list[str]
    env: dict[str, str]
    proc: subprocess.Popen[bytes] | None = None
    status: str = "created"

    @property
    def id(self) -> str:
        return self.name

    def start(self) -> None:
        # A process group of its own, still the runner's child (Slurm's proctrack/linuxproc
        # finds it in the step's process tree): what the workload leaves running in it can be
        # ended with it, as an engine ends a container's processes with its main one.
        self.proc = subprocess.Popen(self.argv, env=self.env, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     process_group=0)
        self.status = "running"

    def wait(self) -> dict[str, int]:
        """The workload's exit code, once it and what it left behind (a `sleep &` holding the
        log pipe open, which kept the runner reading for seconds) are gone."""
        assert self.proc is not None
        code = exit_code(self.proc.wait())
        self._kill_group()
        self.status = "exited"
        return {"StatusCode": code}

    def _kill_group(self) -> None:
        assert self.proc is not None
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except OSError:
            pass  # nothing left in it

    def logs(self, stream: bool = True, follow: bool = True) -> Iterator[bytes]:
        assert self.proc is not None and self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        while chunk := os.read(fd, 65536):
            yield chunk

    def running(self) -> bool:
        """The child has not ended: not reaped, and not a zombie waiting to be."""
        if self.proc is None or self.proc.returncode is not None:
            return False
        try:
            with open(f"/proc/{self.proc.pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
        except (OSError, IndexError):
            return False

    def kill(self, signal: str = "SIGKILL") -> None:
        """Signal the workload; refused once it has ended, as dockerd refuses (supervise reads
        that refusal as "it ended as the stop came")."""
        if not self.running():
            raise ChRunError(f"container {self.name} is not running")
        assert self.proc is not None
        self.proc.send_signal(_signum(signal))

    def reload(self) -> None:
        if self.proc is not None and not self.running():
            self.status = "exited"

    def remove(self, force: bool = False, wait_s: float = 3.0) -> None:
        """Kill the child if it still runs and reap it: nothing of the job is left behind."""
        if self.proc is None:
            return
        if self.running():
            self._kill_group()
        try:
            self.proc.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            pass
        self._kill_group()
        if self.proc.stdout is not None:
            self.proc.stdout.close()


def _signum(name: str) -> int:
    return int(getattr(signal, name)) if name.startswith("SIG") else int(name)


class ChContainers:
    def __init__(self, client: CharliecloudClient) -> None:
        self.client = client
        self.created: dict[str, ChContainer] = {}

    def create(self, **kwargs: Any) -> ChContainer:
        path = self.client.images.get(str(kwargs["image"]))
        config = read_image_config(path)
        # Found on the runner's PATH: the child's is the container's.
        wanted = [self.client.ch_run, *(["unshare"] if self.client.namespaces else [])]
        found = [shutil.which(p) for p in wanted]
        if None in found:
            raise ChRunError(f"cannot run the container: {' or '.join(wanted)} not found on "
                             "this node (apt-get install charliecloud util-linux)")
        argv = chrun_argv(kwargs, path, config, str(found[0]),
                          str(found[1]) if self.client.namespaces else None)
        c = ChContainer(str(kwargs["name"]), argv, child_env(kwargs, config, self.client.user))
        self.created[c.id] = c
        return c

    def get(self, cid: str) -> ChContainer:
        return self.created[cid]

    def list(self, all: bool = False, filters: Mapping[str, Sequence[str]] | None = None
             ) -> list[ChContainer]:
        return []  # a ch-run child dies with the job step: no leftovers of a killed run


class CharliecloudClient:
    """The docker SDK calls the runner makes, answered with `ch-run` children."""

    def __init__(self, images_root: str, user: str, ch_run: str = "ch-run",
                 namespaces: bool = True) -> None:
        self.images = ChImages(images_root)
        self.containers = ChContainers(self)
        self.user = user
        self.ch_run = ch_run
        self.namespaces = namespaces  # False only for a fake ch-run in tests (chrun_argv)

    def info(self) -> dict[str, Any]:
        return {"Runtimes": {}}  # no engine runtimes: GPUs are passed by environment

    def close(self) -> None:
        pass
