"""Pipelines on the real sandbox: 5 dependent container steps, a parallel pair, a failure.

The shipped etc/examples/pipeline.yaml runs with its paths moved to a private dir and shorter
steps; the order is checked from accounting (every step starts after its upstreams ended; rl
and eval overlap). A pipeline whose middle step fails shows its downstream cancelled with the
failed upstream named, while an independent branch completes.
"""

from __future__ import annotations

import functools
import json
import sys
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
import yaml

from slurm_idle.config import load_config
from slurm_idle.testing.demo import reset_cluster
from slurm_idle.testing.images import BUSYBOX_IMAGE, build_demo_image
from slurm_idle.testing.waiting import poll as _poll

pytestmark = pytest.mark.sandbox

EXAMPLES = Path(__file__).resolve().parents[2] / "etc" / "examples"


poll = functools.partial(_poll, interval_s=1.0)


@pytest.fixture(scope="module")
def images(sandbox: Any) -> None:
    import docker

    # Earlier e2e modules (agent ticks) may leave nodes drained as serving: start from a plain
    # cluster, or the steps queue for the one node left.
    reset_cluster(sandbox, load_config(sandbox.config_path).paths.journal)
    client = docker.DockerClient(base_url=sandbox.docker_host, timeout=60)
    build_demo_image(client)
    client.close()


def _relocate(value: Any, root: str, steps: int) -> Any:
    if isinstance(value, str):
        return value.replace("/tmp/slurm-idle-demo", root)
    if isinstance(value, dict):
        out = {k: _relocate(v, root, steps) for k, v in value.items()}
        if "steps" in out and isinstance(out["steps"], int):
            out["steps"] = steps
        return out
    if isinstance(value, list):
        return [_relocate(v, root, steps) for v in value]
    return value


def cli(sandbox: Any, tmp_path: Path, *args: str) -> Any:
    r = sandbox.run([sys.executable, "-m", "slurm_idle.cli", *args],
                    env={"SLURM_IDLE_STATE_DIR": str(tmp_path / "state")})
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def status(sandbox: Any, tmp_path: Path, name: str) -> dict[str, dict[str, Any]]:
    doc = cli(sandbox, tmp_path, "pipeline", "status", "--json", name)
    return {s["name"]: s for s in doc["steps"]}


def times(sandbox: Any, ids: list[int]) -> dict[int, tuple[datetime, datetime]]:
    out = sandbox.run(["sacct", "-n", "-X", "-P", "-o", "JobID,Start,End",
                       "-j", ",".join(map(str, ids))]).stdout
    res = {}
    for line in out.splitlines():
        job, start, end = line.split("|")
        res[int(job)] = (datetime.fromisoformat(start), datetime.fromisoformat(end))
    return res


@pytest.mark.slow
def test_five_step_pipeline_runs_in_dependency_order_with_a_parallel_pair(
    sandbox: Any, images: None, tmp_path: Path
) -> None:
    """pre-process -> pre-train -> sft -> (rl || eval) all COMPLETE, each after its upstreams."""
    for name in ("pipeline.yaml", "demo-job.yaml"):
        doc = _relocate(yaml.safe_load((EXAMPLES / name).read_text()), str(tmp_path), steps=4)
        (tmp_path / name).write_text(yaml.safe_dump(doc))
    run = cli(sandbox, tmp_path, "pipeline", "run", "--json", str(tmp_path / "pipeline.yaml"))
    ids = {s["name"]: s["job_id"] for s in run["steps"]}
    deps = {s["name"]: s["depends_on"] for s in run["steps"]}
    try:
        poll(lambda: all(s["state"] == "COMPLETED" for s in
                         status(sandbox, tmp_path, "llm-recipe").values())
             or any(s["state"] in {"FAILED", "CANCELLED"} for s in
                    status(sandbox, tmp_path, "llm-recipe").values()),
             240, "pipeline end")
        final = status(sandbox, tmp_path, "llm-recipe")
        assert {n: s["state"] for n, s in final.items()} == {n: "COMPLETED" for n in ids}
    finally:
        cli(sandbox, tmp_path, "pipeline", "cancel", "--json", "llm-recipe")
    t = times(sandbox, list(ids.values()))
    for step, ups in deps.items():
        for up in ups:
            assert t[ids[step]][0] >= t[ids[up]][1], f"{step} started before {up} ended"
    rl, ev = t[ids["rl"]], t[ids["eval"]]
    assert rl[0] < ev[1] and ev[0] < rl[1], f"rl {rl} and eval {ev} did not overlap"
    span = (max(e for _, e in t.values()) - min(s for s, _ in t.values())).total_seconds()
    print(f"MEASURE 5-step pipeline wall time {span:.0f}s")
    for n in ids:
        log = next((tmp_path / "llm-recipe").glob(f"{n}-*.out")).read_text()
        assert "done steps=4 sum=10" in log


def test_a_failed_step_cancels_its_downstream_with_the_reason(
    sandbox: Any, images: None, tmp_path: Path
) -> None:
    """b fails -> c (after b) is cancelled and says 'upstream step b failed'; d (after a) runs."""
    fail = {"image": BUSYBOX_IMAGE, "command": ["/bin/sh", "-c", "echo failing; exit 3"]}
    ok = {"image": BUSYBOX_IMAGE, "command": ["/bin/sh", "-c", "sleep 1; echo ok"]}
    pipe = {
        "name": "fails",
        "defaults": {"log": f"{tmp_path}/{{step}}-%j.out", "grace_s": 5},
        "steps": [
            {"name": "a", "job": ok},
            {"name": "b", "depends_on": ["a"], "job": fail},
            {"name": "c", "depends_on": ["b"], "job": ok},
            {"name": "d", "depends_on": ["a"], "job": ok},
        ],
    }
    path = tmp_path / "fails.yaml"
    path.write_text(yaml.safe_dump(pipe))
    cli(sandbox, tmp_path, "pipeline", "run", "--json", str(path))
    try:
        final = poll(lambda: (st := status(sandbox, tmp_path, "fails"))["c"]["state"] != "PENDING"
                     and st["d"]["state"] == "COMPLETED" and st, 120, "c cancelled and d done")
    finally:
        cli(sandbox, tmp_path, "pipeline", "cancel", "--json", str(path))
    assert final["a"]["state"] == "COMPLETED" and final["b"]["state"] == "FAILED"
    assert final["c"]["state"] == "CANCELLED"
    assert final["c"]["reason"] == "upstream step 'b' failed: this step will not run"
    log = next(tmp_path.glob("b-*.out")).read_text()
    assert "container exited with code 3" in log


@pytest.mark.slow
def test_a_requeued_step_keeps_its_downstream_waiting(
    sandbox: Any, images: None, tmp_path: Path
) -> None:
    """Reclaiming the node under a running step (scontrol requeue) sends it back to the queue;
    its downstream stays PENDING on the dependency (not cancelled), and both complete once
    the step resumes from its checkpoint."""
    pipe = {
        "name": "requeued",
        "defaults": {
            "image": "slurm-idle/demo:latest", "gpus": 1, "grace_s": 5, "network": "none",
            "params": {"steps": 12, "step_s": 1, "checkpoint_every": 2},
            "mounts": {"checkpoint": {"source": f"{tmp_path}/{{step}}/ck", "target": "/checkpoint"}},
            "log": f"{tmp_path}/{{step}}-%j.out",
        },
        "steps": [
            {"name": "train", "job": {}},
            {"name": "eval", "depends_on": ["train"], "job": {"params": {"steps": 2}}},
        ],
    }
    path = tmp_path / "requeued.yaml"
    path.write_text(yaml.safe_dump(pipe))
    run = cli(sandbox, tmp_path, "pipeline", "run", "--json", str(path))
    ids = {s["name"]: s["job_id"] for s in run["steps"]}
    try:
        poll(lambda: any("step=3\n" in p.read_text() for p in tmp_path.glob("train-*.out")),
             90, "train at step 3")
        r = sandbox.run(["scontrol", "requeue", str(ids["train"])])
        assert r.returncode == 0, r.stderr
        seen: list[tuple[str, str]] = []

        def train_back_then_done() -> dict[str, Any] | None:
            st = status(sandbox, tmp_path, "requeued")
            seen.append((st["train"]["state"], st["eval"]["state"]))
            assert st["eval"]["state"] not in {"CANCELLED", "FAILED"}, st["eval"]
            assert st["train"]["state"] not in {"CANCELLED", "FAILED"}, st["train"]
            return st if st["eval"]["state"] == "COMPLETED" else None

        final = poll(train_back_then_done, 180, "eval completed after train's requeue")
    finally:
        cli(sandbox, tmp_path, "pipeline", "cancel", "--json", str(path))
    assert final["train"]["state"] == "COMPLETED"
    assert any(e == "PENDING" and t != "COMPLETED" for t, e in seen), seen  # eval waited
    train_log = next(tmp_path.glob("train-*.out")).read_text()
    assert "resumed_from=" in train_log and "done steps=12 sum=78" in train_log
