"""The journal's history on disk: the live file and the siblings logrotate left beside it,
read as one time-ordered history, forward from an instant or backward from the end.

A site rotates the journal with logrotate (etc/logrotate.d/slurm-idle): `journal.jsonl` becomes
`journal.jsonl.1`, then `journal.jsonl.2.gz`, ... (or `journal.jsonl-20261207[.gz]` with
`dateext`). Every append opens the live file by name, so logrotate's `create` needs no signal:
the next record goes to the new file. While logrotate compresses a sibling, the whole
uncompressed copy and a partial `.gz` exist side by side: the uncompressed one is read.

Why readers do not parse everything: a year at the default cadence is half a million records
(over 100 MB); `explain` wants the last few and `report --since` one week. Records are
appended in time order except that a record is written when what it records ends: a step
(minutes), a run of idle ticks (its hour; or, when the agent was stopped in between, when it
comes back). Readers allow LAG_S of disorder when they seek, skip a rotated file only by its
mtime (never older than a record in it), and bisect on the newest of a few lines, so a run
written late does not hide what was written before it.
"""

from __future__ import annotations

import io
import json
import logging
import re
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any, cast

log = logging.getLogger("slurm_idle.journal")

#: How far out of time order records are taken to be written (a step's record is written
#: when it ends, a run of idle ticks when it ends): readers seek this much earlier.
LAG_S = 86400.0
#: Bytes read per block when reading from the end.
BLOCK = 1 << 20
#: A live file smaller than this is read from its start rather than bisected.
BISECT_MIN = 1 << 20

# `.N` (numbered) or `-DATE` (dateext: `-%Y%m%d` by default, any digits and dashes a site's
# `dateformat` makes, e.g. `-%Y%m%d-%s`), then a compression suffix.
_ROTATED = re.compile(r"^(?:\.(?P<n>\d+)|-(?P<date>\d[\d-]{7,}))(?P<comp>\.gz|\.bz2|\.xz)?$")
_TS = re.compile(rb'"ts":\s*(-?[0-9][0-9.eE+-]*)')


def history(path: Path) -> list[Path]:
    """The journal's files, oldest first: rotated siblings, then the live file (if any)."""
    try:
        names = [p.name for p in path.parent.iterdir() if p.name.startswith(path.name)]
    except OSError:
        names = []
    found: dict[tuple[int, int], Path] = {}  # (0 dated | 1 numbered, order) -> file
    for name in names:
        m = _ROTATED.match(name[len(path.name):])
        if m is None:
            continue
        key = (0, int(m["date"].replace("-", ""))) if m["date"] else (1, -int(m["n"]))
        # A sibling being compressed exists twice: its whole uncompressed copy is read.
        if key not in found or not m["comp"]:
            found[key] = path.parent / name
    files = [found[k] for k in sorted(found)]
    if path.exists():
        files.append(path)
    return files


def compressed(path: Path) -> bool:
    """A sibling logrotate compressed (read through its module, not seekable from the end)."""
    return path.suffix in (".gz", ".bz2", ".xz")


def open_history_file(path: Path) -> IO[bytes]:
    """A history file opened for reading bytes, decompressed by its suffix (the modules are
    imported only when a compressed sibling is read)."""
    if path.suffix == ".gz":
        import gzip

        return cast(IO[bytes], gzip.open(path, "rb"))
    if path.suffix == ".bz2":
        import bz2

        return bz2.open(path, "rb")
    if path.suffix == ".xz":
        import lzma

        return lzma.open(path, "rb")
    return path.open("rb")


def ts_of(line: bytes) -> float | None:
    """A record line's `ts`, found without parsing the whole line (None: none there)."""
    m = _TS.search(line)
    if m is None:
        return None
    try:
        return float(m.group(1))
    except ValueError:
        return None


def parse(line: bytes) -> dict[str, Any] | None:
    """One line as a record (None: blank, not UTF-8, not JSON, or not an object)."""
    line = line.strip()
    if not line:
        return None
    try:
        record = json.loads(line.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        return None
    return record if isinstance(record, dict) else None


def forward(path: Path, since: float | None = None) -> Iterator[bytes]:
    """The lines of the whole history, oldest first; with `since`, from about `since - LAG_S`
    on: a rotated file last written before that is skipped unopened (a record is written at or
    after its `ts`, so its file's mtime is never older than it), the live file is bisected.
    Callers still filter by time: this only spares reading what is surely older."""
    cut = None if since is None else since - LAG_S
    for f in history(path):
        live = f == path
        if cut is not None and not live and _mtime(f) < cut:
            continue
        with _tolerated(f, live), open_history_file(f) as fh:
            if cut is not None and not compressed(f):
                _seek_before(fh, cut)
            yield from fh


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return float("inf")  # cannot tell: read it


@contextmanager
def _tolerated(path: Path, live: bool) -> Iterator[None]:
    """A rotated sibling that vanished (rotated on between listing and opening) or is damaged
    (a truncated .gz, not what its suffix says, unreadable) is skipped with a warning: one bad
    file of two years must not stop explain or report. The live file's errors are the caller's."""
    try:
        yield
    except FileNotFoundError:
        if live:
            return
    except Exception as exc:
        if live:
            raise
        log.warning("journal %s: skipped from here (%s: %s)", path, type(exc).__name__, exc)


def _seek_before(fh: IO[bytes], cut: float) -> None:
    """Position `fh` (a plain file) at a line start no later than the first record at `cut`,
    by bisecting on byte offsets (the records' times are in order up to LAG_S, already
    allowed for by the caller)."""
    size = fh.seek(0, io.SEEK_END)
    lo, hi = 0, size
    if size >= BISECT_MIN:
        while hi - lo > BLOCK // 16:
            mid = (lo + hi) // 2
            fh.seek(mid)
            fh.readline()  # the rest of a line begun before mid
            # The middle of three lines' times: one line written late (an idle run appended
            # when the agent came back after a stop) must not send the search past what it needs.
            times: list[float] = []
            for _ in range(16):  # past a few lines without a time (torn or foreign)
                line = fh.readline()
                t = ts_of(line) if line else None
                if t is not None:
                    times.append(t)
                if not line or len(times) == 3:
                    break
            ts = sorted(times)[len(times) // 2] if times else None
            if ts is None or ts >= cut:
                hi = mid
            else:
                lo = mid
    fh.seek(lo)
    if lo:
        fh.readline()


def backward(path: Path, needles: Sequence[bytes] = ()) -> Iterator[bytes]:
    """The lines of the whole history, newest first; with `needles`, only lines holding one
    of them, and a block holding none is skipped unsplit (most of a year is idle ticks).

    A compressed sibling cannot be read from its end: it is read forward in slices of lines,
    each re-read from its start, so memory stays one slice whatever the file's size."""
    for f in reversed(history(path)):
        with _tolerated(f, f == path):
            if compressed(f):
                yield from _compressed_backward(f, needles)
            else:
                yield from _plain_backward(f, needles)


def quoted(names: Iterable[str]) -> tuple[bytes, ...]:
    """Needles for lines naming any of `names` as a JSON string (a record's node, a group's
    nodes): a node's records hold its name in quotes, a tick's never do."""
    return tuple(json.dumps(n).encode() for n in sorted(names))


def _wanted(line: bytes, needles: Sequence[bytes]) -> bool:
    return not needles or any(n in line for n in needles)


def _plain_backward(path: Path, needles: Sequence[bytes]) -> Iterator[bytes]:
    with path.open("rb") as fh:
        end = fh.seek(0, io.SEEK_END)
        tail = b""  # the start of a line whose rest was in the block read before
        while end > 0:
            start = max(0, end - BLOCK)
            fh.seek(start)
            block = fh.read(end - start) + tail
            end = start
            if start > 0:
                cut = block.find(b"\n")
                if cut < 0:
                    tail = block
                    continue
                tail, block = block[:cut + 1], block[cut + 1:]
            else:
                tail = b""
            if needles and not any(n in block for n in needles):
                continue
            for line in reversed(_lines(block)):
                if _wanted(line, needles):
                    yield line
        if tail and _wanted(tail, needles):
            yield tail


def _lines(block: bytes) -> list[bytes]:
    """Lines as a file's iteration gives them (split at b"\n" only, ends kept)."""
    parts = block.split(b"\n")
    tail = parts.pop()
    return [p + b"\n" for p in parts] + ([tail] if tail else [])


def _compressed_backward(path: Path, needles: Sequence[bytes], slice_lines: int = 20000) -> Iterator[bytes]:
    """One pass keeps the wanted lines while they are few (a node's records, a year's
    transitions); past `slice_lines` of them, the file is re-read in slices of lines, each
    from its start, so memory stays one slice."""
    kept: list[bytes] = []
    total = 0
    with open_history_file(path) as fh:
        for line in fh:
            total += 1
            if len(kept) <= slice_lines and _wanted(line, needles):
                kept.append(line)
    if len(kept) <= slice_lines:
        yield from reversed(kept)
        return
    hi = total
    while hi > 0:
        lo = max(0, hi - slice_lines)
        kept = []
        with open_history_file(path) as fh:
            for i, line in enumerate(fh):
                if i >= hi:
                    break
                if i >= lo and _wanted(line, needles):
                    kept.append(line)
        yield from reversed(kept)
        hi = lo
