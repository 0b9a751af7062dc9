"""Engine load by scraping each replica's /metrics directly (sites without Prometheus).

Rates need two readings of each counter. With `metrics.scrape_state` set, the previous tick's
scrape is kept in that JSON file (scrape_state.py), so rates span the time between ticks
(smooth, one request per replica per tick) and the same file keeps a short per-model demand and queue history for the
scale-down window and for `policy.queue_sustain_s` (has the queue lasted?). Without it, or when
the kept scrape is older than `metrics.staleness_s`, each replica is scraped twice
`metrics.scrape_interval_s` apart within the tick: rates are then noisy and the window fields
and the queue's recent minimum stay None (no history), which the planner reads as "do not lend
on this" and "no sustained queue" (token demand, KV cache and latency still scale up).
The history's rules (metrics/history.py): a window counts only when the kept readings cover
it, as the Prometheus source's `count_over_time` check does, and a tick whose model reading is
unknown (no replica answered, or one that was busy went dark) is kept as a hole, not skipped.
Writers of the state file hold the agent's lock (ticks, admin commands); `read_only` sources
(`status`, `tick --dry-run`) read it and never write it.
The forecast uses the same history: the demand's trend over the scale-down window,
extrapolated over the lead (`metrics.forecast`, as the simulator does). The day-old and
week-old peaks that Prometheus provides are not kept here: that would make the state file a
week of samples per model, rewritten every tick; sites that want the daily shape in the
forecast use the Prometheus source. The adaptive headroom's inputs come from the same history:
the demand's mean and trend over the window and its noise (10-minute changes over the last
hour, so the history is kept 70 minutes when `policy.headroom_sigmas` > 0).
The HTTP client, clock and sleep are injected.
"""

from __future__ import annotations

import math
import os
import time
import urllib.error
from collections.abc import Callable, Collection, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from slurm_idle.config import Config, ModelConfig, ReplicaConfig
from slurm_idle.engine_version import version_from_body
from slurm_idle.errors import MetricsUnavailable
from slurm_idle.httpdeadline import DeadlineClient, HttpResponse
from slurm_idle.logs import get_logger
from slurm_idle.metrics import demand_tokens_per_s
from slurm_idle.metrics import history as kept
from slurm_idle.metrics.forecast import NOISE_LAG_S, NOISE_SPAN_S, forecast_leads, forecasts
from slurm_idle.metrics.parse import (
    EngineReading,
    EngineSnapshot,
    NotAMetricsPage,
    ServerReading,
    parse_page,
    read_engines,
    sum_engines,
    sum_histograms,
)
from slurm_idle.metrics.scrape_state import (
    ScrapeState,
)
from slurm_idle.model import ModelLoad, ReplicaLoad

__all__ = ["ScrapeState"]

log = get_logger(__name__)

MAX_PAGE_BYTES = 32 * 1024 * 1024


#: GET (url, timeout_s) -> response; raises OSError (urllib's errors are OSErrors) on no answer.
HttpGet = Callable[[str, float], HttpResponse]
_CLIENT = DeadlineClient(MAX_PAGE_BYTES)


def urllib_get(url: str, timeout_s: float) -> HttpResponse:
    """The default HTTP GET: the one client (httpdeadline.DeadlineClient): no proxies (replicas
    are on the cluster network), `timeout_s` the whole exchange's deadline, not each read's."""
    return _CLIENT.request("GET", url, timeout_s)


def metrics_url(url: str) -> str:
    """A replica URL (`http://gpu01:8000`) -> its metrics page; a URL with a path is kept."""
    parts = urlsplit(url if "://" in url else f"http://{url}")
    path = parts.path if parts.path not in ("", "/") else "/metrics"
    return urlunsplit((parts.scheme, parts.netloc, path, parts.query, ""))


def scrape(url: str, http: HttpGet, timeout_s: float) -> list[EngineSnapshot]:
    """Fetch and parse one server's metrics; MetricsUnavailable says what went wrong."""
    page = metrics_url(url)
    try:
        resp = http(page, timeout_s)
    except (OSError, urllib.error.URLError) as exc:
        reason = getattr(exc, "reason", None) or exc
        raise MetricsUnavailable(
            f"{page} did not answer ({_short(reason)}): check the URL and that vLLM is running there"
        ) from None
    if resp.status != 200:
        raise MetricsUnavailable(
            f"{page} answered HTTP {resp.status}: is this a vLLM server (its /metrics page)?"
        )
    try:
        return parse_page(resp.text)
    except NotAMetricsPage as exc:
        raise MetricsUnavailable(f"{page} is not a vLLM metrics page: {exc}") from None


def server_version(url: str, http: HttpGet = urllib_get, timeout_s: float = 5.0) -> str | None:
    """The server's vLLM version from `GET /version` beside its metrics page; None when it does
    not answer or does not say (a scrape never fails for it: old servers have no /version)."""
    parts = urlsplit(url if "://" in url else f"http://{url}")
    try:
        resp = http(urlunsplit((parts.scheme, parts.netloc, "/version", "", "")), timeout_s)
    except (OSError, urllib.error.URLError):
        return None
    return version_from_body(resp.body) if resp.status == 200 else None


def _short(reason: object) -> str:
    text = str(reason)
    if "refused" in text.lower():
        return "connection refused"
    if "timed out" in text.lower():
        return "timed out"
    return text.splitlines()[0][:160] if text else type(reason).__name__


def read_server(
    url: str,
    http: HttpGet = urllib_get,
    timeout_s: float = 5.0,
    interval_s: float = 1.0,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> list[EngineReading]:
    """Scrape a server twice `interval_s` apart (once if 0): gauges, rates and p95s per engine."""
    first_t = clock()
    first = scrape(url, http, timeout_s)
    if interval_s <= 0:
        return read_engines(None, first, 0.0)
    sleep(interval_s)
    second_t = clock()
    second = scrape(url, http, timeout_s)
    return read_engines(first, second, second_t - first_t)


# --- the source ---------------------------------------------------------------------------------


class ScrapeSource:
    """MetricsSource that reads every replica's /metrics itself."""

    def __init__(
        self,
        config: Config,
        http: HttpGet = urllib_get,
        clock: Callable[[], float] = time.time,
        sleep: Callable[[float], None] = time.sleep,
        state_path: str | os.PathLike[str] | None = None,
        max_workers: int = 16,
        read_only: bool = False,
    ) -> None:
        """`read_only`: use the state file but never write it (`status`, `tick --dry-run`: they
        run without the agent's lock and must not move the next tick's rates or history)."""
        self.config = config
        self.read_only = read_only
        self.http = http
        self.clock = clock
        self.sleep = sleep
        path = state_path if state_path is not None else config.metrics.scrape_state
        self.state_path = Path(path) if path else None
        self.max_workers = max_workers
        self.requests = 0
        self.errors: dict[str, str] = {}  # url -> why it was unknown at the last tick
        self._last: dict[str, tuple[str, ServerReading | None]] = {}  # url -> (model, reading)
        self._dark: set[str] = set()  # replica urls busy at their last answer, silent now
        self._deadline: float | None = None  # monotonic; set by a caller's budget_s

    def _fetch_all(self, urls: Sequence[str]) -> dict[str, list[EngineSnapshot] | MetricsUnavailable]:
        timeout = self._timeout()

        def one(url: str) -> list[EngineSnapshot] | MetricsUnavailable:
            try:
                return scrape(url, self.http, timeout)
            except MetricsUnavailable as exc:
                return exc

        self.requests += len(urls)
        if len(urls) <= 1:
            return {u: one(u) for u in urls}
        with ThreadPoolExecutor(max_workers=min(self.max_workers, len(urls))) as pool:
            return dict(zip(urls, pool.map(one, urls)))

    def replica_loads(
        self,
        replicas: Sequence[tuple[str, ReplicaConfig]],
        *,
        budget_s: float | None = None,
        serving: Collection[str] | None = None,
    ) -> list[ReplicaLoad]:
        """`serving`: scrape only these replicas, by name (the others read as unknown: a lent
        node's port may be anyone's, and a foreign endpoint beside a serving replica is not
        ours). `budget_s`: each scrape's deadline is cut to it, and
        the second round of a double scrape is skipped when it would not fit."""
        self._deadline = None if budget_s is None else time.monotonic() + budget_s
        if serving is None:
            return self._replica_loads(replicas)
        wanted = set(serving)
        scraped = iter(self._replica_loads([(m, r) for m, r in replicas if r.name in wanted]))
        return [
            next(scraped) if r.name in wanted
            else ReplicaLoad(model=m, node=r.node, url=r.url, known=False)
            for m, r in replicas
        ]

    def _timeout(self) -> float:
        """A scrape's total deadline: its own, cut to what the caller's budget has left."""
        timeout = self.config.metrics.scrape_timeout_s
        if self._deadline is not None:
            timeout = min(timeout, max(self._deadline - time.monotonic(), 0.001))
        return timeout

    def _replica_loads(self, replicas: Sequence[tuple[str, ReplicaConfig]]) -> list[ReplicaLoad]:
        state = ScrapeState.load(self.state_path)
        urls = sorted({r.url for _, r in replicas})
        t1 = self.clock()
        first = self._fetch_all(urls)
        # each URL's last answer before this tick's final one: the kept scrape, or this tick's
        # first round when it is scraped twice (see _went_dark)
        last_answer = dict(state.scrapes)
        for url, got in first.items():
            if not isinstance(got, MetricsUnavailable):
                last_answer[url] = (t1, got)
        readings: dict[str, list[EngineReading] | MetricsUnavailable] = {}
        again = []
        for url in urls:
            got = first[url]
            prev = state.scrapes.get(url)
            if isinstance(got, MetricsUnavailable):
                readings[url] = got
            elif prev is not None and 0 < t1 - prev[0] <= self.config.metrics.staleness_s:
                readings[url] = read_engines(prev[1], got, t1 - prev[0])
            else:
                again.append(url)
        t_now = t1
        if again and self._deadline is not None and (
            time.monotonic() + self.config.metrics.scrape_interval_s >= self._deadline
        ):
            for url in again:  # no time for the second reading: rates unknown, never guessed
                readings[url] = MetricsUnavailable(f"{metrics_url(url)}: no time left in the "
                                                   "tick's observe budget for a second scrape")
            again = []
        if again:
            self.sleep(self.config.metrics.scrape_interval_s)
            t2 = self.clock()
            second = self._fetch_all(again)
            for url in again:
                got2, got1 = second[url], first[url]
                assert not isinstance(got1, MetricsUnavailable)
                readings[url] = (
                    got2 if isinstance(got2, MetricsUnavailable) else read_engines(got1, got2, t2 - t1)
                )
            t_now = t2
        for url in urls:
            r = readings[url]
            if not isinstance(r, MetricsUnavailable):
                state.scrapes[url] = (t_now if url in again else t1, [e.snapshot for e in r])
        if not self.read_only:
            state.save(self.state_path)

        self.errors = {u: str(r) for u, r in readings.items() if isinstance(r, MetricsUnavailable)}
        loads = []
        self._dark = set()
        for model, replica in replicas:
            r = readings[replica.url]
            server = None if isinstance(r, MetricsUnavailable) else sum_engines(r)
            bad = invalid_reading(server)
            if bad:
                # NaN, infinite or negative: not a vLLM's reading. Dropped, never summed.
                log.warning("%s: dropped the reading of %s (%s)", replica.node, replica.url, bad)
                self.errors[replica.url] = f"invalid reading dropped: {bad}"
                server = None
            self._last[replica.url] = (model, server)
            if (server is None or not server.complete) and _went_dark(
                last_answer.get(replica.url), t1, self.config.metrics.staleness_s
            ):
                self._dark.add(replica.url)
            loads.append(_replica_load(model, replica, server))
        return loads

    def model_loads(
        self,
        models: Sequence[ModelConfig],
        now: float,
        *,
        budget_s: float | None = None,
        serving: Collection[str] | None = None,
    ) -> list[ModelLoad]:
        """Each model's figures, summed over its replicas that answered, or only over the
        `serving` replicas (by name) when given (so is the kept history)."""
        wanted = [(m.name, r) for m in models for r in m.replicas]
        if any(r.url not in self._last for _, r in wanted):
            self.replica_loads(wanted, budget_s=budget_s, serving=serving)
        counted = None if serving is None else set(serving)
        policy = self.config.policy
        state = ScrapeState.load(self.state_path) if self.state_path else None
        leads = forecast_leads(self.config, models)
        out = []
        staleness = self.config.metrics.staleness_s
        for m in models:
            servers = [
                s for r in m.replicas
                if (counted is None or r.name in counted)
                and (s := self._last.get(r.url, (m.name, None))[1]) is not None and s.complete
            ]
            if not servers:
                out.append(ModelLoad(model=m.name, known=False))
                if state is not None:
                    state.history.append((now, m.name, None, None))  # an outage stays a hole
                continue
            # Demand and queue are the sums of the replicas that answered, as Prometheus' `sum by
            # (model_name)`; the planner lends nothing while a serving replica is unknown. A
            # replica that was busy and went dark makes the sum too low: this tick's reading is
            # then unknown in the history and the window is not read from it.
            dark = any(r.url in self._dark for r in m.replicas)
            gen = sum(s.generation_tokens_per_s or 0.0 for s in servers)
            prompt = sum(s.prompt_tokens_per_s or 0.0 for s in servers)
            waiting = sum(s.waiting for s in servers)
            demand = demand_tokens_per_s(gen, prompt, policy.prompt_token_weight)
            ttft = sum_histograms(s.ttft for s in servers)
            window: tuple[float | None, float | None, float | None] = (None, None, None)
            forecast: tuple[float | None, float | None] = (None, None)
            recent = waiting if policy.queue_sustain_s == 0 else None
            level: tuple[float | None, float | None, float | None] = (None, None, None)
            if state is not None:
                history = state.history
                history.append((now, m.name, None, None) if dark else (now, m.name, demand, waiting))
                window_s = policy.scale_down_window_s
                if not dark:
                    window = kept.window(history, m.name, now, window_s, staleness)
                if policy.queue_sustain_s > 0:
                    recent = kept.recent_min(history, m.name, now, policy.queue_sustain_s, staleness)
                trend = kept.trend(history, m.name, now, window_s)
                if policy.forecast:
                    # Only the trend: the state keeps no day-old history (see the module doc).
                    forecast = forecasts(demand, (), trend, leads[m.name], policy.scale_down_window_s)
                if not dark:
                    level = (kept.window_mean(history, m.name, now, window_s, staleness), trend,
                             kept.noise(history, m.name, now, staleness))
            out.append(
                ModelLoad(
                    model=m.name,
                    known=True,
                    prompt_tokens_per_s=prompt,
                    generation_tokens_per_s=gen,
                    running=sum(s.running for s in servers),
                    waiting=waiting,
                    waiting_min_recent=recent,
                    kv_cache_usage_max=max(s.kv_cache_usage for s in servers),
                    ttft_p95_s=ttft.quantile(0.95) if ttft else None,
                    demand_tokens_per_s_max_window=window[0],
                    waiting_max_window=window[1],
                    waiting_min_window=window[2],
                    demand_tokens_per_s_mean_window=level[0],
                    demand_trend_per_s_window=level[1] if level[0] is not None else None,
                    demand_noise_tokens_per_s=level[2],
                    forecast_demand_tokens_per_s=forecast[0],
                    forecast_demand_tokens_per_s_max_window=forecast[1],
                )
            )
        if state is not None:
            kept_s = max(policy.scale_down_window_s, policy.queue_sustain_s,
                         NOISE_SPAN_S + NOISE_LAG_S if policy.headroom_sigmas > 0 else 0)
            horizon = now - kept_s - 2 * self.config.metrics.staleness_s
            state.history = [h for h in state.history if h[0] >= horizon]
            if not self.read_only:
                state.save(self.state_path)
        self._last = {}  # the next tick scrapes afresh
        self._dark = set()
        return out


def invalid_reading(s: ServerReading | None) -> str | None:
    """Why a server's reading cannot be a vLLM's (a NaN, infinite or negative figure), or None."""
    if s is None:
        return None
    figures = {
        "running": s.running, "waiting": s.waiting, "kv_cache_usage": s.kv_cache_usage,
        "prompt_tokens_per_s": s.prompt_tokens_per_s,
        "generation_tokens_per_s": s.generation_tokens_per_s,
    }
    for name, value in figures.items():
        if value is not None and not 0 <= value < math.inf:
            return f"{name}={value!r}"
    return None


def _went_dark(last: tuple[float, list[EngineSnapshot]] | None, now: float, staleness_s: float) -> bool:
    """A replica without a (complete) answer now whose last answer, within staleness_s, showed
    requests running or queued: its share of the demand is missing from the model's sum. A
    replica drained for lending answered idle before its engine was stopped, and one silent for
    longer than staleness_s is no news: neither counts."""
    if last is None or now - last[0] > staleness_s:
        return False
    return any((e.running or 0.0) + (e.waiting or 0.0) > 0 for e in last[1])


def _replica_load(model: str, replica: ReplicaConfig, s: ServerReading | None) -> ReplicaLoad:
    if s is None:
        return ReplicaLoad(model=model, node=replica.node, url=replica.url, known=False)
    return ReplicaLoad(
        model=model,
        node=replica.node,
        url=replica.url,
        known=s.complete,
        running=s.running,
        waiting=s.waiting,
        kv_cache_usage=s.kv_cache_usage,
        sleeping=s.sleeping,
        prompt_tokens_per_s=s.prompt_tokens_per_s or 0.0,
        generation_tokens_per_s=s.generation_tokens_per_s or 0.0,
        ttft_p95_s=s.ttft_p95_s,
        queue_time_p95_s=s.queue_time_p95_s,
    )
