"""`slurm-idle report` end to end against a stand-in `sacct` (slurm.bin_dir) replaying real output."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

DATA = Path(__file__).resolve().parents[1] / "data" / "sacct" / "22.05"


def setup(tmp_path: Path, sacct_body: str) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    sacct = bin_dir / "sacct"
    sacct.write_text("#!/bin/sh\n" + sacct_body)
    sacct.chmod(0o755)
    config = tmp_path / "slurm-idle.yaml"
    config.write_text(
        f"slurm: {{bin_dir: {bin_dir}}}\n"
        'engine: {kind: command, start_command: "true", stop_command: "true"}\n'
        'models: [{name: m, gpus_per_replica: 4, nodes: "gpu[1-2]"}]\n'
        f"paths: {{journal: {tmp_path / 'journal.jsonl'}}}\n"
        "report: {price_per_gpu_hour: 2.0, currency: EUR}\n"
    )
    return config


def cli(config: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "slurm_idle.cli", "--config", str(config), "report", *args],
        capture_output=True, text=True, timeout=60, check=False,
    )


def test_json_report_from_replayed_sacct(tmp_path: Path) -> None:
    """--json prints the documented keys; --csv writes the day table; sacct got --duplicates."""
    config = setup(tmp_path, f'echo "$@" > {tmp_path}/argv\ncat {DATA / "sacct-XD.json"}\n')
    csv_path = tmp_path / "r.csv"
    r = cli(config, "--since", "2026-12-02", "--until", "2026-12-03", "--json",
            "--csv", str(csv_path))
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert {"gpu_hours", "jobs", "preemptions", "lost_gpu_hours", "reclaim_latency_s_p95",
            "savings", "currency", "days"} <= set(out)
    assert (out["jobs"], out["preemptions"], out["currency"]) == (6, 2, "EUR")
    assert [d["date"] for d in out["days"]] == ["2026-12-02"]
    assert "--duplicates" in (tmp_path / "argv").read_text()
    assert csv_path.read_text().splitlines()[0].startswith("date,gpu_hours")


def test_text_report_is_the_default(tmp_path: Path) -> None:
    """Without --json a human table is printed."""
    config = setup(tmp_path, f'cat {DATA / "sacct-XD.json"}\n')
    r = cli(config, "--since", "2026-12-02", "--until", "2026-12-03")
    assert r.returncode == 0, r.stderr
    assert "GPU-hours used by idle jobs" in r.stdout and "EUR" in r.stdout


@pytest.mark.parametrize(
    ("args", "body", "rc", "message"),
    [
        (["--since", "yesterday-ish"], "exit 0\n", 2, "bad date"),
        (["--since", "2026-12-03", "--until", "2026-12-02"], "exit 0\n", 2, "period is empty"),
        ([], "echo 'sacct: error: Slurm accounting storage is disabled' >&2; exit 1\n", 1,
         "slurmdbd"),
    ],
)
def test_errors_are_one_clear_line(tmp_path: Path, args: list[str], body: str, rc: int,
                                   message: str) -> None:
    """Bad dates, an empty period and disabled accounting end in one line, no traceback."""
    r = cli(setup(tmp_path, body), *args)
    assert r.returncode == rc
    assert message in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_a_missing_journal_is_a_warning_and_null_in_json(tmp_path: Path) -> None:
    """Without the journal (report run off the tick's host) stderr says lends are not counted
    and --json carries `"journal": null`; with it, `journal` is its path and no warning."""
    config = setup(tmp_path, f'cat {DATA / "sacct-XD.json"}\n')
    r = cli(config, "--since", "2026-12-02", "--until", "2026-12-03", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["journal"] is None
    assert "warning: no journal at" in r.stderr and "lends" in r.stderr
    journal = tmp_path / "journal.jsonl"
    journal.write_text('{"event": "tick", "ts": 1796169600.0, "errors": 0}\n')
    r = cli(config, "--since", "2026-12-02", "--until", "2026-12-03", "--json")
    assert json.loads(r.stdout)["journal"] == str(journal)
    assert "warning" not in r.stderr


@pytest.mark.parametrize(
    ("plot", "message"),
    [("nonexist/x.png", "no such directory"), ("x.txt", "must end in .png"), (".", "is a directory")],
)
def test_a_bad_plot_path_fails_first_in_one_line(tmp_path: Path, plot: str, message: str) -> None:
    """`--plot` into a missing directory or with an unknown suffix is exit 2 before sacct runs
    and before the CSV is written."""
    config = setup(tmp_path, f'touch {tmp_path}/sacct-ran\ncat {DATA / "sacct-XD.json"}\n')
    csv_path = tmp_path / "r.csv"
    r = cli(config, "--csv", str(csv_path), "--plot", str(tmp_path / plot))
    assert r.returncode == 2, r.stderr
    assert message in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    assert not csv_path.exists() and not (tmp_path / "sacct-ran").exists()


def test_a_bad_csv_path_is_one_line(tmp_path: Path) -> None:
    """`--csv` into a missing directory is exit 2 naming it."""
    config = setup(tmp_path, f'cat {DATA / "sacct-XD.json"}\n')
    r = cli(config, "--csv", str(tmp_path / "nope" / "r.csv"))
    assert r.returncode == 2 and "no such directory" in r.stderr


def test_help_states_the_preemption_rule() -> None:
    """`report --help` says how a requeue is told from a time-limit requeue."""
    r = subprocess.run([sys.executable, "-m", "slurm_idle.cli", "report", "--help"],
                       capture_output=True, text=True, timeout=60, check=False)
    assert "journal shows the agent" in r.stdout and "time limit" in r.stdout
