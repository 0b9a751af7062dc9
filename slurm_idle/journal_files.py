"""The journal's history on disk: the live file and the siblings logrotate left beside it,
read as one time-ordered history, forward from an instant or backward from the end.

A site rotates the journal with logrotate (etc/logrotate.d/slurm-idle): `journal.jsonl` becomes
`journal.jsonl.1`, then `journal.jsonl.2.gz`, ... (or `journal.jsonl-20261207[.gz]` with
`dateext`). Every append opens the live file by name, so logrotate's `create` needs no signal:
the next record goes to the new file. While logrotate compresses a sibling, the whole
uncompressed copy and a partial `.gz` exist side by side: the uncompressed one is read.

Why readers do not parse everything: a year at the default cadence is half a million records
(over 100 MB); `explain` wants the last few and `report --since` one week. Records are
appended in time order except that a record is written when what it records ends (a step, a
run of idle ticks, at most an hour): every seek allows LAG_S of disorder.
"""

from __future__ import annotations

import io
import json
import re
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import IO, Any, cast

#: How far out of time order records may be written (a step's record is written when it
#: ends, a run of idle ticks when it ends, within its UTC hour): readers seek this much earlier.
LAG_S = 86400.0
#: Bytes read per block when reading from the end.
BLOCK = 1 << 20
#: A live file smaller than this is read from its start rather than bisected.
BISECT_MIN = 1 << 20

_ROTATED = re.compile(r"^(?:\.(?P<n>\d+)|-(?P<date>\d{8,14}))(?P<comp>\.gz|\.bz2|\.xz)?$")
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
        key = (0, int(m["date"])) if m["date"] else (1, -int(m["n"]))
        # A sibling being compressed exists twice: its whole uncompressed copy is read.
        if key not in found or not m["comp"]:
            found[key] = path.parent / name
    files = [found[k] for k in sorted(found)]
    if path.exists():
        files.append(path)
    return files


def compressed(path: Path) -> bool:
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


def _first_ts(path: Path) -> float | None:
    try:
        with open_history_file(path) as fh:
            for _ in range(100):
                line = fh.readline()
                if not line:
                    return None
                ts = ts_of(line)
                if ts is not None:
                    return ts
    except (OSError, EOFError, ValueError):
        return None
    return None


def forward(path: Path, since: float | None = None) -> Iterator[bytes]:
    """The lines of the whole history, oldest first; with `since`, from about `since - LAG_S`
    on (older rotated files skipped unopened past their first line, the live file bisected):
    callers still filter by time, this only spares reading what is surely older."""
    files = history(path)
    start = 0
    cut = None if since is None else since - LAG_S
    if cut is not None:
        for i, f in enumerate(files):
            ts = _first_ts(f)
            if ts is not None and ts <= cut:
                start = i  # the newest file that begins before the cut holds it
    for f in files[start:]:
        try:
            fh = open_history_file(f)
        except FileNotFoundError:
            continue  # rotated away between listing and opening
        with fh:
            if cut is not None and not compressed(f):
                _seek_before(fh, cut)
            yield from fh


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
            ts = None
            for _ in range(8):  # past a few lines without a time (torn or foreign)
                line = fh.readline()
                if not line:
                    break
                ts = ts_of(line)
                if ts is not None:
                    break
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
        try:
            if compressed(f):
                yield from _compressed_backward(f, needles)
            else:
                yield from _plain_backward(f, needles)
        except FileNotFoundError:
            continue


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
    with open_history_file(path) as fh:
        total = sum(1 for _ in fh)
    hi = total
    while hi > 0:
        lo = max(0, hi - slice_lines)
        kept: list[bytes] = []
        with open_history_file(path) as fh:
            for i, line in enumerate(fh):
                if i >= hi:
                    break
                if i >= lo and _wanted(line, needles):
                    kept.append(line)
        yield from reversed(kept)
        hi = lo
