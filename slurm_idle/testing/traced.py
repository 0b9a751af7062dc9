"""Run a slurm-idle command with tracemalloc watching it (`scripts/bench-soak --trace`).

    SLURM_IDLE_TRACE_OUT=trace.jsonl python -m slurm_idle.testing.traced agent --json

Resident memory that creeps up over hours can be Python objects kept alive (a cache that
only grows: a leak to fix) or the C allocator keeping freed pages (glibc's per-thread arenas
after thread pools come and go: RSS that levels off and is given back by `malloc_trim`).
/proc alone cannot tell them apart. This wrapper starts tracemalloc once the command has
warmed up (`SLURM_IDLE_TRACE_AFTER_S`, default 300), takes a snapshot every
`SLURM_IDLE_TRACE_EVERY_S` (default 300) and writes one JSON line per snapshot: the memory
Python's allocators hold for live objects, the number of objects the collector tracks, and
the call stacks whose allocations grew most since the first snapshot. At exit it writes a
last line with traced memory and RSS before and after a full collection (which empties
CPython's free lists: a site that "grows" until its free list is full is no leak) and after
`malloc_trim(0)`: what the allocator held but no object used.

The tracer is one daemon thread (the process's thread count is one higher) and tracemalloc
slows allocation: a run with it measures growth, not speed.
"""

from __future__ import annotations

import atexit
import ctypes
import gc
import json
import os
import statistics
import sys
import threading
import time
import tracemalloc
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

#: Frames kept per allocation: enough to name the caller of a library's allocation.
FRAMES = 8
#: Source lines listed per snapshot, the largest growth first.
TOP = 8


def rss_mb(status: Path = Path("/proc/self/status")) -> float:
    """This process's resident set (VmRSS) in MB."""
    for line in status.read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def _ignored(filename: str) -> bool:
    return filename == tracemalloc.__file__ or filename == __file__


def growth(now: tracemalloc.Snapshot, base: tracemalloc.Snapshot, top: int = TOP
           ) -> list[dict[str, Any]]:
    """The allocation sites whose live allocations grew most from `base` to `now` (size and
    count), the tracer's own left out. A site is a whole call stack (FRAMES deep, oldest
    first in `stack`): a line like subprocess's that every caller passes through is told
    apart by who called it, which is what a leak's fix needs."""
    filt = [tracemalloc.Filter(False, tracemalloc.__file__), tracemalloc.Filter(False, __file__)]
    diffs = now.filter_traces(filt).compare_to(base.filter_traces(filt), "traceback")
    out = []
    for d in diffs[:top]:
        frames = list(d.traceback)  # oldest first
        if not frames or _ignored(frames[-1].filename):
            continue
        out.append({"where": f"{frames[-1].filename}:{frames[-1].lineno}",
                    "size_diff_kb": round(d.size_diff / 1024, 1), "count_diff": d.count_diff,
                    "size_kb": round(d.size / 1024, 1),
                    "stack": [f"{f.filename}:{f.lineno}" for f in frames]})
    return out


def malloc_trim() -> bool:
    """Ask glibc to return freed memory to the system; False where there is no glibc."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.malloc_trim(0))
    except (OSError, AttributeError):
        return False


class Tracer:
    """Snapshots every `every_s` after `after_s`, one JSON line each appended to `out`."""

    def __init__(self, out: Path, after_s: float, every_s: float) -> None:
        self.out = out
        self.after_s = after_s
        self.every_s = every_s
        self.t0 = time.monotonic()
        self.base: tracemalloc.Snapshot | None = None
        self.lock = threading.Lock()

    def write(self, line: Mapping[str, Any]) -> None:
        with self.lock, self.out.open("a") as f:
            f.write(json.dumps(line) + "\n")

    def snapshot(self) -> None:
        snap = tracemalloc.take_snapshot()
        current, peak = tracemalloc.get_traced_memory()
        line: dict[str, Any] = {
            "t_s": round(time.monotonic() - self.t0, 1), "traced_mb": round(current / 2**20, 3),
            "traced_peak_mb": round(peak / 2**20, 3), "objects": len(gc.get_objects()),
            "rss_mb": round(rss_mb(), 3)}
        if self.base is None:
            self.base = snap
        else:
            line["top"] = growth(snap, self.base)
        self.write(line)

    def run(self) -> None:
        time.sleep(self.after_s)
        tracemalloc.start(FRAMES)
        while True:
            self.snapshot()
            time.sleep(self.every_s)

    def at_exit(self) -> None:
        """The last line: traced memory and RSS before and after a full collection (which
        also empties CPython's free lists: freed tuples, floats and frames kept for reuse,
        which tracemalloc still counts where they were first allocated), then RSS after
        giving freed memory back to the system."""
        line: dict[str, Any] = {"t_s": round(time.monotonic() - self.t0, 1), "exit": True,
                                "rss_mb": round(rss_mb(), 3)}
        if tracemalloc.is_tracing():
            line["traced_mb"] = round(tracemalloc.get_traced_memory()[0] / 2**20, 3)
        gc.collect()
        line["rss_after_collect_mb"] = round(rss_mb(), 3)
        if tracemalloc.is_tracing():
            line["traced_after_collect_mb"] = round(tracemalloc.get_traced_memory()[0] / 2**20, 3)
        line["trimmed"] = malloc_trim()
        line["rss_after_trim_mb"] = round(rss_mb(), 3)
        if tracemalloc.is_tracing() and self.base is not None:  # last: a snapshot costs RSS
            line["top_after_collect"] = growth(tracemalloc.take_snapshot(), self.base)
        self.write(line)


def start(env: Mapping[str, str]) -> Tracer | None:
    """A running tracer as the environment asks (SLURM_IDLE_TRACE_OUT unset: none)."""
    path = env.get("SLURM_IDLE_TRACE_OUT")
    if not path:
        return None
    tracer = Tracer(Path(path), float(env.get("SLURM_IDLE_TRACE_AFTER_S", "300")),
                    float(env.get("SLURM_IDLE_TRACE_EVERY_S", "300")))
    threading.Thread(target=tracer.run, name="tracemalloc", daemon=True).start()
    atexit.register(tracer.at_exit)
    return tracer


def _slope_per_hour(ts: Sequence[float], ys: Sequence[float]) -> float:
    try:
        return round(statistics.linear_regression(ts, ys).slope * 3600, 3)
    except statistics.StatisticsError:  # fewer than two snapshots, or all at one time
        return 0.0


def summary(lines: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """What a trace file says: traced memory and objects at the first and last snapshot,
    their slope, the lines that grew most by the end, and the exit's trim."""
    snaps = [ln for ln in lines if not ln.get("exit") and "traced_mb" in ln]
    out: dict[str, Any] = {"snapshots": len(snaps)}
    if snaps:
        first, last = snaps[0], snaps[-1]
        out.update({
            "span_s": round(last["t_s"] - first["t_s"], 1),
            "traced_mb": {"first": first["traced_mb"], "last": last["traced_mb"],
                          "slope_mb_per_h": _slope_per_hour(
                              [s["t_s"] for s in snaps], [s["traced_mb"] for s in snaps])},
            "objects": {"first": first["objects"], "last": last["objects"]},
            "rss_mb": {"first": first["rss_mb"], "last": last["rss_mb"]},
            "top_growth": list(last.get("top", []))[:5]})
    ends = [ln for ln in lines if ln.get("exit")]
    if ends:
        out["exit"] = {k: v for k, v in ends[-1].items() if k not in ("exit", "t_s")}
    return out


def read(path: Path) -> list[dict[str, Any]]:
    """The lines of a trace file (a line cut short by a kill is skipped)."""
    lines = []
    try:
        text = path.read_text()
    except FileNotFoundError:
        return []
    for raw in text.splitlines():
        try:
            lines.append(json.loads(raw))
        except ValueError:
            continue
    return lines


def main() -> None:
    start(os.environ)
    from slurm_idle.cli import entry

    sys.argv[0] = "slurm-idle"
    entry()


if __name__ == "__main__":
    main()
