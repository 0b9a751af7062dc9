"""Write the man pages of `slurm-idle` and each of its commands (click-man, one page per
command: slurm-idle.1, slurm-idle-tick.1, ...) into the directory given, from the click
commands themselves, so a page says what `--help` says. Run through scripts/gen-man.

click-man leaves out click's epilogs, so the exit-code table `slurm-idle --help` ends with is
added to slurm-idle.1 here as its EXIT STATUS section, from the same table (errors.py).

Pages are dated today (or `SOURCE_DATE_EPOCH`, as click-man reads it); the unit test that
keeps man/ in step with the code compares everything but that date.
"""

from __future__ import annotations

import sys
from pathlib import Path

# This checkout's slurm_idle, not whichever one the interpreter has installed.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from click_man.core import write_man_pages

from slurm_idle import __version__
from slurm_idle.cli import load_all, main
from slurm_idle.errors import EXIT_CODE_MEANINGS


def exit_status_section() -> str:
    """The EXIT STATUS section of slurm-idle.1: one tagged paragraph per code."""
    lines = ['.SH "EXIT STATUS"']
    for code, meaning in EXIT_CODE_MEANINGS.items():
        lines += [".TP", rf"\fB{int(code)}\fP", meaning.replace("-", r"\-")]
    return "\n".join(lines) + "\n"


def generate(target: Path) -> list[Path]:
    """Write every page into `target` (made if missing); return the pages, sorted."""
    target.mkdir(parents=True, exist_ok=True)
    load_all()  # click-man walks `main.commands`: every lazily imported command registered
    write_man_pages("slurm-idle", main, version=__version__, target_dir=str(target))
    top = target / "slurm-idle.1"
    text = top.read_text()
    top.write_text(text + ("" if text.endswith("\n") else "\n") + exit_status_section())
    return sorted(target.glob("*.1"))


if __name__ == "__main__":
    pages = generate(Path(sys.argv[1] if len(sys.argv) > 1 else "man"))
    print(f"wrote {len(pages)} man pages into {pages[0].parent}" if pages else "no pages written")
