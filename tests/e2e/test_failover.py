"""Several agents, one actor; a dead leader's reclaim finished by its standby; every agent
stopped, the node-local watchdog gives lent nodes back (leadership.py, watchdog.py).

Two `slurm-idle agent --instance a|b` run on the sandbox, each with its own journal, lock and
textfile (as on two hosts), sharing the lease in Slurm. Under alternating load only one ever
acts: every journaled transition carries the epoch it was made under, and in time order the
epochs never go down nor are shared by two instances. Then `kill -9` of the leader mid-reclaim:
the standby takes over within ha.lease_s + a pass and finishes the reclaim; the idle jobs on the
reclaimed nodes are requeued, none FAILED or CANCELLED.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import yaml

from slurm_idle.config import load_config
from slurm_idle.model import Phase
from slurm_idle.testing.demo import reset_cluster
from slurm_idle.testing.waiting import poll
from slurm_idle.wiring import build_agent

pytestmark = pytest.mark.sandbox

TICK_S, FAST_S, LEASE_S, DEAD_AFTER_S = 20, 3, 12, 25
#: How long the two agents run under alternating load (a longer run: SLURM_IDLE_FAILOVER_S).
ALTERNATE_S = float(os.environ.get("SLURM_IDLE_FAILOVER_S", "160"))
HALF_PERIOD_S = 75.0  # load up, load down: long enough for a lend at 0 and a reclaim at HIGH_RPS
HIGH_RPS = 40.0  # more than the pinned node serves: every lent node comes back


def write_config(sb: Any, tmp_path: Path, name: str, ha: dict[str, Any] | None = None) -> Path:
    doc = yaml.safe_load(Path(sb.config_path).read_text())
    doc["policy"].update({"tick_interval_s": TICK_S, "fast_interval_s": FAST_S,
                          "headroom_sigmas": 0})
    doc["ha"] = {"enabled": True, "lease_s": LEASE_S, "settle_s": 2,
                 "dead_after_s": DEAD_AFTER_S, **(ha or {})}
    doc["paths"] = {"journal": str(tmp_path / f"journal-{name}.jsonl"),
                    "lock": str(tmp_path / f"run-{name}" / "tick.lock"),
                    "textfile": str(tmp_path / f"{name}.prom")}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def cli(sb: Any, config: Path, *args: str, ok: bool = True) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, **sb.env(), "SLURM_IDLE_CONFIG": str(config)}
    proc = subprocess.run([sys.executable, "-m", "slurm_idle.cli", *args], check=False, capture_output=True,
                          text=True, env=env, timeout=300)
    if ok:
        assert proc.returncode == 0, (args, proc.stderr)
    return proc


@contextmanager
def agent(sb: Any, config: Path, instance: str, log: Path) -> Iterator[subprocess.Popen[str]]:
    env = {**os.environ, **sb.env(), "SLURM_IDLE_CONFIG": str(config)}
    with log.open("a") as out:
        proc = subprocess.Popen([sys.executable, "-m", "slurm_idle.cli", "--log", "stderr",
                                 "agent", "--instance", instance], env=env, stdout=out,
                                stderr=subprocess.STDOUT, text=True)
    try:
        yield proc
    except BaseException:
        print(f"--- {log.name} (last lines)\n" + "\n".join(log.read_text().splitlines()[-40:]))
        raise
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=90)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def records(*journals: Path, since: float = 0.0) -> list[dict[str, Any]]:
    out = []
    for path in journals:
        for line in path.read_text().splitlines() if path.exists() else []:
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
    return sorted((r for r in out if float(r.get("ts", 0)) >= since),
                  key=lambda r: float(r.get("ts", 0)))


def check_one_actor(transitions: list[dict[str, Any]]) -> dict[int, str]:
    """Every transition carries an epoch; in time order epochs never go down; one instance per
    epoch. Returns epoch -> instance."""
    owner: dict[int, str] = {}
    last = 0
    for r in transitions:
        assert isinstance(r.get("epoch"), int), r
        assert r["epoch"] >= last, (r, last)
        last = r["epoch"]
        assert owner.setdefault(r["epoch"], r["instance"]) == r["instance"], (r, owner)
    return owner


def leader(sb: Any, config: Path) -> dict[str, Any] | None:
    proc = cli(sb, config, "status", "--json", ok=False)
    if proc.returncode != 0:
        print("status:", proc.returncode, proc.stderr[-2000:])
    doc = json.loads(proc.stdout)
    lead: dict[str, Any] | None = doc["leader"]
    return lead


def phases(config: Path) -> dict[str, Phase]:
    cfg = load_config(config)
    return {v.name: v.phase for v in build_agent(cfg, with_textfile=False,
                                                 read_only=True).observe().nodes}


def idle_job(sb: Any, node: str) -> int:
    out = sb.run(["sbatch", "--parsable", "-p", "idle", "-w", node, "--requeue", "-n", "1",
                  "-o", "/dev/null", "--wrap", "sleep 3600"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return int(out.stdout.strip().split(";")[0])


def job_states(sb: Any, job_ids: list[int]) -> dict[int, str]:
    out = sb.run(["sacct", "-n", "-X", "-P", "--duplicates", "-o", "JobID,State", "-j",
                  ",".join(map(str, job_ids))], capture_output=True, text=True).stdout
    states: dict[int, str] = {}
    for line in out.splitlines():
        job, _, state = line.partition("|")
        if job.isdigit():
            states.setdefault(int(job), "")
            states[int(job)] += " " + state.split()[0] if state else ""
    return states


def quiet(sb: Any, config: Path) -> None:
    poll(lambda: all(e["healthy"] and e["sleeping"] is not True
                     for e in sb.status()["emulators"].values()), 60,
         "every emulator healthy and awake", interval_s=1.0)

    def drained() -> bool:
        loads = build_agent(load_config(config), with_textfile=False,
                            read_only=True).observe().models
        return all(m.known and m.waiting == 0 and m.running == 0 for m in loads)

    poll(drained, 180, "no request queued or running", interval_s=2.0)


@pytest.mark.slow
def test_two_agents_one_actor_and_the_standby_finishes_a_dead_leaders_reclaim(
    sandbox: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sb = sandbox
    for key, value in sb.env().items():  # the in-process observer reads the same cluster
        monkeypatch.setenv(key, value)
    reset_cluster(sb, load_config(sb.config_path).paths.journal)
    conf_a, conf_b = write_config(sb, tmp_path, "a"), write_config(sb, tmp_path, "b")
    journals = (tmp_path / "journal-a.jsonl", tmp_path / "journal-b.jsonl")
    quiet(sb, conf_a)
    cli(sb, conf_a, "pin", "gpu4")  # one node always serves, whoever leads
    jobs: list[int] = []
    started = time.time()  # the admin's pin before is not an agent's: it carries no epoch
    try:
        with agent(sb, conf_a, "a", tmp_path / "agent-a.log") as proc_a:
            poll(lambda: (leader(sb, conf_a) or {}).get("instance") == "a", 60, "a leads")
            with agent(sb, conf_b, "b", tmp_path / "agent-b.log"):
                # Alternating load: lends and reclaims, only ever by one of them.
                end = time.monotonic() + ALTERNATE_S
                high = False  # at rest first: a lend, then the load brings it back
                while time.monotonic() < end:
                    sb.load(HIGH_RPS if high else 0.0)
                    high = not high
                    time.sleep(min(HALF_PERIOD_S, max(0.0, end - time.monotonic())))
                moves = [r for r in records(*journals, since=started) if r.get("event") == "transition"]
                owners = check_one_actor(moves)
                assert owners and set(owners.values()) == {"a"}, owners  # b never acted
                lends = sum(r.get("to") == "lent" for r in moves)
                reclaims = sum(r.get("from") == "lent" for r in moves)
                print(f"\nalternating {ALTERNATE_S:.0f} s: {len(moves)} transitions ({lends} lent, "
                      f"{reclaims} reclaimed), epochs {owners}")
                assert lends >= 1 and reclaims >= 1, moves  # the load did move nodes
                # Lent nodes with idle jobs on them, then a surge: kill -9 a mid-reclaim.
                sb.load(0.0)
                poll(lambda: sum(p is Phase.LENT for p in phases(conf_a).values()) >= 2, 240,
                     "two nodes lent at load 0", interval_s=2.0)
                lent = sorted(n for n, p in phases(conf_a).items() if p is Phase.LENT)
                jobs = [idle_job(sb, n) for n in lent]
                poll(lambda: all(s.strip().endswith("RUNNING") for s in job_states(sb, jobs).values())
                     and len(job_states(sb, jobs)) == len(jobs), 60, "the idle jobs running")
                sb.load(500.0)
                poll(lambda: any(phases(conf_a)[n] is not Phase.LENT for n in lent),
                     TICK_S + 30, "a reclaim under way", interval_s=0.5)
                proc_a.kill()
                killed = time.time()
                proc_a.wait()
                poll(lambda: (leader(sb, conf_b) or {}).get("instance") == "b",
                     LEASE_S + TICK_S + 30, "b leads", interval_s=1.0)
                took_over = float(leader(sb, conf_b)["since"]) - killed  # type: ignore[index]
                poll(lambda: all(phases(conf_b)[n] is Phase.SERVING for n in lent), 240,
                     "the reclaimed nodes serving", interval_s=1.0)
                served = time.time() - killed
        moves = [r for r in records(*journals, since=started) if r.get("event") == "transition"]
        owners = check_one_actor(moves)
        changes = [r for r in records(*journals) if r.get("event") == "leadership"]
        print(f"kill -9 of a mid-reclaim: b took over {took_over:.1f} s later, {lent} serving "
              f"{served:.1f} s after the kill; epochs {owners}; leadership records "
              f"{[(r['instance'], r['change'], r.get('epoch') or r.get('lost_epoch')) for r in changes]}")
        assert took_over <= LEASE_S + TICK_S, took_over
        assert "b" in owners.values(), owners
        assert max(e for e, i in owners.items() if i == "a") < min(
            e for e, i in owners.items() if i == "b"), owners
        phase_now = phases(conf_b)
        assert not [n for n, p in phase_now.items() if p in (Phase.RECLAIMING, Phase.STARTING)]
        states = job_states(sb, jobs)
        assert not any("FAILED" in s or "CANCELLED" in s for s in states.values()), states
        assert all("REQUEUED" in s or "PREEMPTED" in s or "PENDING" in s
                   or s.strip().endswith("RUNNING") for s in states.values()), states
    finally:
        sb.load(0.0)
        if jobs:
            sb.run(["scancel", *map(str, jobs)])
        cli(sb, conf_a, "unpin", "gpu4", ok=False)


@pytest.mark.slow
def test_with_every_agent_stopped_the_watchdog_gives_lent_nodes_back(
    sandbox: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sb = sandbox
    for key, value in sb.env().items():
        monkeypatch.setenv(key, value)
    reset_cluster(sb, load_config(sb.config_path).paths.journal)
    conf = write_config(sb, tmp_path, "a")
    quiet(sb, conf)
    cli(sb, conf, "tick")  # adopt every node, and take the lease (handed back at its end)
    for node in ("gpu1", "gpu2"):
        cli(sb, conf, "lend", node)
    jobs = [idle_job(sb, n) for n in ("gpu1", "gpu2")]
    watchdog = None
    try:
        poll(lambda: all(s.strip().endswith("RUNNING") for s in job_states(sb, jobs).values())
             and len(job_states(sb, jobs)) == 2, 60, "the idle jobs running")
        # The agent is gone (no agent runs): the lease ages. Alive, the watchdog does nothing.
        first = json.loads(cli(sb, conf, "watchdog", "--all", "--dry-run", "--json").stdout)
        assert first["verdict"] in ("alive", "reclaimed"), first
        sb.load(40.0)
        risen = time.time()
        env = {**os.environ, **sb.env(), "SLURM_IDLE_CONFIG": str(conf)}
        with (tmp_path / "watchdog.log").open("w") as out:
            watchdog = subprocess.Popen(
                [sys.executable, "-m", "slurm_idle.cli", "watchdog", "--all", "--every", "3"],
                env=env, stdout=out, stderr=subprocess.STDOUT, text=True)
        lease_at = float(json.loads(cli(sb, conf, "status", "--json").stdout)["leader"]["renewed"])
        poll(lambda: all(phases(conf)[n] is Phase.SERVING for n in ("gpu1", "gpu2")),
             DEAD_AFTER_S + 240, "the lent nodes serving again", interval_s=1.0)
        back = time.time()
        status = json.loads(cli(sb, conf, "status", "--json").stdout)
        print(f"\nwatchdog: lease last renewed {risen - lease_at:.0f} s before the load rose; "
              f"gpu1/gpu2 serving {back - lease_at:.0f} s after the last renewal "
              f"(dead_after_s {DEAD_AFTER_S}); events {status['ha_events']}")
        assert back - lease_at <= DEAD_AFTER_S + 180
        assert any(e.get("event") == "watchdog" and e.get("verdict") == "reclaimed"
                   for e in status["ha_events"]), status["ha_events"]
        states = job_states(sb, jobs)
        assert not any("FAILED" in s or "CANCELLED" in s for s in states.values()), states
        text = cli(sb, conf, "status").stdout
        assert "watchdog reclaimed" in text, text
    finally:
        if watchdog is not None:
            watchdog.send_signal(signal.SIGTERM)
            watchdog.wait(timeout=60)
        sb.load(0.0)
        sb.run(["scancel", *map(str, jobs)])
