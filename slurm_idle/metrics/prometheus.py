"""Engine load through Prometheus: a fixed number of fleet-wide vector queries per tick.

Each signal is ONE instant query for the whole fleet (`sum by (instance) (...)`), never one per
node, so a tick costs the same number of round trips for 4 or 10,000 replicas (`queries` counts
them; the tick benchmark reads it). Series are mapped back to replicas by their scrape target
(`instance` = host:port of the replica URL, or a configured label holding the node name) and
their `model_name`, which must be the replica's model as configured (vLLM's served model name):
another vLLM on the same node, on another port or serving another model, is not the replica.
Rates, counter resets and histogram percentiles are Prometheus' own (`rate`,
`histogram_quantile`); hysteresis and forecast use range subqueries so the agent keeps no state.
A window's extremes count only when Prometheus holds (nearly) the whole window: each such
subquery comes with its `count_over_time` (a `kind`-labelled series of the same query), so a
restarted Prometheus or a new deployment reads as "no window yet" instead of a 2-minute window.
The forecast's inputs (each model's lead, the peaks 1 day / 7 days ago over the lead and over
lead + scale-down window, `deriv` over the window) go through `metrics.forecast`, which calls
the policy's `forecast_demand` exactly as the simulator does.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass
from time import monotonic
from typing import Any, Protocol
from urllib.parse import urlsplit

import requests
from prometheus_api_client.exceptions import PrometheusApiClientException

from slurm_idle.config import Config, ModelConfig, ReplicaConfig
from slurm_idle.errors import MetricsUnavailable
from slurm_idle.httpdeadline import DeadlineExceeded, call_within
from slurm_idle.logs import get_logger
from slurm_idle.metrics import demand_tokens_per_s, names
from slurm_idle.metrics.forecast import NOISE_LAG_S, NOISE_SPAN_S, Peak, forecast_leads, forecasts
from slurm_idle.metrics.history import WINDOW_COVERAGE
from slurm_idle.model import ModelLoad, ReplicaLoad

log = get_logger(__name__)

DAY_S = 86_400
WEEK_S = 7 * DAY_S


class PrometheusClient(Protocol):
    """The part of prometheus_api_client.PrometheusConnect we use (fakes implement just this)."""

    def custom_query(self, query: str, params: dict[str, Any] | None = None) -> list[dict[str, Any]]:
        ...


def connect(url: str, timeout_s: float) -> PrometheusClient:
    """A real PrometheusConnect that fails fast (one retry) instead of backing off for long."""
    from prometheus_api_client import PrometheusConnect
    from urllib3.util.retry import Retry

    retry = Retry(total=1, backoff_factor=0.1, status_forcelist=[502, 503, 504])
    client: PrometheusClient = PrometheusConnect(
        url=url, disable_ssl=True, retry=retry, timeout=timeout_s
    )
    return client


# --- PromQL ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Queries:
    """The PromQL of one tick, built from the config (pure, so tests can read it)."""

    selector: str  # e.g. `{job="vllm"}` or ``
    instance_label: str
    rate_window_s: int
    prompt_token_weight: float
    staleness_s: float = 120.0
    queue_sustain_s: int = 60  # the queue's minimum over this span is the queue signal

    def _sel(self, extra: str = "") -> str:
        inner = ",".join(p for p in (self.selector.strip("{}"), extra) if p)
        return "{" + inner + "}" if inner else ""

    def _rate(self, metric: str, offset_s: int = 0, valid: bool = False) -> str:
        off = f" offset {offset_s}s" if offset_s else ""
        expr = f"rate({metric}{self._sel()}[{self.rate_window_s}s]{off})"
        return _valid(expr) if valid else expr

    def _gauge(self, metric: str, valid: bool = False) -> str:
        return _valid(f"{metric}{self._sel()}") if valid else f"{metric}{self._sel()}"

    def _p95(self, hist: str, by: str, valid: bool = False) -> str:
        return (
            f"histogram_quantile(0.95, sum by (le, {by}) "
            f"({self._rate(hist + '_bucket', valid=valid)}))"
        )

    # Per replica (grouped by the scrape target and the served model: a series of another
    # model on the same target is not this replica's load, see PrometheusSource._by_node).
    def replica(self) -> dict[str, str]:
        i = f"{self.instance_label}, {names.MODEL_LABEL}"
        awake = f'{names.SLEEP_STATE_LABEL}="{names.SLEEP_AWAKE}"'
        return {
            "running": f"sum by ({i}, {names.ENGINE_LABEL}) ({names.RUNNING}{self._sel()})",
            "waiting": f"sum by ({i}) ({names.WAITING}{self._sel()})",
            # `or` keeps the legacy gauge only for targets without the new one.
            "kv": (
                f"max by ({i}) ({names.KV_CACHE_USAGE}{self._sel()}) "
                f"or max by ({i}) ({names.KV_CACHE_USAGE_LEGACY}{self._sel()})"
            ),
            # The next two list only the exceptions (asleep, stale), to keep answers small.
            "asleep": f"max by ({i}) ({names.SLEEP_STATE}{self._sel(awake)}) < 0.5",
            "prompt": f"sum by ({i}) ({self._rate(names.PROMPT_TOKENS)})",
            "generation": f"sum by ({i}) ({self._rate(names.GENERATION_TOKENS)})",
            "stale": (
                f"time() - max by ({i}) (timestamp({names.RUNNING}{self._sel()})) > {self.staleness_s:g}"
            ),
            # `>= 0` drops NaN: replicas without requests in the window have no percentile.
            "ttft": f"{self._p95(names.TTFT, i)} >= 0",
            "queue": f"{self._p95(names.QUEUE_TIME, i)} >= 0",
        }

    def _subquery(self, expr: str, range_s: int) -> str:
        return f"{expr}[{range_s}s:{subquery_step(range_s, self.rate_window_s)}s]"

    def covered(self, points: float | None, range_s: int) -> bool:
        """Whether a subquery over range_s had data at >= WINDOW_COVERAGE of its steps."""
        expected = range_s // subquery_step(range_s, self.rate_window_s)
        return points is not None and points >= WINDOW_COVERAGE * expected

    def demand(self, offset_s: int = 0) -> str:
        m = names.MODEL_LABEL
        gen = self._rate(names.GENERATION_TOKENS, offset_s, valid=True)
        prompt = self._rate(names.PROMPT_TOKENS, offset_s, valid=True)
        return f"(sum by ({m}) ({gen}) + {self.prompt_token_weight!r} * sum by ({m}) ({prompt}))"

    # Fleet-wide per model.
    def model(self, window_s: int, leads: Collection[int] | None) -> dict[str, str]:
        """The per-model queries; `leads`: the models' forecast lead times (None: no forecast)."""
        m = names.MODEL_LABEL
        # Every series passes `_valid` before it is summed: one NaN or negative series (a fake
        # exporter on a lent node's port) must not poison a model's fleet-wide figures.
        waiting = f"sum by ({m}) ({self._gauge(names.WAITING, valid=True)})"
        q = {
            "generation": f"sum by ({m}) ({self._rate(names.GENERATION_TOKENS, valid=True)})",
            "prompt": f"sum by ({m}) ({self._rate(names.PROMPT_TOKENS, valid=True)})",
            "running": f"sum by ({m}) ({self._gauge(names.RUNNING, valid=True)})",
            "waiting": waiting,
            "kv": (
                f"max by ({m}) ({self._gauge(names.KV_CACHE_USAGE, valid=True)}) "
                f"or max by ({m}) ({self._gauge(names.KV_CACHE_USAGE_LEGACY, valid=True)})"
            ),
            "ttft": self._p95(names.TTFT, m, valid=True),
        }
        if self.queue_sustain_s > 0:
            # the queue now, and its minimum over the sustain span with the span's points
            recent = self._subquery(waiting, self.queue_sustain_s)
            q["waiting"] = " or ".join([
                waiting,
                _kind(f"min_over_time({recent})", "recent_min"),
                _kind(f"count_over_time({recent})", "recent_points"),
            ])
        if window_s > 0:
            # the window's points (`kind="points"`) say whether Prometheus holds all of it
            demand = self._subquery(self.demand(), window_s)
            points = _kind(f"count_over_time({demand})", "points")
            # the adaptive headroom's inputs ride on the same query (capacity.Spread): the
            # window's mean and slope, and the noise of the demand's 10-minute changes over an hour
            changes = f"({self.demand()} - {self.demand(NOISE_LAG_S)})"
            noise_sub = f"{changes}[{NOISE_SPAN_S}s:{subquery_step(NOISE_SPAN_S, self.rate_window_s)}s]"
            q["demand_max"] = " or ".join([
                f"max_over_time({demand})", points,
                _kind(f"avg_over_time({demand})", "mean"),
                _kind(f"deriv({demand})", "trend"),
                _kind(f"stddev_over_time({noise_sub}) / {math.sqrt(2)!r}", "noise"),
                _kind(f"count_over_time({noise_sub})", "noise_points"),
            ])
            q["waiting_max"] = f"max_over_time({self._subquery(waiting, window_s)})"
            q["waiting_min"] = f"min_over_time({self._subquery(waiting, window_s)})"
        if leads is not None:
            q["forecast"] = self.forecast(leads, window_s)
        return q

    def forecast(self, leads: Collection[int], window_s: int) -> str:
        """Every input of `policy.forecast_demand`, for every model, in one query.

        Series are told apart by a `kind` label. Per offset (1d, 7d): `then_<o>`, the demand at
        now-offset; for each distinct lead time L of the models, `ahead_<o>@L`, its peak over
        the L seconds after that moment, and `later_<o>@L`, its peak over L + the scale-down
        window (what `forecast_demand_tokens_per_s_max_window` needs). And `trend`: `deriv` of
        the demand over the scale-down window, tokens/s per second. Models with different leads
        (cold start vs sleep-mode wake) each read their own L; the query stays one per tick.
        """
        parts = []
        for ago, tag in ((DAY_S, "1d"), (WEEK_S, "7d")):
            parts.append(f'label_replace({self.demand(ago)}, "kind", "then_{tag}", "", "")')
            for lead in sorted({max(int(v), 1) for v in leads}):
                reaches = [("ahead", lead)] + ([("later", lead + window_s)] if window_s > 0 else [])
                for name, span in reaches:
                    step = subquery_step(span, self.rate_window_s)
                    peak = (
                        f"max_over_time({self.demand()}[{span}s:{step}s] offset {max(ago - span, 1)}s)"
                    )
                    parts.append(f'label_replace({peak}, "kind", "{name}_{tag}@{lead}", "", "")')
        if window_s > 0:
            step = subquery_step(window_s, self.rate_window_s)
            trend = f"deriv({self.demand()}[{window_s}s:{step}s])"
            parts.append(f'label_replace({trend}, "kind", "trend", "", "")')
        return " or ".join(parts)


def _valid(expr: str) -> str:
    """Only the series of `expr` that are finite and not negative (`>= 0` drops NaN too)."""
    return f"({expr} >= 0 < +Inf)"


def _kind(expr: str, kind: str) -> str:
    """expr with the label `kind` set, to send several answers in one query."""
    return f'label_replace({expr}, "kind", "{kind}", "", "")'


def subquery_step(range_s: int, rate_window_s: int) -> int:
    """Resolution of a range subquery: ~10-30 points, never finer than half the rate window."""
    return max(1, min(max(rate_window_s // 2, 1), max(range_s // 10, 1)))


def queries_for(config: Config) -> Queries:
    job = config.metrics.job_label
    return Queries(
        selector=f'{{job="{job}"}}' if job else "",
        instance_label=config.metrics.instance_label,
        rate_window_s=config.metrics.rate_window_s,
        prompt_token_weight=config.policy.prompt_token_weight,
        staleness_s=config.metrics.staleness_s,
        queue_sustain_s=config.policy.queue_sustain_s,
    )


# --- mapping series to replicas ----------------------------------------------------------------


#: `scheme://host[:port]` followed by a path, query, fragment or nothing: the shape of nearly
#: every replica URL, read without urlsplit (10,000 replicas per tick); anything else -> urlsplit.
_SIMPLE_URL = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*)://([A-Za-z0-9._-]+)(?::([0-9]{1,5}))?(?:[/?#]|$)")


def _host_port(url: str) -> tuple[str, int, bool]:
    """(lower-case host, port or the scheme's default, whether the URL names its port), exactly
    as urlsplit reads them."""
    simple = _SIMPLE_URL.match(url)
    if simple is not None:
        scheme, host, port_text = simple.groups()
        port = int(port_text) if port_text else 0
        if port <= 65535:
            return host.lower(), port or (443 if scheme.lower() == "https" else 80), bool(port_text)
    parts = urlsplit(url)
    named = parts.port
    default = 443 if parts.scheme == "https" else 80
    return (parts.hostname or "").lower(), named or default, named is not None


def target_keys(replica: ReplicaConfig) -> list[str]:
    """The label values that identify a replica's series: host:port of its URL, its node name
    (an `instance` relabelled to it), the short host:port; and, only for a URL without a port
    (a proxy on the scheme's port, say), `host:*`: its host on any port.

    A URL with an explicit port matches no other port: gpu01:8001 may be another vLLM on the
    same node (another model, someone's test), whose load is not this replica's. Sites whose
    Prometheus scrapes the replica on another port than its URL's relabel `instance` to the node
    name (or set metrics.instance_label to a label holding it).
    """
    host, port, explicit = _host_port(replica.url)
    keys = [f"{host}:{port}", replica.node.lower()]
    short = host.split(".")[0]
    named = short != host and not host.replace(".", "").isdigit()
    if named:
        keys.append(f"{short}:{port}")
    if not explicit:
        keys.append(f"{host}:*")
        if named:
            keys.append(f"{short}:*")
    return keys


def target_index(replicas: Sequence[tuple[str, ReplicaConfig]]) -> dict[str, str]:
    """label value -> replica url (a replica's key: unique, where a node may run several);
    earlier (more exact) keys win over later ones. A node name heading several replicas is
    no replica's key: a series labelled only with it could be either's (it matches none, so
    both read unknown and nothing is lent on it, rather than one's load counted as the other's)."""
    index: dict[str, str] = {}
    heads: dict[str, int] = {}
    for _, replica in replicas:
        heads[replica.node.lower()] = heads.get(replica.node.lower(), 0) + 1
    all_keys = [
        ([k for k in target_keys(replica) if heads.get(k, 0) < 2], replica.url)
        for _, replica in replicas
    ]
    for rank in range(max((len(keys) for keys, _ in all_keys), default=0)):
        for keys, node in all_keys:
            if rank < len(keys):
                index.setdefault(keys[rank], node)
    return index


def match_target(index: Mapping[str, str], value: str) -> str | None:
    """The node whose replica a label value names (target_keys), or None."""
    v = value.lower()
    if v in index:
        return index[v]
    host, _, port = v.rpartition(":")
    if host and port.isdigit():
        short = host.split(".")[0]
        return index.get(f"{short}:{port}") or index.get(f"{host}:*") or index.get(f"{short}:*")
    return None


# --- the source --------------------------------------------------------------------------------


@dataclass
class _Vector:
    """One instant-query answer: the raw series list and the evaluation time."""

    result: list[dict[str, Any]]
    eval_ts: float | None

    def values(self) -> Iterator[tuple[dict[str, str], float]]:
        """(labels, value) per series; NaN kept (a percentile over no requests)."""
        for item in self.result:
            yield item["metric"], float(item["value"][1])


def parse_vector(result: Any) -> _Vector:
    """Check the shape of prometheus_api_client's `result` list; values are read lazily."""
    if not isinstance(result, list):
        raise TypeError(f"expected a list of series, got {type(result).__name__}")
    eval_ts = float(result[-1]["value"][0]) if result else None
    return _Vector(result, eval_ts)


def _finite(v: float | None) -> float | None:
    return None if v is None or math.isnan(v) or math.isinf(v) else v


#: Signals summed when several series land on one replica (DP engines); for the others
#: (gauges of fullness, percentiles, timestamps) the worst one is kept.
_SUMMED = frozenset({"running", "waiting", "prompt", "generation"})


class PrometheusSource:
    """MetricsSource reading a Prometheus server that scrapes every replica's /metrics."""

    def __init__(
        self,
        config: Config,
        prom: PrometheusClient | None = None,
        connect_fn: Callable[[str, float], PrometheusClient] = connect,
    ) -> None:
        self.config = config
        self.url = config.metrics.prometheus_url
        self.prom = prom if prom is not None else connect_fn(self.url, config.metrics.query_timeout_s)
        self.q = queries_for(config)
        self.queries = 0
        self.last_engines: dict[str, tuple[str, ...]] = {}  # url -> engine labels seen (for the CLI)
        self.dropped: list[str] = []  # "node signal=value" of invalid series dropped at the last call
        self._deadline: float | None = None  # monotonic; set by a caller's budget_s
        # the replica list, its target_index, and node -> configured model name
        self._index: tuple[list[tuple[str, ReplicaConfig]], dict[str, str], dict[str, str]] | None = None

    # One round trip, with every failure turned into one MetricsUnavailable line.
    def _budget(self, budget_s: float | None) -> None:
        self._deadline = None if budget_s is None else monotonic() + budget_s

    def query(self, promql: str, time: float | None = None) -> _Vector:
        self.queries += 1
        params = {"time": repr(time)} if time is not None else None
        started = monotonic()
        # The whole query, not each read, within query_timeout_s and what the caller has left.
        timeout_s = self.config.metrics.query_timeout_s
        if self._deadline is not None:
            timeout_s = min(timeout_s, self._deadline - started)
            if timeout_s <= 0:
                raise MetricsUnavailable(
                    f"no time left in the tick's observe budget for Prometheus at {self.url}"
                )
        try:
            result = call_within(
                lambda: self.prom.custom_query(promql, params=params), timeout_s, "prometheus query"
            )
            log.debug("query %s: %.2fs", promql[:200], monotonic() - started)
        except DeadlineExceeded:
            raise MetricsUnavailable(
                f"Prometheus at {self.url} did not answer within {timeout_s:.3g}s (the query's "
                "total deadline): check its load or raise metrics.query_timeout_s"
            ) from None
        except requests.exceptions.ConnectionError as exc:
            raise MetricsUnavailable(
                f"cannot connect to Prometheus at {self.url} ({_reason(exc)}): check "
                "metrics.prometheus_url and that Prometheus is running"
            ) from None
        except requests.exceptions.Timeout:
            raise MetricsUnavailable(
                f"Prometheus at {self.url} did not answer within {self.config.metrics.query_timeout_s:g}s: "
                "check its load or raise metrics.query_timeout_s"
            ) from None
        except PrometheusApiClientException as exc:
            raise MetricsUnavailable(
                f"{self.url} refused the query `{promql[:100]}` ({_api_error(str(exc))}): check that "
                "metrics.prometheus_url points at Prometheus (not at a replica) and its version"
            ) from None
        except requests.exceptions.RequestException as exc:
            raise MetricsUnavailable(f"Prometheus at {self.url}: {_reason(exc)}") from None
        except (ValueError, KeyError, TypeError) as exc:
            raise MetricsUnavailable(
                f"{self.url} did not answer like a Prometheus server ({type(exc).__name__}): "
                "check metrics.prometheus_url"
            ) from None
        try:
            return parse_vector(result)
        except (ValueError, KeyError, TypeError) as exc:
            raise MetricsUnavailable(
                f"unexpected answer from Prometheus at {self.url} to `{promql[:120]}`: {exc}"
            ) from None

    def _target_index(
        self, replicas: Sequence[tuple[str, ReplicaConfig]]
    ) -> tuple[dict[str, str], dict[str, str]]:
        """(target_index, node -> model), kept while the replica list stays the same (every
        tick of a daemon)."""
        current = list(replicas)
        if self._index is None or self._index[0] != current:
            self._index = (current, target_index(current), {r.url: m for m, r in current})
        return self._index[1], self._index[2]

    def _node_of(self, url: str) -> str:
        """The node of the replica at `url` (for messages: the maps are keyed by url)."""
        current = self._index[0] if self._index is not None else []
        return next((r.node for _, r in current if r.url == url), url)

    def replica_loads(
        self,
        replicas: Sequence[tuple[str, ReplicaConfig]],
        *,
        budget_s: float | None = None,
        serving: Collection[str] | None = None,
    ) -> list[ReplicaLoad]:
        """`budget_s`: every query of the call ends within it; `serving` is not needed here
        (Prometheus already scrapes every replica; the agent keeps only serving ones)."""
        self._budget(budget_s)
        self.dropped = []
        index, model_of = self._target_index(replicas)
        # label value -> node, memoised across the queries; the index's own (lower-case) keys
        # are what match_target returns for them, so they seed it.
        matched: dict[str, str | None] = dict(index)
        signals: dict[str, dict[str, float]] = {}  # signal -> node -> value
        engines: dict[str, str | set[str]] = {}  # node -> engine label (a set once there are more)
        for signal, promql in self.q.replica().items():
            vec = self.query(promql)
            try:
                signals[signal] = self._by_node(vec.result, index, matched, model_of, signal, engines)
            except (ValueError, KeyError, TypeError, IndexError, AttributeError) as exc:
                raise MetricsUnavailable(
                    f"unexpected answer from Prometheus at {self.url} to `{promql[:100]}`: {exc!r}"
                ) from None
        single: dict[str, tuple[str, ...]] = {}  # one shared tuple per engine label
        self.last_engines = {
            node: tuple(sorted(e)) if isinstance(e, set) else single.setdefault(e, (e,))
            for node, e in engines.items()
        }
        return self._replica_loads(replicas, signals)

    def _by_node(
        self,
        result: list[dict[str, Any]],
        index: Mapping[str, str],
        matched: dict[str, str | None],
        model_of: Mapping[str, str],
        signal: str,
        engines: dict[str, str | set[str]],
    ) -> dict[str, float]:
        """node -> value of one signal; several series on one node are summed or the worst kept.

        A series whose `model_name` is not the replica's configured model name is another
        server's (a second vLLM on the node) and skipped. The config's model name must be the
        served model name anyway (`model_loads` reads the fleet's demand by it); a series
        without the label (relabelled away) is taken on its target alone.

        The hot loop of a tick (one pass per signal over every replica's series), hence written
        with subscripts and `in` rather than helper calls.
        """
        label = self.config.metrics.instance_label
        model_label = names.MODEL_LABEL
        summed = signal in _SUMMED
        running = signal == "running"
        engine_label = names.ENGINE_LABEL
        acc: dict[str, float] = {}
        for item in result:
            labels = item["metric"]
            try:
                node = matched[labels[label]]
            except KeyError:
                target = labels.get(label, "")
                node = matched[target] = match_target(index, target)
            if node is None:
                continue
            served = labels.get(model_label)
            if served is not None and served != model_of[node]:
                continue
            value = float(item["value"][1])
            if not 0 <= value < math.inf:
                # NaN, infinite or negative: not a vLLM's reading (a fake exporter's, or a bug).
                # Dropped, so the replica reads as unknown on this signal, never as a number.
                name = self._node_of(node)
                self.dropped.append(f"{name} {signal}={value!r}")
                log.warning("%s: dropped an invalid %s series (%r) from %s", name, signal, value,
                            labels.get(label, "?"))
                continue
            if running:
                engine = labels.get(engine_label) or "0"
                seen = engines.get(node)
                if seen is None:
                    engines[node] = engine
                elif isinstance(seen, set):
                    seen.add(engine)
                elif seen != engine:
                    engines[node] = {seen, engine}
            if node in acc:
                old = acc[node]
                acc[node] = old + value if summed else max(old, value)
            else:
                acc[node] = value
        return acc

    @staticmethod
    def _replica_loads(
        replicas: Sequence[tuple[str, ReplicaConfig]],
        signals: Mapping[str, Mapping[str, float]],
    ) -> list[ReplicaLoad]:
        """One ReplicaLoad per replica from the per-signal node -> value maps.

        Unknown (`known=False`) without a `running` series, when stale, or while a token rate
        or the queue is missing or not finite. `x - x == 0` is `_finite` inlined: False for NaN
        and +-inf only (10,000 replicas, 7 signals each).
        """
        running_of = signals["running"].get
        waiting_of = signals["waiting"].get
        prompt_of = signals["prompt"].get
        generation_of = signals["generation"].get
        kv_of = signals["kv"].get
        ttft_of = signals["ttft"].get
        queue_of = signals["queue"].get
        stale = signals["stale"]
        asleep = signals["asleep"]
        out = []
        for model, replica in replicas:
            node = replica.url  # the key of the per-signal maps (target_index)
            running = running_of(node)
            if running is None:
                out.append(ReplicaLoad(model=model, node=replica.node, url=replica.url, known=False))
                continue
            waiting = waiting_of(node)
            prompt = prompt_of(node)
            generation = generation_of(node)
            kv = kv_of(node)
            ttft = ttft_of(node)
            queue = queue_of(node)
            waiting = waiting if waiting is not None and waiting - waiting == 0 else None
            prompt = prompt if prompt is not None and prompt - prompt == 0 else None
            generation = generation if generation is not None and generation - generation == 0 else None
            out.append(
                ReplicaLoad(
                    model=model,
                    node=replica.node,
                    url=replica.url,
                    known=(
                        node not in stale
                        and waiting is not None
                        and prompt is not None
                        and generation is not None
                    ),
                    running=running,
                    waiting=waiting or 0.0,
                    kv_cache_usage=(kv if kv is not None and kv - kv == 0 else None) or 0.0,
                    sleeping=node in asleep,
                    prompt_tokens_per_s=prompt or 0.0,
                    generation_tokens_per_s=generation or 0.0,
                    ttft_p95_s=ttft if ttft is not None and ttft - ttft == 0 else None,
                    queue_time_p95_s=queue if queue is not None and queue - queue == 0 else None,
                )
            )
        return out

    def model_loads(
        self,
        models: Sequence[ModelConfig],
        now: float,
        *,
        budget_s: float | None = None,
        serving: Collection[str] | None = None,
    ) -> list[ModelLoad]:
        """Fleet-wide figures per model. `serving` is not applied here: a query naming every
        serving target would not scale to 10,000 replicas. The agent recomputes the present
        from the serving replicas (metrics.serving); the window and forecast stay fleet-wide,
        every series checked by `_valid`, where a foreign series can only raise a maximum
        (which delays lending, never a reclaim)."""
        if budget_s is not None:
            self._budget(budget_s)
        policy = self.config.policy
        leads = forecast_leads(self.config, models) if policy.forecast and models else None
        queries = self.q.model(policy.scale_down_window_s, None if leads is None else leads.values())
        by_model: dict[str, dict[str, float]] = {}
        for signal, promql in queries.items():
            for labels, value in self.query(promql, time=now).values():
                key = f"{signal}:{labels['kind']}" if "kind" in labels else signal
                by_model.setdefault(labels.get(names.MODEL_LABEL, ""), {})[key] = value
        return [
            self._model_load(m.name, by_model.get(m.name, {}), None if leads is None else leads[m.name])
            for m in models
        ]

    def _model_load(self, model: str, v: dict[str, float], lead_s: int | None) -> ModelLoad:
        gen, prompt = _finite(v.get("generation")), _finite(v.get("prompt"))
        running = _finite(v.get("running"))
        if gen is None or prompt is None or running is None:
            return ModelLoad(model=model, known=False)
        waiting = _finite(v.get("waiting")) or 0.0
        policy = self.config.policy
        demand_now = demand_tokens_per_s(gen, prompt, policy.prompt_token_weight)
        window_s = policy.scale_down_window_s
        windowed = window_s > 0
        # Without (nearly) the whole window in Prometheus, "low for the whole window" is unknown.
        covered = not windowed or self.q.covered(_finite(v.get("demand_max:points")), window_s)
        # The queue's minimum over the sustain span, the present included (the subquery's last
        # step may predate it); None unless Prometheus holds the span.
        recent: float | None = waiting
        if policy.queue_sustain_s > 0:
            span_min = _finite(v.get("waiting:recent_min"))
            points = _finite(v.get("waiting:recent_points"))
            covered_span = self.q.covered(points, policy.queue_sustain_s)
            recent = min(span_min, waiting) if span_min is not None and covered_span else None
        forecast, forecast_window = (
            forecast_inputs(v, demand_now, lead_s, window_s) if lead_s is not None else (None, None)
        )
        return ModelLoad(
            model=model,
            known=True,
            prompt_tokens_per_s=prompt,
            generation_tokens_per_s=gen,
            running=running,
            waiting=waiting,
            waiting_min_recent=recent,
            kv_cache_usage_max=_finite(v.get("kv")) or 0.0,
            ttft_p95_s=_finite(v.get("ttft")),
            demand_tokens_per_s_max_window=(
                demand_now if not windowed
                else _max_opt(_finite(v.get("demand_max")), demand_now) if covered else None
            ),
            waiting_max_window=(
                waiting if not windowed
                else _max_opt(_finite(v.get("waiting_max")), waiting) if covered else None
            ),
            waiting_min_window=(
                waiting if not windowed else _finite(v.get("waiting_min")) if covered else None
            ),
            demand_tokens_per_s_mean_window=(
                _finite(v.get("demand_max:mean")) if windowed and covered else None
            ),
            demand_trend_per_s_window=(
                _finite(v.get("demand_max:trend")) if windowed and covered else None
            ),
            demand_noise_tokens_per_s=(
                _finite(v.get("demand_max:noise"))
                if windowed and self.q.covered(_finite(v.get("demand_max:noise_points")), NOISE_SPAN_S)
                else None
            ),
            forecast_demand_tokens_per_s=forecast,
            forecast_demand_tokens_per_s_max_window=forecast_window,
        )


def forecast_inputs(
    v: Mapping[str, float], demand_now: float, lead_s: int, window_s: int
) -> tuple[float | None, float | None]:
    """(forecast over the lead, forecast over lead + scale-down window) from the `forecast:*`
    series of one model (`then_<o>`, `ahead_<o>@<lead>`, `later_<o>@<lead>`, `trend`), through
    `metrics.forecast.forecasts`, the simulator's arithmetic."""
    peaks = [
        Peak(
            then,
            ahead=_finite(v.get(f"forecast:ahead_{tag}@{lead_s}")),
            later=_finite(v.get(f"forecast:later_{tag}@{lead_s}")),
        )
        for tag in ("1d", "7d")
        if (then := _finite(v.get(f"forecast:then_{tag}"))) is not None
    ]
    return forecasts(demand_now, peaks, _finite(v.get("forecast:trend")), lead_s, window_s)


def _max_opt(window: float | None, now: float) -> float | None:
    # The window's max must cover the present too (the subquery's last step may predate it).
    return None if window is None else max(window, now)


def _api_error(text: str) -> str:
    """`HTTP Status Code 400 (b'{"error": "..."}')` -> `HTTP 400: ...` without an HTML body."""
    found = re.search(r"HTTP Status Code (\d+)", text)
    code = f"HTTP {found.group(1)}" if found else "error"
    detail = re.search(r'"error"\s*:\s*"([^"]{1,200})', text)
    return f"{code}: {detail.group(1)}" if detail else code


def _reason(exc: BaseException) -> str:
    text = str(exc)
    for hint in ("Connection refused", "Name or service not known", "timed out", "No route to host"):
        if hint in text:
            return hint.lower()
    return text.splitlines()[0][:160] if text else type(exc).__name__
