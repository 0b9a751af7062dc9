"""man/ holds one page per command, generated from the click commands: regenerated here and
compared with the committed pages, so a changed option or --help text cannot leave them behind
(run scripts/gen-man to bring them in step)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def pages(directory: Path) -> dict[str, str]:
    """Each page's text with its header's date blanked (pages are dated when generated)."""
    return {p.name: re.sub(r'^(\.TH "[^"]*" "1") "[^"]*"', r'\1 ""', p.read_text())
            for p in sorted(directory.glob("*.1"))}


def test_committed_man_pages_match_the_commands(tmp_path: Path) -> None:
    """A page per command, each what click-man makes of the code now."""
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "lib" / "gen_man.py"),
                           str(tmp_path)], capture_output=True, text=True, timeout=120,
                          check=False)
    assert proc.returncode == 0, proc.stderr
    fresh, committed = pages(tmp_path), pages(ROOT / "man")
    assert "slurm-idle.1" in fresh and "slurm-idle-tick.1" in fresh
    assert '.SH "EXIT STATUS"' in fresh["slurm-idle.1"]  # the --help epilog's table
    assert sorted(committed) == sorted(fresh), "man/ is out of date: run scripts/gen-man"
    stale = [name for name in fresh if fresh[name] != committed[name]]
    assert not stale, f"man/ is out of date ({', '.join(stale)}): run scripts/gen-man"
