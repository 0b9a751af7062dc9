"""The soak's tracemalloc wrapper (slurm_idle/testing/traced.py): the lines it writes, what
it names as growing, the summary bench-soak prints."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tracemalloc
from pathlib import Path

import pytest

from slurm_idle.testing import traced
from slurm_idle.testing.soak import table

ROOT = Path(__file__).resolve().parents[2]

#: Kept alive between two snapshots: what growth() must name.
_kept: list[bytes] = []


def _grow() -> None:
    _kept.extend(bytes(1024) for _ in range(200))


def test_growth_names_the_line_that_kept_objects_alive() -> None:
    """200 objects of 1 kB kept between two snapshots: their line heads the list, and the
    tracer's own allocations are not in it."""
    was_tracing = tracemalloc.is_tracing()
    tracemalloc.start(traced.FRAMES)
    try:
        base = tracemalloc.take_snapshot()
        _grow()
        now = tracemalloc.take_snapshot()
    finally:
        if not was_tracing:
            tracemalloc.stop()
        _kept.clear()
    top = traced.growth(now, base)
    assert top[0]["where"].endswith(f"test_traced.py:{_grow.__code__.co_firstlineno + 1}")
    assert top[0]["count_diff"] >= 200 and top[0]["size_diff_kb"] >= 200
    assert not any(t["where"].startswith(traced.__file__) for t in top)


def test_summary_of_a_trace_file(tmp_path: Path) -> None:
    """First and last snapshot, the slope per hour, the last snapshot's top growth and the
    exit's trim; a line cut short by a kill is skipped."""
    lines = [{"t_s": 0.0, "traced_mb": 10.0, "traced_peak_mb": 11, "objects": 1000,
              "rss_mb": 50.0},
             {"t_s": 1800.0, "traced_mb": 10.5, "traced_peak_mb": 11, "objects": 1100,
              "rss_mb": 51.0, "top": [{"where": "a.py:1", "size_diff_kb": 400.0,
                                       "count_diff": 12, "size_kb": 410.0}]},
             {"t_s": 3600.0, "traced_mb": 11.0, "traced_peak_mb": 12, "objects": 1200,
              "rss_mb": 52.0, "top": [{"where": "b.py:2", "size_diff_kb": 900.0,
                                       "count_diff": 30, "size_kb": 950.0}]},
             {"t_s": 3601.0, "exit": True, "rss_mb": 52.0, "traced_mb": 11.0,
              "traced_after_collect_mb": 9.9, "rss_after_collect_mb": 51.8,
              "rss_after_trim_mb": 49.5, "trimmed": True}]
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(ln) + "\n" for ln in lines) + '{"t_s": 36')
    out = traced.summary(traced.read(path))
    assert out["snapshots"] == 3 and out["span_s"] == 3600.0
    assert out["traced_mb"] == {"first": 10.0, "last": 11.0, "slope_mb_per_h": 1.0}
    assert out["objects"] == {"first": 1000, "last": 1200}
    assert out["top_growth"][0]["where"] == "b.py:2"
    assert out["exit"] == {"rss_mb": 52.0, "traced_mb": 11.0, "traced_after_collect_mb": 9.9,
                           "rss_after_collect_mb": 51.8, "rss_after_trim_mb": 49.5,
                           "trimmed": True}
    result = {"ticks": 95, "tick_s": 2, "lends": 3, "reclaims": 3, "duration_s": 3601.0,
              "samples": 20, "verdict": "flat", "reasons": [], "trace": out}
    text = table(result)
    assert "traced 10.00 -> 11.00 MB (+1.000 MB/h), objects 1000 -> 1200" in text
    assert "+900.0 kB (+30) b.py:2" in text and "49.50 MB after malloc_trim" in text
    assert "traced 11.00 -> 9.90 MB after a full collection" in text


def test_summary_of_no_trace() -> None:
    """A run killed before its first snapshot: nothing to say, and no slope made up."""
    assert traced.summary([]) == {"snapshots": 0}
    assert traced.read(Path("/nonexistent/trace.jsonl")) == []


def test_start_without_the_variable_traces_nothing() -> None:
    assert traced.start({}) is None


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs /proc")
def test_the_wrapper_runs_a_command_and_writes_snapshots_and_the_exit(tmp_path: Path) -> None:
    """`python -m slurm_idle.testing.traced --help` runs the CLI as `slurm-idle` would, and
    the trace file ends with the exit line: RSS before and after the trim."""
    path = tmp_path / "trace.jsonl"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "SLURM_IDLE_TRACE_OUT": str(path),
           "SLURM_IDLE_TRACE_AFTER_S": "0", "SLURM_IDLE_TRACE_EVERY_S": "60"}
    proc = subprocess.run([sys.executable, "-m", "slurm_idle.testing.traced", "--help"],
                          env=env, capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    assert "Usage: slurm-idle" in proc.stdout
    lines = traced.read(path)
    assert lines[-1]["exit"] is True and 0 < lines[-1]["rss_after_trim_mb"] <= lines[-1]["rss_mb"] + 1
    assert all(ln["objects"] > 1000 for ln in lines[:-1])  # a snapshot, if --help let it run
