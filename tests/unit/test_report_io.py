"""The report's inputs and outputs: dates, the sacct call, CSV and PNG (no real Slurm)."""

from __future__ import annotations

import csv
import json
from collections.abc import Sequence
from pathlib import Path

import pytest

from slurm_idle.commands import CompletedResult
from slurm_idle.config import parse_config
from slurm_idle.errors import CommandError, ConfigError, SlurmIdleError
from slurm_idle.journal import Journal
from slurm_idle.report_io import fetch_runs, make_report, write_csv
from slurm_idle.slurm.cli_backend import CliBackend

DATA = Path(__file__).resolve().parents[1] / "data" / "sacct" / "22.05"

CONFIG = """
engine: {kind: command, start_command: "true", stop_command: "true"}
models:
  - {name: m, gpus_per_replica: 4, nodes: "gpu[1-2]"}
report: {price_per_gpu_hour: 3.0, currency: EUR}
"""


class ReplayRunner:
    """Answers every command with fixed output (or fails like the real runner would)."""

    def __init__(self, stdout: str = "", rc: int = 0, stderr: str = "") -> None:
        self.stdout, self.rc, self.stderr = stdout, rc, stderr
        self.calls: list[list[str]] = []

    def run(self, argv: Sequence[str], input: str | None = None,
            timeout: float | None = None) -> CompletedResult:
        self.calls.append(list(argv))
        if self.rc:
            raise CommandError(argv, self.rc, self.stderr)
        return CompletedResult(tuple(argv), 0, self.stdout, "")


def slurm(runner: ReplayRunner) -> CliBackend:
    return CliBackend(runner=runner, bin_dir="/opt/slurm/bin")


def test_sacct_call_lists_every_run_of_the_lend_partition() -> None:
    """The report reads sacct through the Slurm adapter: JSON, duplicates (one record per run),
    allocations only, every user, the lend partition, the period."""
    runner = ReplayRunner((DATA / "sacct-XD.json").read_text())
    fetch_runs(parse_config(CONFIG), 0, 3600, slurm(runner))
    argv, *mend = runner.calls
    # Job 6 FAILED with 22.05's JSON exit code 0: its code is asked of the text output, once.
    assert mend == [["/opt/slurm/bin/sacct", "--noheader", "--parsable2", "--allusers",
                     "--duplicates", "--allocations", "--format=JobIDRaw,ExitCode", "--jobs=6"]]
    assert argv[0] == "/opt/slurm/bin/sacct"
    for flag in ("--json", "--duplicates", "--allocations", "--allusers", "--partition=idle"):
        assert flag in argv
    assert any(a.startswith("--starttime=") for a in argv)
    assert any(a.startswith("--endtime=") for a in argv)


def test_fetch_runs_parses_captured_sacct_json() -> None:
    """Runs come back one per run, the requeued ones included."""
    runner = ReplayRunner((DATA / "sacct-XD.json").read_text())
    config = parse_config(CONFIG)
    runs = fetch_runs(config, 0, 2e9, slurm(runner))
    assert runner.calls and "--duplicates" in runner.calls[0]
    assert sorted(r.state for r in runs if r.job_id == 2) == ["COMPLETED", "PREEMPTED"]


class TwoAnswers(ReplayRunner):
    """sacct --json first, then its text output."""

    def __init__(self, json_text: str, text: str) -> None:
        super().__init__(json_text)
        self.text = text

    def run(self, argv: Sequence[str], input: str | None = None,
            timeout: float | None = None) -> CompletedResult:
        done = super().run(argv, input, timeout)
        return done if len(self.calls) == 1 else CompletedResult(tuple(argv), 0, self.text, "")


def test_a_failed_runs_exit_code_comes_from_the_text_when_the_json_lost_it() -> None:
    """22.05's JSON says SUCCESS 0 for a job that exited 3 (measured on the sandbox); the text
    output's `3:0` is used, run by run; a signal is kept apart; successes are not asked for."""
    runner = TwoAnswers((DATA / "sacct-XD.json").read_text(), "6|3:0\n")
    runs = {r.job_id: r for r in slurm(runner).accounting(0, 2e9)}
    assert (runs[6].state, runs[6].exit_code, runs[6].signal) == ("FAILED", 3, None)
    assert runs[7].exit_code == 0 and len(runner.calls) == 2
    runner = TwoAnswers((DATA / "sacct-XD.json").read_text(), "6|0:9\n")
    runs = {r.job_id: r for r in slurm(runner).accounting(0, 2e9)}
    assert (runs[6].exit_code, runs[6].signal) == (0, 9)


def test_disabled_accounting_says_what_to_configure() -> None:
    """Without slurmdbd, the adapter's error names the accounting settings the report needs."""
    runner = ReplayRunner(rc=1, stderr="sacct: error: Slurm accounting storage is disabled")
    with pytest.raises(SlurmIdleError, match="slurmdbd"):
        fetch_runs(parse_config(CONFIG), 0, 1, slurm(runner))
    with pytest.raises(CommandError, match="slurmdbd"):  # still a CommandError for the others
        CliBackend(runner=runner).accounting(None, None, job_ids=[1])


def test_garbage_from_sacct_is_a_clear_error() -> None:
    """Output that is not Slurm JSON becomes one readable error."""
    with pytest.raises(SlurmIdleError, match="sacct --json"):
        fetch_runs(parse_config(CONFIG), 0, 1, slurm(ReplayRunner("not json")))


def test_make_report_reads_the_journal_and_prices_from_config(tmp_path: Path) -> None:
    """Lent GPU-hours use the model's gpus_per_replica; savings use report.price_per_gpu_hour."""
    journal = Journal(tmp_path / "journal.jsonl")
    journal.append({"event": "transition", "ts": 1000.0, "node": "gpu1", "from": "lending",
                    "to": "lent", "outcome": "ok", "duration_s": 0})
    doc = json.loads((DATA / "sacct-XD.json").read_text())
    from slurm_idle.slurm.parse import parse_accounting

    config = parse_config(CONFIG)
    r = make_report(config, 1000.0, 1000.0 + 7200, 1000.0 + 7200, parse_accounting(doc),
                    journal_path=str(journal.path))
    assert r.lent_gpu_hours == pytest.approx(8.0)
    assert (r.currency, r.price_per_gpu_hour) == ("EUR", 3.0)


def test_lent_gpu_hours_come_from_the_nodes_gres(tmp_path: Path) -> None:
    """An 8-GPU node (Slurm's gres) with two 2-GPU replicas lends 8 GPUs, not the 4 its replicas
    use; a group of two nodes journaled under its key node counts both nodes' GPUs."""
    journal = Journal(tmp_path / "journal.jsonl")
    for node in ("gpu5", "gpu6"):
        journal.append({"event": "transition", "ts": 1000.0, "node": node, "from": "lending",
                        "to": "lent", "outcome": "ok", "duration_s": 0})
    config = parse_config("""
engine: {kind: command, start_command: a, stop_command: b}
models:
  - name: m
    nodes: gpu5
    gpus_per_replica: 2
    replicas_per_node: 2
    url: "http://{node}:800{index}"
  - name: big
    gpus_per_replica: 16
    replicas: [{nodes: "gpu[6-7]", url: "http://gpu6:8000"}]
""")
    r = make_report(config, 1000.0, 1000.0 + 3600, 1000.0 + 3600, [],
                    journal_path=str(journal.path), slurm_gpus={"gpu5": 8, "gpu6": 8, "gpu7": 8})
    assert r.lent_gpu_hours == pytest.approx(8.0 + 16.0)
    without_slurm = make_report(config, 1000.0, 1000.0 + 3600, 1000.0 + 3600, [],
                                journal_path=str(journal.path))
    assert without_slurm.lent_gpu_hours == pytest.approx(4.0 + 16.0)  # 2 x 2 GPUs; 16 over 2 nodes


def test_csv_file_has_header_days_and_total(tmp_path: Path) -> None:
    """The CSV opens in any spreadsheet: a header, one row per day, then the total."""
    config = parse_config(CONFIG)
    r = make_report(config, 0.0, 2 * 86400.0, 2 * 86400.0, [],
                    journal_path=str(tmp_path / "none.jsonl"))
    path = tmp_path / "r.csv"
    write_csv(r, str(path))
    rows = list(csv.DictReader(path.open()))
    assert [row["date"] for row in rows] == ["1970-01-01", "1970-01-02", "total"]


def test_plot_is_a_png(tmp_path: Path) -> None:
    """--plot writes a PNG of lent and used GPUs per hour."""
    pytest.importorskip("matplotlib")
    from slurm_idle.report_io import write_plot

    config = parse_config(CONFIG)
    r = make_report(config, 0.0, 6 * 3600.0, 6 * 3600.0, [],
                    journal_path=str(tmp_path / "none.jsonl"))
    path = tmp_path / "r.png"
    write_plot(r, str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_title_rounds_as_the_text_report(tmp_path: Path) -> None:
    """The plot's title gives GPU-h used to two places, as the text report does (0.03, not 0.0)."""
    matplotlib = pytest.importorskip("matplotlib")
    from dataclasses import replace

    from slurm_idle.report_io import write_plot
    from slurm_idle.report_model import render_text

    r = replace(make_report(parse_config(CONFIG), 0.0, 3600.0, 3600.0, [],
                            journal_path=str(tmp_path / "none.jsonl")), gpu_hours=0.03)
    path = tmp_path / "r.svg"
    with matplotlib.rc_context({"svg.fonttype": "none"}):  # text as text, not as glyph paths
        write_plot(r, str(path))
    assert f"slurm-idle: 0.03 GPU-h used, {r.savings:.2f} {r.currency} saved" in path.read_text()
    assert "0.03" in render_text(r).splitlines()[2]


def test_savefig_errors_are_slurm_idle_errors(tmp_path: Path) -> None:
    """A plot that cannot be written (its directory vanished) is one clear error."""
    pytest.importorskip("matplotlib")
    from slurm_idle.report_io import write_plot

    r = make_report(parse_config(CONFIG), 0.0, 3600.0, 3600.0, [],
                    journal_path=str(tmp_path / "none.jsonl"))
    with pytest.raises(SlurmIdleError, match="cannot write"):
        write_plot(r, str(tmp_path / "gone" / "r.png"))


def test_output_paths_are_checked_up_front(tmp_path: Path) -> None:
    """Suffix, directory and writability are checked before anything is produced."""
    from slurm_idle.report_io import PLOT_SUFFIXES, check_output_path

    check_output_path(str(tmp_path / "r.png"), "--plot", PLOT_SUFFIXES)
    check_output_path(str(tmp_path / "R.PNG"), "--plot", PLOT_SUFFIXES)
    with pytest.raises(ConfigError, match="must end in .png or .svg or .pdf"):
        check_output_path(str(tmp_path / "r.jpeg"), "--plot", PLOT_SUFFIXES)
    with pytest.raises(ConfigError, match="no such directory"):
        check_output_path(str(tmp_path / "a" / "r.csv"), "--csv")


def test_make_report_says_whether_it_had_a_journal(tmp_path: Path) -> None:
    """`journal` is the path read, or None when the file does not exist."""
    config = parse_config(CONFIG)
    missing = make_report(config, 0.0, 3600.0, 3600.0, [], journal_path=str(tmp_path / "no.jsonl"))
    assert missing.journal is None
    Journal(tmp_path / "j.jsonl").append({"event": "tick", "ts": 1.0})
    found = make_report(config, 0.0, 3600.0, 3600.0, [], journal_path=str(tmp_path / "j.jsonl"))
    assert found.journal == str(tmp_path / "j.jsonl")
