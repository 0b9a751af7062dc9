"""An admin's `lend` obeys the floor on the sandbox, and the agent restores a floor broken
with `--force` by a fast check (rules.lend_refusal, rules.below_floor).

Three of the default model's four nodes are lent by the admin; `lend gpu4` of the last
serving replica exits 2 naming the floor (and with --dry-run), changing nothing. With the
agent running (full tick every 60 s, fast check every 5 s), `lend gpu4 --force` right after a
full tick lends it and journals the override; the agent starts a reclaim within
fast_interval_s + a few seconds (a full tick would come up to a minute later), and a node
serves again.
"""

from __future__ import annotations

import json
import os
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
from slurm_idle.wiring import build_agent

from .test_agent_loop import tick_times

pytestmark = pytest.mark.sandbox

TICK_S, FAST_S = 60, 5
NODES = ("gpu1", "gpu2", "gpu3", "gpu4")


def run(sb: Any, env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    """A `slurm-idle` command, retried while the agent's pass holds the tick lock."""
    for _ in range(60):
        proc: subprocess.CompletedProcess[str] = sb.run(
            [sys.executable, "-m", "slurm_idle.cli", *args], capture_output=True, text=True, env=env)
        if "a tick is running" not in proc.stderr:
            return proc
        time.sleep(0.5)
    raise AssertionError(f"{args}: the tick lock stayed held")


@pytest.mark.slow
def test_lend_below_the_floor_exits_2_and_force_is_undone_by_a_fast_check(
    sandbox: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Exit 2 naming min_serving_replicas (dry run too); --force lends and is journaled; the
    agent's fast check starts a reclaim within fast_interval_s + a few seconds."""
    sb = sandbox
    base = load_config(sb.config_path)
    doc = yaml.safe_load(Path(sb.config_path).read_text())
    doc["policy"].update({"tick_interval_s": TICK_S, "fast_interval_s": FAST_S})
    config_path = tmp_path / "agent.yaml"
    config_path.write_text(yaml.safe_dump(doc))
    env = {**os.environ, **sb.env(), "SLURM_IDLE_CONFIG": str(config_path)}
    for key, value in sb.env().items():  # the in-process observer reads the same cluster
        monkeypatch.setenv(key, value)
    config = load_config(config_path)
    journal = Path(config.paths.journal)
    reset_cluster(sb, base.paths.journal)

    def phases() -> dict[str, Phase]:
        views = build_agent(config, with_textfile=False, read_only=True).observe().nodes
        return {v.name: v.phase for v in views if v.name in NODES}

    assert run(sb, env, "tick").returncode == 0  # adopt every node into serving
    for node in NODES[:3]:
        done = run(sb, env, "lend", node)
        assert done.returncode == 0, done.stderr
    assert [p for p in phases().values()] == [Phase.LENT] * 3 + [Phase.SERVING]
    for extra in ((), ("--dry-run",)):
        refused = run(sb, env, "lend", "gpu4", *extra)
        assert refused.returncode == 2, (extra, refused.stdout, refused.stderr)
        assert "under its floor (min_serving_replicas 1)" in refused.stderr, refused.stderr
        assert "--force" in refused.stderr
    assert phases()["gpu4"] is Phase.SERVING

    def at_rest() -> bool:
        """The planner reclaims nothing now: the load history a module run before this one on
        the same worker left (its level and trend over the planner's windows) is gone."""
        plan = json.loads(run(sb, env, "tick", "--dry-run", "--json").stdout)
        return not any(a["kind"] == "reclaim" for a in plan["actions"])

    poll(at_rest, 600, "the planner at rest (no reclaim at load 0)", interval_s=5.0)
    agent = subprocess.Popen([sys.executable, "-m", "slurm_idle.cli", "agent", "--json"], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        before = len(tick_times(journal))
        poll(lambda: len(tick_times(journal)) > before, 60, "the agent's first full tick")
        now = phases()  # the floor met, nothing to reclaim: the agent moved nothing
        assert now == {**{n: Phase.LENT for n in NODES[:3]}, "gpu4": Phase.SERVING}, now
        forced = run(sb, env, "lend", "gpu4", "--force", "--json")
        lent_at = time.time()
        assert forced.returncode == 0, forced.stderr
        assert "under its floor" in json.loads(forced.stdout)["forced"]
        next_tick = tick_times(journal)[-1] + TICK_S
        started: dict[str, float] = {}

        def reclaim_started() -> bool:
            for node, phase in phases().items():
                if phase is not Phase.LENT and node not in started:
                    started[node] = time.time() - lent_at
            return bool(started)

        poll(reclaim_started, TICK_S + 30, "a node leaving lent", interval_s=0.5)
        poll(lambda: Phase.SERVING in phases().values(), 180, "a node serving again")
        back_s = time.time() - lent_at
    finally:
        agent.terminate()
        try:
            agent.communicate(timeout=config.timeouts.tick_budget_s + 30)
        except subprocess.TimeoutExpired:
            agent.kill()
            agent.communicate()
    first = min(started.values())
    print(f"\nlend --force of the last serving replica: reclaim started {first:.1f}s after it "
          f"returned (fast check every {FAST_S}s; next full tick {next_tick - lent_at:.1f}s "
          f"after), a node serving {back_s:.1f}s after")
    assert first <= FAST_S + 5, started
    records = [json.loads(line) for line in journal.read_text().splitlines()]
    forced_records = [r for r in records if r.get("event") == "admin" and r.get("command") == "lend --force"]
    assert [(r["node"], r["phase"]) for r in forced_records] == [("gpu4", "serving")]
    assert "under its floor" in forced_records[0]["detail"]
    assert run(sb, env, "tick").returncode in (0, 1)  # carry on whatever the stop left
