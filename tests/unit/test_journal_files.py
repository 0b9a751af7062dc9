"""The journal's history on disk (journal_files.py): logrotate's siblings and the live file read
as one history, forward from an instant without reading what is surely older, backward from
the end as exactly the reverse of forward, compressed or not, across block boundaries."""

from __future__ import annotations

import bz2
import gzip
import json
import logging
import lzma
import os
import random
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from slurm_idle import journal_files
from slurm_idle.journal import Journal
from slurm_idle.journal_files import LAG_S, backward, forward, history, ts_of

T0 = 1_796_205_600.0
COMPRESSORS = {"": lambda b: b, ".gz": gzip.compress, ".bz2": bz2.compress, ".xz": lzma.compress}


def write(path: Path, lines: Sequence[bytes]) -> Path:
    """Write `lines` (each with its own newline, or none for a torn last line) to `path`,
    compressed by its suffix as logrotate would."""
    data = b"".join(lines)
    suffix = path.suffix if path.suffix in COMPRESSORS else ""
    path.write_bytes(COMPRESSORS[suffix](data))
    written_at(path, lines)
    return path


def written_at(path: Path, lines: Sequence[bytes]) -> None:
    """The file's mtime as a writer's would be: when its newest record was written (readers
    skip a rotated file by it)."""
    times = [t for t in (ts_of(line) for line in lines) if t is not None]
    if times:
        os.utime(path, (max(times), max(times)))


def rec(ts: float, **extra: object) -> bytes:
    return (json.dumps({"event": "tick", "ts": ts, **extra}) + "\n").encode()


def tss(lines: Iterator[bytes] | Sequence[bytes]) -> list[float]:
    out = []
    for line in lines:
        ts = journal_files.ts_of(line)
        assert ts is not None, line
        out.append(ts)
    return out


# --- history ---------------------------------------------------------------------------------


def test_history_orders_numbered_siblings_oldest_first_and_the_live_file_last(tmp_path: Path) -> None:
    """Numbered siblings sort by number, not by name (.10 is older than .9), compressed or not;
    the live file comes last; the idle-run side file, the lock and other names are not history."""
    live = tmp_path / "journal.jsonl"
    for name in ["journal.jsonl", "journal.jsonl.1", "journal.jsonl.2.gz", "journal.jsonl.3.bz2",
                 "journal.jsonl.9.xz", "journal.jsonl.10.gz", "journal.jsonl.idle-run",
                 "journal.jsonl.lock", "journal.jsonl.bak", "journal.jsonl.1.zip",
                 "journal.jsonlx", "other.jsonl", "other.jsonl.1"]:
        (tmp_path / name).write_bytes(b"")
    assert [p.name for p in history(live)] == [
        "journal.jsonl.10.gz", "journal.jsonl.9.xz", "journal.jsonl.3.bz2", "journal.jsonl.2.gz",
        "journal.jsonl.1", "journal.jsonl"]


def test_history_orders_dateext_siblings_by_date(tmp_path: Path) -> None:
    """logrotate's `dateext` names sort by their date, compressed or not, before the live file."""
    live = tmp_path / "journal.jsonl"
    for name in ["journal.jsonl-20261203", "journal.jsonl-20261201.gz", "journal.jsonl-20261202.gz",
                 "journal.jsonl", "journal.jsonl.idle-run"]:
        (tmp_path / name).write_bytes(b"")
    assert [p.name for p in history(live)] == [
        "journal.jsonl-20261201.gz", "journal.jsonl-20261202.gz", "journal.jsonl-20261203",
        "journal.jsonl"]


def test_a_sibling_being_compressed_is_read_from_its_uncompressed_copy(tmp_path: Path) -> None:
    """While logrotate compresses .2, both .2 and a partial .2.gz exist: .2 is the one in the
    history (whichever the directory lists first), and its lines are read once."""
    live = write(tmp_path / "journal.jsonl", [rec(T0 + 30)])
    write(tmp_path / "journal.jsonl.1", [rec(T0 + 20)])
    write(tmp_path / "journal.jsonl.2", [rec(T0 + 10)])
    (tmp_path / "journal.jsonl.2.gz").write_bytes(gzip.compress(rec(T0 + 10))[:12])  # partial
    write(tmp_path / "journal.jsonl.3.gz", [rec(T0)])
    assert [p.name for p in history(live)] == [
        "journal.jsonl.3.gz", "journal.jsonl.2", "journal.jsonl.1", "journal.jsonl"]
    assert tss(forward(live)) == [T0, T0 + 10, T0 + 20, T0 + 30]


def test_every_sibling_being_compressed_is_read_from_its_uncompressed_copy(tmp_path: Path) -> None:
    """Several pairs (the directory lists them in its own order): the plain one of each pair
    is the one in the history, whichever of the two is listed last."""
    live = write(tmp_path / "journal.jsonl", [rec(T0 + 100)])
    for n in range(1, 9):
        write(tmp_path / f"journal.jsonl.{n}", [rec(T0 + 100 - n)])
        write(tmp_path / f"journal.jsonl.{n}{list(COMPRESSORS)[1 + n % 3]}", [rec(0.0)])
    assert [p.name for p in history(live)] == [f"journal.jsonl.{n}" for n in range(8, 0, -1)] + [
        "journal.jsonl"]
    assert tss(forward(live)) == [T0 + 92 + k for k in range(9)]


def test_history_without_a_live_file_is_the_rotated_siblings(tmp_path: Path) -> None:
    """Just after a rotation without `create`, the history is the siblings alone; no directory
    at all is an empty history."""
    write(tmp_path / "journal.jsonl.1", [rec(T0)])
    assert [p.name for p in history(tmp_path / "journal.jsonl")] == ["journal.jsonl.1"]
    assert history(tmp_path / "missing" / "journal.jsonl") == []
    assert list(forward(tmp_path / "missing" / "journal.jsonl")) == []
    assert list(backward(tmp_path / "missing" / "journal.jsonl")) == []


# --- forward ---------------------------------------------------------------------------------


def rotated_history(tmp_path: Path) -> tuple[Path, list[bytes]]:
    """A history across .4.xz, .3.bz2, .2.gz, .1 and the live file, 5 records each, in order."""
    live = tmp_path / "journal.jsonl"
    lines = [rec(T0 + i * 60, i=i) for i in range(25)]
    for k, name in enumerate(["journal.jsonl.4.xz", "journal.jsonl.3.bz2", "journal.jsonl.2.gz",
                              "journal.jsonl.1", "journal.jsonl"]):
        write(tmp_path / name, lines[k * 5:(k + 1) * 5])
    return live, lines


def test_forward_reads_every_file_oldest_first_whatever_its_compression(tmp_path: Path) -> None:
    """forward yields the lines of .4.xz, .3.bz2, .2.gz, .1 and the live file, in that order."""
    live, lines = rotated_history(tmp_path)
    assert list(forward(live)) == lines


def test_forward_since_skips_rotated_files_wholly_before_the_cut(tmp_path: Path) -> None:
    """With `since`, the rotated files last written before since - LAG_S are not read: the
    lines returned begin with the first line of the file holding the cut."""
    live = tmp_path / "journal.jsonl"
    day = 86400.0
    write(tmp_path / "journal.jsonl.3.gz", [rec(T0 + h * 3600) for h in range(24)])
    write(tmp_path / "journal.jsonl.2.bz2", [rec(T0 + day + h * 3600) for h in range(24)])
    write(tmp_path / "journal.jsonl.1", [rec(T0 + 2 * day + h * 3600) for h in range(24)])
    write(live, [rec(T0 + 3 * day + h * 3600) for h in range(24)])
    since = T0 + 3 * day + 6 * 3600  # cut = T0 + 2 days + 6 h: inside .1
    got = tss(forward(live, since))
    assert got[0] == T0 + 2 * day  # .1 read whole (small files are not bisected)
    assert got == sorted(got) and got[-1] == T0 + 3 * day + 23 * 3600
    assert len(got) == 48
    # A `since` before the whole history reads everything.
    assert len(list(forward(live, T0 - 10 * day))) == 96


def big_live_file(path: Path, n: int = 30_000, step: float = 10.0, jitter: float = 0.0,
                  seed: int = 1) -> list[float]:
    """A live file of `n` padded records ~100 bytes each (about 3 MB), `step` s apart, each
    written up to `jitter` s late (ts earlier than its neighbours'); returns the ts in file order."""
    rnd = random.Random(seed)
    times = [T0 + i * step - rnd.uniform(0, jitter) for i in range(n)]
    write(path, [rec(round(t, 3), pad="x" * 40) for t in times])
    assert path.stat().st_size > journal_files.BISECT_MIN
    return times


def test_forward_since_bisects_a_big_live_file(tmp_path: Path) -> None:
    """On a 3 MB live file, forward(since) starts within one bisection step (64 KiB, about 650
    records here) before since - LAG_S, and returns every record at or after since."""
    live = tmp_path / "journal.jsonl"
    times = big_live_file(live)
    since = T0 + 250_000.0
    cut = since - LAG_S
    got = tss(forward(live, since))
    assert cut - 10_000 <= got[0] <= cut  # nowhere near T0: the start was not read
    assert len(got) < len(times) / 2
    assert [t for t in got if t >= since] == [t for t in times if t >= since]


def test_forward_since_is_a_superset_with_records_written_late(tmp_path: Path) -> None:
    """Records written up to an hour late (a run of idle ticks, a step that ended later) do
    not make forward(since) miss one at or after since, for any since (before, inside or
    after the file), and the reading still starts near the cut."""
    live = tmp_path / "journal.jsonl"
    times = [round(t, 3) for t in big_live_file(live, jitter=3600.0, seed=7)]
    for since in [T0, T0 + 90_000.0, T0 + 123_456.7, T0 + 200_000.0, T0 + 299_990.0,
                  T0 + 400_000.0]:
        got = tss(forward(live, since))
        assert [t for t in got if t >= since] == [t for t in times if t >= since], since
        # From within a bisection step (and the jitter) of the cut, or of the file's end.
        assert got[0] >= min(since - LAG_S, times[-1]) - 3600 - 10_000


def test_forward_since_reads_a_small_live_file_whole(tmp_path: Path) -> None:
    """A live file under BISECT_MIN is read from its start (nothing to spare)."""
    live = write(tmp_path / "journal.jsonl", [rec(T0 + i) for i in range(100)])
    assert tss(forward(live, T0 + 10 * LAG_S)) == [T0 + i for i in range(100)]


# --- backward --------------------------------------------------------------------------------


@pytest.mark.parametrize("block", [1, 7, 64, 1 << 20])
@pytest.mark.parametrize("suffix", ["", ".gz", ".bz2", ".xz"])
def test_backward_is_forward_reversed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                      block: int, suffix: str) -> None:
    """Newest first, line for line, whatever the block size: lines longer than a block, blank
    lines and a torn last line (no newline) come back whole."""
    monkeypatch.setattr(journal_files, "BLOCK", block)
    lines = [rec(T0 + i, pad="y" * (i * 13 % 90)) for i in range(40)]
    lines[5:5] = [b"\n", b"not json\n", b"\n"]
    write(tmp_path / f"journal.jsonl.1{suffix}", lines)
    live = write(tmp_path / "journal.jsonl", [rec(T0 + 100), rec(T0 + 101), b'{"event": "ti'])
    fwd = list(forward(live))
    assert len(fwd) == len(lines) + 3
    assert list(backward(live)) == fwd[::-1]


@pytest.mark.parametrize("block", [3, 50, 1 << 20])
def test_backward_with_needles_yields_only_their_lines(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch,
                                                       block: int) -> None:
    """With needles, exactly the lines holding one of them, newest first, including one that
    spans block boundaries; blocks of ticks alone are skipped."""
    monkeypatch.setattr(journal_files, "BLOCK", block)
    lines = []
    for i in range(300):
        if i % 37 == 0:
            lines.append((json.dumps({"event": "transition", "ts": T0 + i, "reason": "z" * 120})
                          + "\n").encode())
        elif i % 91 == 0:
            lines.append((json.dumps({"event": "admin", "ts": T0 + i}) + "\n").encode())
        else:
            lines.append(rec(T0 + i))
    write(tmp_path / "journal.jsonl.1.gz", lines[:150])
    live = write(tmp_path / "journal.jsonl", lines[150:])
    needles = (b'"transition"', b'"admin"')
    want = [ln for ln in reversed(lines) if b'"transition"' in ln or b'"admin"' in ln]
    assert len(want) == 12
    assert list(backward(live, needles)) == want


def test_backward_reads_a_compressed_sibling_in_slices(tmp_path: Path) -> None:
    """A compressed sibling read in slices of a few lines is still every line, newest first."""
    lines = [rec(T0 + i) for i in range(23)] + [b"torn"]
    path = write(tmp_path / "journal.jsonl.1.gz", lines)
    for size in (1, 5, 23, 24, 1000):
        assert list(journal_files._compressed_backward(path, (), slice_lines=size)) == lines[::-1]


def test_backward_empty_and_missing_files(tmp_path: Path) -> None:
    """Empty files, compressed or not, contribute nothing either way."""
    write(tmp_path / "journal.jsonl.2.gz", [])
    write(tmp_path / "journal.jsonl.1", [])
    live = write(tmp_path / "journal.jsonl", [rec(T0)])
    assert list(backward(live)) == list(forward(live)) == [rec(T0)]


def test_backward_keeps_a_bare_carriage_return_inside_its_line(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """A line is ended by \\n alone, in both directions: a record whose JSON holds a raw \\r
    between tokens (valid JSON whitespace, e.g. written by another tool) is one line."""
    # Regression (this was a bug in journal_files._plain_backward): `block.splitlines()` also splits at a bare b"\r",
    # forward (file iteration) only at b"\n": backward yields two malformed halves where
    # forward yields one valid record, so newest_first/explain lose that record.
    monkeypatch.setattr(journal_files, "BLOCK", 1 << 20)
    live = write(tmp_path / "journal.jsonl", [rec(T0), b'{"event": "admin",\r "ts": 1.0}\n'])
    assert list(backward(live)) == list(forward(live))[::-1]


# --- reading records -------------------------------------------------------------------------


def test_records_skip_a_torn_last_line_and_a_malformed_line(tmp_path: Path,
                                                            caplog: pytest.LogCaptureFixture) -> None:
    """Journal.records skips a malformed line (counted once in a warning) and a torn last line
    (silently: a write in progress), without raising; newest_first skips both too."""
    live = write(tmp_path / "journal.jsonl", [rec(T0), b"{not json\n", b"\xff\xfe\n", b"[1, 2]\n",
                                              rec(T0 + 1), b'{"event": "tick", "ts": 17'])
    journal = Journal(live)
    with caplog.at_level(logging.WARNING, logger="slurm_idle.journal"):
        got = [r["ts"] for r in journal.records()]
    assert got == [T0, T0 + 1]
    assert [m for m in caplog.messages if "malformed" in m] == [
        f"journal {live}: skipped 3 malformed line(s)"]
    assert [r["ts"] for r in journal.newest_first()] == [T0 + 1, T0]


def test_records_read_the_rotated_history(tmp_path: Path) -> None:
    """Journal.records reads across rotated siblings, oldest first."""
    live, _ = rotated_history(tmp_path)
    assert [r["i"] for r in Journal(live).records()] == list(range(25))
    assert [r["i"] for r in Journal(live).newest_first()] == list(range(25))[::-1]


# --- the property ----------------------------------------------------------------------------

# A line is any bytes but b"\n" (and b"\r", see the carriage-return test above), each file's
# last line maybe torn (no newline).
_line = st.binary(max_size=40).map(lambda b: b.replace(b"\n", b"").replace(b"\r", b""))
_file = st.tuples(st.lists(_line, max_size=12), st.booleans(),
                  st.sampled_from(list(COMPRESSORS)))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(files=st.lists(_file, min_size=1, max_size=5), block=st.integers(1, 64),
       needle=st.sampled_from([b"", b"a", b"\x00"]))
def test_backward_is_forward_reversed_for_any_history(tmp_path_factory: pytest.TempPathFactory,
                                                      files: list[tuple[list[bytes], bool, str]],
                                                      block: int, needle: bytes) -> None:
    """For random lines split into random rotated files (random compression) and the live
    file, backward == reversed(forward), and with a needle the same filtered."""
    d = tmp_path_factory.mktemp("h")
    live = d / "journal.jsonl"
    written: list[bytes] = []
    for k, (lines, torn, suffix) in enumerate(files):
        data = [ln + b"\n" for ln in lines]
        if torn and data:
            data[-1] = data[-1][:-1]
        written += data
        n = len(files) - 1 - k
        write(live if n == 0 else d / f"journal.jsonl.{n}{suffix}", data)
    old = journal_files.BLOCK
    journal_files.BLOCK = block  # not monkeypatch: a function-scoped fixture under @given
    try:
        fwd = list(forward(live))
        assert list(backward(live)) == fwd[::-1]
        if needle:
            assert list(backward(live, (needle,))) == [ln for ln in reversed(fwd) if needle in ln]
    finally:
        journal_files.BLOCK = old
    assert b"".join(fwd) == b"".join(written)  # every byte, each file once, oldest first


def test_a_damaged_rotated_file_is_skipped_with_a_warning(tmp_path: Path,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    """A truncated .gz (or one that is not gzip at all) costs its own records, not the reading."""
    live = write(tmp_path / "journal.jsonl", [rec(T0 + 30)])
    write(tmp_path / "journal.jsonl.1", [rec(T0 + 20)])
    whole = gzip.compress(b"".join(rec(T0 + i) for i in range(5)))
    (tmp_path / "journal.jsonl.2.gz").write_bytes(whole[: len(whole) // 2])
    (tmp_path / "journal.jsonl.3.gz").write_bytes(b"not gzip at all\n")
    with caplog.at_level(logging.WARNING, logger="slurm_idle.journal"):
        assert tss(forward(live))[-2:] == [T0 + 20, T0 + 30]
        assert tss(backward(live))[:2] == [T0 + 30, T0 + 20]
        assert [r["ts"] for r in Journal(live).records()][-2:] == [T0 + 20, T0 + 30]
    assert "journal.jsonl.3.gz" in caplog.text and "journal.jsonl.2.gz" in caplog.text


def test_a_late_record_at_the_start_of_the_live_file_hides_no_rotated_file(tmp_path: Path) -> None:
    """An idle run appended when the agent came back after a stop begins the new file with an
    old time: the rotated file before it (written after that time) is still read."""
    day = 86400.0
    write(tmp_path / "journal.jsonl.1", [rec(T0 + 2 * day, event="admin")])
    live = write(tmp_path / "journal.jsonl", [rec(T0), rec(T0 + 10 * day)])
    got = tss(forward(live, since=T0 + 2 * day))
    assert T0 + 2 * day in got


def test_dateext_with_a_dateformat_of_dashes_and_seconds_is_read(tmp_path: Path) -> None:
    live = write(tmp_path / "journal.jsonl", [rec(T0 + 3)])
    write(tmp_path / "journal.jsonl-20261201-1796100000.gz", [rec(T0 + 1)])
    write(tmp_path / "journal.jsonl-20261201-1796200000", [rec(T0 + 2)])
    assert tss(forward(live)) == [T0 + 1, T0 + 2, T0 + 3]
