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

This module sends the queries and maps their failures; the PromQL is built in `promql`, series
are matched to replicas in `targets`, and answers read into loads in `promanswers`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Collection, Mapping, Sequence
from time import monotonic
from typing import Any, Protocol

import requests
from prometheus_api_client.exceptions import PrometheusApiClientException

from slurm_idle.config import Config, ModelConfig, ReplicaConfig
from slurm_idle.errors import MetricsUnavailable
from slurm_idle.httpdeadline import DeadlineExceeded, call_within
from slurm_idle.logs import get_logger
from slurm_idle.metrics import names
from slurm_idle.metrics.forecast import forecast_leads
from slurm_idle.metrics.promanswers import (
    _Vector,
    forecast_inputs,
    model_load,
    parse_vector,
)
from slurm_idle.metrics.promql import DAY_S, WEEK_S, Queries, queries_for, subquery_step
from slurm_idle.metrics.targets import match_target, target_index, target_keys
from slurm_idle.model import ModelLoad, ReplicaLoad

log = get_logger(__name__)

__all__ = ["DAY_S", "WEEK_S", "PrometheusClient", "PrometheusSource", "Queries", "connect",
           "forecast_inputs", "forecast_leads", "match_target", "parse_vector", "queries_for",
           "subquery_step", "target_index", "target_keys"]

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


# --- the source --------------------------------------------------------------------------------


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

    def set_budget(self, budget_s: float | None) -> None:
        """Every query from now on ends within `budget_s` (None: query_timeout_s alone)."""
        self._deadline = None if budget_s is None else monotonic() + budget_s

    # One round trip, with every failure turned into one MetricsUnavailable line.
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
        self.set_budget(budget_s)
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
            self.set_budget(budget_s)
        policy = self.config.policy
        leads = forecast_leads(self.config, models) if policy.forecast and models else None
        queries = self.q.model(policy.scale_down_window_s, None if leads is None else leads.values())
        by_model: dict[str, dict[str, float]] = {}
        for signal, promql in queries.items():
            for labels, value in self.query(promql, time=now).values():
                key = f"{signal}:{labels['kind']}" if "kind" in labels else signal
                by_model.setdefault(labels.get(names.MODEL_LABEL, ""), {})[key] = value
        return [
            model_load(m.name, by_model.get(m.name, {}), None if leads is None else leads[m.name],
                       policy, self.q)
            for m in models
        ]


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
