"""A wake that answers 500 (the GPU held by something the gate cannot see) is retried with a
backoff, then given up: the node goes to the admin with the engine's error and the planner
reclaims another node in its place, on the real sandbox (Slurm, emulators with sleep mode,
HAProxy, the fake GPUs and their DCGM-named exporter).

The gate would keep the engine from waking on a held GPU at all (tests/e2e/test_gpu_held.py);
here its tolerance is set above the hold, as on a site whose exporter misreads or lags, so the
wake itself meets the out-of-memory error vLLM answers.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from slurm_idle.testing.demo import reset_cluster
from slurm_idle.testing.waiting import poll

pytestmark = [pytest.mark.sandbox, pytest.mark.slow]

HOLD_MIB = 20000  # the emulator's 70000 MiB of weights + this > a GPU's 81559: its wake fails


def _config(sb: Any, tmp_path: Path, floor: int) -> Path:
    doc = yaml.safe_load(sb.config_path.read_text())
    doc["engine"] = {"kind": "http-sleep", "drain_timeout_s": 10, "start_timeout_s": 20,
                     "stop_timeout_s": 15, "http_timeout_s": 2, "wake_attempts": 2}
    doc["gpu"]["free_tolerance_mib"] = 30000  # the gate does not see the hold (see above)
    doc["models"][0]["min_serving_replicas"] = floor
    doc["policy"]["min_job_runtime_s"] = 600  # gpu2's young job: gpu1 is reclaimed first
    doc["timeouts"]["tick_budget_s"] = 30
    doc["paths"]["journal"] = str(tmp_path / "journal.jsonl")
    doc["paths"]["textfile"] = str(tmp_path / "slurm_idle.prom")
    path = tmp_path / f"wake-failed-floor{floor}.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def _cli(sb: Any, config: Path, *args: str, ok: bool = True) -> Any:
    proc = sb.run([sys.executable, "-m", "slurm_idle.cli", "--config", str(config), *args],
                  capture_output=True, text=True, timeout=180)
    if ok:
        assert proc.returncode == 0, (args, proc.stdout[-2000:], proc.stderr[-2000:])
    return proc


def _node(sb: Any, name: str) -> dict[str, str]:
    out = sb.run(["scontrol", "-o", "show", "node", name], capture_output=True, text=True).stdout
    fields: dict[str, str] = {}
    for tok in out.split():
        if "=" in tok:
            key, value = tok.split("=", 1)
            fields[key] = value
    reason = out.split("Reason=", 1)[1] if "Reason=" in out else ""
    fields["Reason"] = reason.rsplit(" [", 1)[0].strip()  # "... [root@2026-12-06T...]"
    return fields


def _phases(sb: Any, config: Path) -> dict[str, str]:
    doc = json.loads(_cli(sb, config, "status", "--json").stdout)
    return {n["name"]: n["phase"] for n in doc["nodes"]}


def test_a_wake_answering_500_backs_off_then_goes_to_the_admin_and_another_node_serves(
        sandbox: Any, tmp_path: Path) -> None:
    sb = sandbox
    lend_cfg, cfg = _config(sb, tmp_path, floor=1), _config(sb, tmp_path, floor=3)
    reset_cluster(sb, str(tmp_path / "journal.jsonl"))
    try:
        _cli(sb, lend_cfg, "tick")  # adopt every node into serving
        for node in ("gpu3", "gpu4"):
            _cli(sb, lend_cfg, "pin", node)
        for node in ("gpu1", "gpu2"):
            if _phases(sb, lend_cfg)[node] != "lent":
                _cli(sb, lend_cfg, "lend", node)
        assert {n: p for n, p in _phases(sb, cfg).items() if n in ("gpu1", "gpu2")} == \
            {"gpu1": "lent", "gpu2": "lent"}
        sb.run(["sbatch", "-p", "idle", "-w", "gpu2", "--requeue", "--gres=gpu:1",
                "--wrap", "sleep 600"], check=True, capture_output=True)
        poll(lambda: "gpu2" in sb.run(["squeue", "-h", "-t", "R", "-o", "%N"], capture_output=True,
                                      text=True).stdout, 60, "the idle job on gpu2 runs")
        sb.gpu_hold("gpu1", 0, mib=HOLD_MIB)  # outside Slurm, after the lend: a leftover

        # Floor 3 with two serving: gpu1 (no job) is reclaimed first; its wake answers 500.
        first = _cli(sb, cfg, "tick", ok=False)
        assert first.returncode == 1, first.stderr[-2000:]
        assert "start or wake 1 of 2 failed" in first.stderr and "out of memory" in first.stderr

        # At once, the next tick counts gpu1 out and takes gpu2 (its young job requeued), while
        # gpu1 backs off: no second wake yet.
        def gpu2_serving() -> bool:
            _cli(sb, cfg, "tick", ok=False)
            return _phases(sb, cfg)["gpu2"] == "serving"

        poll(gpu2_serving, 120, "gpu2 reclaimed in gpu1's place and serving", interval_s=2.0)
        journal = [json.loads(line) for line in (tmp_path / "journal.jsonl").read_text().splitlines()]
        wakes = [r for r in journal if r.get("event") == "transition" and r.get("node") == "gpu1"
                 and "failed" in str(r.get("error", ""))]
        assert len(wakes) == 1, wakes  # backing off, not hammering

        # After the backoff (15 s): the second failure is the last: handed to the admin.
        def handed_over() -> bool:
            _cli(sb, cfg, "tick", ok=False)
            return _phases(sb, cfg)["gpu1"] == "admin"

        began = time.monotonic()
        poll(handed_over, 90, "gpu1 handed to the admin", interval_s=3.0)
        reason = _node(sb, "gpu1")["Reason"]
        assert reason.startswith("slurm-idle:wake-failed since="), reason
        assert "out of memory" in reason and "scontrol update nodename=gpu1 state=resume" in reason
        prom = (tmp_path / "slurm_idle.prom").read_text()
        _cli(sb, cfg, "tick", ok=False)  # the textfile reads the Reasons it observes
        prom = (tmp_path / "slurm_idle.prom").read_text()
        assert 'slurm_idle_wake_failed{node="gpu1",replica="gpu1"' in prom, prom
        assert _phases(sb, cfg)["gpu2"] == "serving"
        assert time.monotonic() - began < 90
    finally:
        sb.gpu_release()
        sb.engine_stop("gpu1")  # asleep after its failed wakes: the next module starts it afresh
        for node in ("gpu3", "gpu4"):
            _cli(sb, lend_cfg, "unpin", node, ok=False)
        sb.run(["scontrol", "update", "nodename=gpu1", "state=RESUME"], capture_output=True)
