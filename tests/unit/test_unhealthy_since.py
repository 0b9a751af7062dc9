"""`status` says since when a replica has been unhealthy: each tick remembers when it first
saw each one so, beside the journal; a replica healthy again is forgotten."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from click.testing import CliRunner

from slurm_idle import safefiles, unhealthy_since
from slurm_idle.cli import main
from slurm_idle.cli.common import Context
from slurm_idle.config import parse_config
from slurm_idle.model import ReplicaLoad
from slurm_idle.unhealthy_since import clock_time, iso, read, remember, since_path

from .test_agent import T0, make_config
from .test_status_health import make_agent


def test_remember_keeps_the_first_time_and_forgets_the_healed(tmp_path: Path) -> None:
    path = tmp_path / "unhealthy-since.json"
    assert remember(path, ["gpu2"], 100.0) == {"gpu2": 100.0}
    assert remember(path, ["gpu2", "gpu3"], 160.0) == {"gpu2": 100.0, "gpu3": 160.0}
    assert read(path) == {"gpu2": 100.0, "gpu3": 160.0}
    assert remember(path, ["gpu3"], 220.0) == {"gpu3": 160.0}
    assert remember(path, [], 280.0) == {} and read(path) == {}


def test_the_file_is_rewritten_only_when_the_set_changes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tick every minute with the same unhealthy replicas writes nothing."""
    writes: list[str] = []
    real = safefiles.atomic_write
    monkeypatch.setattr(safefiles, "atomic_write",
                        lambda path, text, **kw: (writes.append(text), real(path, text, **kw)))
    path = tmp_path / "unhealthy-since.json"
    for now in (100.0, 160.0, 220.0):
        remember(path, ["gpu2"], now)
    assert len(writes) == 1
    remember(path, [], 280.0)
    assert len(writes) == 2


@pytest.mark.parametrize("content", ["not json", "[1, 2]", '{"gpu2": "noon", "gpu3": true}', ""])
def test_a_damaged_file_reads_as_nothing_known(tmp_path: Path, content: str) -> None:
    path = tmp_path / "unhealthy-since.json"
    path.write_text(content)
    assert read(path) == {}


def test_a_symlink_is_not_followed_nor_fatal(tmp_path: Path) -> None:
    """A planted symlink costs the `since` (a warning), never the tick, and is not written
    through."""
    target = tmp_path / "elsewhere"
    target.write_text("keep")
    path = tmp_path / "unhealthy-since.json"
    os.symlink(target, path)
    assert read(path) == {}
    remember(path, ["gpu2"], 100.0)  # replaces the link itself (rename), or warns
    assert target.read_text() == "keep"


def test_clock_time_is_utc_and_names_another_day() -> None:
    assert clock_time(iso(T0 + 61), T0 + 3600) == iso(T0 + 61)[11:16]
    assert clock_time(iso(T0), T0 + 2 * 86400).startswith(
        __import__("datetime").datetime.fromtimestamp(T0, __import__("datetime").UTC).strftime("%b %d"))


def test_a_tick_records_the_unhealthy_replica_and_forgets_it_once_healthy(tmp_path: Path) -> None:
    """gpu2's engine stopped, its series stale: the first tick that sees it writes its time;
    later ticks keep that time; once it serves again with fresh metrics it is dropped."""
    agent, engine = make_agent(tmp_path)
    path = since_path(agent.config.paths.journal)
    agent.tick()
    first = agent.clock()
    assert read(path) == {"gpu2": first}
    agent.sleep(60)
    agent.tick()
    assert read(path) == {"gpu2": first}
    engine.up["gpu2"] = True
    agent.metrics.replicas["gpu2"] = ReplicaLoad("m", "gpu2", url="http://127.0.0.1:1/gpu2")  # type: ignore[attr-defined]
    agent.tick()
    assert read(path) == {}


def test_a_dry_run_tick_records_nothing(tmp_path: Path) -> None:
    agent, _ = make_agent(tmp_path)
    agent.tick(dry_run=True)
    assert not since_path(agent.config.paths.journal).exists()


def test_status_says_since_when_in_text_and_json(tmp_path: Path) -> None:
    """After a tick saw gpu2 unhealthy, `status` reads `(unhealthy: ... since HH:MM)` and
    `--json` has `unhealthy_since`; the healthy replicas have None."""
    cfg = parse_config(make_config(tmp_path).model_dump_json().replace(
        '"bin_dir":""', f'"bin_dir":"{tmp_path}/no-slurm"').replace(
        '"bin_dir":null', f'"bin_dir":"{tmp_path}/no-slurm"'))
    agent, _ = make_agent(tmp_path, cfg)
    agent.tick()
    seen = agent.clock()
    agent.sleep(300)

    def run(*args: str) -> str:
        ctx = Context(_config=agent.config, agent_factory=lambda config, read_only=False: agent)
        result = CliRunner().invoke(main, ["status", *args], obj=ctx)
        assert result.exit_code == 0, result.output
        return result.output

    line = next(ln for ln in run().splitlines() if ln.startswith("  └ gpu2 serving (unhealthy: "))
    assert line.endswith(f" since {iso(seen)[11:16]})"), line
    doc = json.loads(run("--json"))
    since = {r["name"]: r["unhealthy_since"] for r in doc["replicas"]}
    assert since == {"gpu1": None, "gpu2": iso(seen), "gpu3": None}


def test_status_without_the_agents_file_has_no_since(tmp_path: Path) -> None:
    """No tick yet (or the file unreadable to this admin): the reason, no `since`."""
    cfg = parse_config(make_config(tmp_path).model_dump_json().replace(
        '"bin_dir":null', f'"bin_dir":"{tmp_path}/no-slurm"'))
    agent, _ = make_agent(tmp_path, cfg)
    ctx = Context(_config=agent.config, agent_factory=lambda config, read_only=False: agent)
    out = CliRunner().invoke(main, ["status"], obj=ctx).output
    line = next(ln for ln in out.splitlines() if ln.startswith("  └ gpu2 serving (unhealthy: "))
    assert " since " not in line
    assert unhealthy_since.FILE_NAME == since_path(agent.config.paths.journal).name
