"""Trace files and the synthetic generator: formats read, errors named, shapes as promised."""

from __future__ import annotations

from pathlib import Path

import pytest

from slurm_idle.errors import ConfigError
from slurm_idle.traces import (
    SyntheticModel,
    format_trace,
    parse_csv_trace,
    read_trace,
    synthetic_trace,
)

DATA = Path(__file__).resolve().parents[1] / "data" / "traces"

CSV = """timestamp,model,rps,prompt_tokens,output_tokens
2025-01-06T00:00:00Z,a,2.0,1000,200
2025-01-06T00:00:00Z,b,1.0,500,100
2025-01-06T00:02:00Z,a,4.0,1000,300
"""


def test_csv_trace_is_aligned_per_minute_with_gaps_as_zero() -> None:
    """Rows land on their minute; a minute without a row has no traffic."""
    trace = parse_csv_trace(CSV)
    assert trace.minutes == 3 and trace.models == ("a", "b")
    assert trace.series["a"].rps == (2.0, 0.0, 4.0)
    assert trace.series["b"].rps == (1.0, 0.0, 0.0)
    assert trace.start == 1736121600.0


def test_csv_round_trip() -> None:
    """format_trace writes what parse_csv_trace reads back."""
    trace = synthetic_trace(days=1, seed=3)
    again = parse_csv_trace(format_trace(trace))
    assert again.minutes == trace.minutes and again.start == trace.start
    assert again.series["llama-70b"].rps[:50] == pytest.approx(trace.series["llama-70b"].rps[:50], abs=1e-4)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("time,model\n", "header must be"),
        ("timestamp,model,rps,prompt_tokens,output_tokens\nnot-a-time,a,1,1,1\n", "line 2: timestamp"),
        ("timestamp,model,rps,prompt_tokens,output_tokens\n2025-01-06T00:00:00Z,a,-1,1,1\n", ">= 0"),
        ("timestamp,model,rps,prompt_tokens,output_tokens\n", "no rows"),
    ],
)
def test_bad_csv_names_the_problem(text: str, message: str) -> None:
    """A malformed trace fails with one line naming the place and the problem."""
    with pytest.raises(ConfigError, match=message):
        parse_csv_trace(text)


def test_azure_trace_is_aggregated_per_minute() -> None:
    """Per-request Azure rows become per-minute request rates and mean token counts."""
    trace = read_trace(DATA / "azure_sample.csv", azure_model="m")
    series = trace.series["m"]
    assert trace.minutes == 4
    assert series.rps == pytest.approx((3 / 60, 1 / 60, 0.0, 1 / 60))
    assert series.prompt_tokens[0] == pytest.approx((374 + 396 + 879) / 3)
    assert series.output_tokens[1] == 200.0


def test_missing_trace_file_is_a_clear_error(tmp_path: Path) -> None:
    """A trace path that does not exist says so."""
    with pytest.raises(ConfigError, match="not found"):
        read_trace(tmp_path / "nope.csv")


def test_synthetic_is_seeded_and_shaped() -> None:
    """Same seed, same trace; nights and weekends are quieter than weekday afternoons."""
    a = synthetic_trace(days=7, seed=5)
    assert a == synthetic_trace(days=7, seed=5)
    assert a != synthetic_trace(days=7, seed=6)
    rps = a.series["llama-70b"].rps
    monday_3am, monday_3pm, saturday_3pm = rps[3 * 60], rps[15 * 60], rps[5 * 1440 + 15 * 60]
    assert monday_3am < 0.4 * monday_3pm
    assert saturday_3pm < 0.8 * monday_3pm


def test_synthetic_bursts_are_sudden_surges() -> None:
    """With bursts, some minute jumps well above the burst-free trace of the same seed."""
    calm = synthetic_trace(days=7, seed=9, models=[SyntheticModel(bursts_per_week=0.0)])
    bursty = synthetic_trace(days=7, seed=9, models=[SyntheticModel(bursts_per_week=5.0)])
    ratios = [b / c for b, c in zip(bursty.series["llama-70b"].rps, calm.series["llama-70b"].rps, strict=True)]
    assert max(ratios) > 1.3
