"""A GPU someone still holds keeps its node out of serving, on the real sandbox.

Every node serving, then gpu3 and gpu4 lent; a process outside Slurm holds GPU 0 of gpu3
(`Sandbox.gpu_hold`, as a leftover container does) and GPU 1 of gpu4. Client traffic runs
through HAProxy and the simulated load needs both lent nodes back. The ticks reclaim both:
neither engine starts on a held GPU, both wait in `held` and `explain` names the GPU, its MiB
and its holder; gpu4's hold ends before timeouts.gpu_free_s and gpu4 serves; gpu3's does not,
so gpu3 is drained for the admin with a Reason naming the holder, the textfile says so and the
sandbox's Prometheus fires SlurmIdleGpuHeld. No client request fails meanwhile. `status
--json` shows every pool node's GPU readings throughout. Once the admin frees the GPU and
resumes the node, as the Reason says, the next tick brings it back to serving.
"""

from __future__ import annotations

import json
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml

from slurm_idle.config import load_config
from slurm_idle.testing.demo import reset_cluster
from slurm_idle.testing.waiting import poll

pytestmark = pytest.mark.sandbox

HELD, FREED = "gpu3", "gpu4"  # gpu3's hold outlives gpu_free_s; gpu4's ends before it
HOLD_MIB = 20000
GPU_FREE_S = 20
TICK_BUDGET_S = 10
CLIENT_RPS = 1.0
# Each emulator does 5 req/s (Capacity: 500 tokens/s, 100 a request); at target_utilisation
# 0.4 the planner counts 240 weighted tokens/s (120 a request) per replica, so 6 + 1 req/s need
# all 4 replicas, while the 2 left serving carry them at 70% of what they can do.
SIMULATED_RPS = 6.0
MAX_TICKS = 8


def cli(sb: Any, config: Path, *args: str, check: bool = True) -> Any:
    proc = sb.run([sys.executable, "-m", "slurm_idle.cli", "--config", str(config), *args],
                  timeout=180)
    if check:
        assert proc.returncode == 0, (args, proc.stdout[-2000:], proc.stderr[-2000:])
    return proc


def gpu_held_config(sb: Any, tmp_path: Path) -> Path:
    """The sandbox's config (its journal and textfile, which Prometheus scrapes) with a short
    gpu_free_s and tick budget, and a planner sized for the present load alone."""
    doc = yaml.safe_load(sb.config_path.read_text())
    doc["timeouts"].update(gpu_free_s=GPU_FREE_S, tick_budget_s=TICK_BUDGET_S)
    doc["policy"].update(target_utilisation=0.4, headroom_sigmas=0)
    path = tmp_path / "slurm-idle-gpu-held.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def pool(sb: Any, config: Path) -> dict[str, dict[str, Any]]:
    doc = json.loads(cli(sb, config, "status", "--json").stdout)
    return {n["name"]: n for n in doc["nodes"]}


def engine_running(sb: Any, node: str) -> bool:
    """Its emulator's process is recorded or its port answers (the engine was started)."""
    import socket

    port = int(sb.emulator_url(node).rsplit(":", 1)[1])
    with socket.socket() as s:
        s.settimeout(0.5)
        listening = s.connect_ex(("127.0.0.1", port)) == 0
    return listening or f"emulator-{node}" in sb._recorded()


def node_reason(sb: Any, node: str) -> str:
    out = sb.run(["scontrol", "show", "node", node]).stdout
    return out.split("Reason=", 1)[1].splitlines()[0] if "Reason=" in out else ""


def firing(sb: Any, name: str) -> list[dict[str, Any]]:
    with urllib.request.urlopen(f"{sb.prometheus_url}/api/v1/alerts", timeout=5) as r:
        alerts = json.loads(r.read())["data"]["alerts"]
    return [a for a in alerts if a["labels"]["alertname"] == name and a["state"] == "firing"]


@pytest.mark.slow
def test_a_held_gpu_is_never_woken_and_is_handed_to_the_admin(sandbox: Any, tmp_path: Path) -> None:
    """Load needing both lent nodes back: neither engine starts on a held GPU; the hold that
    ends before gpu_free_s lets its node serve; the other node is handed over past gpu_free_s
    (Reason naming GPU, MiB and holder), SlurmIdleGpuHeld fires; 0 failed client requests."""
    sb = sandbox
    config = gpu_held_config(sb, tmp_path)
    reset_cluster(sb, load_config(config).paths.journal)
    try:
        _play(sb, config)
    finally:
        sb.traffic_stop()
        reset_cluster(sb, load_config(config).paths.journal)  # ends the holds, resumes gpu3


def _play(sb: Any, config: Path) -> None:
    cli(sb, config, "tick")  # adopt every node into serving
    for node in (HELD, FREED):
        cli(sb, config, "lend", node)
    nodes = pool(sb, config)
    assert {n: nodes[n]["phase"] for n in (HELD, FREED)} == {HELD: "lent", FREED: "lent"}
    assert all(isinstance(v["gpus"], list) and v["gpus"] for v in nodes.values()), nodes
    sb.gpu_hold(HELD, 0, mib=HOLD_MIB)
    sb.gpu_hold(FREED, 1, mib=HOLD_MIB)
    sb.traffic(CLIENT_RPS)
    sb.load(SIMULATED_RPS)
    cfg = load_config(config)
    time.sleep(cfg.metrics.rate_window_s / 2 + cfg.policy.queue_sustain_s + 2)  # seen by Prometheus

    started = time.monotonic()
    timeline: dict[str, float] = {}
    for tick in range(1, MAX_TICKS + 1):
        doc = json.loads(cli(sb, config, "tick", "--json", check=False).stdout)
        print(f"tick {tick} at {time.monotonic() - started:.1f}s: "
              f"{[(s['node'], s['to'], s['outcome'], s.get('error') or s.get('detail')) for s in doc['steps']]}",
              flush=True)
        assert not any(s["node"] == HELD and s["to"] == "starting" and s["outcome"] == "ok"
                       for s in doc["steps"]), f"{HELD}'s engine started on a held GPU"
        assert not engine_running(sb, HELD), f"{HELD}'s engine runs on a held GPU"
        nodes = pool(sb, config)
        phases = {n: v["phase"] for n, v in nodes.items()}
        assert all(isinstance(v["gpus"], list) and v["gpus"] for v in nodes.values()), nodes
        if phases[HELD] == "held" and "held" not in timeline:
            timeline["held"] = time.monotonic() - started
            _check_held(sb, config, nodes)
        if f"gpuhold-{FREED}-1" in sb.gpu_holds() and phases[FREED] == "held":
            assert not engine_running(sb, FREED)
            sb.gpu_release(FREED)  # before gpu_free_s: the next tick starts its engine
            timeline["freed"] = time.monotonic() - started
        if phases[FREED] == "serving" and f"{FREED} serving" not in timeline:
            timeline[f"{FREED} serving"] = time.monotonic() - started
        if phases[HELD] == "admin" and "handed over" not in timeline:
            timeline["handed over"] = time.monotonic() - started
        if "handed over" in timeline and f"{FREED} serving" in timeline and tick_textfile_ok(sb):
            break
    print(f"MEASURE gpu-held: {json.dumps({k: round(v, 1) for k, v in timeline.items()})}",
          flush=True)
    assert "held" in timeline and "freed" in timeline, timeline
    assert f"{FREED} serving" in timeline and "handed over" in timeline, (timeline, phases)
    assert timeline["handed over"] - timeline["held"] >= GPU_FREE_S - TICK_BUDGET_S

    reason = node_reason(sb, HELD)
    assert reason.startswith("slurm-idle:gpu-held since="), reason
    assert f"GPU 0: {HOLD_MIB} MiB, holder unknown" in reason, reason
    assert f"scontrol update nodename={HELD} state=resume" in reason, reason
    alert = poll(lambda: firing(sb, "SlurmIdleGpuHeld"), 30, "SlurmIdleGpuHeld firing")
    assert [(a["labels"]["node"], a["labels"]["gpu"], a["labels"]["mib"], a["labels"]["holder"])
            for a in alert] == [(HELD, "0", str(HOLD_MIB), "unknown")]
    assert not engine_running(sb, HELD)
    assert pool(sb, config)[FREED]["phase"] == "serving"
    assert sb.router_states().get(FREED) == "UP"
    time.sleep(2)
    stats = sb.traffic_stats()
    print(f"MEASURE gpu-held clients: {json.dumps(stats)}", flush=True)
    assert stats["requests"] >= CLIENT_RPS * 20 and stats["failed"] == 0, stats

    # What the Reason and the alert tell the admin to do: free the GPU, resume the node.
    sb.gpu_release(HELD)
    sb.run(["scontrol", "update", f"nodename={HELD}", "state=resume"], check=True)
    cli(sb, config, "tick")
    assert pool(sb, config)[HELD]["phase"] == "serving"


def tick_textfile_ok(sb: Any) -> bool:
    """The sandbox's textfile names the handed-over GPU (written by the tick after the one
    that handed it over: the Reason is read back from Slurm)."""
    text = sb.layout.textfiles["slurm_idle.prom"].read_text()
    return any(line.startswith("slurm_idle_gpu_held{") and f'node="{HELD}"' in line
               for line in text.splitlines())


def _check_held(sb: Any, config: Path, nodes: dict[str, dict[str, Any]]) -> None:
    """While gpu3 waits in `held`: explain names the GPU, its MiB and holder; status shows it."""
    (gpu0,) = [g for g in nodes[HELD]["gpus"] if g["index"] == 0]
    assert gpu0["used_mib"] >= HOLD_MIB and gpu0["holder"] is None, gpu0
    out = cli(sb, config, "explain", HELD).stdout
    assert f"{HELD} GPU 0: {HOLD_MIB} MiB held" in out and "holder unknown" in out, out
