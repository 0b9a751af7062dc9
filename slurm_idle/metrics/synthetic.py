"""A stand-in for a Prometheus server that answers exactly the PromQL `PrometheusSource` sends.

For unit tests of the mapping/staleness logic and for `scripts/bench-tick` (10,000 replicas
without a daemon). It recognises each query by rebuilding the same `Queries` text, so it
cannot drift from the real query set; it says nothing about Prometheus' own semantics (the
contract tests run the real server for that). Unknown queries fail loudly.
"""

from __future__ import annotations

import json
import math
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

from slurm_idle.metrics import names
from slurm_idle.metrics.prometheus import Queries

Value = float | dict[str, float]  # `running` may be given per engine: {"0": 3, "1": 4}


@dataclass
class SyntheticPrometheus:
    """Answers `custom_query` from per-target and per-model tables of signal values.

    A per-model key `signal:kind` answers, within that signal's query, the series labelled
    `kind` (`demand_max:points`, `waiting:recent_min`); a dict value, the forecast's kinds.
    `served` gives a target's series a `model_name` label (none without); a `#suffix` of a
    target key is not part of its instance, so one instance can carry several tables (two
    models on one server).
    """

    queries: Queries
    window_s: int
    forecast_leads: Collection[int] | None  # the models' lead times (forecast_leads(...).values())
    targets: dict[str, dict[str, Value]] = field(default_factory=dict)  # instance -> signal -> v
    models: dict[str, dict[str, Value]] = field(default_factory=dict)  # model -> signal -> v
    served: dict[str, str] = field(default_factory=dict)  # target key -> its model_name label
    eval_ts: float = 1_700_000_000.0
    calls: int = 0
    seen: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._replica = {v: k for k, v in self.queries.replica().items()}
        self._model = {v: k for k, v in self.queries.model(self.window_s, self.forecast_leads).items()}
        self._json: dict[str, str] = {}

    def prepare(self) -> None:
        """Encode every answer as Prometheus' JSON now, so that queries cost what decoding does."""
        for query in [*self._replica, *self._model]:
            self._json[query] = json.dumps({"status": "success", "data": {"resultType": "vector",
                                            "result": self._answer(query)}})

    def custom_query(self, query: str, params: dict[str, Any] | None = None) -> list[dict[str, Any]]:
        self.calls += 1
        self.seen.append(query)
        if query in self._json:  # like PrometheusConnect: decode the response body
            result: list[dict[str, Any]] = json.loads(self._json[query])["data"]["result"]
            return result
        return self._answer(query)

    def _answer(self, query: str) -> list[dict[str, Any]]:
        ts = self.eval_ts  # every answer is evaluated "now"; the time parameter is ignored
        label = self.queries.instance_label
        out: list[dict[str, Any]] = []
        if query in self._replica:
            signal = self._replica[query]
            for key, signals in self.targets.items():
                value = _exception(signal, signals, ts, self.queries.staleness_s)
                if value is None:
                    continue
                target = {label: key.split("#")[0]}
                if key in self.served:
                    target[names.MODEL_LABEL] = self.served[key]
                if isinstance(value, dict):
                    for engine, v in value.items():
                        out.append(_item({**target, names.ENGINE_LABEL: engine}, ts, v))
                else:
                    labels = dict(target)
                    if signal == "running":
                        labels[names.ENGINE_LABEL] = "0"
                    out.append(_item(labels, ts, value))
            return out
        if query in self._model:
            signal = self._model[query]
            for model, signals in self.models.items():
                for key, value in signals.items():
                    name, _, kind = key.partition(":")
                    if name != signal:
                        continue
                    if isinstance(value, dict):  # the forecast's `kind`-labelled series
                        for each, v in value.items():
                            for k in self._kinds(each):
                                out.append(_item({names.MODEL_LABEL: model, "kind": k}, ts, v))
                    elif kind:  # e.g. `demand_max:points`: the series kind="points" of demand_max
                        out.append(_item({names.MODEL_LABEL: model, "kind": kind}, ts, value))
                    else:
                        out.append(_item({names.MODEL_LABEL: model}, ts, value))
            return out
        raise ValueError(f"SyntheticPrometheus does not know the query {query!r}")

    def _kinds(self, kind: str) -> list[str]:
        """`ahead_1d` / `later_1d` without `@lead` stand for that peak at every lead queried
        (as Prometheus answers every lead's part for every model); other kinds as given."""
        if kind.startswith(("ahead_", "later_")) and "@" not in kind:
            return [f"{kind}@{max(int(lead), 1)}" for lead in sorted(set(self.forecast_leads or ()))]
        return [kind]


def _exception(signal: str, signals: dict[str, Value], ts: float, staleness_s: float) -> Value | None:
    """The answer for one target: tables hold `awake` and `fresh` (sample time); the queries
    `asleep` and `stale` return only the targets that are asleep / stale, as PromQL filters do."""
    if signal == "asleep":
        awake = signals.get("awake")
        return 0.0 if isinstance(awake, float) and awake < 0.5 else None
    if signal == "stale":
        fresh = signals.get("fresh")
        age = ts - fresh if isinstance(fresh, float) else None
        return age if age is not None and age > staleness_s else None
    value = signals.get(signal)
    if signal in ("ttft", "queue") and isinstance(value, float) and math.isnan(value):
        return None  # `>= 0` drops NaN
    return value


def _item(labels: dict[str, str], ts: float, value: float) -> dict[str, Any]:
    return {"metric": labels, "value": [ts, "NaN" if math.isnan(value) else repr(float(value))]}
