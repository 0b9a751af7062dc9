"""Commands that only look (status, tick --dry-run, lend/reclaim/pin --dry-run) build an agent
whose metrics source never writes the scrape state file; real ticks and admin actions do."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from slurm_idle import wiring
from slurm_idle.agent import Agent
from slurm_idle.cli import main
from slurm_idle.cli.common import Context
from slurm_idle.config import Config, parse_config
from slurm_idle.errors import SlurmIdleError
from slurm_idle.metrics.scrape import ScrapeSource

CONFIG = """
metrics: {{source: scrape, scrape_state: {state}}}
engine: {{kind: command, start_command: "true", stop_command: "true"}}
models:
  - name: m
    nodes: gpu[1-2]
    url: "http://{{node}}:8000"
paths: {{journal: {journal}, lock: {lock}}}
"""


def test_build_agent_passes_read_only_to_the_scrape_source(tmp_path: Path) -> None:
    """build_agent(read_only=True) gives a ScrapeSource that keeps the state file as it is."""
    cfg = parse_config(CONFIG.format(state=tmp_path / "s.json", journal=tmp_path / "j", lock=tmp_path / "l"))
    assert isinstance(wiring.make_metrics_source(cfg, read_only=True), ScrapeSource)
    assert wiring.build_agent(cfg, read_only=True).metrics.read_only is True
    assert wiring.build_agent(cfg).metrics.read_only is False


@pytest.mark.parametrize(
    ("args", "read_only"),
    [
        (["status"], True),
        (["tick", "--dry-run"], True),
        (["tick"], False),
        (["lend", "gpu1", "--dry-run"], True),
        (["reclaim", "gpu1", "--dry-run"], True),
        (["pin", "gpu1", "--dry-run"], True),
        (["lend", "gpu1"], False),
    ],
)
def test_looking_commands_build_a_read_only_agent(
    tmp_path: Path, args: list[str], read_only: bool
) -> None:
    """The CLI asks its context's agent factory for a read-only agent exactly when the command
    changes nothing."""
    path = tmp_path / "c.yaml"
    path.write_text(CONFIG.format(state=tmp_path / "s.json", journal=tmp_path / "j", lock=tmp_path / "l"))
    seen: list[bool] = []

    def factory(config: Config, *, read_only: bool = False) -> Agent:
        seen.append(read_only)
        raise SlurmIdleError("stop here")

    result = CliRunner().invoke(main, ["--config", str(path), *args],
                                obj=Context(agent_factory=factory))
    assert seen == [read_only], result.output
