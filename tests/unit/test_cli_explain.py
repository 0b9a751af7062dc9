"""`explain -n N` shows the last N transitions; N below 1 is refused, not misread; events
come in the order they happened, and a journal older than the pool's state says so."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from slurm_idle.cli import main
from slurm_idle.cli.common import Context
from slurm_idle.explain import stale_nodes
from slurm_idle.journal import Journal, StepOutcome, TransitionRecord
from slurm_idle.model import Phase
from slurm_idle.testing.fakes import FakeSlurm

from .test_config import run_cli
from .test_transitions import set_phase

CONFIG = """
engine: {{kind: command, start_command: "true", stop_command: "true"}}
models: [{{name: m, nodes: "gpu[1-2]"}}]
paths: {{journal: {journal}}}
"""


def setup(tmp_path: Path) -> Path:
    journal = Journal(tmp_path / "j.jsonl")
    for i in range(5):
        journal.append({"event": "transition", "ts": 1000.0 + i, "node": "gpu1", "from": "lent",
                        "to": "reclaiming", "outcome": "ok", "reason": f"r{i}"})
    cfg = tmp_path / "c.yaml"
    cfg.write_text(CONFIG.format(journal=journal.path))
    return cfg


def test_last_n_transitions(tmp_path: Path) -> None:
    """-n 2 prints the two latest transitions."""
    proc = run_cli("--config", str(setup(tmp_path)), "explain", "-n", "2")
    assert proc.returncode == 0, proc.stderr
    assert [ln.rsplit(" ", 1)[-1] for ln in proc.stdout.splitlines() if "because" in ln] == ["r3", "r4"]


@pytest.mark.parametrize("n", ["0", "-2"])
def test_n_below_one_is_a_usage_error(tmp_path: Path, n: str) -> None:
    """-n 0 (which used to show everything) and -n -2 (which showed 3) exit 2."""
    proc = run_cli("--config", str(setup(tmp_path)), "explain", "-n", n)
    assert proc.returncode == 2 and "--last" in proc.stderr and "Traceback" not in proc.stderr


def test_explain_a_replica_job(tmp_path: Path) -> None:
    """`explain MODEL#INDEX` shows a `placement: jobs` replica's transitions; an index the
    model does not have is refused."""
    journal = Journal(tmp_path / "j.jsonl")
    journal.append({"event": "transition", "ts": 1000.0, "node": "jm#1", "from": "lent",
                    "to": "reclaiming", "outcome": "ok", "reason": "load rose"})
    cfg = tmp_path / "c.yaml"
    cfg.write_text(CONFIG.format(journal=journal.path).replace(
        "models: [", "models: [{name: jm, placement: jobs, job: {replicas: 2, command: serve}}, "))
    proc = run_cli("--config", str(cfg), "explain", "jm#1")
    assert proc.returncode == 0 and "jm#1: lent -> reclaiming [ok] because load rose" in proc.stdout
    proc = run_cli("--config", str(cfg), "explain", "jm#2")
    assert proc.returncode == 2 and "not a pool node" in proc.stderr


def run_with_phases(cfg: Path, phases: dict[str, Phase], *args: str) -> str:
    """Run explain over a fake Slurm whose nodes are in `phases` (unknown: no Reason of ours),
    the pool as `status` would see it."""
    slurm = FakeSlurm.with_nodes(["gpu1", "gpu2"])
    for node, phase in phases.items():
        if phase is not Phase.UNKNOWN:
            set_phase(slurm, node, phase)

    class Agent:  # explain reads only the agent's Slurm
        pass

    agent = Agent()
    agent.slurm = slurm  # type: ignore[attr-defined]
    result = CliRunner().invoke(main, ["--config", str(cfg), "explain", *args],
                                obj=Context(agent_factory=lambda config, read_only=False: agent))  # type: ignore[arg-type,return-value]
    assert result.exit_code == 0, result.output
    return result.stdout


def serving_journal(tmp_path: Path) -> Path:
    """gpu1 started and joined the router; the router record was written first but happened
    a second after the transition began (records are appended when a step ends)."""
    journal = Journal(tmp_path / "j.jsonl")
    journal.append({"event": "router", "ts": 4002.0, "node": "gpu1", "router": "haproxy",
                    "call": "add", "outcome": "ok", "reason": "engine healthy"})
    journal.append({"event": "transition", "ts": 4001.0, "node": "gpu1", "from": "starting",
                    "to": "serving", "outcome": "ok", "reason": "engine up"})
    cfg = tmp_path / "c.yaml"
    cfg.write_text(CONFIG.format(journal=journal.path))
    return cfg


def test_events_are_shown_in_the_order_they_happened(tmp_path: Path) -> None:
    """A record journaled late is shown at its own time: starting -> serving, then joined."""
    out = run_with_phases(serving_journal(tmp_path), {"gpu1": Phase.SERVING}).splitlines()
    assert "starting -> serving" in out[0] and "joined the router" in out[1]
    assert not any("predates" in ln for ln in out)


def test_a_journal_older_than_the_pool_says_so(tmp_path: Path) -> None:
    """A node the journal leaves serving but that is unknown now (a restarted pool) gets one
    line naming its last record's time and its phase now, in text and in --json."""
    cfg = serving_journal(tmp_path)
    out = run_with_phases(cfg, {"gpu1": Phase.UNKNOWN, "gpu2": Phase.UNKNOWN})
    assert ("journal predates the current state of gpu1 (last record 01:06, node now unknown)"
            in out.splitlines())
    assert "gpu2" not in out  # no records: nothing to predate
    doc = json.loads(run_with_phases(cfg, {"gpu1": Phase.UNKNOWN}, "--json"))
    assert doc["journal_predates"] == [{"node": "gpu1", "last_record_ts": 4002.0,
                                        "journal_phase": "serving", "phase": "unknown"}]
    assert "predates" not in run_with_phases(cfg, {"gpu1": Phase.UNKNOWN}, "gpu2")


def test_an_unfinished_step_agrees_with_either_phase() -> None:
    """A step still waiting leaves its node in the old phase or the new: neither is stale."""
    rec = TransitionRecord(ts=1.0, node="gpu1", model="m", action="lend", from_phase="serving",
                           to_phase="retiring", reason="low", outcome=StepOutcome.WAITING,
                           duration_s=0.0)
    assert stale_nodes([rec], {"gpu1": "serving"}) == []
    assert stale_nodes([rec], {"gpu1": "retiring"}) == []
    assert [s.node for s in stale_nodes([rec], {"gpu1": "lent"})] == ["gpu1"]


def test_only_the_current_pools_nodes_are_explained(tmp_path: Path) -> None:
    """A journal kept across a pool change (gpu9 was in the pool, is not any more): `explain`
    without NODE shows gpu1's records, not gpu9's; `explain gpu9` refuses it (exit 2)."""
    cfg = setup(tmp_path)
    Journal(tmp_path / "j.jsonl").append({"event": "transition", "ts": 2000.0, "node": "gpu9",
                                          "from": "serving", "to": "retiring", "outcome": "ok",
                                          "reason": "old pool"})
    proc = run_cli("--config", str(cfg), "explain")
    assert proc.returncode == 0, proc.stderr
    assert "gpu9" not in proc.stdout and "gpu1: lent -> reclaiming" in proc.stdout
    assert run_cli("--config", str(cfg), "explain", "gpu9").returncode == 2


def test_a_replica_jobs_router_calls_are_explained_by_its_name(tmp_path: Path) -> None:
    """A replica job's router record carries the node it ran on (any node of the serve
    partition, maybe none of the pool's) and its name: `explain` finds it by the name."""
    journal = Journal(tmp_path / "j.jsonl")
    journal.append({"event": "router", "ts": 1000.0, "node": "gpu7", "replica": "jm#1",
                    "model": "jm", "router": "file", "call": "add", "reason": "serving",
                    "outcome": "ok"})
    cfg = tmp_path / "c.yaml"
    cfg.write_text(CONFIG.format(journal=journal.path).replace(
        "models: [", "models: [{name: jm, placement: jobs, job: {replicas: 2, command: serve}}, "))
    for args in (("explain",), ("explain", "jm#1")):
        proc = run_cli("--config", str(cfg), *args)
        assert proc.returncode == 0 and "gpu7: joined the router (file)" in proc.stdout, proc.stdout


def test_a_waiting_step_says_what_it_waits_for(tmp_path: Path) -> None:
    """A step carried over names what holds it (a held GPU: the GPU, the MiB, the holder)."""
    journal = Journal(tmp_path / "j.jsonl")
    journal.append({"event": "transition", "ts": 1000.0, "node": "gpu1", "from": "held",
                    "to": "starting", "outcome": "waiting", "reason": "carry on held -> starting",
                    "detail": "GPU memory held: gpu1 GPU 0: 20480 MiB held (allowed 1024), holder job 7"})
    cfg = tmp_path / "c.yaml"
    cfg.write_text(CONFIG.format(journal=journal.path))
    proc = run_cli("--config", str(cfg), "explain", "gpu1")
    assert proc.returncode == 0, proc.stderr
    assert "gpu1 GPU 0: 20480 MiB held (allowed 1024), holder job 7" in proc.stdout
