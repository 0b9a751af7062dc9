"""Small local container images for tests and the demo (no registry is reachable here).

`slurm-idle/busybox:latest` is imported from a rootfs tar holding Debian's busybox-static and
one symlink per applet; `slurm-idle/demo:latest` is built on it from a Dockerfile that COPYs
etc/examples/demo/demo.sh (the checkpointing demo workload). Both are idempotent: an image
that already exists is kept unless `force=True`. For `job_policy.runtime: charliecloud` each is
also exported into a flattened directory (charliecloud.py reads it): `docker export` of a
container of the image, unpacked, plus what ch-run needs of it.

    python -m slurm_idle.testing.images [--docker-host unix:///path/docker.sock] [--force]
                                        [--charliecloud-dir /var/lib/slurm-idle/images]
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
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


#: Made in every exported directory: ch-run's own mount points, and a stand-in for the params
#: file the runner binds (ch-run cannot create a bind target in a read-only image).
CH_DIRS = ("dev", "proc", "sys", "home", "mnt", "run/slurm-idle", "checkpoint", "ch")
CH_FILES = ("etc/passwd", "etc/group", "etc/hosts", "etc/resolv.conf", "run/slurm-idle/params.json")


def export_image_dir(client: Any, tag: str, root: str | Path, force: bool = False) -> Path:
    """Flatten `tag` from the engine into `root`'s image directory for ch-run (no network).

    The image's config goes to `ch/config.pulled.json`, where `ch-image pull` keeps it (the
    entrypoint, CMD, env and working directory a flattened tree would lose). The directory is
    made beside its final name and renamed into place: a half-made image is never run.
    """
    from slurm_idle.charliecloud import image_dir

    final = image_dir(root, tag)
    if final.is_dir() and not force:
        return final
    Path(root).mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=".export-", dir=root))
    # Never started: a command only because the engine wants one for an image without any.
    container = client.containers.create(tag, command=["/bin/true"], network_mode="none")
    try:
        with tempfile.TemporaryFile() as tar:
            for chunk in container.export():
                tar.write(chunk)
            tar.seek(0)
            with tarfile.open(fileobj=tar) as t:
                if hasattr(tarfile, "tar_filter"):  # Python 3.11.4+: no member outside `work`
                    t.extractall(work, filter="tar")
                else:
                    t.extractall(work)  # our own engine's export of a local image
    finally:
        container.remove(force=True)
    for d in CH_DIRS:
        (work / d).mkdir(parents=True, exist_ok=True)
    for f in CH_FILES:
        (work / f).touch(exist_ok=True)
    attrs = client.images.get(tag).attrs
    config = {"architecture": attrs.get("Architecture", ""), "config": attrs.get("Config") or {},
              "history": []}
    (work / "ch" / "config.pulled.json").write_text(json.dumps(config, indent=2) + "\n")
    work.chmod(0o755)
    if final.exists():
        shutil.rmtree(final)
    work.rename(final)
    return final


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Build slurm-idle's local test/demo images.")
    p.add_argument("--docker-host", default=os.environ.get("DOCKER_HOST"))
    p.add_argument("--force", action="store_true", help="rebuild even if the images exist")
    p.add_argument("--charliecloud-dir", metavar="DIR",
                   help="also export each image into a directory under DIR for ch-run "
                        "(job_policy.charliecloud_images)")
    args = p.parse_args(argv)
    import docker
    import docker.errors

    try:
        client = (docker.DockerClient(base_url=args.docker_host) if args.docker_host
                  else docker.from_env())
        tags = [import_busybox(client, force=args.force), build_demo_image(client, force=args.force)]
        for tag in tags:
            print(tag)
            if args.charliecloud_dir:
                print(export_image_dir(client, tag, args.charliecloud_dir, force=args.force))
    except (docker.errors.DockerException, RuntimeError, OSError) as exc:
        # One line with the engine's own message (e.g. dockerd refusing to import the rootfs).
        print(f"images: {' '.join(str(exc).split())}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
