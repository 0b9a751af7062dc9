"""scripts/lib/install.sh, the install step behind the README's two commands and .ci/run."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def stub(bin_dir: Path, name: str, body: str) -> None:
    path = bin_dir / name
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(0o755)


@pytest.mark.parametrize("policy_rc_exists", [True, False])
def test_install_carries_on_after_apt(tmp_path: Path, policy_rc_exists: bool) -> None:
    """Regression: with a policy-rc.d already there (Debian images ship one) the install step
    returned 1 after apt-get, and `set -e` stopped scripts/test before pip and pytest.
    Ours is removed again; an existing one is left alone."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    stub(bin_dir, "dpkg-query", "exit 1")  # nothing installed
    stub(bin_dir, "apt-get", f'echo "$@" >> {tmp_path}/apt.log')
    stub(bin_dir, "id", "echo 0")
    prc = tmp_path / "policy-rc.d"
    if policy_rc_exists:
        prc.write_text("#!/bin/sh\nexit 0\n")
    script = f"set -euo pipefail; . {ROOT}/scripts/lib/install.sh; install_system_packages; echo REACHED"
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_IDLE_POLICY_RC": str(prc)}
    proc = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True,
                          timeout=60, check=False)
    assert proc.returncode == 0 and "REACHED" in proc.stdout, proc.stderr
    assert "install -y" in (tmp_path / "apt.log").read_text()
    assert prc.exists() == policy_rc_exists


def test_a_failed_apt_install_stops_with_its_exit_code(tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    stub(bin_dir, "dpkg-query", "exit 1")
    stub(bin_dir, "apt-get", 'case " $* " in *" install "*) exit 100;; esac')
    stub(bin_dir, "id", "echo 0")
    prc = tmp_path / "policy-rc.d"
    script = f"set -euo pipefail; . {ROOT}/scripts/lib/install.sh; install_system_packages; echo REACHED"
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_IDLE_POLICY_RC": str(prc)}
    proc = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True,
                          timeout=60, check=False)
    assert proc.returncode == 100 and "REACHED" not in proc.stdout
    assert "apt-get install failed" in proc.stderr
    assert not prc.exists()  # ours is cleaned up on failure too


def test_long_steps_print_one_progress_line_each_with_elapsed_time(tmp_path: Path) -> None:
    """apt and pip say when they start and end, with the seconds since the install began, on
    stderr; an install with nothing to do prints nothing."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    stub(bin_dir, "dpkg-query", "exit 1")
    stub(bin_dir, "apt-get", "true")
    stub(bin_dir, "id", "echo 0")
    # `fakepy -m venv .venv` makes a .venv whose python accepts any pip call.
    stub(bin_dir, "fakepy", 'mkdir -p .venv/bin && printf "#!/bin/sh\\n" > .venv/bin/python'
                            " && chmod +x .venv/bin/python")
    work = tmp_path / "repo"
    work.mkdir()
    (work / "pyproject.toml").write_text("")
    script = (f"set -euo pipefail; . {ROOT}/scripts/lib/install.sh; install_system_packages; "
              "install_python_env; echo REACHED")
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "PYTHON": "fakepy",
           "SLURM_IDLE_POLICY_RC": str(tmp_path / "policy-rc.d")}

    def run() -> subprocess.CompletedProcess[str]:
        return subprocess.run(["bash", "-c", script], env=env, cwd=work, capture_output=True,
                              text=True, timeout=60, check=False)

    proc = run()
    assert proc.returncode == 0 and "REACHED" in proc.stdout, proc.stderr
    lines = proc.stderr.splitlines()
    assert all(re.fullmatch(r"slurm-idle: \[ +\d+s\] .+", ln) for ln in lines), lines
    steps = [ln.split("] ", 1)[1] for ln in lines]
    assert steps[0].startswith("installing ") and "Debian packages" in steps[0]
    assert steps[1:] == ["Debian packages installed", "creating .venv ...",
                         "installing Python packages into .venv ...", "Python packages installed"]
    stub(bin_dir, "dpkg-query", "echo 'install ok installed'")
    again = run()
    assert again.returncode == 0 and again.stderr == ""
