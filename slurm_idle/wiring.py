"""Build the real Agent from a Config: the one place that picks adapters.

Kept apart from the CLI so that scripts (demo, benchmarks) and tests build agents the same way.
"""

from __future__ import annotations

from functools import cache
from typing import Any

from slurm_idle.agent import Agent, TickResult
from slurm_idle.config import Config


def make_metrics_source(config: Config) -> Any:
    """Prometheus (one vector query per signal per tick) or direct /metrics scrapes."""
    from slurm_idle import metrics

    return metrics.make_source(config)


def build_agent(config: Config, with_textfile: bool = True) -> Agent:
    """An Agent on the real Slurm backend, engines, metrics and planner named in `config`."""
    from slurm_idle import policy
    from slurm_idle.engine import make_engine
    from slurm_idle.slurm import make_backend

    @cache
    def engine_for(model: str) -> Any:
        return make_engine(config.engine_for(model), model)

    on_tick = None
    if with_textfile and config.paths.textfile:
        on_tick = _textfile_writer(config)
    return Agent(
        config=config,
        slurm=make_backend(config),
        metrics=make_metrics_source(config),
        engine_for=engine_for,
        planner=policy.plan,
        assessor=policy.assess,
        on_tick=on_tick,
    )


def _textfile_writer(config: Config) -> Any:
    from slurm_idle.agent import phase_counts
    from slurm_idle.agent_metrics import write_textfile

    def write(result: TickResult) -> None:
        assert config.paths.textfile is not None
        write_textfile(
            config.paths.textfile,
            phases=phase_counts(result) if result.observation is not None else None,
            needed={p.model: p.needed_replicas for p in result.plans},
            serving={p.model: p.serving_replicas for p in result.plans},
            tick_duration_s=result.duration_s,
            tick_ts=result.started,
            transitions=[
                (s.from_phase.value, s.to_phase.value) for s in result.steps if s.outcome == "ok"
            ],
            tick_error=result.errors > 0,
            floors={m.name: m.min_serving_replicas for m in config.models},
        )

    return write
