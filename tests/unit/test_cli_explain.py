"""`explain -n N` shows the last N transitions; N below 1 is refused, not misread."""

from __future__ import annotations

from pathlib import Path

import pytest

from slurm_idle.journal import Journal

from .test_config import run_cli

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
    assert proc.returncode == 1 and "not a pool node" in proc.stderr
