"""An admin's reclaim says how far it got as it goes: each step printed once as it ends, and,
before the lent jobs' grace is waited out, one stderr line naming the jobs given it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from click.testing import CliRunner, Result

from slurm_idle import admin
from slurm_idle.agent import Agent
from slurm_idle.cli import main
from slurm_idle.cli.common import Context
from slurm_idle.config import Config
from slurm_idle.errors import SlurmIdleError
from slurm_idle.logs import setup_logging
from slurm_idle.model import ActionKind, SlurmJob
from slurm_idle.steps import StepResult

from .test_admin import CONFIG, adopted


def run(tmp_path: Path, agent: Agent, *args: str) -> Result:
    path = tmp_path / "c.yaml"
    path.write_text(CONFIG.format(tmp=tmp_path))

    def factory(config: Config, *, read_only: bool = False) -> Agent:
        return agent

    try:
        return CliRunner().invoke(main, ["--config", str(path), *args],
                                  obj=Context(agent_factory=factory))
    finally:
        setup_logging()


def lent_with_a_job(tmp_path: Path) -> Agent:
    """gpu1 lent, an idle-partition batch job running on it."""
    agent, slurm = adopted(tmp_path)
    admin.force(agent, "gpu1", ActionKind.LEND)
    slurm.job_list = [SlurmJob(job_id=77, name="train", partition="idle",  # type: ignore[attr-defined]
                               state="RUNNING", nodes=("gpu1",))]
    return agent


def test_reclaim_names_the_grace_it_waits_for_before_the_steps(tmp_path: Path) -> None:
    """The grace line comes first (stderr), then each step once (stdout)."""
    agent = lent_with_a_job(tmp_path)
    result = run(tmp_path, agent, "reclaim", "gpu1")
    assert result.exit_code == 0, result.output
    grace = ("slurm-idle: reclaim gpu1: idle job(s) 77 get up to 30s (slurm.requeue_grace_s) "
             "to stop before their requeue; waiting ...")
    assert result.stderr.splitlines() == [grace]
    steps = [ln for ln in result.stdout.splitlines() if ln.startswith("gpu1 ")]
    assert steps and steps[0].startswith("gpu1 lent -> reclaiming ")
    assert len(set(steps)) == len(steps)  # printed as they ended, not again at the end
    assert result.output.index(grace) < result.output.index(steps[0])


def test_steps_are_printed_as_they_end_not_after_the_last(tmp_path: Path) -> None:
    """A reclaim cut short after its steps (Ctrl-C while the engine starts, here an error
    raised once the driver returns) has already shown every step it made."""
    agent = lent_with_a_job(tmp_path)
    real = agent.run_actions

    def then_interrupted(*args: Any, **kwargs: Any) -> list[StepResult]:
        real(*args, **kwargs)
        raise SlurmIdleError("interrupted after the steps")

    agent.run_actions = then_interrupted  # type: ignore[method-assign]
    result = run(tmp_path, agent, "reclaim", "gpu1")
    assert isinstance(result.exception, SlurmIdleError)
    assert [ln.split()[1:4] for ln in result.stdout.splitlines()][:1] == [
        ["lent", "->", "reclaiming"]]


def test_no_job_no_grace_line_and_json_stays_json(tmp_path: Path) -> None:
    """Without lent jobs nothing is waited for; --json prints only the document."""
    agent, _ = adopted(tmp_path)
    admin.force(agent, "gpu1", ActionKind.LEND)
    result = run(tmp_path, agent, "reclaim", "gpu1", "--json")
    assert result.exit_code == 0 and result.stderr == ""
    assert result.stdout.lstrip().startswith("{")


def test_the_library_hands_each_step_over_as_it_ends(tmp_path: Path) -> None:
    """admin.force's on_step sees every step the result holds, in order."""
    agent = lent_with_a_job(tmp_path)
    seen: list[StepResult] = []
    lines: list[str] = []
    result = admin.force(agent, "gpu1", ActionKind.RECLAIM, on_step=seen.append,
                         notify=lines.append)
    assert seen == result.steps and seen
    assert len(lines) == 1 and "job(s) 77" in lines[0]
