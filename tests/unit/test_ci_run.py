""".ci/run with a stand-in scripts/test: which commands the two lanes run, in what order, and how
their exit codes combine (the real lanes take most of an hour)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

FAKE_TEST = """#!/usr/bin/env bash
# Records each call (start, end) in calls.log; exit codes from rc-<first arg or "host">.
name=host; [ "${1:-}" = --debian ] && name=debian$2
case " $* " in *" --collect-only "*) name=$name-setup ;; esac
echo "start $name $*" >> calls.log
[ "$name" = debian13-setup ] && sleep 0.5   # the setup outlasts the start of the host lane
echo "end $name" >> calls.log
exit "$(cat rc-$name 2>/dev/null || echo 0)"
"""


def run_ci(tmp_path: Path, **rcs: int) -> tuple[int, list[str], str]:
    (tmp_path / ".ci").mkdir()
    shutil.copy(ROOT / ".ci" / "run", tmp_path / ".ci" / "run")
    (tmp_path / "scripts").mkdir()
    fake = tmp_path / "scripts" / "test"
    fake.write_text(FAKE_TEST)
    fake.chmod(0o755)
    for name, rc in rcs.items():
        (tmp_path / f"rc-{name.replace('_', '-')}").write_text(str(rc))
    proc = subprocess.run(["bash", str(tmp_path / ".ci" / "run")], cwd=tmp_path,
                          capture_output=True, text=True, timeout=60, check=False)
    return proc.returncode, (tmp_path / "calls.log").read_text().splitlines(), proc.stderr


def test_setup_beside_the_host_lane_then_the_slurm_tests_on_24_11(tmp_path: Path) -> None:
    rc, calls, err = run_ci(tmp_path)
    assert rc == 0, err
    starts = [c for c in calls if c.startswith("start")]
    assert starts[0].startswith("start debian13-setup --debian 13 --collect-only")
    assert starts[1] == "start host "  # the whole suite, no selection
    assert starts[2] == "start debian13 --debian 13 -m slurm"
    # the setup ran while the host lane started, and the 24.11 lane began after both ended
    assert calls.index("start host ") < calls.index("end debian13-setup")
    assert calls.index("start debian13 --debian 13 -m slurm") > calls.index("end debian13-setup")
    assert "debian12=0 debian13=0" in err


@pytest.mark.parametrize(("rcs", "expect"), [
    ({"host": 1}, "debian12=1 debian13=0"),
    ({"debian13": 1}, "debian12=0 debian13=1"),
    ({"debian13": 5}, "debian12=0 debian13=1"),  # pytest collected nothing: a failure
])
def test_either_lane_failing_fails_ci(tmp_path: Path, rcs: dict[str, int], expect: str) -> None:
    rc, calls, err = run_ci(tmp_path, **rcs)
    assert rc == 1 and expect in err
    assert sum(c.startswith("start") for c in calls) == 3  # both lanes always run


def test_a_failed_setup_still_runs_the_lane_and_shows_the_log(tmp_path: Path) -> None:
    rc, calls, err = run_ci(tmp_path, debian13_setup=1)
    assert rc == 0  # the lane sets up what is missing itself, and it passed
    assert "debian13 root setup exited 1" in err
    assert "start debian13 --debian 13 -m slurm" in calls
