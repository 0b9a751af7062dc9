"""Prometheus `file_sd_configs` targets of the replica jobs (`placement: jobs`).

A replica job runs wherever Slurm placed it, so no static scrape config can name it: each tick
the agent writes every placed replica (starting, serving, retiring, lending) as a target with
its model, replica and job id as labels, atomically (temp file + rename, safefiles), and
Prometheus picks the file up on its own (`file_sd_configs: [{files: [PATH]}]`,
etc/prometheus.yml). The text is a pure function of the replicas, tested on its own.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit

from slurm_idle import safefiles
from slurm_idle.model import JobReplica


def targets(replicas: Sequence[JobReplica]) -> list[dict[str, Any]]:
    """One target group per placed replica, in replica order."""
    out = []
    for r in replicas:
        if not r.url or not r.nodes:
            continue
        out.append({"targets": [urlsplit(r.url).netloc],
                    "labels": {"slurm_idle_model": r.model, "slurm_idle_replica": r.name,
                               "slurm_job_id": str(r.job_id), "node": r.nodes[0]}})
    return out


def write(path: str, replicas: Sequence[JobReplica]) -> None:
    """Replace `path` with the targets of `replicas` (never a half-written file)."""
    safefiles.atomic_write(path, json.dumps(targets(replicas), indent=1) + "\n", 0o644)
