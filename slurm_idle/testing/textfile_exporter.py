"""The sandbox's textfile exporter: the agents' textfiles (paths.textfile) over HTTP, for its
Prometheus, as node_exporter's textfile collector serves them on a site.

One port, one path per file (`--file NAME=PATH`: GET /NAME answers PATH's text), so that
Prometheus scrapes each agent's file as a target of its own (`__metrics_path__`): the
sandbox's agents (default, topology, jobs) each write a textfile with the same families, which
node_exporter's one page per directory could not hold side by side. A file not written yet
answers an empty page, as node_exporter collects nothing from a missing file: the target is up
and has no series (SlurmIdleMetricsMissing, after its `for`).

Run: python -m slurm_idle.testing.textfile_exporter --port PORT --file NAME=PATH [--file ...]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

from slurm_idle.testing import asynchttp
from slurm_idle.testing.asynchttp import HttpRequest, Reply

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def page(files: dict[str, Path], target: str) -> Reply:
    """The reply to GET `target`: the named file's text, '' while it does not exist."""
    name = target.split("?")[0].lstrip("/")
    if name not in files:
        return 404, b"Not Found\n", "text/plain"
    try:
        return 200, files[name].read_bytes(), CONTENT_TYPE
    except FileNotFoundError:
        return 200, b"", CONTENT_TYPE


async def serve(files: dict[str, Path], port: int, host: str = "127.0.0.1") -> None:
    async def handle(request: HttpRequest) -> Reply:
        return page(files, request.target)

    await asynchttp.start(handle, host, port)
    print(f"textfile-exporter: {host}:{port} " + " ".join(f"/{n}={p}" for n, p in files.items()),
          flush=True)
    await asyncio.Event().wait()  # until SIGTERM


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m slurm_idle.testing.textfile_exporter",
                                description=(__doc__ or "").splitlines()[0])
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--file", action="append", default=[], metavar="NAME=PATH", required=True)
    p.add_argument("--host", default="127.0.0.1")
    args = p.parse_args(argv)
    files = {}
    for item in args.file:
        name, _, path = item.partition("=")
        files[name] = Path(path)
    try:
        asyncio.run(serve(files, args.port, args.host))
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
