"""The agent's own metrics, published the way a cron job publishes them: a node_exporter textfile.

Each `slurm-idle tick` is a fresh process, so there is no long-lived registry to hold counters.
Counters (`slurm_idle_transitions_total`, `slurm_idle_tick_errors_total`, `slurm_idle_ticks_total`)
are kept **in the textfile itself**: every tick reads the previous file back, adds this tick's
increments and writes the whole file again. That costs one small read per tick (the journal
would grow without bound), and if the file is lost or unreadable the counters restart at 0,
which Prometheus' `rate()`/`increase()` treat as an ordinary counter reset.

The file is written atomically (a temp file in the same directory, fsync, `os.replace`) so
node_exporter never reads half a file; the temp name does not end in `.prom`, so the collector
ignores it. Two ticks never write at once: the agent's lock serialises them.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from slurm_idle import safefiles
from slurm_idle.handover import HeldEntry, WakeFailedEntry
from slurm_idle.lifecycle import edges
from slurm_idle.logs import get_logger
from slurm_idle.model import Phase

log = get_logger(__name__)

PREFIX = "slurm_idle"

#: name -> (type, help). The order here is the order in the file.
METRICS: dict[str, tuple[str, str]] = {
    "slurm_idle_nodes": ("gauge", "Pool nodes per lifecycle phase after the last tick."),
    "slurm_idle_transitions_total": (
        "counter",
        "Successful phase transitions applied by the agent, by from/to phase.",
    ),
    "slurm_idle_tick_duration_seconds": ("gauge", "Wall time of the last tick."),
    "slurm_idle_last_tick_timestamp_seconds": ("gauge", "Unix time the last tick started."),
    "slurm_idle_tick_errors_total": ("counter", "Ticks that failed or had a failed transition."),
    "slurm_idle_ticks_total": ("counter", "Ticks that ran (got the lock)."),
    "slurm_idle_needed_replicas": ("gauge", "Replicas the planner says the traffic needs."),
    "slurm_idle_serving_replicas": ("gauge", "Replicas serving after the last tick."),
    "slurm_idle_min_serving_replicas": ("gauge", "Configured floor of serving replicas."),
    "slurm_idle_replicas": ("gauge", "Replicas per model and lifecycle phase (their lend group's)."),
    "slurm_idle_groups": ("gauge", "Lend groups (the nodes lent together) per lifecycle phase."),
    "slurm_idle_metrics_source": (
        "gauge",
        "1 for the metrics source the last tick planned on: prometheus, scrape, or none.",
    ),
    "slurm_idle_router_errors_total": (
        "counter", "Router calls (remove, add, state read) that failed; each is retried next tick."),
    "slurm_idle_lock_blocked_seconds": (
        "gauge",
        ("Seconds a process that is not a slurm-idle tick has held the tick lock past the "
         "budget (0: not blocked)."),
    ),
    "slurm_idle_gpu_held": (
        "gauge",
        ("1 per GPU of a node handed to the admin because someone else held its memory past "
         "timeouts.gpu_free_s, by node, gpu and holder (MiB held as label mib)."),
    ),
    "slurm_idle_leader": (
        "gauge",
        ("1 while this agent holds the leadership lease (ha.enabled), 0 while it stands by, "
         "by instance; no sample without ha."),
    ),
    "slurm_idle_lease_age_seconds": (
        "gauge",
        ("Seconds since the leadership lease was last renewed, as this agent read it (ha.enabled); "
         "no sample without ha or before any lease exists."),
    ),
    "slurm_idle_wake_failed": (
        "gauge",
        ("1 per node handed to the admin because its replica's starts or wakes kept failing, "
         "by node, replica and the engine's last error."),
    ),
}

#: Label values of slurm_idle_metrics_source (metrics.fallback), all written so none vanishes.
METRICS_SOURCES = ("prometheus", "scrape", "none")


def write_textfile(
    path: str | os.PathLike[str],
    *,
    phases: Mapping[str, int] | None,
    needed: Mapping[str, int],
    serving: Mapping[str, int],
    tick_duration_s: float,
    tick_ts: float,
    transitions: Iterable[tuple[str, str]],
    tick_error: bool,
    floors: Mapping[str, int] | None = None,
    replicas: Mapping[tuple[str, str], int] | None = None,
    groups: Mapping[str, int] | None = None,
    metrics_source: str | None = None,
    router_errors: int = 0,
    gpu_held: Iterable[HeldEntry] = (),
    wake_failed: Iterable[WakeFailedEntry] = (),
) -> None:
    """Write the agent's metrics for this tick, carrying the counters over from the last file.

    `replicas`: (model, phase) -> replicas, `groups`: phase -> lend groups, after the tick's
    steps (no samples when the pool could not be observed).

    `transitions` are this tick's successful (from_phase, to_phase) pairs; `floors` (optional)
    is each model's `min_serving_replicas`, for the "serving below floor" alert. `phases` is
    None when the pool could not be observed (the node gauge is then left without samples).
    """
    target = Path(path)
    previous = read_counters(target)
    text = render(
        phases=phases,
        needed=needed,
        serving=serving,
        tick_duration_s=tick_duration_s,
        tick_ts=tick_ts,
        transitions=transitions,
        tick_error=tick_error,
        floors=floors or {},
        previous=previous,
        replicas=replicas,
        groups=groups,
        metrics_source=metrics_source,
        router_errors=router_errors,
        gpu_held=gpu_held,
        wake_failed=wake_failed,
    )
    atomic_write(target, text)


def render(
    *,
    phases: Mapping[str, int] | None,
    needed: Mapping[str, int],
    serving: Mapping[str, int],
    tick_duration_s: float,
    tick_ts: float,
    transitions: Iterable[tuple[str, str]],
    tick_error: bool,
    floors: Mapping[str, int],
    previous: Counters,
    replicas: Mapping[tuple[str, str], int] | None = None,
    groups: Mapping[str, int] | None = None,
    metrics_source: str | None = None,
    router_errors: int = 0,
    gpu_held: Iterable[HeldEntry] = (),
    wake_failed: Iterable[WakeFailedEntry] = (),
) -> str:
    """The textfile's content (pure): previous counters + this tick's increments."""
    # Every phase appears, so a phase that empties reads 0 rather than vanishing; when the
    # pool could not be observed (phases None) the gauge has no sample: unknown, not empty.
    phase_counts: dict[str, int] = {}
    if phases is not None:
        phase_counts = {p.value: 0 for p in Phase}
        for phase, count in phases.items():
            phase_counts[str(phase)] = int(count)

    samples: dict[str, list[tuple[dict[str, str], float]]] = {
        "slurm_idle_nodes": [({"phase": p}, n) for p, n in phase_counts.items()],
        "slurm_idle_transitions_total": _transition_samples(previous, transitions),
        "slurm_idle_tick_duration_seconds": [({}, float(tick_duration_s))],
        "slurm_idle_last_tick_timestamp_seconds": [({}, float(tick_ts))],
        "slurm_idle_tick_errors_total": [({}, previous.tick_errors + (1 if tick_error else 0))],
        "slurm_idle_ticks_total": [({}, previous.ticks + 1)],
        "slurm_idle_needed_replicas": [({"model": m}, n) for m, n in sorted(needed.items())],
        "slurm_idle_serving_replicas": [({"model": m}, n) for m, n in sorted(serving.items())],
        "slurm_idle_min_serving_replicas": [({"model": m}, n) for m, n in sorted(floors.items())],
        "slurm_idle_replicas": [({"model": m, "phase": p}, n)
                                for (m, p), n in sorted((replicas or {}).items())],
        "slurm_idle_groups": [({"phase": p}, n) for p, n in sorted((groups or {}).items())],
        # one-hot over the sources; no sample when the source does not say (a single source)
        "slurm_idle_metrics_source": [
            ({"source": s}, float(s == metrics_source)) for s in METRICS_SOURCES
        ] if metrics_source in METRICS_SOURCES else [],
        "slurm_idle_router_errors_total": [({}, previous.router_errors + router_errors)],
        "slurm_idle_lock_blocked_seconds": [({}, 0)],  # a tick that ran holds the lock
        "slurm_idle_gpu_held": [({"node": g.node, "gpu": str(g.gpu) if g.gpu >= 0 else "unknown",
                                  "holder": g.holder[:80],
                                  "mib": str(g.used_mib)}, 1) for g in gpu_held],
        "slurm_idle_wake_failed": [({"node": w.node, "replica": w.replica, "error": w.error[:120]}, 1)
                                   for w in wake_failed],
        "slurm_idle_leader": [],
        "slurm_idle_lease_age_seconds": [],
    }
    # HELP/TYPE even without samples: every family is declared in every file.
    lines = [line for name in METRICS for line in _family_lines(name, samples[name])]
    return "\n".join(lines) + "\n"


def _transition_samples(
    previous: Counters, transitions: Iterable[tuple[str, str]]
) -> list[tuple[dict[str, str], float]]:
    # Every edge of the lifecycle starts at 0: a counter that first appears at 1 loses that
    # first increment in increase()/rate(), and dashboards should not depend on history.
    moved: dict[tuple[str, str], float] = {(e.from_phase.value, e.to_phase.value): 0.0 for e in edges()}
    moved.update(previous.transitions)
    for from_phase, to_phase in transitions:
        key = (str(from_phase), str(to_phase))
        moved[key] = moved.get(key, 0.0) + 1
    return [({"from": f, "to": t}, n) for (f, t), n in sorted(moved.items())]


def _family_lines(name: str, samples: list[tuple[dict[str, str], float]]) -> list[str]:
    kind, help_text = METRICS[name]
    return [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"] + [
        f"{name}{_labels(labels)} {_number(value)}" for labels, value in samples
    ]


def add_transitions(path: str | os.PathLike[str], transitions: Iterable[tuple[str, str]]) -> None:
    """Count transitions made outside a tick (admin `lend`/`reclaim`/`pin`) in the textfile.

    Only the transitions counter changes; the gauges stay what the last tick wrote until the
    next tick (within a minute) refreshes them. Callers hold the agent's lock, like a tick.
    """
    transitions = list(transitions)
    if not transitions:
        return
    target = Path(path)
    name = "slurm_idle_transitions_total"
    _replace_family(target, name, _transition_samples(read_counters(target), transitions))


def set_lock_blocked(path: str | os.PathLike[str], seconds: float, pid: int | None, command: str) -> None:
    """A tick locked out by a foreign holder (lock.inspect) says so in the textfile.

    Only that gauge changes: the others keep what the last tick that ran wrote, and their
    `slurm_idle_last_tick_timestamp_seconds` ages, which the stale-tick alert sees as well.
    """
    labels = {"pid": str(pid or ""), "command": command[:80]}
    _replace_family(Path(path), "slurm_idle_lock_blocked_seconds", [(labels, round(seconds, 1))])


#: The families only the acting agent can fill: a standby's textfile has no samples of them.
STANDBY_EMPTY = ("slurm_idle_nodes", "slurm_idle_needed_replicas", "slurm_idle_serving_replicas",
                 "slurm_idle_min_serving_replicas", "slurm_idle_replicas", "slurm_idle_groups",
                 "slurm_idle_metrics_source", "slurm_idle_gpu_held", "slurm_idle_wake_failed")


def set_leadership(path: str | os.PathLike[str], instance: str, leads: bool,
                   lease_age_s: float | None, now: float | None = None) -> None:
    """Who leads, as this agent sees it (leadership.py): its own gauge and the lease's age.

    Written after every full pass, the standby's too (whose other gauges are left as they were:
    a standby observes nothing)."""
    target = Path(path)
    _replace_family(target, "slurm_idle_leader", [({"instance": instance}, float(leads))])
    _replace_family(target, "slurm_idle_lease_age_seconds",
                    [] if lease_age_s is None else [({}, round(lease_age_s, 1))])
    if not leads and now is not None:
        # A standby is alive (its heartbeat stays fresh for SlurmIdleTickStale) and speaks for
        # nothing it did not observe: what it wrote when it last led would be counted twice.
        _replace_family(target, "slurm_idle_last_tick_timestamp_seconds", [({}, float(now))])
        for name in STANDBY_EMPTY:
            _replace_family(target, name, [])


def _replace_family(target: Path, name: str, samples: list[tuple[dict[str, str], float]]) -> None:
    try:
        old_lines = (safefiles.read_text(target) or "").splitlines()
    except OSError:
        old_lines = []
    block = _family_lines(name, samples)

    def ours(line: str) -> bool:
        return line.startswith((name, f"# HELP {name} ", f"# TYPE {name} "))

    at = next((i for i, line in enumerate(old_lines) if ours(line)), len(old_lines))
    kept = [line for line in old_lines if not ours(line)]
    atomic_write(target, "\n".join(kept[:at] + block + kept[at:]) + "\n")


@dataclass
class Counters:
    """Counter values read back from the previous textfile (zeros when there is none)."""

    transitions: dict[tuple[str, str], float] = field(default_factory=dict)
    tick_errors: float = 0.0
    ticks: float = 0.0
    router_errors: float = 0.0


def parse_counters(text: str) -> Counters:
    """The counters in a textfile we wrote earlier (pure). Raises ValueError on a broken file."""
    from prometheus_client.parser import text_string_to_metric_families

    counters = Counters()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            value = float(sample.value)
            if math.isnan(value) or value < 0:
                continue
            if sample.name == "slurm_idle_transitions_total":
                key = (sample.labels.get("from", ""), sample.labels.get("to", ""))
                counters.transitions[key] = value
            elif sample.name == "slurm_idle_tick_errors_total":
                counters.tick_errors = value
            elif sample.name == "slurm_idle_ticks_total":
                counters.ticks = value
            elif sample.name == "slurm_idle_router_errors_total":
                counters.router_errors = value
    return counters


def read_counters(path: Path) -> Counters:
    """Counters of the previous file; a missing or unreadable file restarts them at 0."""
    try:
        text = safefiles.read_text(path)
    except OSError as exc:
        log.warning("cannot read %s (%s): agent counters restart at 0", path, exc.strerror)
        return Counters()
    if text is None:
        return Counters()
    try:
        return parse_counters(text)
    except ValueError as exc:
        log.warning("cannot parse %s (%s): agent counters restart at 0", path, exc)
        return Counters()


def atomic_write(
    path: Path, text: str, *, before_replace: Callable[[str], None] | None = None
) -> None:
    """Replace `path` with `text` so a reader sees the old or the new file, never a mix, in a
    directory nobody else can write and never through a symlink (safefiles)."""
    safefiles.atomic_write(path, text, 0o644, before_replace)


def _labels(labels: Mapping[str, str]) -> str:
    if not labels:
        return ""
    inner = ",".join(f'{k}="{_escape(str(v))}"' for k, v in labels.items())
    return "{" + inner + "}"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _number(value: float) -> str:
    if isinstance(value, bool):
        value = int(value)
    if float(value).is_integer() and abs(value) < 2**53:
        return str(int(value))
    return repr(float(value))
