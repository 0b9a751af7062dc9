"""A pipeline's fan-out is bounded (`pipeline.max_steps`) and refused before it is expanded:
a matrix of ten 100-value lists is 10^20 jobs in a dozen lines."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from slurm_idle.errors import ConfigError
from slurm_idle.pipeline import parse_pipeline


def _pipeline(keys: int, values: int) -> dict[str, object]:
    matrix = {f"k{i}": list(range(values)) for i in range(keys)}
    return {"name": "p", "steps": [{"name": "s", "matrix": matrix,
                                    "job": {"image": "busybox", "command": ["true"]}}]}


def test_more_jobs_than_max_steps_is_refused_naming_the_key() -> None:
    """11 x 10 jobs against a bound of 100: a ConfigError that names pipeline.max_steps."""
    with pytest.raises(ConfigError, match=r"110 jobs, more than pipeline.max_steps \(100\)"):
        parse_pipeline(_pipeline(1, 110), max_steps=100)
    assert len(parse_pipeline(_pipeline(2, 10), max_steps=100).steps) == 100


def test_the_config_key_sets_the_bound(tmp_path: Path) -> None:
    """`pipeline.max_steps: 5` in the config refuses a 6-job pipeline at `pipeline run`."""
    from click.testing import CliRunner

    from slurm_idle.cli import main

    cfg = tmp_path / "c.yaml"
    cfg.write_text(textwrap.dedent("""\
        engine: {kind: command, start_command: "true", stop_command: "true"}
        models: [{name: a, nodes: "a1"}]
        pipeline: {max_steps: 5}
        """))
    spec = tmp_path / "p.yaml"
    spec.write_text("name: p\nsteps:\n  - {name: s, matrix: {x: [1, 2, 3, 4, 5, 6]}, "
                    "job: {image: busybox, command: [\"true\"]}}\n")
    done = CliRunner().invoke(main, ["--config", str(cfg), "pipeline", "run", str(spec),
                                    "--dry-run"])
    assert isinstance(done.exception, ConfigError), done.output  # exit 2
    assert "6 jobs, more than pipeline.max_steps (5)" in str(done.exception)


def test_a_huge_matrix_exits_2_without_expanding(tmp_path: Path) -> None:
    """100^10 jobs, `pipeline run --dry-run` under a 400 MB address-space limit: exit 2."""
    spec = tmp_path / "p.yaml"
    rows = "".join(f"      k{i}: [{', '.join(str(v) for v in range(100))}]\n" for i in range(10))
    spec.write_text("name: p\nsteps:\n  - name: s\n    job: {image: busybox, command: [\"true\"]}\n"
                    f"    matrix:\n{rows}")
    limit = ("import resource, runpy, sys; "
             "resource.setrlimit(resource.RLIMIT_AS, (400 << 20, 400 << 20)); "
             "sys.argv = ['slurm-idle', 'pipeline', 'run', sys.argv[1], '--dry-run']; "
             "runpy.run_module('slurm_idle.cli', run_name='__main__')")
    env = {k: v for k, v in os.environ.items() if k != "SLURM_IDLE_CONFIG"}
    done = subprocess.run([sys.executable, "-c", limit, str(spec)], capture_output=True,
                          text=True, timeout=60, check=False, env=env)
    assert done.returncode == 2, done.stderr
    assert "100000000000000000000 jobs" in done.stderr
