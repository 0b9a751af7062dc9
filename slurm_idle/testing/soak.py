"""A soak benchmark (`scripts/bench-soak`): one real `slurm-idle agent` on a sandbox of its own
for a day's worth of ticks, sampled from /proc, judged flat or not.

The agent runs for months under systemd; a leak of a few kB a tick (a cache that only grows, a
descriptor or thread per pass, a child never reaped) is invisible in a test and fatal there.
This module starts the sandbox on its own root and ports, one agent with a short tick, drives
the load up and down so that nodes are really lent and reclaimed (level-triggered: the load
flips once the nodes have followed it, bounded by a minimum and a maximum phase length), and
every few seconds samples the agent's resident memory, descriptors, threads and child
processes. Ticks, lends and reclaims are counted from the agent's journal.

The pure parts (the /proc parsers, the journal counting, the load phases, the judge) are
apart from the one function that runs everything (`run_soak`); tests/unit/test_soak.py
covers them without a sandbox.
"""

from __future__ import annotations

import csv
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

from slurm_idle.testing.traced import read, summary

#: The columns of `--csv`, in order (Sample's fields).
CSV_FIELDS = ("t_s", "ticks", "lends", "reclaims", "rss_mb", "fds", "threads", "children",
              "zombies", "load_rps")


# --- /proc ------------------------------------------------------------------------------


@dataclass(frozen=True)
class ProcStatus:
    """What /proc/PID/status says of a process that matters for a leak."""

    rss_kb: int
    threads: int
    state: str  # R, S, Z, ...


def parse_status(text: str) -> ProcStatus:
    """VmRSS (kB), Threads and State of a /proc/PID/status text; a zombie has no VmRSS (0)."""
    fields: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep:
            fields[key.strip()] = value.strip()
    rss = fields.get("VmRSS", "0 kB").split()
    return ProcStatus(rss_kb=int(rss[0]) if rss else 0,
                      threads=int(fields.get("Threads", "0") or 0),
                      state=(fields.get("State", "?") or "?")[0])


def parse_stat_ppid(text: str) -> tuple[int, str]:
    """(ppid, state) of a /proc/PID/stat line. The command name, in parentheses, may itself
    hold spaces and parentheses: the fields are read after its last `)`."""
    rest = text[text.rindex(")") + 1:].split()
    return int(rest[1]), rest[0]


def descendants(pid: int, parents: Mapping[int, int]) -> set[int]:
    """Every process below `pid` in a child -> parent map (children, theirs, ...)."""
    below: dict[int, list[int]] = {}
    for child, parent in parents.items():
        below.setdefault(parent, []).append(child)
    out: set[int] = set()
    todo = [pid]
    while todo:
        for child in below.get(todo.pop(), ()):
            if child not in out:
                out.add(child)
                todo.append(child)
    return out


@dataclass(frozen=True)
class ProcSample:
    """One look at the agent's process."""

    rss_mb: float
    fds: int
    threads: int
    children: int  # every descendant, zombies included
    zombies: int  # descendants exited and not reaped


def sample_process(pid: int, proc: Path = Path("/proc")) -> ProcSample | None:
    """The process `pid` as /proc shows it now, or None when it is gone (or a zombie itself)."""
    try:
        status = parse_status((proc / str(pid) / "status").read_text())
        fds = len(os.listdir(proc / str(pid) / "fd"))
    except (FileNotFoundError, ProcessLookupError):
        return None
    if status.state == "Z":
        return None
    parents: dict[int, int] = {}
    states: dict[int, str] = {}
    for entry in os.listdir(proc):
        if not entry.isdigit():
            continue
        try:
            ppid, state = parse_stat_ppid((proc / entry / "stat").read_text())
        except (OSError, ValueError, IndexError):
            continue  # exited between listdir and read
        parents[int(entry)] = ppid
        states[int(entry)] = state
    below = descendants(pid, parents)
    return ProcSample(rss_mb=status.rss_kb / 1024, fds=fds, threads=status.threads,
                      children=len(below), zombies=sum(states.get(p) == "Z" for p in below))


# --- the journal ------------------------------------------------------------------------


@dataclass
class JournalCounts:
    """Ticks, lends and reclaims in the journal so far, and when each lend/reclaim happened."""

    # In the journal's lines; JournalTail.ticks adds the idle run pending. A fast check that
    # acted is journaled as a tick record too (loop.py), so this runs a little ahead of the
    # agent's own count of full ticks (its `--json` on exit, the result's `agent`).
    ticks: int = 0
    last_tick_ts: float | None = None  # the newest tick record's start
    tick_errors: int = 0  # tick records carrying errors (a failed step or a failed tick)
    lends: int = 0  # lending -> lent, done
    reclaims: int = 0  # lent -> reclaiming, done
    served: int = 0  # starting -> serving, done (a reclaim finished)
    lent: set[str] = field(default_factory=set)  # nodes lent now, as the journal tells
    lend_ts: list[float] = field(default_factory=list)
    reclaim_ts: list[float] = field(default_factory=list)

    def add(self, record: Mapping[str, Any]) -> None:
        """Count one journal record. A tick record may stand for several identical idle ticks
        (`count`); a transition counts only once it is done (outcome ok), not while waiting."""
        event = record.get("event")
        if event == "tick":
            count = record.get("count", 1)
            self.ticks += count if isinstance(count, int) and count > 0 else 1
            self.last_tick_ts = float(record.get("ts", 0) or 0)
            if record.get("error") or record.get("errors"):
                self.tick_errors += 1
            return
        if event != "transition" or record.get("outcome") != "ok":
            return
        node, src, dst = str(record.get("node", "")), record.get("from"), record.get("to")
        ts = float(record.get("ts", 0) or 0)
        if (src, dst) == ("lending", "lent"):
            self.lends += 1
            self.lent.add(node)
            self.lend_ts.append(ts)
        elif (src, dst) == ("lent", "reclaiming"):
            self.reclaims += 1
            self.lent.discard(node)
            self.reclaim_ts.append(ts)
        elif (src, dst) == ("starting", "serving"):
            self.served += 1


def count_lines(lines: Iterable[str], counts: JournalCounts | None = None) -> JournalCounts:
    """Add the journal lines to `counts` (new ones when None); a malformed line is skipped."""
    out = counts if counts is not None else JournalCounts()
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            out.add(record)
    return out


def pending_ticks(text: str, last_tick_ts: float | None) -> int:
    """The ticks of the idle run not yet in the journal (`<journal>.idle-run`, one tick
    record, idle_runs.py), 0 when there is none or it is the journal's last tick record
    already (read between its append and the side file's replacement)."""
    try:
        record = json.loads(text)
    except ValueError:
        return 0
    if not isinstance(record, dict) or record.get("event") != "tick":
        return 0
    if last_tick_ts is not None and float(record.get("ts", 0) or 0) == last_tick_ts:
        return 0
    count = record.get("count", 1)
    return count if isinstance(count, int) and count > 0 else 1


class JournalTail:
    """Reads a growing journal a piece at a time: complete lines only (a line being written
    is read at the next call), from the start again if the file was replaced by a shorter one.
    `ticks` adds the pending idle run, kept beside the journal until a tick ends it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.pending_path = path.with_name(path.name + ".idle-run")
        self.counts = JournalCounts()
        self.ticks = 0
        self._offset = 0

    def poll(self) -> JournalCounts:
        try:
            with self.path.open("rb") as f:
                if os.fstat(f.fileno()).st_size < self._offset:
                    self._offset, self.counts = 0, JournalCounts()
                f.seek(self._offset)
                data = f.read()
        except FileNotFoundError:
            return self.counts
        end = data.rfind(b"\n") + 1
        self._offset += end
        count_lines(data[:end].decode(errors="replace").splitlines(), self.counts)
        try:
            pending = self.pending_path.read_text()
        except OSError:
            pending = ""
        self.ticks = self.counts.ticks + pending_ticks(pending, self.counts.last_tick_ts)
        return self.counts


# --- the load ---------------------------------------------------------------------------


@dataclass(frozen=True)
class LoadPlan:
    """Low load until the nodes are lent, high load until they all serve again; each phase
    lasts at least min_s (the nodes settle) and at most max_s (a cycle that stalls moves on)."""

    high_rps: float = 12.0  # the demo's rise: queues build on one or two replicas
    low_rps: float = 0.0
    lent_target: int = 3  # pool of 4, min_serving_replicas 1
    min_s: float = 45.0
    max_s: float = 240.0


def next_load(plan: LoadPlan, high: bool, phase_s: float, lent: int, busy: bool) -> bool:
    """Whether the load is high after this look: `phase_s` seconds into the current phase,
    `lent` nodes lent now, `busy` while a reclaim has not reached serving yet."""
    if phase_s < plan.min_s:
        return high
    if phase_s >= plan.max_s:
        return not high
    if high:
        return lent > 0 or busy  # back to low once every reclaimed node serves
    return lent >= plan.lent_target  # up once as many nodes are lent as can be


# --- the judge --------------------------------------------------------------------------


@dataclass(frozen=True)
class Sample:
    """One row of the soak: seconds since the agent started, journal counts, the process."""

    t_s: float
    ticks: int
    lends: int
    reclaims: int
    rss_mb: float
    fds: int
    threads: int
    children: int
    zombies: int
    load_rps: float


def slope_per_hour(ts: Sequence[float], ys: Sequence[float]) -> float:
    """Least-squares slope of ys over ts (seconds), per hour; 0 for fewer than two points."""
    n = len(ts)
    if n < 2:
        return 0.0
    mt, my = sum(ts) / n, sum(ys) / n
    var = sum((t - mt) ** 2 for t in ts)
    if var == 0:
        return 0.0
    return sum((t - mt) * (y - my) for t, y in zip(ts, ys, strict=True)) / var * 3600.0


@dataclass(frozen=True)
class Bounds:
    """What counts as flat: the second half's median RSS within max(abs_mb, rel x the first's)
    of the first half's; descriptors' and threads' floors (each half's fewest) equal.

    Floors, not medians, for those two: a pass holds a socket or two and a thread pool while
    it runs, so their median follows the share of samples that land mid-pass, which grows
    when the machine is busy and passes take longer (a day-long run, 2026-12-07: median fds
    5 -> 6 in the busiest half, floor 5 throughout). A leaked descriptor or thread raises
    every sample, the floor too. The medians are reported beside them."""

    rss_abs_mb: float = 2.0
    rss_rel: float = 0.03
    warmup_fraction: float = 0.10


def _halves(values: Sequence[float]) -> tuple[float, float]:
    mid = len(values) // 2
    return statistics.median(values[:mid]), statistics.median(values[mid:])


def judge(samples: Sequence[Sample], bounds: Bounds = Bounds()) -> dict[str, Any]:
    """The verdict on a run's samples: drop the warm-up (the first fraction of the run's
    time), split the rest in two halves by sample, compare the halves' medians."""
    if not samples:
        return {"verdict": "no samples", "reasons": ["the agent was never sampled"]}
    t_end = samples[-1].t_s
    kept = [s for s in samples if s.t_s >= samples[0].t_s + bounds.warmup_fraction
            * (t_end - samples[0].t_s)]
    if len(kept) < 4:
        return {"verdict": "too short", "reasons": [f"{len(kept)} samples after the warm-up"]}
    out: dict[str, Any] = {"warmup_s": round(kept[0].t_s - samples[0].t_s, 1),
                           "judged_samples": len(kept)}
    reasons: list[str] = []
    rss = [s.rss_mb for s in kept]
    first, second = _halves(rss)
    out["rss_mb"] = {"first_half_median": round(first, 2), "second_half_median": round(second, 2),
                     "min": round(min(rss), 2), "max": round(max(rss), 2),
                     "slope_mb_per_h": round(slope_per_hour([s.t_s for s in kept], rss), 3)}
    bound = max(bounds.rss_abs_mb, bounds.rss_rel * first)
    if abs(second - first) > bound:
        reasons.append(f"median RSS moved {second - first:+.2f} MB between the halves "
                       f"(bound {bound:.2f} MB)")
    for name in ("fds", "threads"):
        series = [float(getattr(s, name)) for s in kept]
        a, b = _halves(series)
        mid = len(series) // 2
        low_a, low_b = min(series[:mid]), min(series[mid:])
        out[name] = {"first_half_median": a, "second_half_median": b,
                     "first_half_floor": low_a, "second_half_floor": low_b,
                     "median": statistics.median(series), "min": min(series),
                     "peak": max(series)}
        if low_b != low_a:
            reasons.append(f"{name} at rest (fewest) {low_a:g} -> {low_b:g}")
    for name in ("children", "zombies"):
        series = [float(getattr(s, name)) for s in kept]
        a, b = _halves(series)
        out[name] = {"median": statistics.median(series), "peak": max(series),
                     "first_half_median": a, "second_half_median": b}
        if b > a:
            reasons.append(f"median {name} {a:g} -> {b:g}")
    out["verdict"] = "flat" if not reasons else "not flat"
    out["reasons"] = reasons
    return out


# --- reports ----------------------------------------------------------------------------


def write_csv(path: Path, samples: Sequence[Sample]) -> None:
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        w.writeheader()
        for s in samples:
            w.writerow(asdict(s))


def read_csv(path: Path) -> list[Sample]:
    """The samples a run wrote with --csv."""
    with path.open(newline="") as f:
        return [Sample(t_s=float(r["t_s"]), ticks=int(r["ticks"]), lends=int(r["lends"]),
                       reclaims=int(r["reclaims"]), rss_mb=float(r["rss_mb"]),
                       fds=int(r["fds"]), threads=int(r["threads"]),
                       children=int(r["children"]), zombies=int(r["zombies"]),
                       load_rps=float(r["load_rps"]))
                for r in csv.DictReader(f)]


def rejudge(samples: Sequence[Sample], bounds: Bounds, tick_s: float) -> dict[str, Any]:
    """The result of a run saved with --csv, judged again (no sandbox): its counts are the
    last sample's, the agent's own figures and log are not in the file."""
    last = samples[-1] if samples else Sample(0, 0, 0, 0, 0, 0, 0, 0, 0, 0)
    verdict = judge(samples, bounds)
    return {"ticks": last.ticks, "lends": last.lends, "reclaims": last.reclaims,
            "duration_s": last.t_s, "samples": len(samples), "tick_s": tick_s,
            **{k: verdict[k] for k in ("warmup_s", "judged_samples", "rss_mb", "fds",
                                       "threads", "children", "zombies") if k in verdict},
            "verdict": verdict["verdict"], "reasons": verdict["reasons"],
            "bounds": asdict(bounds)}


def table(result: Mapping[str, Any]) -> str:
    """The human summary of a result (the `--json` dict)."""
    head = (f"soak: {result['ticks']} ticks ({result['tick_s']:g} s apart), {result['lends']} "
            f"lends, {result['reclaims']} reclaims in {result['duration_s'] / 60:.1f} min, "
            f"{result['samples']} samples (warm-up {result.get('warmup_s', 0):.0f} s dropped)")
    lines = [head]
    rss = result.get("rss_mb")
    if rss:
        lines.append(f"{'':10} {'1st half':>9} {'2nd half':>9} {'min':>8} {'max':>8}")
        lines.append(f"{'RSS MB':10} {rss['first_half_median']:>9.2f} "
                     f"{rss['second_half_median']:>9.2f} {rss['min']:>8.2f} {rss['max']:>8.2f}"
                     f"   slope {rss['slope_mb_per_h']:+.3f} MB/h")
        for name in ("fds", "threads"):
            d = result[name]
            lines.append(f"{name:10} {d['first_half_median']:>9g} {d['second_half_median']:>9g} "
                         f"{d['min']:>8g} {d['peak']:>8g}   at rest {d['first_half_floor']:g}"
                         f" -> {d['second_half_floor']:g}")
        for name in ("children", "zombies"):
            d = result[name]
            lines.append(f"{name:10} median {d['median']:g}, peak {d['peak']:g}")
    trace = result.get("trace") or {}
    if trace.get("snapshots"):
        tm, objs = trace["traced_mb"], trace["objects"]
        lines.append(f"tracemalloc over {trace['span_s'] / 60:.0f} min ({trace['snapshots']} "
                     f"snapshots): traced {tm['first']:.2f} -> {tm['last']:.2f} MB "
                     f"({tm['slope_mb_per_h']:+.3f} MB/h), objects {objs['first']} -> "
                     f"{objs['last']}")
        for top in trace.get("top_growth", [])[:3]:
            lines.append(f"  {top['size_diff_kb']:+.1f} kB ({top['count_diff']:+d}) "
                         f"{top['where']}")
    end = trace.get("exit") or {}
    if end:
        collected = (f"traced {end['traced_mb']:.2f} -> {end['traced_after_collect_mb']:.2f} MB "
                     "after a full collection, " if "traced_after_collect_mb" in end else "")
        lines.append(f"at exit: {collected}RSS {end['rss_mb']:.2f} MB, "
                     f"{end['rss_after_trim_mb']:.2f} MB after malloc_trim")
    lines.append(f"verdict: {result['verdict']}"
                 + (f" ({'; '.join(result['reasons'])})" if result.get("reasons") else ""))
    return "\n".join(lines)


def plot(path: Path, samples: Sequence[Sample], result: Mapping[str, Any],
         lend_t: Sequence[float] = (), reclaim_t: Sequence[float] = ()) -> str:
    """A PNG of the four series over the run (matplotlib, if importable); what was written."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not importable: no plot (pip install matplotlib)"
    minutes = [s.t_s / 60 for s in samples]
    fig, axes = plt.subplots(4, 1, figsize=(9, 8), sharex=True)
    series = [("rss_mb", "RSS (MB)"), ("fds", "open fds"), ("threads", "threads"),
              ("children", "child processes")]
    warm = float(result.get("warmup_s", 0)) / 60
    for ax, (name, label) in zip(axes, series, strict=True):
        ax.plot(minutes, [getattr(s, name) for s in samples], lw=0.8)
        ax.set_ylabel(label)
        ax.axvspan(0, warm, color="0.9")
        ax.grid(alpha=0.3)
    for t in lend_t:
        axes[0].axvline(t / 60, color="tab:green", lw=0.3, alpha=0.5)
    for t in reclaim_t:
        axes[0].axvline(t / 60, color="tab:red", lw=0.3, alpha=0.5)
    rss = result.get("rss_mb") or {}
    if rss:  # the judged range, not the interpreter's start from 0
        axes[0].set_ylim(rss["min"] - 2, rss["max"] + 2)
    axes[0].set_title(f"slurm-idle agent over {result['ticks']} ticks: {result['lends']} lends "
                      f"(green), {result['reclaims']} reclaims (red); slope "
                      f"{rss.get('slope_mb_per_h', 0):+.2f} MB/h, {result['verdict']}",
                      fontsize=9)
    axes[-1].set_xlabel("minutes since the agent started (grey: warm-up, not judged)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return f"plot: {path}"


# --- the run ----------------------------------------------------------------------------


@dataclass
class SoakOptions:
    root: Path
    base_port: int | None
    ticks: int = 1440
    tick_s: int = 2
    fast_s: int = 1
    sample_s: float = 5.0
    plan: LoadPlan = LoadPlan()
    bounds: Bounds = Bounds()
    keep: bool = False
    csv: Path | None = None
    plot: Path | None = None
    max_minutes: float | None = None  # stop then, whatever the tick count
    trace: Path | None = None  # run the agent under tracemalloc (testing/traced.py), lines here
    trace_after_s: float = 300.0
    trace_every_s: float = 300.0


def _agent_config(sb: Any, opts: SoakOptions, out: Path) -> Path:
    """The sandbox's own config with the agent's short tick and fast check, and no noise
    margin (`headroom_sigmas: 0`).

    The soak's load is a square wave (12 requests/s or none, flipped every few minutes). Once
    the noise of its 10-minute changes is on record (about 40 minutes in, measured
    2026-12-07) the margin is three times that noise, more than the whole pool: the agent
    then rightly keeps every replica serving, even at zero load, and the rest of the soak
    has no lend or reclaim to measure."""
    import yaml

    doc = yaml.safe_load(Path(sb.config_path).read_text())
    doc["policy"].update({"tick_interval_s": opts.tick_s, "fast_interval_s": opts.fast_s,
                          "headroom_sigmas": 0})
    out.write_text(yaml.safe_dump(doc, sort_keys=False))
    return out


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt  # SIGTERM ends the run like Ctrl-C: the finally tears down


def run_soak(opts: SoakOptions, say: Callable[[str], None]) -> dict[str, Any]:
    """Up, reset, one agent, sample until opts.ticks ticks, stop, judge; the sandbox down
    at the end whatever happens (unless opts.keep)."""
    from slurm_idle.config import load_config
    from slurm_idle.testing.demo import reset_cluster
    from slurm_idle.testing.sandbox import Sandbox

    signal.signal(signal.SIGTERM, _interrupt)
    sb = Sandbox(opts.root, opts.base_port)
    agent: subprocess.Popen[str] | None = None
    samples: list[Sample] = []
    agent_stats: dict[str, Any] = {}
    t0 = time.monotonic()
    try:
        say(f"sandbox up under {sb.root}, ports {sb.base_port}-{sb.base_port + 39} ...")
        sb.up(progress=lambda line: say(f"  sandbox: {line}"))
        config_path = _agent_config(sb, opts, sb.root / "soak-agent.yaml")
        config = load_config(config_path)
        journal = Path(config.paths.journal)
        reset_cluster(sb, str(journal))
        # the idle run kept beside the journal (idle_runs.py) goes too: left there, an earlier
        # run's ticks are appended to this run's journal at its first tick
        journal.with_name(journal.name + ".idle-run").unlink(missing_ok=True)
        tree = str(Path(__file__).resolve().parents[2])
        env = {**os.environ, **sb.env(), "SLURM_IDLE_CONFIG": str(config_path),
               "PYTHONPATH": os.pathsep.join(dict.fromkeys(
                   [tree, *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]))}
        command = [sb.python, "-m", "slurm_idle.cli", "agent", "--json"]
        if opts.trace is not None:
            opts.trace.unlink(missing_ok=True)
            command[2] = "slurm_idle.testing.traced"
            env.update({"SLURM_IDLE_TRACE_OUT": str(opts.trace.resolve()),
                        "SLURM_IDLE_TRACE_AFTER_S": str(opts.trace_after_s),
                        "SLURM_IDLE_TRACE_EVERY_S": str(opts.trace_every_s)})
        log_path = sb.root / "soak-agent.log"
        out_path = sb.root / "soak-agent.out"
        with log_path.open("w") as err, out_path.open("w") as out:
            agent = subprocess.Popen(command, env=env, stdout=out, stderr=err, text=True,
                                     cwd=sb.root, start_new_session=True)
        say(f"agent pid {agent.pid}: tick {opts.tick_s}s, fast check {opts.fast_s}s, "
            f"log {log_path}")
        tail = JournalTail(journal)
        started = time.monotonic()
        high, phase_start, last_say = False, started, 0.0
        sb.load(opts.plan.low_rps)
        while True:
            now = time.monotonic()
            counts = tail.poll()
            proc = sample_process(agent.pid)
            if proc is None:
                raise RuntimeError(f"bench-soak: the agent exited (rc {agent.poll()}); see "
                                   f"{log_path}")
            busy = counts.reclaims > counts.served
            want = next_load(opts.plan, high, now - phase_start, len(counts.lent), busy)
            if want != high:
                high, phase_start = want, now
                sb.load(opts.plan.high_rps if high else opts.plan.low_rps)
            samples.append(Sample(
                t_s=round(now - started, 1), ticks=tail.ticks, lends=counts.lends,
                reclaims=counts.reclaims, rss_mb=round(proc.rss_mb, 3), fds=proc.fds,
                threads=proc.threads, children=proc.children, zombies=proc.zombies,
                load_rps=opts.plan.high_rps if high else opts.plan.low_rps))
            if now - last_say >= 60:
                last_say = now
                s = samples[-1]
                say(f"[{s.t_s / 60:5.1f} min] ticks {s.ticks}/{opts.ticks}, lends {s.lends}, "
                    f"reclaims {s.reclaims}, lent {len(counts.lent)}, load {s.load_rps:g}; "
                    f"RSS {s.rss_mb:.1f} MB, fds {s.fds}, threads {s.threads}, "
                    f"children {s.children}")
            if tail.ticks >= opts.ticks:
                break
            if opts.max_minutes is not None and now - started >= opts.max_minutes * 60:
                say(f"bench-soak: --max-minutes {opts.max_minutes:g} reached at "
                    f"{tail.ticks} ticks")
                break
            time.sleep(opts.sample_s)
        agent.send_signal(signal.SIGTERM)
        agent.wait(timeout=config.timeouts.tick_budget_s + 30)
        try:
            agent_stats = json.loads(out_path.read_text() or "{}")
        except ValueError:
            agent_stats = {}
        counts = tail.poll()
        result = summarize(samples, counts, tail.ticks, opts, agent_stats, log_path,
                           time.monotonic() - started)
        wall0 = time.time() - (time.monotonic() - started)  # the journal's clock is the wall's
        t_lend = [t - wall0 for t in counts.lend_ts]
        t_reclaim = [t - wall0 for t in counts.reclaim_ts]
        if opts.csv is not None:
            write_csv(opts.csv, samples)
        if opts.plot is not None:
            say(plot(opts.plot, samples, result, t_lend, t_reclaim))
        return result
    finally:
        if agent is not None and agent.poll() is None:
            agent.kill()
            agent.wait()
        try:
            sb.load(0.0)
        except OSError:
            pass
        if opts.keep:
            say(f"sandbox left running: scripts/sandbox --root {sb.root} down")
        else:
            res = sb.down()
            say(f"sandbox down: {len(res['stopped'])} processes stopped"
                + (f", LEFT {res['left']}" if res["left"] else "")
                + f" ({time.monotonic() - t0:.0f} s in all)")


def agent_log_problems(path: Path, limit: int = 5) -> tuple[int, list[str]]:
    """How many lines of the agent's stderr are warnings, errors or tracebacks; the first few."""
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return 0, []
    bad = [ln for ln in lines if any(w in ln for w in ("WARNING", "ERROR", "Traceback",
                                                       "error", "warning"))]
    return len(bad), bad[:limit]


def summarize(samples: Sequence[Sample], counts: JournalCounts, ticks: int, opts: SoakOptions,
              agent_stats: Mapping[str, Any], log_path: Path, duration_s: float
              ) -> dict[str, Any]:
    """The `--json` shape: counts, the judge's series and verdict, the agent's own figures."""
    verdict = judge(samples, opts.bounds)
    problems, first = agent_log_problems(log_path)
    traced = {} if opts.trace is None else {"trace": summary(read(opts.trace))}
    return {
        "ticks": ticks, "lends": counts.lends, "reclaims": counts.reclaims,
        "duration_s": round(duration_s, 1), "samples": len(samples),
        "tick_s": opts.tick_s, "fast_s": opts.fast_s, "sample_s": opts.sample_s,
        **{k: verdict[k] for k in ("warmup_s", "judged_samples", "rss_mb", "fds", "threads",
                                   "children", "zombies") if k in verdict},
        "verdict": verdict["verdict"], "reasons": verdict["reasons"],
        "tick_errors": counts.tick_errors, "agent": dict(agent_stats),
        "agent_log": {"path": str(log_path), "problem_lines": problems, "first": first},
        "bounds": asdict(opts.bounds), **traced,
    }


def main(argv: Sequence[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="bench-soak", description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--ticks", type=int, default=1440, help="stop after N ticks (default 1440: "
                    "a day of ticks at the default 60 s cadence)")
    ap.add_argument("--tick-s", type=int, default=2, help="policy.tick_interval_s (default 2)")
    ap.add_argument("--fast-s", type=int, default=1, help="policy.fast_interval_s (default 1)")
    ap.add_argument("--sample-s", type=float, default=5.0, help="seconds between samples")
    ap.add_argument("--root", type=Path, default=Path("/tmp/soak-sandbox"))
    ap.add_argument("--base-port", type=int, default=None,
                    help="first of the sandbox's 40 ports (default: a leased free block)")
    ap.add_argument("--high-rps", type=float, default=LoadPlan.high_rps)
    ap.add_argument("--max-minutes", type=float, default=None,
                    help="stop after this long even short of --ticks")
    ap.add_argument("--csv", type=Path, default=None, help="write every sample here")
    ap.add_argument("--plot", type=Path, default=None, help="write a PNG of the series here")
    ap.add_argument("--json", action="store_true", help="print the result as JSON")
    ap.add_argument("--keep", action="store_true", help="leave the sandbox running")
    ap.add_argument("--trace", type=Path, default=None, metavar="JSONL",
                    help="run the agent under tracemalloc and write its snapshots here "
                    "(what grows: Python objects, or the allocator's retained pages)")
    ap.add_argument("--trace-after-s", type=float, default=300.0,
                    help="start tracing after this warm-up (default 300)")
    ap.add_argument("--trace-every-s", type=float, default=300.0,
                    help="seconds between snapshots (default 300)")
    ap.add_argument("--from-csv", type=Path, default=None, metavar="CSV",
                    help="judge (and --plot) the samples an earlier run wrote with --csv; "
                    "no sandbox")
    args = ap.parse_args(argv)
    if args.ticks < 1 or args.tick_s < 1:
        ap.error("--ticks and --tick-s must be >= 1")
    if args.from_csv is not None:
        samples = read_csv(args.from_csv)
        result = rejudge(samples, Bounds(), args.tick_s)
        if args.plot is not None:
            print(plot(args.plot, samples, result), file=sys.stderr)
        print(json.dumps(result, indent=2) if args.json else table(result))
        return 0 if result["verdict"] == "flat" else 1
    opts = SoakOptions(root=args.root, base_port=args.base_port, ticks=args.ticks,
                       tick_s=args.tick_s, fast_s=args.fast_s, sample_s=args.sample_s,
                       plan=LoadPlan(high_rps=args.high_rps), keep=args.keep, csv=args.csv,
                       plot=args.plot, max_minutes=args.max_minutes, trace=args.trace,
                       trace_after_s=args.trace_after_s, trace_every_s=args.trace_every_s)

    def say(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    try:
        result = run_soak(opts, say)
    except KeyboardInterrupt:
        say("bench-soak: interrupted; the sandbox is down")
        return 130
    except (RuntimeError, TimeoutError, OSError, subprocess.SubprocessError) as exc:
        say(" ".join(str(exc).split()))
        return 1
    print(json.dumps(result, indent=2) if args.json else table(result))
    return 0 if result["verdict"] == "flat" else 1
