"""`slurm-idle agent` on the sandbox (issue 15): a surge is met by a fast check, within
fast_interval_s + a few seconds, not at the next full tick; SIGTERM stops it cleanly.

The test lends two nodes, starts the agent (full tick every 60 s, fast check every 10 s),
waits until just after a full tick (the worst moment for cron), raises the load to 500 req/s
and measures load rise -> reclaim started -> serving. It prints the agent's numbers beside
what cron-style ticks would give on the same run (the reclaim could only start at the next
full tick), sends SIGTERM right after the reclaim starts, and checks that the agent exits 0
and a plain `tick` afterwards finds nothing half-done.
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
from slurm_idle.journal import Journal, TickRecord, typed_records
from slurm_idle.model import Phase
from slurm_idle.testing.demo import reset_cluster
from slurm_idle.testing.waiting import poll
from slurm_idle.wiring import build_agent

pytestmark = pytest.mark.sandbox

TICK_S, FAST_S = 60, 10


def cli(sb: Any, env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    proc = sb.run([sys.executable, "-m", "slurm_idle.cli", *args], capture_output=True, text=True,
                  env=env)
    assert proc.returncode == 0, (args, proc.stderr)
    return proc


def why_reclaimed(journal: Path, since: float) -> list[tuple[str, str, str, str]]:
    """(node, from, to, reason) of gpu1's and gpu2's transitions journaled since `since`: what
    to look at when the reclaim came before the load rise (a state left by a module run
    earlier on the same worker)."""
    out = []
    for line in journal.read_text().splitlines() if journal.exists() else []:
        try:
            r = json.loads(line)
        except ValueError:
            continue
        if r.get("event") == "transition" and float(r.get("ts", 0)) >= since \
                and r.get("node") in ("gpu1", "gpu2"):
            out.append((r["node"], r.get("from", ""), r.get("to", ""), r.get("reason", "")))
    return out


def tick_times(journal: Path) -> list[float]:
    """Every journaled tick's start, oldest first; a run of identical idle ticks (one record,
    the one being counted in the side file included: idle_runs.py) spread over its span."""
    out: list[float] = []
    for rec in typed_records(Journal(journal).records()):
        if isinstance(rec, TickRecord):
            step = (rec.last_ts - rec.ts) / (rec.count - 1) if rec.count > 1 else 0.0
            out += [rec.ts + i * step for i in range(rec.count)]
    return out


@pytest.mark.slow
def test_agent_reclaims_within_a_fast_interval_and_stops_on_sigterm(
    sandbox: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Load 500: the agent starts the reclaim within fast_interval_s + a few seconds (cron: at
    the next minute), the nodes serve, SIGTERM ends it with exit 0, and a tick then finds every
    node serving with nothing in transition."""
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

    def drained() -> bool:
        loads = build_agent(config, with_textfile=False, read_only=True).observe().models
        return all(m.known and m.waiting == 0 and m.running == 0 for m in loads)

    # Quiet before the agent's first tick: every engine up and no queue left by a module run
    # before this one on the same worker (sharded suite), or that tick reclaims at once.
    poll(lambda: all(e["healthy"] and e["sleeping"] is not True
                     for e in sb.status()["emulators"].values()), 60,
         "every emulator healthy and awake", interval_s=1.0)
    poll(drained, 180, "no request queued or running", interval_s=2.0)

    def phases() -> dict[str, Phase]:
        return {v.name: v.phase for v in build_agent(config, with_textfile=False,
                                                     read_only=True).observe().nodes}

    cli(sb, env, "tick")  # adopt every node into serving
    for node in ("gpu1", "gpu2"):
        cli(sb, env, "lend", node)
    assert {n for n, p in phases().items() if p is Phase.LENT} >= {"gpu1", "gpu2"}
    cli(sb, env, "pin", "gpu3")  # the agent must not lend every node at load 0 either
    cli(sb, env, "pin", "gpu4")

    def at_rest() -> bool:
        """The planner reclaims nothing now: the load history of a module run before this
        one on the same worker (its level and trend over the planner's windows) is gone."""
        plan = json.loads(cli(sb, env, "tick", "--dry-run", "--json").stdout)
        return not any(a["kind"] == "reclaim" for a in plan["actions"])

    poll(at_rest, 600, "the planner at rest (no reclaim at load 0)", interval_s=5.0)
    agent_started = time.time()
    agent = subprocess.Popen([sys.executable, "-m", "slurm_idle.cli", "agent", "--json"], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        before = len(tick_times(journal))
        poll(lambda: len(tick_times(journal)) > before, 60, "the agent's first full tick")
        first_tick = tick_times(journal)[-1]
        time.sleep(3)  # just after a full tick: cron would only act a minute later
        sb.load(500.0)
        rise = time.time()
        lent = {"gpu1", "gpu2"}
        started: dict[str, float] = {}
        serving: dict[str, float] = {}

        def reclaim_started() -> bool:
            for node, phase in phases().items():
                if node in lent and phase is not Phase.LENT and node not in started:
                    started[node] = time.time() - rise
            return bool(started)

        poll(reclaim_started, TICK_S + 30, "a lent node leaving lent", interval_s=0.5)
        agent.send_signal(signal.SIGTERM)  # mid-transition: the pass in flight finishes its steps

        def all_serving() -> bool:
            now = phases()
            for node in lent:
                if now[node] is Phase.SERVING and node not in serving:
                    serving[node] = time.time() - rise
            return all(now[n] is Phase.SERVING for n in lent)

        poll(all_serving, 180, "the reclaimed nodes serving", interval_s=0.5)
        out, err = agent.communicate(timeout=config.timeouts.tick_budget_s + 30)
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.wait()
        sb.load(0.0)  # the session's sandbox is shared: leave it quiet for the next test
        poll(drained, 180, "the surge's queue drained", interval_s=2.0)
    first_start = min(started.values())
    next_tick = first_tick + TICK_S
    cron_start = max(0.0, next_tick - rise)
    print(f"\nagent (tick {TICK_S}s, fast {FAST_S}s): load rise -> reclaim started "
          f"{first_start:.1f}s -> serving {max(serving.values()):.1f}s (per node {serving}); "
          f"cron-style ticks would start the reclaim at the next full tick, {cron_start:.1f}s "
          f"after the rise (serving ~{cron_start + max(serving.values()) - first_start:.1f}s)")
    assert agent.returncode == 0, err
    stats = json.loads(out)
    if not stats["fast_checks"]:  # the reclaim came before the rise: say why, in full
        for record in why_reclaimed(journal, agent_started):
            print("before the rise:", record)
    assert stats["ticks"] >= 1 and stats["fast_checks"] >= 1, stats
    # the queue must last policy.queue_sustain_s (5 s here) before it counts, then a fast check
    assert first_start <= FAST_S + config.policy.queue_sustain_s + 5, (started, err)
    assert first_start < cron_start
    # Nothing half-done: a plain tick carries on whatever the stop left; all nodes end serving.
    cli(sb, env, "tick")
    final = phases()
    assert all(final[n] is Phase.SERVING for n in lent), final
    assert not [n for n, p in final.items() if p in (Phase.RECLAIMING, Phase.STARTING)], final
    for node in ("gpu3", "gpu4"):
        cli(sb, env, "unpin", node)
