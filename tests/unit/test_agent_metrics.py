"""The agent's node_exporter textfile: format, counters across ticks, atomic replacement."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from slurm_idle.agent_metrics import METRICS, atomic_write, parse_counters, write_textfile
from slurm_idle.model import Phase


def tick(path: Path, **kw: Any) -> None:
    args: dict[str, Any] = {
        "phases": {"serving": 2, "lent": 1},
        "needed": {"meta-llama/Llama-3.1-70B-Instruct": 2},
        "serving": {"meta-llama/Llama-3.1-70B-Instruct": 2},
        "tick_duration_s": 1.5,
        "tick_ts": 1796205600.25,
        "transitions": [],
        "tick_error": False,
    }
    args.update(kw)
    write_textfile(path, **args)


def samples(path: Path) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(path.read_text()):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_textfile_parses_and_has_every_metric(tmp_path: Path) -> None:
    """prometheus_client's parser reads every metric the issue names, with its labels."""
    path = tmp_path / "slurm_idle.prom"
    tick(path, transitions=[("lent", "reclaiming")], floors={"meta-llama/Llama-3.1-70B-Instruct": 1})
    families = {f.name: f for f in text_string_to_metric_families(path.read_text())}
    assert families["slurm_idle_transitions"].type == "counter"
    assert families["slurm_idle_tick_errors"].type == "counter"
    assert families["slurm_idle_nodes"].type == "gauge"
    got = samples(path)
    model = (("model", "meta-llama/Llama-3.1-70B-Instruct"),)
    assert got[("slurm_idle_needed_replicas", model)] == 2
    assert got[("slurm_idle_serving_replicas", model)] == 2
    assert got[("slurm_idle_min_serving_replicas", model)] == 1
    assert got[("slurm_idle_tick_duration_seconds", ())] == 1.5
    assert got[("slurm_idle_last_tick_timestamp_seconds", ())] == 1796205600.25
    assert got[("slurm_idle_transitions_total", (("from", "lent"), ("to", "reclaiming")))] == 1
    assert got[("slurm_idle_tick_errors_total", ())] == 0


def test_every_phase_appears_even_when_empty(tmp_path: Path) -> None:
    """A phase with no node reads 0 instead of vanishing from Prometheus."""
    path = tmp_path / "a.prom"
    tick(path, phases={"lent": 3})
    got = samples(path)
    for phase in Phase:
        assert ("slurm_idle_nodes", (("phase", phase.value),)) in got
    assert got[("slurm_idle_nodes", (("phase", "lent"),))] == 3
    assert got[("slurm_idle_nodes", (("phase", "serving"),))] == 0


def test_counters_keep_growing_across_ticks(tmp_path: Path) -> None:
    """Each tick is a new process; counters carry over through the file itself."""
    path = tmp_path / "a.prom"
    tick(path, transitions=[("serving", "retiring")], tick_error=True)
    tick(path, transitions=[("serving", "retiring"), ("retiring", "lending")])
    tick(path, transitions=[], tick_error=True)
    got = samples(path)
    assert got[("slurm_idle_transitions_total", (("from", "serving"), ("to", "retiring")))] == 2
    assert got[("slurm_idle_transitions_total", (("from", "retiring"), ("to", "lending")))] == 1
    assert got[("slurm_idle_tick_errors_total", ())] == 2
    assert got[("slurm_idle_ticks_total", ())] == 3


def test_gauges_are_replaced_not_accumulated(tmp_path: Path) -> None:
    """Phase counts and replicas describe the last tick only."""
    path = tmp_path / "a.prom"
    tick(path, phases={"lent": 3}, tick_duration_s=9.0)
    tick(path, phases={"lent": 1}, tick_duration_s=2.0)
    got = samples(path)
    assert got[("slurm_idle_nodes", (("phase", "lent"),))] == 1
    assert got[("slurm_idle_tick_duration_seconds", ())] == 2.0


def test_unreadable_previous_file_restarts_counters_at_zero(tmp_path: Path) -> None:
    """A corrupt file is a counter reset (which Prometheus handles), never a failed tick."""
    path = tmp_path / "a.prom"
    path.write_text("this is { not a metric file\n")
    tick(path, tick_error=True)
    assert samples(path)[("slurm_idle_tick_errors_total", ())] == 1


def test_label_values_are_escaped(tmp_path: Path) -> None:
    """A model name with quotes and backslashes survives the round trip."""
    path = tmp_path / "a.prom"
    name = 'we"ird\\model'
    tick(path, needed={name: 1}, serving={name: 0})
    assert samples(path)[("slurm_idle_needed_replicas", (("model", name),))] == 1


def test_parse_counters_ignores_other_metrics() -> None:
    """Only our counters are read back; gauges and foreign series are not."""
    text = (
        "# TYPE slurm_idle_nodes gauge\nslurm_idle_nodes{phase=\"lent\"} 4\n"
        "# TYPE slurm_idle_tick_errors_total counter\nslurm_idle_tick_errors_total 5\n"
        "# TYPE other_total counter\nother_total 7\n"
    )
    counters = parse_counters(text)
    assert counters.tick_errors == 5 and counters.transitions == {} and counters.ticks == 0


def test_write_replaces_the_file_atomically(tmp_path: Path) -> None:
    """A reader holding the old file keeps reading it whole; the path shows the new one."""
    path = tmp_path / "a.prom"
    tick(path, phases={"lent": 1})
    old_inode = path.stat().st_ino
    with path.open() as reader:
        tick(path, phases={"lent": 2})
        assert 'slurm_idle_nodes{phase="lent"} 1' in reader.read()
    assert path.stat().st_ino != old_inode
    assert 'slurm_idle_nodes{phase="lent"} 2' in path.read_text()
    assert sorted(os.listdir(tmp_path)) == ["a.prom"]  # no temp file left behind
    assert path.stat().st_mode & 0o777 == 0o644  # readable by a node_exporter user


def test_failed_write_leaves_no_temp_file(tmp_path: Path) -> None:
    """If the final rename fails, the temp file is removed and the error surfaces."""
    target = tmp_path / "a.prom"
    target.mkdir()  # os.replace(file, directory) fails
    with pytest.raises(OSError):
        atomic_write(target, "x 1\n")
    assert sorted(os.listdir(tmp_path)) == ["a.prom"]


def test_temp_file_is_complete_and_invisible_to_the_collector(tmp_path: Path) -> None:
    """Before the rename the temp file is whole, world-readable and not named *.prom."""
    seen: list[tuple[str, str, int]] = []

    def look(src: str) -> None:
        seen.append((os.path.basename(src), Path(src).read_text(), os.stat(src).st_mode & 0o777))

    atomic_write(tmp_path / "a.prom", "x 1\n", before_replace=look)
    (name, content, mode), = seen
    assert not name.endswith(".prom") and content == "x 1\n" and mode == 0o644


def test_a_quiet_tick_still_declares_every_family_and_edge(tmp_path: Path) -> None:
    """No transition, failed observation: every family is declared, each lifecycle edge is a
    0 counter, and the node gauge has no sample (unknown, not an empty pool)."""
    from slurm_idle.lifecycle import edges

    path = tmp_path / "slurm_idle.prom"
    write_textfile(path, phases=None, needed={}, serving={}, tick_duration_s=0.1, tick_ts=1.0,
                   transitions=[], tick_error=True)
    text = path.read_text()
    for name, (kind, _) in METRICS.items():
        assert f"# TYPE {name} {kind}" in text
    assert "slurm_idle_nodes{" not in text
    for e in edges():
        assert f'slurm_idle_transitions_total{{from="{e.from_phase.value}",to="{e.to_phase.value}"}} 0' in text


def test_admin_transitions_bump_only_the_counter(tmp_path: Path) -> None:
    from slurm_idle.agent_metrics import add_transitions, read_counters

    path = tmp_path / "slurm_idle.prom"
    write_textfile(path, phases={"serving": 2}, needed={"m": 1}, serving={"m": 2},
                   tick_duration_s=0.1, tick_ts=1.0, transitions=[("lent", "reclaiming")],
                   tick_error=False)
    before = path.read_text()
    add_transitions(path, [("lent", "reclaiming"), ("reclaiming", "starting")])
    after = path.read_text()
    counters = read_counters(path)
    assert counters.transitions[("lent", "reclaiming")] == 2
    assert counters.transitions[("reclaiming", "starting")] == 1
    assert counters.ticks == 1  # not a tick
    strip = [ln for ln in before.splitlines() if not ln.startswith("slurm_idle_transitions_total")]
    assert strip == [ln for ln in after.splitlines() if not ln.startswith("slurm_idle_transitions_total")]
    list(text_string_to_metric_families(after))  # still a valid exposition
    add_transitions(tmp_path / "new.prom", [("serving", "retiring")])
    assert read_counters(tmp_path / "new.prom").transitions[("serving", "retiring")] == 1
