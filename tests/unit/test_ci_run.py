""".ci/run with a stand-in scripts/test: which commands the two lanes run, at the same time or
one after the other, and how their exit codes combine (the real lanes take most of an hour)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# Records each call's start and end in calls.log; its exit code comes from rc-<lane>. Like
# pytest it writes a JUnit report where SLURM_IDLE_JUNITXML says, with one failed test when
# its exit code is 1, and prints a long log with the pip noise .ci/run filters out.
FAKE_TEST = """#!/usr/bin/env bash
name=host; [ "${1:-}" = --debian ] && name=debian$2
echo "start $name $*" >> calls.log
sleep 0.5
echo "end $name" >> calls.log
echo "output of $name"
echo "WARNING: Location 'file:///opt/pypi/simple/x/' is ignored: it is neither a file nor a directory."
for i in $(seq 400); do echo "line $i of $name"; done
rc=$(cat rc-$name 2>/dev/null || echo 0)
case=''
[ "$rc" = 1 ] && case='<testcase classname="tests.unit.test_deliberate" name="test_red_in_'$name'">'\
'<failure message="AssertionError: deliberately red in '$name'">tb</failure></testcase>'
if [ -n "${SLURM_IDLE_JUNITXML:-}" ]; then
  echo '<?xml version="1.0"?><testsuites><testsuite name="pytest">'\
'<testcase classname="tests.unit.test_ok" name="test_fine"/>'"$case"'</testsuite></testsuites>' \
    > "$SLURM_IDLE_JUNITXML"
fi
exit "$rc"
"""

# The host's install steps, which the parallel mode runs once before forking the lanes.
FAKE_INSTALL = """
install_system_packages() { echo "install packages" >> calls.log; }
install_python_env() { echo "install venv" >> calls.log; }
"""


def run_ci(tmp_path: Path, serial: bool = False, **rcs: int) -> tuple[int, list[str], str]:
    (tmp_path / ".ci").mkdir()
    shutil.copy(ROOT / ".ci" / "run", tmp_path / ".ci" / "run")
    (tmp_path / "scripts").mkdir()
    fake = tmp_path / "scripts" / "test"
    fake.write_text(FAKE_TEST)
    fake.chmod(0o755)
    (tmp_path / "scripts" / "lib").mkdir()
    shutil.copy(ROOT / "scripts" / "lib" / "ci_summary.py", tmp_path / "scripts" / "lib")
    (tmp_path / "scripts" / "lib" / "install.sh").write_text(FAKE_INSTALL)
    for name, rc in rcs.items():
        (tmp_path / f"rc-{name}").write_text(str(rc))
    env = {"PATH": "/usr/bin:/bin", "SLURM_IDLE_CI_SERIAL": "1" if serial else "0"}
    proc = subprocess.run(["bash", str(tmp_path / ".ci" / "run")], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=60, check=False)
    return proc.returncode, (tmp_path / "calls.log").read_text().splitlines(), proc.stderr


def test_both_lanes_run_the_whole_suite_at_once(tmp_path: Path) -> None:
    rc, calls, err = run_ci(tmp_path)
    assert rc == 0, err
    assert sorted(c for c in calls if c.startswith("start")) == [
        "start debian13 --debian 13", "start host "]  # 22.05: the whole suite
    # installed once, before the lanes (they would race for apt's lock), then overlapping
    assert calls[:2] == ["install packages", "install venv"]
    assert [c.split()[0] for c in calls[2:]] == ["start", "start", "end", "end"]
    assert "output of debian13" in err  # its log is printed at the end
    assert "debian12=0 debian13=0" in err
    assert err.splitlines()[-1] == "ci: GREEN: every lane passed"
    assert "is ignored" not in err  # known noise stays out


def test_serial_runs_one_lane_after_the_other(tmp_path: Path) -> None:
    rc, calls, err = run_ci(tmp_path, serial=True)
    assert rc == 0, err
    assert calls == ["start host ", "end host", "start debian13 --debian 13",
                     "end debian13"]


@pytest.mark.parametrize("serial", [False, True])
@pytest.mark.parametrize(("rcs", "expect"), [
    ({"host": 1}, "debian12=1 debian13=0"),
    ({"debian13": 1}, "debian12=0 debian13=1"),
    ({"debian13": 5}, "debian12=0 debian13=1"),  # pytest collected nothing: a failure
])
def test_either_lane_failing_fails_ci(tmp_path: Path, serial: bool, rcs: dict[str, int],
                                      expect: str) -> None:
    rc, calls, err = run_ci(tmp_path, serial, **rcs)
    assert rc == 1 and expect in err, err
    assert sum(c.startswith("end") for c in calls) == 2  # both lanes always run to the end


@pytest.mark.parametrize("serial", [False, True])
def test_a_failed_test_of_the_first_lane_is_named_in_the_last_30_lines(
        tmp_path: Path, serial: bool) -> None:
    """A deliberately failing test in the 22.05 lane, 800 lines of both lanes' logs after it:
    the last 30 lines of .ci/run's output name that test, its error and the red lane."""
    rc, _, err = run_ci(tmp_path, serial, host=1)
    last = err.splitlines()[-30:]
    assert rc == 1
    assert ("ci: FAILED [debian12/slurm22.05] tests/unit/test_deliberate.py::test_red_in_host"
            in last or "ci: FAILED [debian12/slurm22.05] tests.unit.test_deliberate::test_red_in_host"
            in last), last
    assert "ci:     AssertionError: deliberately red in host" in last
    assert last[-1] == "ci: RED: debian12/slurm22.05"
    assert (tmp_path / ".ci" / "logs" / "debian12.log").read_text().count("line 400 of host") == 1
