"""The documents the web view renders, gathered with the library functions the CLI uses.

`status` (wiring.build_agent -> observe -> status.node_rows/model_rows), `report`
(report_io.fetch_runs/make_report, report.journal_facts), `jobs` (jobview.job_rows) and
`pipeline status` (pipeline.live_status, dag) all do the real work; this module only calls
them, joins their rows and shapes `/api/pool` and `/api/jobs` (docs/researchers.md documents both shapes).
A part that fails (Prometheus down, accounting off) becomes a line in `errors`, never a 500.

Who sees what: every job is listed (as `squeue` lists them), but a job's log tail and a
pipeline's parameters are shown only to their owner, the `viewer` the app identified (see
app.viewer), unless the site sets `web.show_all_users: true`. An unidentified viewer sees no
one's. The viewer's own jobs come first (the order is otherwise Slurm's). The answers are
cached per (`?user=`, viewer) in a bounded LRU: unique `?user=` values cannot grow the
process without limit.

`PoolData` is the Protocol the Flask app needs: the real `LiveData` here, a fake in tests.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol

from slurm_idle import dag
from slurm_idle.config import Config
from slurm_idle.errors import SlurmIdleError
from slurm_idle.job_history import job_rows
from slurm_idle.jobs_spec import DEFAULT_PARTITION, DEFAULT_TAG
from slurm_idle.jobview import log_tail, users
from slurm_idle.journal import iso
from slurm_idle.web.outlook import best_time, best_time_note, outlook, timeline, unknown_note

log = logging.getLogger(__name__)

DAY_S = 86400.0
WEEK_S = 7 * DAY_S
LOG_LINES = 15
MAX_CACHED = 64  # documents kept (the pool, then one per ?user= and viewer), least recent out


class PoolData(Protocol):
    """What the web app renders: two JSON documents (see docs/researchers.md, "The web view")."""

    def pool(self) -> dict[str, Any]: ...

    def jobs(self, user: str | None = None, viewer: str | None = None) -> dict[str, Any]: ...


class LiveData:
    """The real cluster, read through the same code as the CLI; answers cached `ttl_s`."""

    def __init__(self, config: Config | None, state_root: Path,
                 clock: Callable[[], float] = time.time, ttl_s: float = 15.0,
                 max_cached: int = MAX_CACHED, slurm: Any = None) -> None:
        self.config = config
        # The Slurm backend (slurm.SlurmBackend) the jobs are read from; None: the config's.
        self.slurm = slurm
        self.state_root = state_root
        self.clock = clock
        self.ttl_s = ttl_s
        self.max_cached = max_cached
        self.show_all_users = config.web.show_all_users if config is not None else False
        self._cache: OrderedDict[tuple[str, ...], tuple[float, dict[str, Any]]] = OrderedDict()
        self._lock = threading.Lock()

    def _cached(self, key: tuple[str, ...], make: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        with self._lock:
            hit = self._cache.get(key)
            now = time.monotonic()
            if hit and now - hit[0] < self.ttl_s:
                self._cache.move_to_end(key)
                return hit[1]
            doc = make()
            self._cache[key] = (now, doc)
            self._cache.move_to_end(key)
            while len(self._cache) > self.max_cached:
                self._cache.popitem(last=False)
            return doc

    def _may_see(self, viewer: str | None, owners: set[str]) -> bool:
        return self.show_all_users or (viewer is not None and viewer in owners)

    # ------------------------------------------------------------ pool

    def pool(self) -> dict[str, Any]:
        return self._cached(("pool",), self._pool)

    def _pool(self) -> dict[str, Any]:
        now = self.clock()
        doc: dict[str, Any] = {"generated_at": iso(now), "nodes": [], "models": [], "errors": [],
                               "lent_gpu_hours": {"today": None, "week": None},
                               "gpu_hours_used": {"today": None, "week": None},
                               "timeline": {"t": [], "serving_gpus": [], "lent_gpus": [],
                                            "demand_tokens_per_s": []},
                               "outlook": [], "outlook_note": None,
                               "best_time_to_submit": None, "best_time_note": None}
        cfg = self.config
        if cfg is None:
            doc["errors"].append("no config: the pool view needs the agent's config (--config)")
            doc["best_time_note"] = "no forecast without the agent's config"
            return doc
        self._nodes(cfg, doc)
        report = self._report(cfg, now, doc["errors"])
        if report is not None and report.days:
            doc["lent_gpu_hours"] = {"today": _r(report.days[-1].lent_gpu_hours),
                                     "week": _r(report.lent_gpu_hours)}
            doc["gpu_hours_used"] = {"today": _r(report.days[-1].gpu_hours),
                                     "week": _r(report.gpu_hours)}
        self._timeline(cfg, now, doc)
        return doc

    def _nodes(self, cfg: Config, doc: dict[str, Any]) -> None:
        from slurm_idle.status import model_rows, node_rows
        from slurm_idle.wiring import build_agent

        try:
            agent = build_agent(cfg, with_textfile=False, read_only=True)
            obs = agent.observe()
            plans = agent.assessor(obs, cfg, obs.now)
        except SlurmIdleError as exc:
            doc["errors"].append(f"pool: {exc}")
            return
        doc["nodes"] = [{**r, "phase_since_iso": iso(r["phase_since"]) if r["phase_since"] else None}
                        for r in node_rows(obs)]
        doc["models"] = model_rows(obs, plans)
        doc["errors"].extend(obs.errors)

    def _report(self, cfg: Config, now: float, errors: list[str]) -> Any:
        from slurm_idle.report_io import fetch_runs, make_report

        runs: list[Any] = []
        try:
            runs = fetch_runs(cfg, now - WEEK_S, now)
        except SlurmIdleError as exc:
            errors.append(f"accounting: {exc}")
        try:
            return make_report(cfg, now - WEEK_S, now, now, runs)
        except SlurmIdleError as exc:
            errors.append(f"report: {exc}")
            return None

    def _timeline(self, cfg: Config, now: float, doc: dict[str, Any]) -> None:
        from slurm_idle.journal import Journal
        from slurm_idle.report import journal_facts
        from slurm_idle.report_io import window_records

        node_gpus = {r.node: m.gpus_per_replica for m in cfg.models for r in m.replicas}
        records, before = window_records(Journal(Path(cfg.paths.journal)), now - DAY_S, node_gpus)
        facts = journal_facts(records, since=now - DAY_S, until=now, now=now,
                              phases_before=before)
        line = timeline(facts.intervals, node_gpus, now - DAY_S, now)
        demand = self._demand_series(cfg, now, doc["errors"])
        line["demand_tokens_per_s"] = demand[:len(line["t"])]
        doc["timeline"] = line
        history, cause = self._demand_history(cfg, now)
        rows = outlook(cfg, now, lambda t: history.get(round(t / 3600)))
        doc["outlook"] = [{**r, "time": iso(r["t"])} for r in rows]
        doc["outlook_note"] = unknown_note(rows, cause)
        best = best_time(rows)
        doc["best_time_to_submit"] = iso(best) if best is not None else None
        doc["best_time_note"] = best_time_note(rows, cause)

    # Prometheus: two subqueries (24 h of demand; the next hours a day and a week ago).
    def _prom(self, cfg: Config) -> Any:
        if cfg.metrics.source != "prometheus":
            return None
        from slurm_idle.metrics.prometheus import connect, queries_for

        return connect(cfg.metrics.prometheus_url, cfg.metrics.query_timeout_s), queries_for(cfg)

    def _demand_series(self, cfg: Config, now: float, errors: list[str]) -> list[float | None]:
        """Total demand (tokens/s) at each 10-minute point of the timeline (now - 24 h .. now)."""
        since = now - DAY_S
        out: list[float | None] = [None] * (int(DAY_S // 600) + 1)
        try:
            got = self._prom(cfg)
            if got is None:
                return out
            prom, q = got
            result = prom.custom_query(f"(sum({q.demand()}))[86400s:600s]",
                                       params={"time": repr(now)})
        except Exception as exc:  # noqa: BLE001 - the plot does without the load line
            errors.append(f"load history: {exc}")
            return out
        # Subquery points sit on multiples of the step: each goes to its nearest sample.
        for series in result or []:
            for t, v in series.get("values", []):
                i = round((float(t) - since) / 600)
                if 0 <= i < len(out):
                    out[i] = float(v)
        return out

    def _demand_history(self, cfg: Config, now: float) -> tuple[dict[int, dict[str, float]],
                                                                 str | None]:
        """{hour index: {model: demand}} for the hours 1 day and 1 week before the outlook's,
        and why none could be read (None: Prometheus answered, with whatever it has)."""
        from slurm_idle.metrics.names import MODEL_LABEL

        out: dict[int, dict[str, float]] = {}
        try:
            got = self._prom(cfg)
            if got is None:
                return out, (f"metrics.source is {cfg.metrics.source}: only Prometheus keeps "
                             "the demand history the outlook reads")
            prom, q = got
            # A subquery's points sit on whole hours inside (end - range, end]: 7 hours read
            # from 1 h before the first to 1 h after the last, so the hour each is rounded to
            # is there at any minute (a [6h:1h] ending at +6 h has 6 points, one hour short).
            for off in (DAY_S, WEEK_S):
                end = now - off + 7 * 3600
                result = prom.custom_query(f"({q.demand()})[8h:1h]",
                                           params={"time": repr(end)})
                for series in result or []:
                    model = series.get("metric", {}).get(MODEL_LABEL, "")
                    for t, v in series.get("values", []):
                        out.setdefault(round(float(t) / 3600), {})[model] = float(v)
        except Exception as exc:  # noqa: BLE001 - no history: the outlook says unknown, and why
            log.debug("demand history: %s", exc)
            return out, f"Prometheus did not answer the demand-history query ({exc})"
        return out, None

    # ------------------------------------------------------------ jobs

    def jobs(self, user: str | None = None, viewer: str | None = None) -> dict[str, Any]:
        return self._cached(("jobs", user or "", viewer or ""), lambda: self._jobs(user, viewer))

    def _jobs(self, user: str | None, viewer: str | None) -> dict[str, Any]:
        from slurm_idle.pipeline import live_status, pipeline_records
        from slurm_idle.slurm import CliBackend, make_backend

        now = self.clock()
        cfg = self.config
        errors: list[str] = []
        slurm = (self.slurm if self.slurm is not None
                 else make_backend(cfg) if cfg is not None else CliBackend())
        tag = cfg.slurm.tag if cfg is not None else DEFAULT_TAG
        partition = cfg.slurm.lend_partition if cfg is not None else DEFAULT_PARTITION
        try:
            cluster = slurm.cluster_name()
            all_rows = job_rows(slurm.jobs(), (), tag=tag, partition=partition,
                                root=self.state_root, now=now, cluster=cluster)
        except SlurmIdleError as exc:
            return {"generated_at": iso(now), "user": user, "viewer": viewer,
                    "logs_shown_to": "everyone" if self.show_all_users else "owner",
                    "users": [], "jobs": [], "pipelines": [], "errors": [f"squeue: {exc}"]}
        usage = self._usage(cfg, now, errors)
        rows = [r for r in all_rows if not user or r["user"] == user]
        rows.sort(key=lambda r: viewer is None or r["user"] != viewer)  # stable: the viewer's first
        for r in rows:
            used = usage.get(r["job_id"], {})
            r["gpu_hours"] = used.get("gpu_hours")
            r["lost_gpu_hours"] = used.get("lost_gpu_hours")
            mine = self._may_see(viewer, {r["user"]})
            r["log_tail"] = log_tail(r.get("log"), LOG_LINES) if mine else []
        pipelines = []
        for record in pipeline_records(self.state_root, cluster):
            try:
                steps = live_status(record, slurm)
            except SlurmIdleError as exc:
                errors.append(f"pipeline {record.get('pipeline')}: {exc}")
                continue
            listed = {r["job_id"] for r in rows}
            if user and not any(s.job_id in listed for s in steps):
                continue
            ids = {s.job_id for s in steps}
            # Its jobs' users; once they left squeue, the owner of the state dir it is in.
            owners = {r["user"] for r in all_rows if r["job_id"] in ids} or {_owner(self.state_root)}
            pipelines.append({
                "pipeline": record.get("pipeline"),
                "attempt": record.get("attempt", 1),
                "params": record.get("params", {}) if self._may_see(viewer, owners) else {},
                "submitted_at": iso(float(record.get("submitted_at") or 0)),
                "steps": [{"name": s.name, "job_id": s.job_id, "state": s.state,
                           "depends_on": list(s.depends_on), "restarts": s.restarts,
                           "node": s.node, "reason": s.reason} for s in steps],
                "svg": dag.render_svg(steps),
            })
        return {"generated_at": iso(now), "user": user, "viewer": viewer,
                "logs_shown_to": "everyone" if self.show_all_users else "owner",
                "users": users(all_rows), "jobs": rows, "pipelines": pipelines, "errors": errors}

    def _usage(self, cfg: Config | None, now: float, errors: list[str]) -> dict[int, dict[str, Any]]:
        """GPU-hours used and lost per job over the last week (report's per-job rows)."""
        if cfg is None:
            return {}
        report = self._report(cfg, now, errors)
        if report is None:
            return {}
        return {j.job_id: {"gpu_hours": _r(j.gpu_hours), "lost_gpu_hours": _r(j.lost_gpu_hours)}
                for j in report.per_job}


def _owner(path: Path) -> str:
    """The login of the user who owns `path` ("" if unknown)."""
    import pwd

    try:
        return pwd.getpwuid(os.stat(path).st_uid).pw_name
    except (OSError, KeyError):
        return ""


def _r(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


def gpu_counts(doc: Mapping[str, Any]) -> dict[str, int]:
    """GPUs per phase now (the pool view's header)."""
    out: dict[str, int] = {}
    for n in doc.get("nodes", []):
        out[n["phase"]] = out.get(n["phase"], 0) + int(n.get("gpus_total") or 0)
    return out
