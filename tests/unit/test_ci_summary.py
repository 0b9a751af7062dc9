"""`.ci/run`'s last screen (scripts/lib/ci_summary.py) says why a run is red, in ~30 lines."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "lib" / "ci_summary.py"


def load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("ci_summary", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["ci_summary"] = module  # dataclasses look their module up while it loads
    spec.loader.exec_module(module)
    return module


def junit(path: Path, passed: int, failed: list[tuple[str, str, str]]) -> Path:
    """A pytest-like JUnit report: `passed` passing cases and the (classname, name, message)
    failures."""
    cases = [f'<testcase classname="tests.unit.test_ok" name="test_{i}" time="0.1"/>'
             for i in range(passed)]
    cases += [f'<testcase classname="{c}" name="{n}" time="1"><failure message="{m}">'
              f"Traceback ...\n{m}</failure></testcase>" for c, n, m in failed]
    path.write_text('<?xml version="1.0"?><testsuites><testsuite name="pytest">'
                    + "".join(cases) + "</testsuite></testsuites>")
    return path


def run(*lanes: str) -> list[str]:
    out = subprocess.run([sys.executable, str(SCRIPT), *lanes], capture_output=True, text=True,
                         cwd=ROOT, timeout=30, check=True)
    return out.stderr.splitlines()


def test_a_failure_in_the_first_lane_is_on_the_last_screen(tmp_path: Path) -> None:
    """The 22.05 lane has one failed test under a long log, the 24.11 lane passes: the
    summary names the failed test (as pytest's id) and its error, in at most 30 lines."""
    log = tmp_path / "debian12.log"
    log.write_text("noise\n" * 5000)
    x12 = junit(tmp_path / "12.xml", 1200, [(
        "tests.contract.test_sandbox_start_failure",
        "test_a_start_failing_midway_stops_every_daemon_it_started",
        "OSError: [Errno 98] Address already in use")])
    x13 = junit(tmp_path / "13.xml", 1190, [])
    lines = run(f"debian12/slurm22.05:1:1500:{x12}:{log}",
                f"debian13/slurm24.11:0:1100:{x13}:{tmp_path / 'debian13.log'}")
    assert len(lines) <= 30, lines
    text = "\n".join(lines)
    assert ("FAILED [debian12/slurm22.05] tests/contract/test_sandbox_start_failure.py::"
            "test_a_start_failing_midway_stops_every_daemon_it_started") in text
    assert "OSError: [Errno 98] Address already in use" in text
    assert "exit 1" in lines[1] and "1200 passed, 1 failed" in lines[1]
    assert "exit 0" in lines[2] and "1190 passed" in lines[2]
    assert lines[-1] == "ci: RED: debian12/slurm22.05"


def test_many_failures_stay_within_the_screen_and_are_counted(tmp_path: Path) -> None:
    """25 failures: ten listed with their errors, the rest counted; still at most 30 lines."""
    x12 = junit(tmp_path / "12.xml", 3, [("tests.unit.test_x", f"test_{i}", f"E{i}")
                                         for i in range(25)])
    lines = run(f"a:1:1:{x12}:{tmp_path / 'a.log'}", f"b:0:1:{junit(tmp_path / '13.xml', 3, [])}:-")
    assert len(lines) <= 30, lines
    assert "ci: ... and 15 more failed or errored tests (see the logs)" in lines


def test_a_lane_that_fails_before_pytest_shows_its_log_end(tmp_path: Path) -> None:
    """mypy failing (no test report): the lane's last log lines stand in for test ids."""
    log = tmp_path / "a.log"
    log.write_text("slurm-idle: mypy --strict slurm_idle\nslurm_idle/x.py:3: error: boom\n"
                   "Found 1 error in 1 file\n")
    lines = run(f"a:1:30:{tmp_path / 'none.xml'}:{log}")
    text = "\n".join(lines)
    assert "no test report" in text and "slurm_idle/x.py:3: error: boom" in text
    assert lines[-1] == "ci: RED: a"


def test_ids_follow_pytest_for_module_and_class_tests() -> None:
    """A dotted JUnit classname becomes pytest's file::Class::name id."""
    m = load()
    assert m.test_id("tests.unit.test_ci_summary", "test_x") == "tests/unit/test_ci_summary.py::test_x"
    assert (m.test_id("tests.unit.test_ci_summary.TestA", "test_y")
            == "tests/unit/test_ci_summary.py::TestA::test_y")
