"""The sandbox's emulators as containers, for the `docker` engine kind (issue 14's e2e).

Each node's emulator runs in a container `sandbox-vllm-<node>` on the sandbox's dockerd (host
network and pid namespace, the same port as the process emulator), made from the busybox image
with this machine's Python bind-mounted read-only: no registry is needed. `docker stop` sends
SIGTERM to the emulator, which stops like vLLM (in-flight requests aborted unless it runs with
--shutdown-timeout). `down()` removes the containers and starts the process emulators again.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from slurm_idle.testing import sandboxconf
from slurm_idle.testing.images import import_busybox

CONTAINER = "sandbox-vllm-{node}"


def _binds(sb: Any) -> dict[str, dict[str, str]]:
    ro = [Path(sys.prefix), Path(sys.base_prefix), Path(sb.python).resolve().parent.parent,
          Path(sb.layout.pythonpath), Path("/usr"), Path("/lib"), Path("/lib64")]
    binds = {str(p): {"bind": str(p), "mode": "ro"} for p in ro if p.exists()}
    binds[str(sb.root)] = {"bind": str(sb.root), "mode": "rw"}
    return binds


def up(sb: Any, client: Any) -> list[str]:
    """Replace every process emulator by a running container; returns the container names."""
    image = import_busybox(client)
    names = []
    lay, cap = sb.layout, sb.capacity
    for node in sb.nodes:
        name = CONTAINER.format(node=node)
        for old in client.containers.list(all=True, filters={"name": name}):
            old.remove(force=True)
        sb.engine_stop(node)
        client.containers.create(
            image, name=name, network_mode="host", pid_mode="host", volumes=_binds(sb),
            environment={"PYTHONPATH": lay.pythonpath},
            command=[sb.python, "-m", "slurm_idle.testing.emulator",
                     "--port", str(lay.emulator_port(node)), "--model", sandboxconf.MODEL_NAME,
                     "--node", node, "--state-dir", str(lay.emulator_state_dir),
                     "--load-file", str(lay.load_file), "--max-num-seqs", str(cap.max_num_seqs),
                     "--tokens-per-s", str(cap.tokens_per_s),
                     "--seq-tokens-per-s", str(cap.seq_tokens_per_s)],
        ).start()
        names.append(name)
    return names


def down(sb: Any, client: Any) -> None:
    """Remove the emulator containers and start the process emulators again."""
    for node in sb.nodes:
        for c in client.containers.list(all=True, filters={"name": CONTAINER.format(node=node)}):
            c.remove(force=True)
        sb.engine_start(node)
