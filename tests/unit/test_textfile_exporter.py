"""The sandbox's textfile exporter answers each named textfile, and only those."""

from __future__ import annotations

from pathlib import Path

from slurm_idle.testing import textfile_exporter


def test_each_named_file_is_served_and_a_missing_one_is_an_empty_page(tmp_path: Path) -> None:
    """GET /NAME: the file's text; a file not written yet: 200 and nothing (no series, as
    node_exporter collects nothing from it); any other path: 404, never another file."""
    written, missing = tmp_path / "a.prom", tmp_path / "b.prom"
    written.write_text("slurm_idle_tick_errors_total 0\n")
    (tmp_path / "secret").write_text("no")
    files = {"a.prom": written, "b.prom": missing}
    assert textfile_exporter.page(files, "/a.prom") == (
        200, b"slurm_idle_tick_errors_total 0\n", textfile_exporter.CONTENT_TYPE)
    assert textfile_exporter.page(files, "/b.prom?x=1")[:2] == (200, b"")
    assert textfile_exporter.page(files, "/secret")[0] == 404
    assert textfile_exporter.page(files, "/../secret")[0] == 404
