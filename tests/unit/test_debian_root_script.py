"""scripts/lib/debian-mirror.sh and the argument check of `scripts/test --debian N`."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def mirrors(tmp_path: Path) -> list[str]:
    env = {**os.environ, "SLURM_IDLE_HOST_APT": str(tmp_path / "apt"),
           "SLURM_IDLE_HOST_OS_RELEASE": str(tmp_path / "os-release")}
    r = subprocess.run(["bash", "-c", f". {ROOT}/scripts/lib/debian-mirror.sh; host_mirrors"],
                       env=env, capture_output=True, text=True, timeout=30, check=True)
    return r.stdout.splitlines()


def test_the_mirror_comes_from_the_hosts_own_apt_sources(tmp_path: Path) -> None:
    """deb822 and one-line sources of the host's release give the archive and security URIs;
    other suites (-updates) and other repositories (a vendor's) are not Debian's archive."""
    (tmp_path / "os-release").write_text("ID=debian\nVERSION_CODENAME=bookworm\n")
    d = tmp_path / "apt" / "sources.list.d"
    d.mkdir(parents=True)
    (d / "debian.sources").write_text(
        "Types: deb\n# a comment\nURIs: http://mirror.example/debian\nSuites: bookworm bookworm-updates\n"
        "Components: main\n\nTypes: deb\nURIs: http://mirror.example/debian-security\n"
        "Suites: bookworm-security\nComponents: main\n")
    (d / "vendor.sources").write_text("Types: deb\nURIs: https://vendor.example/apt\nSuites: nodistro\n")
    (d / "local.list").write_text("deb [arch=amd64 signed-by=/k.gpg] http://local.example/debian bookworm main\n"
                                  "deb-src http://src.example/debian bookworm main\n")
    assert sorted(mirrors(tmp_path)) == [
        "archive http://local.example/debian", "archive http://mirror.example/debian",
        "security http://mirror.example/debian-security"]


def test_no_debian_sources_gives_no_mirror(tmp_path: Path) -> None:
    (tmp_path / "os-release").write_text("ID=other\n")
    (tmp_path / "apt").mkdir()
    assert mirrors(tmp_path) == []


def test_an_unknown_release_is_refused_in_one_line() -> None:
    r = subprocess.run([str(ROOT / "scripts" / "test"), "--debian", "99"], capture_output=True,
                       text=True, timeout=30, check=False)
    assert r.returncode == 2 and r.stderr.strip() == "slurm-idle: --debian takes 12 or 13 (got '99')"
