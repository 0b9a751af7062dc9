"""Reading vLLM /metrics pages: names, fallbacks, engines, sleep, rates, resets and p95s."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from slurm_idle.metrics.parse import (
    Histogram,
    NotAMetricsPage,
    counter_increase,
    histogram_quantile,
    parse_page,
    read_engines,
    sum_engines,
)

PAGES = Path(__file__).resolve().parents[1] / "data" / "vllm"
INF = math.inf


def page(name: str) -> str:
    return (PAGES / f"{name}.txt").read_text()


def test_recent_page_gives_one_engine_with_every_signal() -> None:
    """A v1 page yields one (model, engine) snapshot with gauges, counters, histograms, awake."""
    [snap] = parse_page(page("v1_recent"))
    assert (snap.model, snap.engine) == ("meta-llama/Llama-3.1-8B-Instruct", "0")
    assert (snap.running, snap.waiting, snap.kv_cache_usage) == (7.0, 2.0, 0.4213)
    assert snap.sleep_state == "awake" and not snap.sleeping
    assert snap.prompt_tokens_total == 1843211.0
    assert snap.generation_tokens_total == 972540.0
    assert snap.ttft is not None and snap.ttft.count == 4211
    assert snap.queue_time is not None and snap.queue_time.buckets[-1][0] == INF


def test_legacy_page_falls_back_to_gpu_cache_usage() -> None:
    """A v0 page (no engine label, gpu_cache_usage_perc, no sleep gauge) still reads fully."""
    [snap] = parse_page(page("v0_legacy"))
    assert snap.model == "mistralai/Mistral-7B-Instruct-v0.3"
    assert snap.engine == "0"
    assert snap.kv_cache_usage == 0.1875
    assert snap.sleep_state is None and not snap.sleeping
    assert snap.running == 3.0 and snap.generation_tokens_total == 233981.0


def test_new_kv_gauge_wins_over_the_deprecated_one() -> None:
    """When both KV gauges are exported, kv_cache_usage_perc is the one read."""
    text = (
        'vllm:gpu_cache_usage_perc{engine="0",model_name="m"} 0.1\n'
        'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.7\n'
    )
    assert parse_page(text)[0].kv_cache_usage == 0.7


def test_data_parallel_page_gives_one_snapshot_per_engine() -> None:
    """engine="0" and engine="1" of one server are two snapshots, sorted by engine."""
    snaps = parse_page(page("v1_dp2"))
    assert [(s.engine, s.running, s.waiting) for s in snaps] == [("0", 12.0, 4.0), ("1", 10.0, 3.0)]
    assert {s.model for s in snaps} == {"Qwen/Qwen2.5-72B-Instruct"}


def test_data_parallel_engines_are_summed_per_server() -> None:
    """Summing a DP server adds running/waiting/rates and keeps the hottest KV cache."""
    snaps = parse_page(page("v1_dp2"))
    server = sum_engines(read_engines(snaps, snaps, 10.0))
    assert server is not None
    assert (server.running, server.waiting) == (22.0, 7.0)
    assert server.kv_cache_usage == 0.7104
    assert server.engines == ("0", "1")
    assert server.generation_tokens_per_s == 0.0 and server.complete


def test_sleeping_page_reads_as_sleeping() -> None:
    """sleep_state=weights_offloaded at 1 (awake at 0) means the engine sleeps."""
    [snap] = parse_page(page("v1_sleeping"))
    assert snap.sleep_state == "weights_offloaded" and snap.sleeping
    server = sum_engines(read_engines(None, [snap], 0.0))
    assert server is not None and server.sleeping


def test_a_server_sleeps_only_when_every_engine_does() -> None:
    """One awake DP engine makes the server awake."""
    text = (
        'vllm:engine_sleep_state{engine="0",model_name="m",sleep_state="awake"} 0\n'
        'vllm:engine_sleep_state{engine="0",model_name="m",sleep_state="discard_all"} 1\n'
        'vllm:engine_sleep_state{engine="1",model_name="m",sleep_state="awake"} 1\n'
    )
    snaps = parse_page(text)
    assert [s.sleep_state for s in snaps] == ["discard_all", "awake"]
    server = sum_engines(read_engines(None, snaps, 0.0))
    assert server is not None and not server.sleeping


def test_rates_come_from_two_scrapes() -> None:
    """Token rates are counter increases over the interval between scrapes."""
    earlier = parse_page(page("v1_recent"))
    later = parse_page(page("v1_recent_10s_later"))
    [r] = read_engines(earlier, later, 10.0)
    assert r.prompt_tokens_per_s == pytest.approx(2400.0)
    assert r.generation_tokens_per_s == pytest.approx(1150.0)
    assert r.ttft is not None and r.ttft.count == 48  # only the interval's requests
    assert r.ttft_p95_s is not None and 0 < r.ttft_p95_s < 2.5


def test_counter_reset_counts_from_zero() -> None:
    """A restarted server (counters went down) gives the new total as the increase, not a negative."""
    earlier = parse_page(page("v1_recent"))
    later = parse_page(page("v1_restarted"))
    [r] = read_engines(earlier, later, 10.0)
    assert r.prompt_tokens_per_s == pytest.approx(521.0)
    assert r.generation_tokens_per_s == pytest.approx(183.0)
    assert r.ttft is not None and r.ttft.count == 12


def test_counter_increase_rules() -> None:
    """Growth is the difference; a drop is a reset; a missing side is unknown."""
    assert counter_increase(10.0, 25.0) == 15.0
    assert counter_increase(100.0, 7.0) == 7.0
    assert counter_increase(None, 7.0) is None
    assert counter_increase(1.0, None) is None


def test_single_scrape_has_gauges_but_no_rates() -> None:
    """Without an earlier scrape, rates and p95s are None (not zero)."""
    [r] = read_engines(None, parse_page(page("v1_recent")), 0.0)
    assert r.prompt_tokens_per_s is None and r.ttft_p95_s is None
    server = sum_engines([r])
    assert server is not None and not server.complete


def test_histogram_quantile_interpolates_like_prometheus() -> None:
    """p95 interpolates linearly inside the bucket holding the rank."""
    buckets = [(0.1, 50.0), (0.5, 90.0), (1.0, 100.0), (INF, 100.0)]
    # rank 95 lies in (0.5, 1.0], 5 of its 10 observations in: 0.5 + 0.5 * 0.5
    assert histogram_quantile(0.95, buckets) == pytest.approx(0.75)
    assert histogram_quantile(0.5, buckets) == pytest.approx(0.1)
    assert histogram_quantile(0.25, buckets) == pytest.approx(0.05)


def test_histogram_quantile_edges() -> None:
    """No observations -> None; rank in +Inf -> highest finite bound; no +Inf bucket -> None."""
    assert histogram_quantile(0.95, [(1.0, 0.0), (INF, 0.0)]) is None
    assert histogram_quantile(0.95, [(1.0, 10.0), (2.0, 10.0), (INF, 20.0)]) == 2.0
    assert histogram_quantile(0.95, [(1.0, 10.0), (2.0, 20.0)]) is None


def test_histogram_since_handles_reset_and_sum() -> None:
    """Deltas subtract bucket-wise; a histogram whose count fell restarted; plus() adds engines."""
    a = Histogram(((1.0, 5.0), (INF, 10.0)))
    b = Histogram(((1.0, 8.0), (INF, 20.0)))
    assert b.since(a).buckets == ((1.0, 3.0), (INF, 10.0))
    assert a.since(b) == a
    assert a.plus(b).buckets == ((1.0, 13.0), (INF, 30.0))


@pytest.mark.parametrize(
    "text",
    ["<html><body>Not here</body></html>\n", '{"detail":"Not Found"}', "", "node_load1 0.5\n"],
)
def test_non_vllm_pages_are_refused(text: str) -> None:
    """HTML, JSON, empty pages and metrics pages without vllm:* raise NotAMetricsPage."""
    with pytest.raises(NotAMetricsPage):
        parse_page(text)
