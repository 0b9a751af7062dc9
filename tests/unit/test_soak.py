"""The soak benchmark's pure parts (slurm_idle/testing/soak.py): /proc parsers, journal
counting, the load phases and the judge. The run itself needs a sandbox: scripts/bench-soak."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from slurm_idle.testing.soak import (
    Bounds,
    JournalCounts,
    JournalTail,
    LoadPlan,
    Sample,
    count_lines,
    descendants,
    judge,
    next_load,
    parse_stat_ppid,
    parse_status,
    pending_ticks,
    read_csv,
    rejudge,
    sample_process,
    slope_per_hour,
    table,
    write_csv,
)

STATUS = """Name:\tslurm-idle
Umask:\t0022
State:\tS (sleeping)
Tgid:\t4242
Pid:\t4242
PPid:\t1
VmPeak:\t  123456 kB
VmRSS:\t   51200 kB
RssAnon:\t   30000 kB
Threads:\t3
"""


def test_parse_status_reads_rss_threads_and_state() -> None:
    """VmRSS in kB, the thread count and the state letter come out of /proc/PID/status."""
    st = parse_status(STATUS)
    assert (st.rss_kb, st.threads, st.state) == (51200, 3, "S")


def test_parse_status_of_a_zombie_has_no_rss() -> None:
    """A zombie's status has no VmRSS line: 0, not an error."""
    st = parse_status("Name:\tsinfo\nState:\tZ (zombie)\nThreads:\t1\n")
    assert (st.rss_kb, st.state) == (0, "Z")


def test_parse_stat_reads_ppid_after_a_command_name_with_spaces_and_parens() -> None:
    """The fields are read after the last `)`: a comm such as `a) (b` does not shift them."""
    assert parse_stat_ppid("77 (a) (b) S 42 77 77 0 -1 4194560") == (42, "S")
    assert parse_stat_ppid("78 (sinfo) Z 4242 78 78 0") == (4242, "Z")


def test_descendants_are_found_at_every_depth_and_only_below() -> None:
    """Children, grandchildren, ...: never the process itself, its parent or a sibling."""
    parents = {10: 1, 11: 10, 12: 11, 13: 10, 20: 1, 21: 20}
    assert descendants(10, parents) == {11, 12, 13}
    assert descendants(12, parents) == set()


def _fake_proc(root: Path, pid: int, ppid: int, state: str = "S", fds: int = 0) -> None:
    d = root / str(pid)
    (d / "fd").mkdir(parents=True)
    for i in range(fds):
        (d / "fd" / str(i)).touch()
    (d / "stat").write_text(f"{pid} (p{pid}) {state} {ppid} 0 0")
    (d / "status").write_text(f"State:\t{state} (x)\nVmRSS:\t 2048 kB\nThreads:\t2\n")


def test_sample_process_reads_a_proc_tree(tmp_path: Path) -> None:
    """RSS in MB, descriptors, threads, descendants and zombies among them, from a /proc tree."""
    _fake_proc(tmp_path, 100, 1, fds=4)
    _fake_proc(tmp_path, 101, 100)
    _fake_proc(tmp_path, 102, 101, state="Z")
    _fake_proc(tmp_path, 200, 1)
    (tmp_path / "self").mkdir()  # not a pid: skipped
    s = sample_process(100, tmp_path)
    assert s is not None
    assert (s.rss_mb, s.fds, s.threads, s.children, s.zombies) == (2.0, 4, 2, 2, 1)


def test_sample_process_of_a_gone_process_is_none(tmp_path: Path) -> None:
    """No /proc entry (the agent exited): None, so the run stops and says so."""
    assert sample_process(999, tmp_path) is None


def test_sample_process_of_the_test_itself_works() -> None:
    """On the real /proc, this process has memory, descriptors and at least one thread."""
    s = sample_process(os.getpid())
    assert s is not None and s.rss_mb > 1 and s.fds > 0 and s.threads >= 1


def _tr(node: str, src: str, dst: str, outcome: str = "ok", ts: float = 1.0) -> str:
    return json.dumps({"event": "transition", "ts": ts, "node": node, "from": src, "to": dst,
                       "outcome": outcome})


def test_counting_ticks_sums_folded_tick_records() -> None:
    """A tick record with `count` stands for that many ticks; without it, for one."""
    lines = [json.dumps({"event": "tick", "ts": 1}),
             json.dumps({"event": "tick", "ts": 2, "count": 5}),
             json.dumps({"event": "tick", "ts": 3, "errors": 1}),
             "not json", "[1, 2]"]
    c = count_lines(lines)
    assert (c.ticks, c.tick_errors) == (7, 1)


def test_counting_lends_and_reclaims_only_when_done() -> None:
    """lending -> lent and lent -> reclaiming count once done (ok), not while waiting; the
    set of lent nodes follows them."""
    c = count_lines([
        _tr("gpu1", "serving", "lending"),
        _tr("gpu1", "lending", "lent", outcome="waiting"),
        _tr("gpu1", "lending", "lent", ts=5.0),
        _tr("gpu2", "lending", "lent"),
        _tr("gpu1", "lent", "reclaiming", ts=9.0),
        _tr("gpu2", "lent", "reclaiming", outcome="error"),
        _tr("gpu1", "starting", "serving"),
    ])
    assert (c.lends, c.reclaims, c.served) == (2, 1, 1)
    assert c.lent == {"gpu2"}
    assert (c.lend_ts[0], c.reclaim_ts) == (5.0, [9.0])


def test_journal_tail_reads_only_complete_lines_and_restarts_on_a_new_file(
        tmp_path: Path) -> None:
    """A half-written line waits for the next poll; a journal replaced by a shorter one is
    counted from its start again."""
    path = tmp_path / "journal.jsonl"
    tail = JournalTail(path)
    assert tail.poll().ticks == 0  # no file yet
    tick = json.dumps({"event": "tick", "ts": 1})
    path.write_text(tick + "\n" + tick[:5])
    assert tail.poll().ticks == 1
    with path.open("a") as f:
        f.write(tick[5:] + "\n")
    assert tail.poll().ticks == 2
    path.write_text(tick + "\n")
    assert tail.poll().ticks == 1


def test_pending_idle_run_counts_unless_already_appended() -> None:
    """The idle run beside the journal adds its `count`; once it is the journal's last tick
    record (same start), it is not counted twice; no file or a bad one adds nothing."""
    run = json.dumps({"event": "tick", "ts": 50.0, "count": 9, "until": 66.0})
    assert pending_ticks(run, last_tick_ts=40.0) == 9
    assert pending_ticks(run, last_tick_ts=None) == 9
    assert pending_ticks(run, last_tick_ts=50.0) == 0
    assert pending_ticks(json.dumps({"event": "tick", "ts": 70.0}), 50.0) == 1
    assert pending_ticks("", 50.0) == 0
    assert pending_ticks(json.dumps({"event": "transition", "ts": 1}), None) == 0


def test_journal_tail_ticks_include_the_pending_idle_run(tmp_path: Path) -> None:
    """Ticks = the journal's tick records (their counts) + the pending run beside it."""
    path = tmp_path / "journal.jsonl"
    path.write_text(json.dumps({"event": "tick", "ts": 1.0, "count": 3}) + "\n")
    tail = JournalTail(path)
    tail.poll()
    assert tail.ticks == 3
    tail.pending_path.write_text(json.dumps({"event": "tick", "ts": 9.0, "count": 4}))
    tail.poll()
    assert tail.ticks == 7
    with path.open("a") as f:  # the run appended, the side file not yet replaced
        f.write(json.dumps({"event": "tick", "ts": 9.0, "count": 4}) + "\n")
    tail.poll()
    assert tail.ticks == 7


PLAN = LoadPlan(lent_target=3, min_s=30, max_s=240)


@pytest.mark.parametrize(("high", "phase_s", "lent", "busy", "want"), [
    (False, 10, 3, False, False),  # too soon to flip, whatever the nodes did
    (False, 40, 2, False, False),  # low: not every node lent yet
    (False, 40, 3, False, True),  # low: lent as far as it goes -> high
    (True, 40, 1, False, True),  # high: a node still lent
    (True, 40, 0, True, True),  # high: a reclaim not yet serving
    (True, 40, 0, False, False),  # high: every node back -> low
    (False, 240, 0, False, True),  # a stalled phase moves on
    (True, 240, 3, True, False),
])
def test_next_load_flips_once_the_nodes_followed(high: bool, phase_s: float, lent: int,
                                                  busy: bool, want: bool) -> None:
    """The load flips after min_s once the nodes followed it, and at max_s regardless."""
    assert next_load(PLAN, high, phase_s, lent, busy) is want


def test_slope_per_hour_of_a_line_and_of_degenerate_input() -> None:
    """1 MB per 1800 s is 2 MB/h; one point or a single instant is 0."""
    assert slope_per_hour([0, 1800, 3600], [10, 11, 12]) == pytest.approx(2.0)
    assert slope_per_hour([5], [1]) == 0.0
    assert slope_per_hour([5, 5], [1, 2]) == 0.0


def _samples(rss: list[float], fds: list[int] | None = None,
             children: list[int] | None = None) -> list[Sample]:
    n = len(rss)
    fds = fds or [10] * n
    children = children or [0] * n
    return [Sample(t_s=i * 10.0, ticks=i * 5, lends=0, reclaims=0, rss_mb=r, fds=f, threads=2,
                   children=c, zombies=0, load_rps=0.0)
            for i, (r, f, c) in enumerate(zip(rss, fds, children, strict=True))]


def test_judge_calls_noise_within_the_bound_flat_and_drops_the_warm_up() -> None:
    """A warm-up climb, then RSS wobbling by 0.5 MB: flat; the climb is not judged."""
    rss = [20.0, 40.0] + [60.0 + (0.5 if i % 2 else 0) for i in range(18)]
    out = judge(_samples(rss), Bounds(warmup_fraction=0.1))
    assert out["verdict"] == "flat", out
    assert out["rss_mb"]["min"] == 60.0 and out["judged_samples"] == 18
    assert out["fds"]["median"] == 10 and out["children"]["peak"] == 0


def test_judge_calls_a_steady_climb_not_flat_with_its_slope() -> None:
    """RSS growing 1 MB a sample (360 MB/h at 10 s a sample): not flat, the reason says by
    how much."""
    out = judge(_samples([50.0 + i for i in range(40)]))
    assert out["verdict"] == "not flat"
    assert out["rss_mb"]["slope_mb_per_h"] == pytest.approx(360.0)
    assert "median RSS moved" in out["reasons"][0]


def test_judge_relative_bound_for_a_large_process() -> None:
    """3% of a 200 MB process (6 MB) is the bound when larger than 2 MB: +4 MB is flat."""
    out = judge(_samples([200.0] * 10 + [204.0] * 10), Bounds(warmup_fraction=0))
    assert out["verdict"] == "flat"


def test_judge_flags_descriptor_and_child_growth() -> None:
    """Equal RSS but one more descriptor at rest, and a child that stays, in the second half."""
    out = judge(_samples([50.0] * 20, fds=[10] * 10 + [11] * 10, children=[0] * 10 + [1] * 10),
                Bounds(warmup_fraction=0))
    assert out["verdict"] == "not flat"
    assert out["reasons"] == ["fds at rest (fewest) 10 -> 11", "median children 0 -> 1"]


def test_judge_busier_samples_move_the_fds_median_not_the_floor() -> None:
    """More samples caught mid-pass (a socket open) in the second half: the median goes
    5 -> 6, the floor stays 5, and that is flat; the medians are still reported."""
    fds = [5, 5, 5, 6] * 3 + [5, 6, 6, 6] * 3
    out = judge(_samples([50.0] * 24, fds=fds), Bounds(warmup_fraction=0))
    assert out["verdict"] == "flat", out
    assert (out["fds"]["first_half_median"], out["fds"]["second_half_median"]) == (5, 6)
    assert (out["fds"]["first_half_floor"], out["fds"]["second_half_floor"]) == (5, 5)


def test_judge_of_too_few_samples_says_so() -> None:
    """No samples, or fewer than 4 after the warm-up: no verdict of flatness."""
    assert judge([])["verdict"] == "no samples"
    assert judge(_samples([1.0, 2.0, 3.0]))["verdict"] == "too short"


def test_table_and_csv_of_a_result(tmp_path: Path) -> None:
    """The human table names the counts and the verdict; the CSV has a row per sample."""
    samples = _samples([50.0] * 20)
    verdict = judge(samples, Bounds(warmup_fraction=0))
    result = {"ticks": 95, "tick_s": 2, "lends": 3, "reclaims": 3, "duration_s": 190.0,
              "samples": 20, **verdict}
    text = table(result)
    assert "95 ticks" in text and "verdict: flat" in text and "RSS MB" in text
    path = tmp_path / "s.csv"
    write_csv(path, samples)
    rows = path.read_text().splitlines()
    assert rows[0].startswith("t_s,ticks,lends,reclaims,rss_mb") and len(rows) == 21
    assert read_csv(path) == samples


def test_rejudge_a_saved_run_takes_its_counts_from_the_last_sample() -> None:
    """--from-csv: ticks, lends and duration are the last sample's; the verdict is judge's."""
    samples = _samples([50.0] * 20)
    out = rejudge(samples, Bounds(), tick_s=2)
    assert (out["ticks"], out["duration_s"], out["samples"]) == (95, 190.0, 20)
    assert out["verdict"] == "flat" and "verdict: flat" in table(out)


def test_counts_default_is_empty() -> None:
    """A fresh count has nothing lent and no ticks."""
    c = JournalCounts()
    assert (c.ticks, c.lends, c.reclaims, c.lent) == (0, 0, 0, set())
