"""`slurm-idle simulate`: flags, the --json shape, the timeline file and one-line errors."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

from slurm_idle.traces import format_trace, synthetic_trace

KEYS = ["minutes", "harvested_gpu_hours", "oracle_gpu_hours", "harvest_ratio",
        "slo_violation_minutes", "model_minutes", "slo_violation_share",
        "slo_violation_wall_minutes", "slo_violation_minutes_by_model", "preemptions",
        "lost_gpu_hours", "step_s", "trace_step_s", "resampled", "unserved_share", "minutes_short_5pct",
        "queue_delay_p99_s", "queue_delay_max_s", "flaps"]


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "slurm_idle.cli", "simulate", *args],
                          check=False, capture_output=True, text=True, timeout=120)


def test_json_keys_and_timeline(tmp_path: Path) -> None:
    """--json prints exactly the documented keys; --timeline has one row per minute and model
    whose counts sum to the replicas."""
    trace = tmp_path / "t.csv"
    trace.write_text(format_trace(synthetic_trace(days=1, seed=2)))
    timeline = tmp_path / "timeline.csv"
    done = run_cli(str(trace), "--fleet", "llama-70b=8:4:2500", "--policy", "reactive",
                   "--start-s", "120", "--grace-s", "30", "--json", "--timeline", str(timeline))
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout)
    assert list(summary) == KEYS
    assert summary["minutes"] == 1440
    with timeline.open() as handle:
        rows = list(csv.reader(handle))
    assert rows[0] == ["timestamp", "model", "serving", "starting", "lent", "reclaiming"]
    assert len(rows) == 1441
    assert all(sum(int(x) for x in row[2:]) == 8 for row in rows[1:])


def test_synthetic_runs_the_real_planner() -> None:
    """--synthetic generates a trace and scores slurm-idle against the oracle."""
    done = run_cli("--synthetic", "--days", "2", "--seed", "3")
    assert done.returncode == 0, done.stderr
    assert "policy slurm-idle: 2880 minutes" in done.stdout
    assert "of an oracle's" in done.stdout


def test_utilisation_flag_reaches_the_planner() -> None:
    """`--utilisation 0.6` scores against a lower SLO line and the planner plans against it too:
    the oracle and slurm-idle both stay nearly violation-free."""
    for policy in ("oracle", "slurm-idle"):
        done = run_cli("--synthetic", "--days", "2", "--utilisation", "0.6", "--policy", policy, "--json")
        assert done.returncode == 0, done.stderr
        summary = json.loads(done.stdout)
        assert summary["slo_violation_minutes"] <= 0.005 * summary["minutes"], (policy, summary)


def test_errors_are_one_clear_line(tmp_path: Path) -> None:
    """No fleet, a bad fleet spec or a bad trace: exit 2 and one line saying what to do."""
    trace = tmp_path / "t.csv"
    trace.write_text("timestamp,model,rps,prompt_tokens,output_tokens\n2025-01-06T00:00:00Z,a,1,1,1\n")
    for args, message in [
        ((str(trace),), "no fleet"),
        ((str(trace), "--fleet", "a=2"), "MODEL=REPLICAS"),
        ((str(tmp_path / "missing.csv"), "--fleet", "a=2:1:100"), "not found"),
        ((), "--synthetic"),
    ]:
        done = run_cli(*args)
        assert done.returncode == 2, (args, done.stderr)
        assert message in done.stderr and "Traceback" not in done.stderr
        assert len(done.stderr.strip().splitlines()) == 1


def test_plot_writes_a_png(tmp_path: Path) -> None:
    """--plot draws a PNG (matplotlib comes with the `plot` extra)."""
    import pytest

    pytest.importorskip("matplotlib")
    out = tmp_path / "sim.png"
    done = run_cli("--synthetic", "--days", "1", "--fleet", "m=4:4:2500", "--policy", "slurm-idle",
                   "--plot", str(out))
    assert done.returncode == 0, done.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert out.stat().st_size > 10_000


def test_a_trace_model_without_a_fleet_entry_is_named(tmp_path: Path) -> None:
    """A model of the trace that --fleet leaves out is not simulated: say so, don't drop it quietly."""
    from slurm_idle.traces import SyntheticModel

    trace = tmp_path / "t.csv"
    trace.write_text(format_trace(synthetic_trace(
        days=1, seed=2, models=[SyntheticModel(name="a"), SyntheticModel(name="b")])))
    done = run_cli(str(trace), "--fleet", "a=8:4:2500", "--policy", "reactive", "--json")
    assert done.returncode == 0, done.stderr
    assert "trace model(s) b have no --fleet entry" in done.stderr
    assert json.loads(done.stdout)["minutes"] == 1440
