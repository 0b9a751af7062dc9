"""ScrapeSource: two scrapes or a kept previous scrape give rates; failures make replicas unknown."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import pytest

from slurm_idle.config import Config, ReplicaConfig, parse_config
from slurm_idle.errors import MetricsUnavailable
from slurm_idle.metrics.forecast import slope_per_s
from slurm_idle.metrics.scrape import HttpResponse, ScrapeSource, ScrapeState, metrics_url, scrape

PAGES = Path(__file__).resolve().parents[1] / "data" / "vllm"

CONFIG = """
metrics: {source: scrape, staleness_s: 120, scrape_interval_s: 10}
engine: {kind: command, start_command: "start", stop_command: "stop"}
policy: {scale_down_window_s: 300}
models:
  - name: meta-llama/Llama-3.1-8B-Instruct
    replicas:
      - {node: a, url: "http://a:8000"}
      - {node: b, url: "http://b:8000"}
"""


def page(name: str) -> str:
    return (PAGES / f"{name}.txt").read_text()


class Web:
    """A fake HTTP client: each URL serves the next page of its list (the last one repeats)."""

    def __init__(self, pages: dict[str, list[str | None]]) -> None:
        self.pages = pages
        self.got: list[str] = []

    def __call__(self, url: str, timeout_s: float) -> HttpResponse:
        self.got.append(url)
        queue = self.pages[url]
        text = queue.pop(0) if len(queue) > 1 else queue[0]
        if text is None:
            raise ConnectionRefusedError(111, "Connection refused")
        return HttpResponse(200, text.encode())


class Clock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        self.t += s


def source(web: Web, clock: Clock, state: Path | None = None) -> tuple[ScrapeSource, Config]:
    cfg = parse_config(CONFIG)
    return ScrapeSource(cfg, http=web, clock=clock, sleep=clock.sleep, state_path=state), cfg


def pairs(cfg: Config) -> list[tuple[str, ReplicaConfig]]:
    return [(m.name, r) for m in cfg.models for r in m.replicas]


def test_without_state_each_replica_is_scraped_twice() -> None:
    """No kept scrape: two scrapes scrape_interval_s apart give rates; a dead replica is unknown."""
    web = Web({"http://a:8000/metrics": [page("v1_recent"), page("v1_recent_10s_later")],
               "http://b:8000/metrics": [None]})
    clock = Clock()
    src, cfg = source(web, clock)
    a, b = src.replica_loads(pairs(cfg))
    assert a.known and a.running == 9.0
    assert a.generation_tokens_per_s == pytest.approx(1150.0)
    assert not b.known
    assert "connection refused" in src.errors["http://b:8000"]
    assert web.got.count("http://a:8000/metrics") == 2


def test_state_file_gives_rates_across_ticks(tmp_path: Path) -> None:
    """With a state file, the second tick scrapes once and rates span the time between ticks."""
    state = tmp_path / "scrape.json"
    web = Web({"http://a:8000/metrics": [page("v1_recent"), page("v1_recent"), page("v1_recent_10s_later")],
               "http://b:8000/metrics": [page("v1_recent")]})
    clock = Clock()
    src, cfg = source(web, clock, state)
    src.replica_loads(pairs(cfg))  # first tick: double scrape, state saved
    assert state.exists()
    clock.t += 50.0  # next tick 60 s after the first scrape's second round
    web.got.clear()
    a, b = src.replica_loads(pairs(cfg))
    assert web.got.count("http://a:8000/metrics") == 1
    assert a.generation_tokens_per_s == pytest.approx(11500.0 / 50.0)
    assert b.known and b.generation_tokens_per_s == 0.0


def test_old_state_is_not_used_for_rates(tmp_path: Path) -> None:
    """A kept scrape older than staleness_s is ignored: the replica is scraped twice again."""
    state = tmp_path / "scrape.json"
    web = Web({"http://a:8000/metrics": [page("v1_recent")], "http://b:8000/metrics": [page("v1_recent")]})
    clock = Clock()
    src, cfg = source(web, clock, state)
    src.replica_loads(pairs(cfg))
    clock.t += 500.0
    web.got.clear()
    src.replica_loads(pairs(cfg))
    assert web.got.count("http://a:8000/metrics") == 2


def test_counter_reset_between_ticks(tmp_path: Path) -> None:
    """A replica restarted between ticks gives its new totals as the increase, not a negative rate."""
    state = tmp_path / "scrape.json"
    web = Web({"http://a:8000/metrics": [page("v1_recent"), page("v1_recent"), page("v1_restarted")],
               "http://b:8000/metrics": [page("v1_recent")]})
    clock = Clock()
    src, cfg = source(web, clock, state)
    src.replica_loads(pairs(cfg))
    clock.t += 10.0
    a, _ = src.replica_loads(pairs(cfg))
    assert a.generation_tokens_per_s == pytest.approx(183.0)
    assert a.prompt_tokens_per_s >= 0


def test_model_loads_sum_replicas_and_window_needs_history(tmp_path: Path) -> None:
    """Fleet load sums known replicas; window fields stay None until history covers the window
    (known readings at 90% of its ticks, none more than staleness_s apart)."""
    state = tmp_path / "scrape.json"
    web = Web({"http://a:8000/metrics": [page("v1_recent"), page("v1_recent_10s_later")],
               "http://b:8000/metrics": [page("v1_sleeping")]})
    clock = Clock()
    src, cfg = source(web, clock, state)
    [m] = src.model_loads(cfg.models, clock())
    assert m.known and m.running == 9.0
    assert m.generation_tokens_per_s == pytest.approx(1150.0)
    assert m.demand_tokens_per_s_max_window is None  # one point of history, window is 300 s
    first_demand = 1150.0 + 0.1 * 2400.0
    maxima = []
    for _ in range(7):  # a tick a minute; the pages stop changing, so demand drops to 0
        clock.t += 60.0
        src.replica_loads(pairs(cfg))
        [m] = src.model_loads(cfg.models, clock())
        maxima.append(m.demand_tokens_per_s_max_window)
    # 300 s at a tick a minute is 5 ticks: 4 readings (at 1000..1190) are not enough, the 5th
    # (1250) covers the window; the first busy tick then ages out of it
    assert maxima[:3] == [None, None, None]
    assert maxima[3] == pytest.approx(first_demand)
    assert maxima[4:] == [0.0, 0.0, 0.0]
    assert m.waiting_min_window == 1.0 and m.waiting_max_window == 1.0


def test_no_state_means_no_window() -> None:
    """Without a state file there is no history: the hysteresis fields are None."""
    web = Web({"http://a:8000/metrics": [page("v1_recent")], "http://b:8000/metrics": [page("v1_recent")]})
    src, cfg = source(web, Clock())
    [m] = src.model_loads(cfg.models, 1000.0)
    assert m.known and m.demand_tokens_per_s_max_window is None


def test_forecast_extrapolates_the_trend_of_the_kept_history(tmp_path: Path) -> None:
    """With a state file, the forecast is today's demand plus the window's rising trend over the
    lead (390 s: 30 s grace + 300 s cold start + a tick) and over lead + window for the window
    field."""
    state = tmp_path / "scrape.json"
    name = "meta-llama/Llama-3.1-8B-Instruct"
    now = 10_000.0
    # demand rose 0 -> 1200 over the last 4 minutes; 400 s ago is outside the 300 s window
    ScrapeState({}, [(now - 400, name, 9999.0, 0.0)]
                + [(now - 60 * k, name, 300.0 * (4 - k), 0.0) for k in (4, 3, 2, 1)]).save(state)
    web = Web({"http://a:8000/metrics": [page("v1_recent"), page("v1_recent_10s_later")],
               "http://b:8000/metrics": [page("v1_sleeping")]})
    src, cfg = source(web, Clock(now), state)
    [m] = src.model_loads(cfg.models, now)
    demand = m.generation_tokens_per_s + 0.1 * m.prompt_tokens_per_s
    assert demand == pytest.approx(1150.0 + 0.1 * 2400.0)
    points = [(now - 60 * k, 300.0 * (4 - k)) for k in (4, 3, 2, 1)] + [(now, demand)]
    trend = slope_per_s(points)
    assert trend is not None and trend > 0
    assert m.forecast_demand_tokens_per_s == pytest.approx(demand + trend * 390)
    assert m.forecast_demand_tokens_per_s_max_window == pytest.approx(demand + trend * (390 + 300))


def test_no_trend_without_history_or_when_falling(tmp_path: Path) -> None:
    """One point of history gives no forecast; a falling demand forecasts today's demand."""
    state = tmp_path / "scrape.json"
    name = "meta-llama/Llama-3.1-8B-Instruct"
    web = Web({"http://a:8000/metrics": [page("v1_recent")], "http://b:8000/metrics": [page("v1_recent")]})
    src, cfg = source(web, Clock(10_000.0), state)
    [m] = src.model_loads(cfg.models, 10_000.0)
    assert m.forecast_demand_tokens_per_s is None and m.forecast_demand_tokens_per_s_max_window is None
    ScrapeState({}, [(9_940.0, name, 1e6, 0.0)]).save(state)
    src, cfg = source(web, Clock(10_000.0), state)
    [m] = src.model_loads(cfg.models, 10_000.0)
    demand = m.generation_tokens_per_s + 0.1 * m.prompt_tokens_per_s
    assert m.forecast_demand_tokens_per_s == pytest.approx(demand)
    assert m.forecast_demand_tokens_per_s_max_window == pytest.approx(demand)


@pytest.mark.parametrize(
    ("kept", "expected"),
    [
        ([(-61.0, 0.0)], 0.0),  # the queue was empty a minute ago: now's 1 waiting is a blip
        ([(-61.0, 3.0)], 1.0),  # queued a minute ago and now: the minimum, now included
        ([(-130.0, 4.0), (-61.0, 2.0), (-30.0, 5.0)], 1.0),
        ([(-30.0, 3.0)], None),  # history shorter than queue_sustain_s
        ([(-400.0, 3.0), (-20.0, 3.0)], None),  # ticks missed: a gap longer than staleness_s
    ],
)
def test_queue_signal_needs_the_sustain_span_in_the_history(
    tmp_path: Path, kept: list[tuple[float, float]], expected: float | None
) -> None:
    """waiting_min_recent is the queue's minimum over the last queue_sustain_s (60 s) of kept
    ticks: the reading at or before the span's start and every one since, without gaps."""
    state = tmp_path / "scrape.json"
    name = "meta-llama/Llama-3.1-8B-Instruct"
    now = 10_000.0
    ScrapeState({}, [(now + dt, name, 100.0, w) for dt, w in kept]).save(state)
    web = Web({"http://a:8000/metrics": [page("v1_recent"), page("v1_recent_10s_later")],
               "http://b:8000/metrics": [page("v1_sleeping")]})
    src, cfg = source(web, Clock(now), state)
    [m] = src.model_loads(cfg.models, now)
    assert m.waiting == 1.0
    assert m.waiting_min_recent == expected


def test_no_state_means_no_sustained_queue() -> None:
    """Without kept history the queue's recent minimum is unknown (None), whatever waits now."""
    web = Web({"http://a:8000/metrics": [page("v1_recent")], "http://b:8000/metrics": [page("v1_sleeping")]})
    src, cfg = source(web, Clock())
    [m] = src.model_loads(cfg.models, 1000.0)
    assert m.waiting > 0 and m.waiting_min_recent is None


def test_slope_is_least_squares_per_second() -> None:
    """slope_per_s agrees with a least-squares fit and needs two distinct times."""
    import statistics

    pts = [(0.0, 1.0), (30.0, 4.0), (60.0, 2.0), (150.0, 9.0)]
    fit = statistics.linear_regression([t for t, _ in pts], [v for _, v in pts]).slope
    assert slope_per_s(pts) == pytest.approx(fit)
    assert slope_per_s([(5.0, 1.0)]) is None and slope_per_s([(5.0, 1.0), (5.0, 2.0)]) is None


@pytest.mark.parametrize(
    ("answer", "needle"),
    [
        (HttpResponse(404, b"Not Found"), "HTTP 404"),
        (HttpResponse(200, b"<html><body>hello</body></html>"), "not a vLLM metrics page"),
        (HttpResponse(200, b"node_load1 0.1\n"), "no vllm:"),
    ],
)
def test_bad_pages_raise_metrics_unavailable(answer: HttpResponse, needle: str) -> None:
    """Wrong status, HTML and non-vLLM metrics each say what is wrong with the URL."""
    get: Callable[[str, float], HttpResponse] = lambda url, timeout: answer
    with pytest.raises(MetricsUnavailable, match=needle):
        scrape("http://x:8000", get, 1.0)


def test_metrics_url_appends_the_path() -> None:
    """A server URL gets /metrics; an explicit metrics path is kept."""
    assert metrics_url("http://a:8000") == "http://a:8000/metrics"
    assert metrics_url("http://a:8000/") == "http://a:8000/metrics"
    assert metrics_url("a:8000") == "http://a:8000/metrics"
    assert metrics_url("http://a:8000/custom/metrics") == "http://a:8000/custom/metrics"


# --- coverage of the kept history, outages, replicas gone dark ---------------------------------

NAME = "meta-llama/Llama-3.1-8B-Instruct"


def idle(text: str) -> str:
    """The page with no request running or queued (a replica drained before lending)."""
    return re.sub(r"^(vllm:num_requests_(?:running|waiting)\{[^}]*\}) \S+", r"\1 0.0", text, flags=re.MULTILINE)


def quiet_history(now: float) -> ScrapeState:
    """Ten minutes of known, quiet readings a minute apart up to the minute before `now`."""
    return ScrapeState({}, [(now - 60.0 * k, NAME, 100.0, 0.0) for k in range(10, 0, -1)])


def test_an_unknown_model_is_kept_as_a_hole_in_the_history(tmp_path: Path) -> None:
    """A tick where no replica answers records an unknown reading, so the outage breaks the
    window instead of vanishing between the readings around it."""
    state = tmp_path / "scrape.json"
    now = 10_000.0
    quiet_history(now).save(state)
    web = Web({"http://a:8000/metrics": [None], "http://b:8000/metrics": [None]})
    src, cfg = source(web, Clock(now), state)
    [m] = src.model_loads(cfg.models, now)
    assert not m.known
    assert ScrapeState.load(state).history[-1] == (now, NAME, None, None)
    # back a minute later: the window holds a hole, so it is not known yet
    web.pages = {"http://a:8000/metrics": [page("v1_sleeping")], "http://b:8000/metrics": [page("v1_sleeping")]}
    src, cfg = source(web, Clock(now + 60.0), state)
    [m] = src.model_loads(cfg.models, now + 60.0)
    assert m.known and m.demand_tokens_per_s_max_window is None


def test_a_busy_replica_going_dark_makes_the_reading_unknown(tmp_path: Path) -> None:
    """When a replica that was busy at its last answer stops answering, the model's sum lacks
    its share: the load stays known (the planner holds lending on the unknown replica and can
    still scale up), but the tick's reading is unknown and the window is not read."""
    state = tmp_path / "scrape.json"
    now = 10_000.0
    quiet_history(now).save(state)
    web = Web({"http://a:8000/metrics": [page("v1_recent"), page("v1_recent_10s_later"), None],
               "http://b:8000/metrics": [page("v1_sleeping")]})
    clock = Clock(now)
    src, cfg = source(web, clock, state)
    [m] = src.model_loads(cfg.models, now)
    assert m.demand_tokens_per_s_max_window is not None  # both answered: covered
    clock.t = now + 60.0
    a, _ = src.replica_loads(pairs(cfg))
    [m] = src.model_loads(cfg.models, now + 60.0)
    assert not a.known
    assert m.known and m.running == 0.0  # b alone
    assert m.demand_tokens_per_s_max_window is None and m.waiting_max_window is None
    assert ScrapeState.load(state).history[-1] == (now + 60.0, NAME, None, None)


def test_a_replica_stopped_idle_for_lending_does_not_break_the_window(tmp_path: Path) -> None:
    """A replica whose last answer was idle (drained, then its engine stopped for lending) is
    not missing demand: the window stays readable."""
    state = tmp_path / "scrape.json"
    now = 10_000.0
    quiet_history(now).save(state)
    quiet = idle(page("v1_recent_10s_later"))
    web = Web({"http://a:8000/metrics": [quiet, quiet, None], "http://b:8000/metrics": [page("v1_sleeping")]})
    clock = Clock(now)
    src, cfg = source(web, clock, state)
    src.model_loads(cfg.models, now)
    clock.t = now + 60.0
    a, _ = src.replica_loads(pairs(cfg))
    [m] = src.model_loads(cfg.models, now + 60.0)
    assert not a.known
    assert m.known and m.demand_tokens_per_s_max_window is not None


# --- the state file: atomic, private temp names, read-only users ------------------------------


def test_read_only_source_never_writes_the_state(tmp_path: Path) -> None:
    """status and tick --dry-run read the kept scrape and history but leave the file alone."""
    state = tmp_path / "scrape.json"
    web = Web({"http://a:8000/metrics": [page("v1_recent")], "http://b:8000/metrics": [page("v1_recent")]})
    cfg = parse_config(CONFIG)
    clock = Clock(10_000.0)
    look = ScrapeSource(cfg, http=web, clock=clock, sleep=clock.sleep, state_path=state, read_only=True)
    look.replica_loads(pairs(cfg))
    look.model_loads(cfg.models, clock())
    assert not state.exists()
    quiet_history(10_000.0).save(state)
    before = state.read_bytes()
    [m] = look.model_loads(cfg.models, clock())
    assert m.known and state.read_bytes() == before
    assert list(tmp_path.iterdir()) == [state]


def test_concurrent_saves_never_collide(tmp_path: Path) -> None:
    """Two writers saving at once each use their own temp file: no FileNotFoundError, no
    leftover temp file, and the file is always one whole state."""
    import threading

    state = tmp_path / "scrape.json"
    errors: list[BaseException] = []

    def writer(k: int) -> None:
        try:
            for i in range(150):
                ScrapeState({}, [(float(i), f"m{k}", 1.0, 0.0)] * 50).save(state)
        except BaseException as exc:  # noqa: BLE001 - collected for the assertion
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert [p.name for p in tmp_path.iterdir()] == ["scrape.json"]
    assert len(ScrapeState.load(state).history) == 50
