"""Small local container images for tests and the demo (no registry is reachable here).

`slurm-idle/busybox:latest` is imported from a rootfs tar holding Debian's busybox-static and
one symlink per applet; `slurm-idle/demo:latest` is built on it from a Dockerfile that COPYs
etc/examples/demo/demo.sh (the checkpointing demo workload). Both are idempotent: an image
that already exists is kept unless `force=True`.

    python -m slurm_idle.testing.images [--docker-host unix:///path/docker.sock] [--force]
"""

from __future__ import annotations

import argparse
import io
import os
import shutil
import subprocess
import sys
import tarfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

BUSYBOX_IMAGE = "slurm-idle/busybox:latest"
DEMO_IMAGE = "slurm-idle/demo:latest"
DEMO_DIR = Path(__file__).resolve().parents[2] / "etc" / "examples" / "demo"

DEMO_DOCKERFILE = f"""\
FROM {BUSYBOX_IMAGE}
COPY demo.sh /demo.sh
ENTRYPOINT ["/bin/sh", "/demo.sh"]
"""


def find_busybox() -> str:
    """The static busybox binary (Debian's busybox-static installs /bin/busybox)."""
    path = shutil.which("busybox") or "/bin/busybox"
    if not os.path.exists(path):
        raise RuntimeError("busybox not found: apt-get install busybox-static")
    return path


def busybox_rootfs_tar(busybox: str | None = None) -> bytes:
    """A minimal root filesystem as tar bytes: /bin/busybox, applet symlinks, /tmp, /etc."""
    busybox = busybox or find_busybox()
    applets = subprocess.run(
        [busybox, "--list"], capture_output=True, text=True, check=True
    ).stdout.split()
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for d, mode in (("bin", 0o755), ("tmp", 0o1777), ("etc", 0o755), ("checkpoint", 0o777)):
            info = tarfile.TarInfo(d)
            info.type, info.mode = tarfile.DIRTYPE, mode
            tar.addfile(info)
        tar.add(busybox, arcname="bin/busybox")
        for name in applets:
            if name == "busybox":
                continue
            info = tarfile.TarInfo(f"bin/{name}")
            info.type, info.linkname = tarfile.SYMTYPE, "busybox"
            tar.addfile(info)
        passwd = b"root:x:0:0:root:/:/bin/sh\nnobody:x:65534:65534:nobody:/:/bin/sh\n"
        _add_file(tar, "etc/passwd", passwd, 0o644)
        _add_file(tar, "etc/group", b"root:x:0:\nnogroup:x:65534:\n", 0o644)
    return buf.getvalue()


def _add_file(tar: tarfile.TarFile, name: str, data: bytes, mode: int) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mode = len(data), mode
    tar.addfile(info, io.BytesIO(data))


def _has_image(client: Any, tag: str) -> bool:
    import docker.errors

    try:
        client.images.get(tag)
        return True
    except docker.errors.ImageNotFound:
        return False


def import_busybox(client: Any, tag: str = BUSYBOX_IMAGE, force: bool = False) -> str:
    """Import the busybox rootfs as an image (docker import)."""
    if force or not _has_image(client, tag):
        repo, _, version = tag.rpartition(":")
        client.api.import_image_from_data(busybox_rootfs_tar(), repository=repo, tag=version)
    return tag


def build_image(
    client: Any, tag: str, dockerfile: str, files: Mapping[str, bytes], force: bool = False
) -> str:
    """Build `tag` from a Dockerfile and in-memory files (no network: COPY-only builds)."""
    if not force and _has_image(client, tag):
        return tag
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        _add_file(tar, "Dockerfile", dockerfile.encode(), 0o644)
        for name, data in files.items():
            _add_file(tar, name, data, 0o755)
    buf.seek(0)
    client.images.build(
        fileobj=buf, custom_context=True, tag=tag, rm=True, forcerm=True, network_mode="none"
    )
    return tag


def build_demo_image(client: Any, tag: str = DEMO_IMAGE, force: bool = False) -> str:
    """The demo workload image (busybox + etc/examples/demo/demo.sh)."""
    import_busybox(client, force=force)
    files = {"demo.sh": (DEMO_DIR / "demo.sh").read_bytes()}
    return build_image(client, tag, DEMO_DOCKERFILE, files, force=force)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Build slurm-idle's local test/demo images.")
    p.add_argument("--docker-host", default=os.environ.get("DOCKER_HOST"))
    p.add_argument("--force", action="store_true", help="rebuild even if the images exist")
    args = p.parse_args(argv)
    import docker
    import docker.errors

    try:
        client = (docker.DockerClient(base_url=args.docker_host) if args.docker_host
                  else docker.from_env())
        print(import_busybox(client, force=args.force))
        print(build_demo_image(client, force=args.force))
    except (docker.errors.DockerException, RuntimeError, OSError) as exc:
        # One line with the engine's own message (e.g. dockerd refusing to import the rootfs).
        print(f"images: {' '.join(str(exc).split())}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
