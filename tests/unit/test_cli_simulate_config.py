"""`simulate` follows the global config contract (--config, $SLURM_IDLE_CONFIG, the system
path) but needs no config at all when --fleet or --synthetic's defaults suffice."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

TWO_MODELS = """
engine: {kind: command, start_command: "true", stop_command: "true"}
models:
  - {name: a, nodes: "a[1-3]", tokens_per_s_per_replica: 2500}
  - {name: b, nodes: "b[1-2]", tokens_per_s_per_replica: 2500}
"""


def simulate(*args: str, env_config: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "SLURM_IDLE_CONFIG"}
    if env_config is not None:
        env["SLURM_IDLE_CONFIG"] = env_config
    return subprocess.run([sys.executable, "-m", "slurm_idle.cli", *args], env=env,
                          capture_output=True, text=True, timeout=120, check=False)


def test_the_config_in_slurm_idle_config_gives_the_pool(tmp_path: Path) -> None:
    """With $SLURM_IDLE_CONFIG naming a config, `simulate --synthetic` simulates its pool."""
    cfg = tmp_path / "c.yaml"
    cfg.write_text(TWO_MODELS)
    done = simulate("simulate", "--synthetic", "--days", "1", env_config=str(cfg))
    assert done.returncode == 0, done.stderr
    assert "2 model(s)" in done.stdout


def test_the_global_config_gives_the_pool_even_after_the_command(tmp_path: Path) -> None:
    """`slurm-idle --config F simulate` and `simulate --config F` both use F."""
    cfg = tmp_path / "c.yaml"
    cfg.write_text(TWO_MODELS)
    for args in (("--config", str(cfg), "simulate"), ("simulate", "--config", str(cfg))):
        done = simulate(*args, "--synthetic", "--days", "1")
        assert done.returncode == 0, done.stderr
        assert "2 model(s)" in done.stdout


def test_no_config_file_is_fine_with_synthetic_defaults(tmp_path: Path) -> None:
    """$SLURM_IDLE_CONFIG naming no file: --synthetic runs its default fleet, no error."""
    done = simulate("simulate", "--synthetic", "--days", "1", env_config=str(tmp_path / "none.yaml"))
    assert done.returncode == 0, done.stderr
    assert "1 model(s)" in done.stdout


def test_an_explicit_missing_config_is_an_error(tmp_path: Path) -> None:
    """--config naming no file is exit 2 saying so, not a silent fallback."""
    done = simulate("--config", str(tmp_path / "none.yaml"), "simulate", "--synthetic")
    assert done.returncode == 2 and "not found" in done.stderr


def test_help_states_the_config_order() -> None:
    """`simulate --help` names the order in which a config is looked for."""
    done = simulate("simulate", "--help")
    assert "$SLURM_IDLE_CONFIG" in done.stdout and "/etc/slurm-idle/slurm-idle.yaml" in done.stdout
