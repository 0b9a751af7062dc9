"""Only a live engine is capacity, on the sandbox: under `slurm-idle agent`, the engine of the
only serving node is stopped behind the agent's back (`scripts/sandbox engine-stop`): `status`
shows it not serving at once, and a fast check reclaims a lent node within fast_interval_s,
without waiting for the next full tick; the full tick after repairs the dead engine.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from slurm_idle.config import load_config
from slurm_idle.model import Phase
from slurm_idle.testing.demo import reset_cluster
from slurm_idle.testing.waiting import poll

from .test_agent_loop import cli, tick_times

pytestmark = pytest.mark.sandbox

TICK_S, FAST_S = 60, 10
LENT = ("gpu2", "gpu3", "gpu4")


def status(sb: Any, env: dict[str, str]) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(cli(sb, env, "status", "--json").stdout)
    return doc


@pytest.mark.slow
def test_a_dead_serving_engine_is_replaced_within_a_fast_interval(sandbox: Any, tmp_path: Path) -> None:
    """gpu1 serves alone, gpu[2-4] are lent, load 0 (no pressure at all). Its engine is stopped
    just after the agent's full tick: `status` says gpu1 is not answering and the model serves
    0 replicas; a lent node leaves LENT within fast_interval_s + a few seconds, through a fast
    check; the next tick repairs gpu1 (SIGTERM ends the agent with exit 0 first)."""
    sb = sandbox
    base = load_config(sb.config_path)
    doc = yaml.safe_load(Path(sb.config_path).read_text())
    doc["policy"].update({"tick_interval_s": TICK_S, "fast_interval_s": FAST_S})
    config_path = tmp_path / "agent.yaml"
    config_path.write_text(yaml.safe_dump(doc))
    env = {**os.environ, **sb.env(), "SLURM_IDLE_CONFIG": str(config_path)}
    journal = Path(load_config(config_path).paths.journal)
    reset_cluster(sb, base.paths.journal)
    cli(sb, env, "tick")  # adopt every node into serving
    for node in LENT:
        cli(sb, env, "lend", node)

    def phases() -> dict[str, str]:
        return {n["name"]: n["phase"] for n in status(sb, env)["nodes"]}

    assert phases() == {"gpu1": Phase.SERVING.value, **{n: Phase.LENT.value for n in LENT}}

    def at_rest() -> bool:
        """The planner reclaims nothing now: the load history of a module run before this
        one on the same worker (its level and trend over the planner's windows) is gone, or
        the agent's first tick reclaims for it and gpu1 is not serving alone."""
        plan = json.loads(cli(sb, env, "tick", "--dry-run", "--json").stdout)
        return not any(a["kind"] == "reclaim" for a in plan["actions"])

    poll(at_rest, 600, "the planner at rest (no reclaim at load 0)", interval_s=5.0)
    agent = subprocess.Popen([sys.executable, "-m", "slurm_idle.cli", "agent", "--json"], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        before = len(tick_times(journal))
        poll(lambda: len(tick_times(journal)) > before, 60, "the agent's first full tick")
        assert sb.engine_stop("gpu1")
        stopped = time.time()
        seen = status(sb, env)
        [gpu1] = [r for r in seen["replicas"] if r["name"] == "gpu1"]
        assert gpu1["phase"] == "serving" and gpu1["healthy"] is False, gpu1
        assert gpu1["health_summary"] == "engine not answering /health", gpu1
        assert [m["serving"] for m in seen["models"]] == [0], seen["models"]
        left: dict[str, float] = {}

        def reclaimed() -> bool:
            now = phases()
            left.update({n: time.time() - stopped for n in LENT if now[n] != Phase.LENT.value})
            return bool(left)

        poll(reclaimed, TICK_S, "a lent node leaving lent", interval_s=0.5)
        agent.send_signal(signal.SIGTERM)
        out, err = agent.communicate(timeout=60)
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.wait()
    print(f"\nengine of gpu1 stopped -> lent node leaving lent after {min(left.values()):.1f}s "
          f"({left}); fast checks every {FAST_S}s, full ticks every {TICK_S}s")
    assert agent.returncode == 0, err
    assert min(left.values()) <= FAST_S + 5, (left, err)
    stats = json.loads(out)
    assert stats["fast_actions"] >= 1 and stats["ticks"] == 1, stats  # no second full tick
    cli(sb, env, "tick")  # the full tick repairs gpu1 (restarts its engine)
    poll(lambda: phases()["gpu1"] == Phase.SERVING.value and not status(sb, env)["attention"],
         60, "gpu1 repaired and serving")
