"""A web view over a made-up cluster, for the browser tests and the README's screenshots.

The pool needs a live cluster, so its document is written out here (outlook notes from the
real outlook functions); the jobs go through the real LiveData.jobs (job rows, the runner's
ledger, log tails, who sees what, the viewer's jobs first) over a state dir written here and
a FakeSlurm. The strings are the hard cases for a 1280 px page: a long job name, a log line
with no space in 240 characters, a six-stage pipeline wider than the page, runner `t=` stamps
from today and yesterday. bob's log holds BOB_SECRET: no viewer but bob may see it.

`python -m slurm_idle.testing.webview DIR [--port P]` serves it on 127.0.0.1 (a look by hand).
"""

from __future__ import annotations

import json
import math
import os
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from slurm_idle import runlog
from slurm_idle.journal import iso
from slurm_idle.model import SlurmJob
from slurm_idle.pipeline import pipeline_path, records_dir
from slurm_idle.slurm.protocol import AcctJob
from slurm_idle.testing.fakes import FakeSlurm
from slurm_idle.web.data import LiveData
from slurm_idle.web.outlook import best_time, best_time_note, unknown_note

NOW = datetime(2026, 12, 7, 16, 30, tzinfo=UTC).timestamp()
TIMEZONE = "Europe/Berlin"
BOB_SECRET = "BOB-SECRET-5f2c"
LONG_NAME = "finetune-llama3-8b-lora-r64-lr3e-4-cosine-warmup-seed1234"
H = 3600.0


#: The made-up cluster's ClusterName: a researcher's records are kept per cluster.
CLUSTER = "acme"

def _tag(**kv: str) -> str:
    return "slurm-idle:job" + "".join(f",{k}={v}" for k, v in kv.items())


def _job(job_id: int, name: str, user: str, state: str, node: str = "", reason: str = "",
         restarts: int = 0, **tags: str) -> SlurmJob:
    return SlurmJob(job_id=job_id, name=name, partition="idle", state=state,
                    nodes=(node,) if node else (), restart_count=restarts, gpus=1,
                    comment=_tag(**tags), user=user, state_reason=reason)


PIPELINE = ["prep", "tokenize", "train-0", "train-1", "eval", "export", "report"]
DEPENDS = {"tokenize": ["prep"], "train-0": ["tokenize"], "train-1": ["tokenize"],
           "eval": ["train-0", "train-1"], "export": ["eval"], "report": ["export"]}


def slurm() -> FakeSlurm:
    """bob's job the oldest, carol's pending, and alice's six-stage pipeline."""
    pipe = {s: 4120 + i for i, s in enumerate(PIPELINE)}
    jobs = [_job(4102, "sweep-b", "bob", "RUNNING", "gpu1"),
            _job(4111, "ablation", "carol", "PENDING", reason="Priority"),
            _job(4107, LONG_NAME, "alice", "RUNNING", "gpu1", restarts=1),
            _job(pipe["train-0"], "eval-suite.train-0", "alice", "RUNNING", "gpu1",
                 pipeline="eval-suite", step="train-0"),
            _job(pipe["train-1"], "eval-suite.train-1", "alice", "PENDING", reason="Resources",
                 pipeline="eval-suite", step="train-1")]
    jobs += [_job(pipe[s], f"eval-suite.{s}", "alice", "PENDING", reason="Dependency",
                  pipeline="eval-suite", step=s) for s in ("eval", "export", "report")]
    done = NOW - 3 * H
    acct = [AcctJob(job_id=pipe[s], name=f"eval-suite.{s}", partition="idle", state="COMPLETED",
                    start=done + i * 600, end=done + (i + 1) * 600, elapsed_s=600.0, gpus=1)
            for i, s in enumerate(("prep", "tokenize"))]
    return FakeSlurm(job_list=jobs, acct=acct, cluster=CLUSTER)


def _stamp(t: float) -> str:
    return f"t={t:.0f}"


def alice_log(now: float = NOW) -> list[str]:
    """A finetune preempted once yesterday evening and resumed: runner and job lines."""
    y = now - 20 * H  # yesterday, 21:30 in Berlin
    shards = ",".join(f"shard-{i:05d}" for i in range(12))
    ckpt = f"/scratch/alice/checkpoints/{LONG_NAME}/step-000412/model-00001-of-00004,{shards}"
    return [
        (f"slurm-idle-run: started container slurm-idle-4107 image=localhost/finetune:2026.12 "
         f"restart=0 {_stamp(y)}.4"),
        f"start restart=0 job=4107 step=0 {_stamp(y + 2)}",
        "epoch 1 step 200/1800 loss 2.314 lr 2.9e-4 tokens/s 11873",
        f"checkpoint step=400 {_stamp(y + 1900)}",
        f"slurm-idle-run: SIGTERM (preemption): checkpointing, 30 s grace {_stamp(y + 1960)}.0",
        f"preempted at step=412 {_stamp(y + 1961)}: checkpoint saved, exiting",
        (f"slurm-idle-run: started container slurm-idle-4107 image=localhost/finetune:2026.12 "
         f"restart=1 {_stamp(now - 2 * H)}.7"),
        f"start restart=1 job=4107 step=412 {_stamp(now - 2 * H + 3)}",
        f"loaded {ckpt}",
        "epoch 1 step 600/1800 loss 1.987 lr 2.7e-4 tokens/s 12010",
        f"checkpoint step=800 {_stamp(now - 240)}",
    ]


def write_state(root: Path, now: float = NOW) -> None:
    """Job records, logs, alice's run ledger and checkpoint, the pipeline record under root."""
    logs = root / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    (logs / "alice-4107.out").write_text("\n".join(alice_log(now)) + "\n")
    (logs / "bob-4102.out").write_text(f"sweep 3/12\nusing token {BOB_SECRET}\n")
    (logs / "carol-4111.out").write_text("")
    ckpt = root / "ckpt-4107"
    ckpt.mkdir(exist_ok=True)
    (ckpt / "step-000800.pt").write_text("x")
    os.utime(ckpt / "step-000800.pt", (now - 240, now - 240))
    jobs = records_dir(root, "jobs", CLUSTER)
    jobs.mkdir(parents=True, exist_ok=True)
    for job_id, user, check in ((4107, "alice", str(ckpt)), (4102, "bob", None),
                                (4111, "carol", None)):
        (jobs / f"{job_id}.json").write_text(json.dumps({
            "job_id": job_id, "checkpoint": check, "log": str(logs / f"{user}-{job_id}.out"),
            "submitted_at": now - 22 * H}))
    for rec in ({"run": 0, "event": "start"}, {"run": 0, "event": "end", "why": "preempted"},
                {"run": 1, "event": "start"}):
        runlog.append(root, 4107, rec, CLUSTER)
    steps = [{"name": s, "job_id": 4120 + i, "depends_on": DEPENDS.get(s, []), "group": s}
             for i, s in enumerate(PIPELINE)]
    path = pipeline_path(root, "eval-suite", CLUSTER)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({
        "pipeline": "eval-suite", "submitted_at": now - 3 * H, "attempt": 1,
        "params": {"model": "llama3-8b", "suite": "full"}, "steps": steps}))


def pool_doc(now: float = NOW) -> dict[str, Any]:
    """Four nodes (gpu1 lent), 24 hours of timeline, an outlook with 21 hours of history."""
    nodes = [{"name": f"gpu{i}", "model": "llama3-70b", "phase": "lent" if i == 1 else "serving",
              "phase_since_iso": iso(now - (5 * H if i == 1 else 30 * H)), "gpus_total": 4,
              "gpus_used": 3 if i == 1 else 0, "slurm_state": "MIXED" if i == 1 else "IDLE+DRAIN",
              "jobs": [4102, 4107, 4120] if i == 1 else [], "pinned": i == 4}
             for i in range(1, 5)]
    ts = [now - 24 * H + i * 600 for i in range(145)]
    lent = [4 if (now - t) < 5 * H or 10 * H < (now - t) < 16 * H else 0 for t in ts]
    outlook = []
    for h in range(7):
        known = h >= 3  # history since 21 hours ago: the hour h needs 24 - h hours of it
        outlook.append({"t": now + h * H, "time": iso(now + h * H),
                        "lendable_gpus": (4 if h < 5 else 8) if known else None,
                        "demand_tokens_per_s": {"llama3-70b": 2100.0 - 300 * h} if known else None})
    best = best_time(outlook)
    return {
        "generated_at": iso(now), "nodes": nodes, "errors": [],
        "models": [{"model": "llama3-70b", "serving": 3, "needed": 2, "running": 41, "waiting": 0,
                    "generation_tokens_per_s": 2380.5,
                    "reason": "2 replicas carry 2381 tok/s at 80 % utilisation; 1 lent"}],
        "lent_gpu_hours": {"today": 21.3, "week": 188.0},
        "gpu_hours_used": {"today": 17.9, "week": 160.2},
        "timeline": {"t": ts, "serving_gpus": [16 - v for v in lent], "lent_gpus": lent,
                     "demand_tokens_per_s": [2200.0 + 700 * math.sin(2 * math.pi * (t / 86400.0))
                                             for t in ts]},
        "outlook": outlook, "outlook_note": unknown_note(outlook),
        "best_time_to_submit": iso(best) if best is not None else None,
        "best_time_note": best_time_note(outlook),
    }


class _Live(LiveData):
    def _usage(self, cfg: Any, now: float, errors: list[str]) -> dict[int, dict[str, Any]]:
        return {4107: {"gpu_hours": 14.2, "lost_gpu_hours": 0.1},
                4102: {"gpu_hours": 3.0, "lost_gpu_hours": 0.0}}


class SampleData:
    """PoolData over the made-up cluster: pool_doc() and the real jobs code over `root`."""

    def __init__(self, root: Path, now: float = NOW) -> None:
        write_state(root, now)
        self.now = now
        self.live = _Live(None, root, clock=lambda: now, ttl_s=0, slurm=slurm())

    def pool(self) -> dict[str, Any]:
        return pool_doc(self.now)

    def jobs(self, user: str | None = None, viewer: str | None = None) -> dict[str, Any]:
        return self.live.jobs(user, viewer)


def main(argv: list[str] | None = None) -> None:
    import argparse

    from slurm_idle.web import create_app, serve

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("dir", type=Path, help="where to write the made-up state dir")
    p.add_argument("--port", type=int, default=8766)
    p.add_argument("--user-header", default="X-Remote-User")
    args = p.parse_args(argv)
    app = create_app(SampleData(args.dir), timezone=TIMEZONE, user_header=args.user_header)
    serve(app, "127.0.0.1", args.port)


if __name__ == "__main__":
    main()
