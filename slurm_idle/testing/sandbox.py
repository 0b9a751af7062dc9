"""A real local test cluster: Slurm (+ slurmdbd/MariaDB), dockerd, Prometheus, vLLM emulators.

Everything runs on 127.0.0.1 under one root directory with its own ports, sockets and pid
files, so several sandboxes (and other engineers' daemons) coexist on one machine. Daemons
run in the foreground as our own detached children and are stopped strictly by pid; `down`
then sweeps processes carrying this sandbox's marker (slurmstepd, containerd) or its unique
cluster name (job processes), and unmounts dockerd's netns. Config texts live in
sandboxconf.py, pid handling in procs.py, the emulator in emulator.py.

`up` also builds the demo's images into the sandbox's dockerd (testing/images.py), because its
config never pulls (`job_policy.pull: never`). dockerd runs with its HTTP(S) proxy on a loopback
port of the block and, in a mount namespace of its own, an /etc/resolv.conf naming a closed
loopback resolver (sandboxconf.dockerd_proxy_env, with_private_resolver), so not even a pull
made on purpose sends a DNS query or a registry request off the machine.

Nodes: gpu1-gpu4 (4 GPUs, one replica each, the default config) and gpu5-gpu7 (8 GPUs: two
replicas on gpu5, one over gpu[6-7]; their own config, `topology_config_path`; issue 13).
GPUs: device files of each node's own, held by processes (fakegpu.py: the emulators, a job's
Prolog holder, `gpu_hold`), reported by one GPU exporter with DCGM's names (gpu_exporter.py).

CLI (sandbox_cli.py): python -m slurm_idle.testing.sandbox [--root DIR] [--base-port N]
     up | down | status [--json] | env | load RPS [--model M] | engine-start NODE [--index N]
     | engine-stop NODE [--index N] | gpu-hold NODE [GPU] [--mib N] | gpu-release NODE

Over 400 lines for now (~1000): one class drives every daemon's start, readiness and teardown in
order, and CI-flake fixes land here often; splitting it (per daemon) waits until those settle.
"""

from __future__ import annotations

import http.client
import json
import os
import random
import secrets
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import slurm_idle
from slurm_idle.testing import fakegpu, ports, procs, sandboxconf
from slurm_idle.testing.engine_model import Capacity
from slurm_idle.testing.procs import PidFile
from slurm_idle.testing.sandboxconf import ALL_NODES, NODES, REPLICAS, Layout

DEFAULT_ROOT = Path("/tmp/slurm-idle-sandbox")
DEFAULT_BASE_PORT = 17100
_AUTO = object()
DB_USER = "slurm"


def detect_slurm_version() -> str:
    out = subprocess.run(["slurmd", "-V"], capture_output=True, text=True, timeout=30, check=False)
    return sandboxconf.parse_slurm_version(out.stdout + out.stderr)


def default_job_submit_lua() -> Path | None:
    """The product's job_submit.lua beside the package (etc/job_submit.lua), if present."""
    p = Path(slurm_idle.__file__).resolve().parents[1] / "etc" / "job_submit.lua"
    return p if p.is_file() else None


def default_alert_rules() -> Path | None:
    """The product's Prometheus alerts beside the package (etc/prometheus/...), if present."""
    p = Path(slurm_idle.__file__).resolve().parents[1] / "etc" / "prometheus" / "slurm-idle-alerts.yml"
    return p if p.is_file() else None


def pick_base_port(span: int = sandboxconf.PORT_SPAN, rng: random.Random | None = None) -> int:
    """The base of a block of `span` ports leased to this process (ports.py: no other sandbox
    can be handed any of them until the lease is let go, at the sandbox's `down()` or when
    this process ends) and bindable now."""
    lease = ports.lease_free_block(span, rng)
    ports.hold(lease)
    return lease.base


def _unix_http(sock: Path, path: str, timeout: float = 2.0) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("localhost", timeout=timeout)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    s.connect(str(sock))
    conn.sock = s
    try:
        conn.request("GET", path)
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


#: How long `up` waits for a real vLLM's /health (36-45 s on 2 cores, up to ~160 s when busy).
REAL_VLLM_UP_S = 600.0
#: A real vLLM's `--shutdown-timeout` in the sandbox: the config's drain window (seconds).
REAL_VLLM_SHUTDOWN_S = 10


def _http_get(url: str, timeout: float = 2.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _tail(path: Path, n: int = 5) -> str:
    try:
        return " | ".join(path.read_text(errors="replace").strip().splitlines()[-n:])
    except OSError:
        return "(no log)"


class Sandbox:
    """One sandbox under `root`; `up()` is idempotent, `down()` leaves nothing running."""

    def __init__(self, root: Path | str, base_port: int | None = None, *,
                 python: str | None = None, job_submit_lua: Any = _AUTO,
                 engine_start_delay_s: float | None = None,
                 real_vllm_nodes: Sequence[str] | None = None) -> None:
        self.root = Path(root).resolve()
        self.nodes = list(NODES)  # the default model's (the demo story's)
        self.all_nodes = list(ALL_NODES)  # every Slurm node, the 8-GPU ones too (issue 13)
        self.replicas = REPLICAS  # every emulated replica: two on gpu5, one over gpu[6-7]
        self._state_file = self.root / "sandbox.json"
        saved = self._read_state()
        if base_port is None:
            base_port = saved.get("base_port") or pick_base_port()
        self.python = python or saved.get("python") or sys.executable
        # Simulated cold start of an emulator (seconds before it listens); kept in sandbox.json
        # so `engine-start` run later by the product's start_command uses the same value.
        self.engine_start_delay_s = float(engine_start_delay_s if engine_start_delay_s is not None
                                          else saved.get("engine_start_delay_s", 0.0))
        self.slurm_version: str = saved.get("slurm_version") or detect_slurm_version()
        # Nodes whose engine is a real vLLM (`up --real-vllm`); kept in sandbox.json so the
        # product's start command (`engine-start`, a new process) starts the same engine.
        chosen = tuple(real_vllm_nodes if real_vllm_nodes is not None
                       else saved.get("real_vllm", ()))
        wrong = [n for n in chosen if n not in NODES]
        if wrong:
            raise ValueError(f"--real-vllm: {', '.join(wrong)} is not a node of the default "
                             f"model; choose among {', '.join(NODES)}")
        self.real_vllm_nodes: tuple[str, ...] = chosen
        lua = default_job_submit_lua() if job_submit_lua is _AUTO else job_submit_lua
        self.capacity = Capacity()
        self.layout = Layout(root=self.root, base_port=int(base_port),
                             slurm_version=self.slurm_version,
                             hostname=socket.gethostname().split(".")[0], python=self.python,
                             job_submit_lua=Path(lua) if lua else None,
                             alert_rules=default_alert_rules(),
                             pythonpath=str(Path(slurm_idle.__file__).resolve().parents[1]),
                             real_vllm=self.real_vllm_nodes)
        self.base_port = self.layout.base_port
        self.slurm_conf = self.layout.slurm_conf
        self.config_path = self.layout.config_path
        self.topology_config_path = self.layout.topology_config_path  # gpu5, gpu[6-7] (issue 13)
        self.prometheus_url = self.layout.prometheus_url
        self.docker_host = f"unix://{self.layout.docker_socket}"

    # --- small public helpers -----------------------------------------------------------

    def emulator_url(self, replica: str) -> str:
        """A replica's emulator URL, by replica name (a default-model node's name)."""
        return self.layout.emulator_url(replica)

    @property
    def tokens_per_s_per_replica(self) -> float:
        """The planner's capacity figure matching the emulator (generation + 0.1 * prompt)."""
        return self.capacity.weighted_tokens_per_s(0.1)

    def env(self) -> dict[str, str]:
        """SLURM_CONF, PATH, SLURM_IDLE_CONFIG, DOCKER_HOST pointing at this sandbox, and
        SLURM_IDLE_STATE_DIR in it: a researcher's records of this sandbox stay out of the
        ones of a real cluster in the same home directory (and go with `down`)."""
        path = [p for p in os.environ.get("PATH", "").split(":") if p]
        pybin = str(Path(self.python).parent)  # where `slurm-idle` of this python lives
        parts = [pybin] + [p for p in path if p != pybin]
        parts += [p for p in ("/usr/sbin", "/usr/bin", "/sbin", "/bin") if p not in parts]
        return {
            "SLURM_CONF": str(self.slurm_conf),
            "PATH": ":".join(parts),
            "SLURM_IDLE_CONFIG": str(self.config_path),
            "DOCKER_HOST": self.docker_host,
            "SLURM_IDLE_STATE_DIR": str(self.root / "state"),
        }

    def run(self, argv: list[str], **kw: Any) -> subprocess.CompletedProcess[str]:
        """Run a command against this sandbox (SLURM_CONF etc. set); output captured as text."""
        env = {**os.environ, **self.env(), **kw.pop("env", {})}
        kw.setdefault("capture_output", True)
        kw.setdefault("text", True)
        kw.setdefault("timeout", 60)
        check = kw.pop("check", False)
        return subprocess.run(argv, env=env, check=check, **kw)

    def load(self, rps: float, model: str = sandboxconf.MODEL_NAME) -> None:
        """Set `model`'s total simulated request rate, spread over its awake replicas."""
        self.root.mkdir(parents=True, exist_ok=True)
        path = self.layout.model_load_file(model)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"rps": float(rps)}))
        tmp.replace(path)

    def load_jobs(self, rps: float) -> None:
        """Set the simulated request rate of the jobs-mode model's replicas (their own file)."""
        tmp = self.layout.jobs_load_file.with_suffix(".tmp")
        tmp.write_text(json.dumps({"rps": float(rps)}))
        tmp.replace(self.layout.jobs_load_file)

    def jobs_node(self, on: bool) -> None:
        """Open (RESUME) or close (DRAIN, admin-like Reason) gpu8, the jobs-mode node. Closed by
        default so that no other story's idle jobs land on it."""
        node = sandboxconf.JOBS_NODE
        argv = (["scontrol", "update", f"nodename={node}", "state=resume"] if on else
                ["scontrol", "update", f"nodename={node}", "state=drain",
                 f"reason={sandboxconf.JOBS_OFF_REASON}"])
        r = self.run(argv, timeout=15)
        if r.returncode != 0 and "invalid node state" not in r.stderr.lower():
            raise RuntimeError(f"sandbox: {' '.join(argv)} failed: {r.stderr.strip()}")

    # --- client traffic through the router (issue 14) -------------------------------------

    @property
    def router_url(self) -> str:
        return self.layout.router_url

    def traffic(self, rps: float, max_tokens: int | None = None,
                model: str = sandboxconf.MODEL_NAME) -> None:
        """Real completions for `model` through HAProxy at `rps` (0 stops them; the router
        spreads them over the model's replicas), counted client-side from now on: the
        previous generator is stopped and its results cleared."""
        self.traffic_stop()
        self.layout.traffic_file.unlink(missing_ok=True)
        self.layout.traffic_file.touch()
        if rps <= 0:
            return
        from slurm_idle.testing import loadgen

        self._spawn("loadgen", [
            self.python, "-m", "slurm_idle.testing.loadgen",
            "--url", self.layout.model_router_url(model),
            "--rps", str(rps), "--out", str(self.layout.traffic_file), "--model", model,
            "--max-tokens", str(max_tokens or loadgen.MAX_TOKENS)])

    def traffic_stop(self) -> None:
        """Stop sending at once: requests in flight are cancelled and counted as `cancelled`,
        not as failures (the results are kept). The generator exits within a second of
        SIGTERM; the SIGKILL after 5 s is for one that does not."""
        pf = self._pidfile("loadgen")
        pid = pf.read()
        if pid is not None:
            procs.terminate([pid], timeout_s=5)
        pf.clear()

    def traffic_stats(self, since: float | None = None, until: float | None = None) -> dict[str, Any]:
        """Client-side outcome since the last `traffic()` (or of a window of start times)."""
        from slurm_idle.testing import loadgen

        return loadgen.summarize(loadgen.read_results(self.layout.traffic_file), since, until)

    def router_ready_all(self) -> None:
        """Every emulator's server back in HAProxy's load balancing (a clean start for tests)."""
        from slurm_idle.errors import RouterError
        from slurm_idle.router.haproxy import unix_send

        send = unix_send(str(self.layout.haproxy_socket), 2.0)
        for r in REPLICAS:
            try:
                send(f"set server {r.backend}/{r.name} state ready")
            except RouterError:
                return  # HAProxy not running: nothing to reset

    def router_states(self) -> dict[str, str]:
        """Each replica's server status in HAProxy (UP, DOWN, DRAIN, MAINT) by replica name (a
        default-model node's name), {} when unreachable."""
        try:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.settimeout(2)
            s.connect(str(self.layout.haproxy_socket))
            s.sendall(b"show stat\n")
            data = b""
            while chunk := s.recv(65536):
                data += chunk
            s.close()
        except OSError:
            return {}
        out = {}
        servers = {(r.backend, r.name) for r in REPLICAS}
        for line in data.decode(errors="replace").splitlines():
            cols = line.split(",")
            if len(cols) > 17 and (cols[0], cols[1]) in servers:
                out[cols[1]] = cols[17]
        return out

    # --- state ---------------------------------------------------------------------------

    def _read_state(self) -> dict[str, Any]:
        try:
            data = json.loads(self._state_file.read_text())
            return data if isinstance(data, dict) else {}
        except (OSError, ValueError):
            return {}

    def _pidfile(self, name: str) -> PidFile:
        return PidFile(self.layout.run / f"{name}.pidj")

    def _daemon_env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
        env.update(self.env())
        env[procs.MARKER] = str(self.root)
        assert self.layout.pythonpath
        env["PYTHONPATH"] = ":".join([self.layout.pythonpath]
                                     + [p for p in env.get("PYTHONPATH", "").split(":") if p])
        return env

    def _spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> bool:
        """Start `name` unless it already runs (with `env` over the daemons' environment); True
        when it was started now."""
        pf = self._pidfile(name)
        if pf.read() is not None:
            return False
        procs.spawn(argv, self.layout.log / f"{name}.out", {**self._daemon_env(), **(env or {})},
                    pf, cwd=self.root)
        return True

    def _check_alive(self, name: str) -> None:
        if self._pidfile(name).read() is None:
            raise RuntimeError(f"sandbox: {name} exited; see {self.layout.log}/{name}.out: "
                               f"{_tail(self.layout.log / f'{name}.out')}")

    def _wait(self, name: str, check: Any, timeout_s: float = 60.0) -> float:
        def probe() -> bool:
            self._check_alive(name)
            return bool(check())
        try:
            return procs.wait_for(probe, timeout_s, name)
        except TimeoutError as e:
            raise TimeoutError(f"{e}; see {self.layout.log}/{name}.out: "
                               f"{_tail(self.layout.log / f'{name}.out')}") from None

    # --- files ---------------------------------------------------------------------------

    def _write_files(self) -> None:
        lay = self.layout
        for d in (lay.etc, lay.run, lay.log, lay.dev, lay.emulator_state_dir,
                  self.root / "state" / "slurmctld", self.root / "munge", self.root / "prometheus",
                  self.root / "docker"):
            d.mkdir(parents=True, exist_ok=True)
        for n in (*ALL_NODES, sandboxconf.JOBS_NODE):
            (self.root / "state" / f"slurmd-{n}").mkdir(parents=True, exist_ok=True)
        self._state_file.write_text(json.dumps({
            "base_port": lay.base_port, "python": self.python, "slurm_version": self.slurm_version,
            "engine_start_delay_s": self.engine_start_delay_s,
            "real_vllm": list(self.real_vllm_nodes)}))
        for node in sandboxconf.GPU_NODES:  # a character device per GPU, per node (fakegpu.py)
            fakegpu.held_dir(lay.node_dev(node)).mkdir(parents=True, exist_ok=True)
            for i in range(sandboxconf.node_gpus(node)):
                dev = fakegpu.device_path(lay.node_dev(node), i)
                if not dev.exists():
                    os.mknod(dev, 0o666 | 0o020000, os.makedev(195, i))
        (lay.etc / "slurm.conf").write_text(sandboxconf.slurm_conf(lay))
        (lay.etc / "gres.conf").write_text(sandboxconf.gres_conf(lay))
        lay.prolog.write_text(sandboxconf.prolog_sh(lay))
        lay.epilog.write_text(sandboxconf.epilog_sh(lay))
        lay.prolog.chmod(0o755)
        lay.epilog.chmod(0o755)
        lay.bin.mkdir(exist_ok=True)
        (lay.bin / "nvidia-smi").write_text(sandboxconf.nvidia_smi_sh(lay))
        (lay.bin / "nvidia-smi").chmod(0o755)
        lay.haproxy_cfg.write_text(sandboxconf.haproxy_cfg(lay))
        if lay.needs_cgroup_conf:
            (lay.etc / "cgroup.conf").write_text(sandboxconf.cgroup_conf(lay))
        if lay.job_submit_lua is not None:
            shutil.copyfile(lay.job_submit_lua, lay.etc / "job_submit.lua")
        pw_file = self.root / "munge" / "db.pass"
        if not pw_file.exists():
            pw_file.write_text(secrets.token_hex(12))
        dbd = lay.etc / "slurmdbd.conf"
        dbd.write_text(sandboxconf.slurmdbd_conf(lay, DB_USER, pw_file.read_text().strip()))
        dbd.chmod(0o600)
        key = self.root / "munge" / "munge.key"
        if not key.exists():
            key.write_bytes(secrets.token_bytes(1024))
            key.chmod(0o400)
        (self.root / "prometheus.yml").write_text(sandboxconf.prometheus_yml(lay))
        (self.root / "docker" / "daemon.json").write_text("{}\n")
        (self.root / "docker" / "resolv.conf").write_text(sandboxconf.dockerd_resolv_conf())
        lay.config_path.write_text(sandboxconf.slurm_idle_config(lay, self.tokens_per_s_per_replica))
        lay.topology_config_path.write_text(
            sandboxconf.topology_config(lay, self.tokens_per_s_per_replica))
        for model in dict.fromkeys(r.model for r in REPLICAS):
            if not lay.model_load_file(model).exists():
                self.load(0.0, model)
        cap = self.capacity
        lay.jobs_config_path.write_text(sandboxconf.slurm_idle_jobs_config(
            lay, self.tokens_per_s_per_replica,
            {"max_num_seqs": cap.max_num_seqs, "tokens_per_s": cap.tokens_per_s,
             "seq_tokens_per_s": cap.seq_tokens_per_s}))
        if not lay.jobs_targets.exists():
            lay.jobs_targets.write_text("[]\n")
        (self.root / "emulators-jobs").mkdir(exist_ok=True)
        if not lay.jobs_load_file.exists():
            self.load_jobs(0.0)

    # --- lifecycle -----------------------------------------------------------------------

    def up(self, timeout_s: float = 240.0,
           progress: Callable[[str], None] | None = None) -> dict[str, float]:
        """Start whatever is not running and wait until all is ready.

        Each part gets up to `timeout_s` (an upper bound: it returns as soon as all is ready,
        ~10-15 s on an idle machine). 240 s, not 90: CI runs two lanes side by side on 2 cores,
        each starting nine slurmd at once, and a 90 s wait for every node to register ran out
        there once (24.11 lane, all its sandbox tests in error).

        Returns when each part was ready, in seconds since up() began (cumulative), and total;
        `progress` (the CLI's stderr) gets one line as each part is ready, so a start that
        takes a minute on a loaded machine is not a silent one.
        A start that fails stops what this call started (everything, when nothing ran
        before), so no daemon outlives the error, which names the part and its log's last lines.
        """
        before = self._recorded()
        try:
            return self._up(timeout_s, progress)
        except BaseException:
            self._undo_up(before)
            raise

    def _prepare_real_vllm(self, ready: Callable[[str], None]) -> None:
        """The real vLLM's venv (made on first use by scripts/lib/vllm-env.sh: minutes, its
        progress on stderr) and the tiny model it serves (made here, no download)."""
        from slurm_idle.testing import real_vllm

        try:
            python = real_vllm.ensure_venv()
            real_vllm.make_model_dir(python, self.real_vllm_model)
        except real_vllm.RealVllmUnavailable as exc:
            raise RuntimeError(f"sandbox: --real-vllm: {exc}") from None
        ready("real vLLM venv and model")

    def _undo_up(self, before: dict[str, int]) -> None:
        if not before:
            self.down()
            return
        started = [pid for name, pid in self._recorded().items() if before.get(name) != pid]
        procs.terminate(started, timeout_s=15)
        for name, pid in self._recorded().items():
            if before.get(name) != pid:
                self._pidfile(name).clear()

    def _up(self, timeout_s: float,
            progress: Callable[[str], None] | None = None) -> dict[str, float]:
        t0 = time.monotonic()
        timings: dict[str, float] = {}

        def ready(part: str) -> None:
            timings[part] = time.monotonic() - t0
            if progress is not None:
                progress(f"[{timings[part]:4.0f}s] {part} ready")

        lay = self.layout
        self._check_ports()  # first: a port in use is the more useful message of the two
        self._write_files()
        self._keep_lease()
        root = self.root
        self._spawn("munged", ["munged", "-F", "--force", f"--key-file={root}/munge/munge.key",
                               f"--socket={lay.munge_socket}", f"--pid-file={lay.run}/munged.pid",
                               f"--log-file={lay.log}/munged.log",
                               f"--seed-file={root}/munge/munged.seed"])
        self._spawn("dockerd", sandboxconf.with_private_resolver(root / "docker" / "resolv.conf", [
            "dockerd", f"--config-file={root}/docker/daemon.json", "--iptables=false",
            "--ip-masq=false", "--bridge=none", "--storage-driver=vfs",
            f"--data-root={root}/docker/data", f"--exec-root={root}/docker/exec",
            f"--pidfile={lay.run}/dockerd.pid", f"--host=unix://{lay.docker_socket}"]),
            env=sandboxconf.dockerd_proxy_env(lay))
        self._spawn("prometheus", self._prometheus_argv())
        self._spawn("gpu-exporter", self._gpu_exporter_argv())
        self._spawn("textfile-exporter", self._textfile_exporter_argv())
        if self.real_vllm_nodes:
            self._prepare_real_vllm(ready)
        for node in ALL_NODES:
            self.engine_start(node, start_delay_s=0)
        # -db: foreground, so it is our child and stopped by pid like the rest.
        self._spawn("haproxy", ["haproxy", "-db", "-f", str(lay.haproxy_cfg)])
        self._start_mariadb(ready)
        self._wait("munged", lambda: lay.munge_socket.exists())
        ready("munged")
        self._spawn("slurmdbd", ["slurmdbd", "-D"])
        self._wait("slurmdbd", lambda: procs.port_open(lay.dbd_port), timeout_s)
        ready("slurmdbd")
        # -c: a cold start forgets old jobs and node states, so nodes come up plain IDLE.
        self._spawn("slurmctld", ["slurmctld", "-D", "-c", "-f", str(self.slurm_conf)])
        self._wait("slurmctld", lambda: self.run(["scontrol", "ping"], timeout=10).stdout.count("UP") > 0, timeout_s)
        ready("slurmctld")
        for node in (*ALL_NODES, sandboxconf.JOBS_NODE):
            self._spawn(f"slurmd-{node}", ["slurmd", "-D", "-N", node, "-f", str(self.slurm_conf)])
        self._wait(f"slurmd-{ALL_NODES[-1]}", lambda: self._nodes_ready(), timeout_s)
        self.jobs_node(False)  # placement: jobs' node, closed until a test opens it
        ready("slurmd")
        self._wait("slurmdbd", lambda: self.run(["sacct", "-n", "-X"], timeout=10).returncode == 0, timeout_s)
        ready("sacct")
        self._wait("prometheus", lambda: _http_get(f"{self.prometheus_url}/-/ready")[0] == 200, timeout_s)
        ready("prometheus")
        for r in REPLICAS:
            real = r.node in self.real_vllm_nodes
            self._wait(f"emulator-{r.name}",
                       lambda n=r.name: _http_get(f"{self.emulator_url(n)}/health")[0] == 200,
                       max(timeout_s, REAL_VLLM_UP_S) if real else timeout_s)
        ready("engines (real vLLM on " + ",".join(self.real_vllm_nodes) + ")"
              if self.real_vllm_nodes else "emulators")
        self._wait("prometheus", lambda: self._targets()["up"] == len(REPLICAS), timeout_s)
        self._wait("gpu-exporter", lambda: self._targets("dcgm")["up"] == len(sandboxconf.GPU_NODES),
                   timeout_s)
        self._wait("textfile-exporter",
                   lambda: self._targets("slurm-idle")["up"] == len(lay.textfiles), timeout_s)
        ready("scraped")
        self._wait("haproxy", lambda: all(self.router_states().get(r.name) == "UP"
                                          for r in REPLICAS), timeout_s)
        ready("haproxy")
        self._wait("dockerd", lambda: _unix_http(lay.docker_socket, "/_ping")[0] == 200, timeout_s)
        ready("dockerd")
        self._build_images()
        ready("images")
        timings["total"] = time.monotonic() - t0
        return {k: round(v, 2) for k, v in timings.items()}

    def _build_images(self) -> None:
        """The demo's images in the sandbox's dockerd (kept when there): job_policy.pull is
        never here, so `slurm-idle submit etc/examples/demo-job.yaml` runs right after `up`."""
        import docker
        import docker.errors

        from slurm_idle.testing.images import build_demo_image

        client = docker.DockerClient(base_url=self.docker_host, timeout=120)
        try:
            build_demo_image(client)
        except (docker.errors.DockerException, RuntimeError, OSError,
                subprocess.CalledProcessError) as exc:
            raise RuntimeError(f"sandbox: building the demo images failed: "
                               f"{' '.join(str(exc).split())}") from exc
        finally:
            client.close()

    def _gpu_exporter_argv(self) -> list[str]:
        lay = self.layout
        return [self.python, "-m", "slurm_idle.testing.gpu_exporter", "--dev", str(lay.dev),
                *(f"--node={n}={lay.gpu_exporter_port(n)}" for n in sandboxconf.GPU_NODES)]

    def _textfile_exporter_argv(self) -> list[str]:
        lay = self.layout
        return [self.python, "-m", "slurm_idle.testing.textfile_exporter",
                f"--port={lay.textfile_exporter_port}",
                *(f"--file={name}={path}" for name, path in lay.textfiles.items())]

    def _prometheus_argv(self) -> list[str]:
        root, lay = self.root, self.layout
        return ["prometheus", f"--config.file={root}/prometheus.yml",
                f"--storage.tsdb.path={root}/prometheus", "--storage.tsdb.retention.time=1d",
                f"--web.listen-address=127.0.0.1:{lay.prometheus_port}", "--web.enable-lifecycle"]

    def stop_prometheus(self) -> None:
        """A Prometheus outage (tests of the scrape fallback): stop it by pid."""
        pid = self._pidfile("prometheus").read()
        if pid is not None:
            procs.terminate([pid], timeout_s=15)
        self._pidfile("prometheus").clear()

    def start_prometheus(self, timeout_s: float = 60.0) -> None:
        """Start Prometheus again (same TSDB) and wait until it scrapes every emulator that runs."""
        self._spawn("prometheus", self._prometheus_argv())
        self._wait("prometheus", lambda: _http_get(f"{self.prometheus_url}/-/ready")[0] == 200, timeout_s)

    def restart_slurmctld(self, timeout_s: float = 90.0) -> float:
        """Stop slurmctld and start it again from its saved state, as `systemctl restart
        slurmctld` does on a real cluster (no -c: jobs, node reasons and comments recovered).

        Returns the seconds until every node answers again.
        """
        t0 = time.monotonic()
        pid = self._pidfile("slurmctld").read()
        if pid is not None:
            procs.terminate([pid], timeout_s=15)
        self._pidfile("slurmctld").clear()
        self._spawn("slurmctld", ["slurmctld", "-D", "-f", str(self.slurm_conf)])
        self._wait("slurmctld", lambda: self.run(["scontrol", "ping"], timeout=10).stdout.count("UP") > 0, timeout_s)
        self._wait("slurmctld", lambda: len(self.slurm_nodes()) == len(ALL_NODES) + 1 and not any(
            "*" in n["state"] or n["state"].startswith(("down", "unk")) for n in self.slurm_nodes()),
            timeout_s)
        return round(time.monotonic() - t0, 2)

    def _ports(self) -> dict[str, list[int]]:
        lay = self.layout
        ports = {"slurmctld": [lay.ctld_port], "slurmdbd": [lay.dbd_port],
                 "mariadb": [lay.mysql_port], "prometheus": [lay.prometheus_port],
                 "haproxy": [lay.haproxy_port, lay.base_port + sandboxconf.HAPROXY_TOPOLOGY]}
        for n in ALL_NODES:
            ports[f"slurmd-{n}"] = [lay.slurmd_port(n)]
        for r in REPLICAS:
            ports[f"emulator-{r.name}"] = [lay.emulator_port(r.name)]
        ports[f"slurmd-{sandboxconf.JOBS_NODE}"] = [lay.jobs_slurmd_port]
        ports["gpu-exporter"] = [lay.gpu_exporter_port(n) for n in sandboxconf.GPU_NODES]
        ports["textfile-exporter"] = [lay.textfile_exporter_port]
        return ports

    def _keep_lease(self) -> None:
        """Hand the lease on this sandbox's port block to its holder process, which keeps it
        until `down()`: taken by pick_base_port, or now for a saved or given base. A block
        another sandbox holds is refused, even when its ports look free (its emulators may be
        stopped for a lend)."""
        if self._pidfile("portlease").read() is not None:
            return
        span = sandboxconf.PORT_SPAN
        lease = ports.held(self.base_port) or ports.try_lease(self.base_port, span)
        if lease is None:
            raise RuntimeError(
                f"sandbox: ports {self.base_port}-{self.base_port + span - 1} are leased by "
                "another sandbox (`ss -xlp | grep slurm-idle-ports` shows which process); "
                f"choose another root or base port, or remove {self._state_file} to pick a block")
        procs.spawn([self.python, "-m", "slurm_idle.testing.ports", "hold", str(self.base_port)],
                    self.layout.log / "portlease.out", self._daemon_env(),
                    self._pidfile("portlease"), cwd=self.root, pass_fds=lease.fds())
        ports.release_held(self.base_port)
        lease.release()
        if not ports.leased_by_anyone(self.base_port, span):
            raise RuntimeError(f"sandbox: the port lease holder exited at once; see "
                               f"{self.layout.log}/portlease.out: "
                               f"{_tail(self.layout.log / 'portlease.out')}")

    def _check_ports(self) -> None:
        """Fail fast when a port of a part we are about to start is taken by someone else, or
        when a DNS server listens where dockerd's closed resolver must be (it would answer)."""
        if not procs.dns_port_closed(sandboxconf.CLOSED_RESOLVER):
            raise RuntimeError(f"a DNS server listens on {sandboxconf.CLOSED_RESOLVER}:53, the "
                               "sandbox's dockerd's closed resolver: stop it, or a missing "
                               "image's registry lookup could leave the machine")
        running = self._recorded()
        for name, numbers in self._ports().items():
            for port in numbers:
                if name not in running and not procs.port_free(port):
                    raise RuntimeError(
                        f"port {port} (for {name}) is already in use by another process; "
                        f"choose another base port (now {self.base_port}) or root")

    def _start_mariadb(self, ready: Callable[[str], None]) -> None:
        lay = self.layout
        datadir = self.root / "mysql"
        # Its temporary tables in a directory of this sandbox's own, not /tmp: three workers'
        # sandboxes bootstrap at the same moment (once, in the Debian 13 lane, a bootstrap
        # found its temporary tables gone from /tmp and aborted).
        tmpdir = self.root / "mysql-tmp"
        tmpdir.mkdir(parents=True, exist_ok=True)
        if self._pidfile("mariadb").read() is None and not (datadir / "mysql").is_dir():
            for attempt in (1, 2):  # a failed bootstrap leaves a partial datadir: start afresh
                shutil.rmtree(datadir, ignore_errors=True)
                r = subprocess.run(["mariadb-install-db", "--no-defaults", f"--datadir={datadir}",
                                    f"--tmpdir={tmpdir}", "--auth-root-authentication-method=socket",
                                    "--skip-test-db", "--user=root"], capture_output=True,
                                   text=True, timeout=120, check=False)
                if r.returncode == 0:
                    break
                if attempt == 2:
                    raise RuntimeError("sandbox: mariadb-install-db failed twice: "
                                       f"{r.stderr.strip()[-300:]}")
        self._spawn("mariadb", ["mariadbd", "--no-defaults", f"--datadir={datadir}",
                                f"--tmpdir={tmpdir}",
                                f"--socket={lay.mysql_socket}", f"--port={lay.mysql_port}",
                                "--bind-address=127.0.0.1", "--user=root", "--skip-name-resolve",
                                f"--pid-file={lay.run}/mariadb.pid",
                                f"--log-error={lay.log}/mariadb.log",
                                "--innodb-buffer-pool-size=64M", "--innodb-lock-wait-timeout=900"])
        self._wait("mariadb", lambda: lay.mysql_socket.exists() and self._sql("SELECT 1"))
        pw = (self.root / "munge" / "db.pass").read_text().strip()
        ok = self._sql(
            "CREATE DATABASE IF NOT EXISTS slurm_acct_db; "
            f"CREATE USER IF NOT EXISTS '{DB_USER}'@'127.0.0.1' IDENTIFIED BY '{pw}'; "
            f"GRANT ALL ON slurm_acct_db.* TO '{DB_USER}'@'127.0.0.1';")
        if not ok:
            raise RuntimeError("sandbox: could not create the slurm database user in MariaDB")
        ready("mariadb")

    def _sql(self, sql: str) -> bool:
        r = subprocess.run(["mariadb", "--no-defaults", f"--socket={self.layout.mysql_socket}",
                            "-u", "root", "-e", sql], capture_output=True, text=True, timeout=20,
                           check=False)
        return r.returncode == 0

    def _nodes_ready(self) -> bool:
        nodes = self.slurm_nodes()
        return len(nodes) == len(ALL_NODES) + 1 and all(n["state"] == "idle" for n in nodes)

    def slurm_nodes(self) -> list[dict[str, Any]]:
        """Each node once: name, base state (idle, mixed, drained...), GPUs configured."""
        r = self.run(["sinfo", "-N", "-h", "-o", "%N|%T|%G"], timeout=15)
        seen: dict[str, dict[str, Any]] = {}
        for line in r.stdout.splitlines():
            parts = line.strip().split("|")
            if len(parts) != 3 or parts[0] in seen:
                continue
            gpus = 0
            for g in parts[2].split(","):
                bits = g.split("(")[0].split(":")
                if bits[0] == "gpu" and bits[-1].isdigit():
                    gpus += int(bits[-1])
            seen[parts[0]] = {"name": parts[0], "state": parts[1], "gpus": gpus}
        return [seen[n] for n in sorted(seen)]

    # --- engines (an emulator per replica: one per node, two on gpu5) ----------------------

    def engine_start(self, node: str, start_delay_s: float | None = None,
                     index: int | None = None, identity: str = "") -> bool:
        """Launch the engine of every replica headed on `node` (or of its `index`th only): its
        emulator, or a real vLLM on a `--real-vllm` node; returns at once (it answers /health
        shortly after, a real vLLM a minute or more later); True when one was started now.

        start_delay_s: simulated cold start of an emulator (default: the sandbox's
        engine_start_delay_s); a real vLLM's start is what it is.
        identity: the replica's secret served name (the agent's `{identity}`), listed after the
        model's by /v1/models as vLLM's `--served-model-name MODEL IDENTITY` does. Without it
        (the sandbox's own start, a test's): the name the agent holds for the replica (made
        now when it has none), as on a site where the agent started every engine.
        """
        from slurm_idle.engine import IdentityStore, identity_dir

        lay = self.layout
        started = False
        names = IdentityStore(identity_dir(str(lay.root / "journal.jsonl")))
        for r in sandboxconf.replicas_headed(node, index):
            for d in (lay.run, lay.log, lay.model_state_dir(r.model)):
                d.mkdir(parents=True, exist_ok=True)
            name = identity or names.issue(sandboxconf.agent_replica_name(lay, r))
            if self._pidfile(f"emulator-{r.name}").read() is not None:
                continue  # running already: nothing to make
            argv, env = self.engine_command(r, name, start_delay_s)
            started |= self._spawn(f"emulator-{r.name}", argv, env)
        return started

    def engine_command(self, r: sandboxconf.SandboxReplica, identity: str,
                       start_delay_s: float | None = None) -> tuple[list[str], dict[str, str]]:
        """The argv and extra environment of replica `r`'s engine: the emulator, or on a
        `--real-vllm` node vLLM's own OpenAI server (the tiny model, dummy weights) on the port
        the emulator would use, so the config, Prometheus and HAProxy are the same. Its
        `--shutdown-timeout` is the config's drain window, as a site should pass it (SIGTERM
        without it aborts every request in flight); the marker finds its engine core."""
        lay = self.layout
        if r.node in self.real_vllm_nodes:
            from slurm_idle.testing import real_vllm

            python = real_vllm.venv_python(real_vllm.env_dir())
            if python is None:
                raise RuntimeError(f"sandbox: no real vLLM venv at {real_vllm.env_dir()} "
                                   "(`scripts/sandbox up --real-vllm` makes it)")
            model = real_vllm.make_model_dir(python, self.real_vllm_model)
            argv = real_vllm.server_argv(
                python, model, lay.emulator_port(r.name), served_name=r.model,
                identity=identity, max_num_seqs=self.capacity.max_num_seqs,
                extra=["--shutdown-timeout", str(REAL_VLLM_SHUTDOWN_S)])
            env = real_vllm.server_env({})
            env[real_vllm.MARKER] = self.real_vllm_marker(r.node)
            return argv, env
        cap = self.capacity
        delay = self.engine_start_delay_s if start_delay_s is None else start_delay_s
        return [
            self.python, "-m", "slurm_idle.testing.emulator",
            "--port", str(lay.emulator_port(r.name)), "--model", r.model, "--node", r.name,
            "--served-model-name", r.model, identity,
            "--state-dir", str(lay.model_state_dir(r.model)),
            "--load-file", str(lay.model_load_file(r.model)),
            "--max-num-seqs", str(cap.max_num_seqs), "--tokens-per-s", str(cap.tokens_per_s),
            "--seq-tokens-per-s", str(cap.seq_tokens_per_s),
            "--start-delay-s", str(delay),
            *(f"--gpu-device={d}" for d in lay.replica_devices(r))], {}

    @property
    def real_vllm_model(self) -> Path:
        """The tiny model's directory (config and tokenizer, made once by `up`)."""
        return self.root / "real-vllm-model"

    def real_vllm_marker(self, node: str) -> str:
        """The value of real_vllm.MARKER in the environment of `node`'s vLLM processes."""
        return f"{self.root}:{node}"

    def real_vllm_pids(self, node: str) -> list[int]:
        """`node`'s real vLLM processes: its API server, the engine core and worker it forks."""
        from slurm_idle.testing import real_vllm

        servers = [self._pidfile(f"emulator-{r.name}").recorded()
                   for r in sandboxconf.replicas_headed(node)]
        return real_vllm.server_processes(self.real_vllm_marker(node), servers, self.root)

    def engine_stop(self, node: str, timeout_s: float = 10.0, index: int | None = None) -> bool:
        """Stop the engine of every replica headed on `node` (or its `index`th) by pid and
        return once it is gone (as `systemctl stop` does): a real vLLM's engine core too, and
        given its `--shutdown-timeout` to finish what it has; True when one was running."""
        stopped = False
        real = node in self.real_vllm_nodes
        for r in sandboxconf.replicas_headed(node, index):
            pf = self._pidfile(f"emulator-{r.name}")
            pid = pf.read()
            # As systemd's KillMode=mixed: SIGTERM to the server alone (to every process, the
            # vLLM worker dies at once and the drain of --shutdown-timeout is lost), then the
            # rest of its session: its engine core and worker, were they left.
            if pid is not None:
                procs.terminate([pid], REAL_VLLM_SHUTDOWN_S + 20 if real else timeout_s)
            if real:
                procs.terminate(self.real_vllm_pids(node), timeout_s)
            pf.clear()
            (self.layout.model_state_dir(r.model) / f"{r.name}.json").unlink(missing_ok=True)
            stopped |= pid is not None
        return stopped

    # --- GPUs held outside Slurm (a leftover container, an untracked process) -------------

    def gpu_hold(self, node: str, gpu: int | None = None,
                 mib: int = fakegpu.DEFAULT_HOLD_MIB) -> int:
        """Hold `mib` on GPU `gpu` of `node` (every GPU of it when None) from a process outside
        Slurm, until gpu_release; returns its pid once the hold shows (its record is written).
        A second hold of the same GPU(s) while one runs is refused."""
        count = sandboxconf.node_gpus(node)
        if gpu is not None and not 0 <= gpu < count:
            raise ValueError(f"{node} has GPUs 0-{count - 1}, not {gpu}")
        name = f"gpuhold-{node}-{'all' if gpu is None else gpu}"
        node_dir = self.layout.node_dev(node)
        argv = [self.python, "-m", "slurm_idle.testing.fakegpu", "hold",
                f"--gpu-dir={node_dir}", f"--mib={mib}"]
        if gpu is not None:
            argv.append(f"--gpus={gpu}")
        if not self._spawn(name, argv):
            raise RuntimeError(f"sandbox: {name} runs already; `gpu-release {node}` first")
        pid = self._pidfile(name).read()
        record = fakegpu.held_dir(node_dir) / f"{pid}.json"
        self._wait(name, record.exists, 30)
        return int(pid or 0)

    def gpu_holds(self) -> dict[str, int]:
        """The holds running now (`gpuhold-NODE-GPU|all`), by name: their pids."""
        return {n: pid for n, pid in self._recorded().items() if n.startswith("gpuhold-")}

    def gpu_release(self, node: str | None = None) -> list[str]:
        """End every hold of `node` (of every node when None) and wait until each is gone;
        returns the holds ended."""
        prefix = "gpuhold-" if node is None else f"gpuhold-{node}-"
        ended = sorted(n for n in self.gpu_holds() if n.startswith(prefix))
        procs.terminate([self.gpu_holds()[n] for n in ended], timeout_s=10)
        for n in ended:
            self._pidfile(n).clear()
        return ended

    # --- teardown ------------------------------------------------------------------------

    def _recorded(self) -> dict[str, int]:
        out = {}
        run = self.layout.run
        if run.is_dir():
            for f in run.glob("*.pidj"):
                pid = PidFile(f).read()
                if pid is not None:
                    out[f.stem] = pid
        return out

    def _ours(self, env: dict[str, str]) -> bool:
        return (env.get(procs.MARKER) == str(self.root)
                or env.get("SLURM_CLUSTER_NAME") == self.layout.cluster_name)

    def down(self) -> dict[str, Any]:
        """Stop everything this sandbox started; return what was stopped and what is left."""
        t0 = time.monotonic()
        running = self._recorded()
        if "slurmctld" in running:
            self._cancel_jobs()
        if "dockerd" in running:
            self._remove_containers()
        phases: list[list[str]] = [
            # GPU holders: a hold's, and a job's the Prolog started (outside the job, never
            # ended when slurmd goes first)
            [n for n in running if n.startswith(("emulator-", "slurmd-", "gpuhold-", "jobhold-"))]
            + [n for n in ("prometheus", "gpu-exporter", "textfile-exporter", "slurmctld",
                           "dockerd", "haproxy", "loadgen") if n in running],
            [n for n in ("slurmdbd",) if n in running],
            [n for n in ("mariadb", "munged") if n in running],
            [n for n in ("portlease",) if n in running],  # the block is ours until the end
        ]
        killed: list[str] = []
        for names in phases:
            k = procs.terminate([running[n] for n in names], timeout_s=15)
            killed += [n for n in names if running[n] in k]
        # A real vLLM's engine core and worker: their environ blanked, found by session.
        stray = sorted({*procs.pids_with_env(self._ours),
                        *(p for n in self.real_vllm_nodes for p in self.real_vllm_pids(n))})
        procs.terminate(stray, timeout_s=5)
        still_mounted = procs.unmount_all(self.root)
        for name in running:
            self._pidfile(name).clear()
        ports.release_held(self.base_port)
        if self.layout.emulator_state_dir.is_dir():
            for f in self.layout.emulator_state_dir.rglob("*.json"):
                f.unlink(missing_ok=True)
        left = list(self._recorded().values()) + procs.pids_with_env(self._ours)
        return {"stopped": sorted(running), "killed": killed, "stray": stray,
                "left": sorted(set(left)), "mounts_left": still_mounted,
                "seconds": round(time.monotonic() - t0, 2)}

    def _cancel_jobs(self) -> None:
        try:
            r = self.run(["squeue", "-h", "-o", "%A"], timeout=10)
            ids = r.stdout.split()
            if ids:
                self.run(["scancel", *ids], timeout=10)
                procs.wait_for(lambda: not self.run(["squeue", "-h", "-o", "%A"], timeout=10).stdout.split(),
                               15, "job cancellation", interval_s=0.5)
        except (subprocess.TimeoutExpired, TimeoutError, OSError):
            pass

    def _remove_containers(self) -> None:
        try:
            import docker

            client = docker.DockerClient(base_url=self.docker_host, timeout=20)
            for c in client.containers.list(all=True):
                c.remove(force=True)
            client.close()
        except Exception as e:  # noqa: BLE001 - best effort; the pid sweep follows
            with open(self.layout.log / "down.log", "a") as f:
                f.write(f"removing containers failed: {e!r}\n")

    # --- status --------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        """What runs and answers: processes, nodes, emulators, sacct, dockerd, Prometheus."""
        running = self._recorded()
        st: dict[str, Any] = {"root": str(self.root), "slurm_version": self.slurm_version,
                              "base_port": self.base_port,
                              "processes": {n: running.get(n) for n in self._component_names()}}
        try:
            st["nodes"] = self.slurm_nodes() if "slurmctld" in running else []
        except (subprocess.TimeoutExpired, OSError):
            st["nodes"] = []
        emus = {}
        for node in (r.name for r in REPLICAS):
            url = self.emulator_url(node)
            e: dict[str, Any] = {"url": url, "healthy": False, "sleeping": None,
                                 "engine": "vllm" if node in self.real_vllm_nodes else "emulator"}
            try:
                e["healthy"] = _http_get(f"{url}/health", 1)[0] == 200
                e["sleeping"] = json.loads(_http_get(f"{url}/is_sleeping", 1)[1])["is_sleeping"]
            except (OSError, ValueError, KeyError):
                pass
            emus[node] = e
        st["emulators"] = emus
        try:
            st["sacct"] = "slurmdbd" in running and self.run(["sacct", "-n", "-X"], timeout=10).returncode == 0
        except (subprocess.TimeoutExpired, OSError):
            st["sacct"] = False
        try:
            st["docker"] = _unix_http(self.layout.docker_socket, "/_ping")[0] == 200
        except OSError:
            st["docker"] = False
        st["prometheus_targets"] = targets = self._targets()
        st["gpu_targets"] = gpu_targets = self._targets("dcgm")
        st["textfile_targets"] = textfile_targets = self._targets("slurm-idle")
        st["router"] = self.router_states()
        try:
            st["load_rps"] = json.loads(self.layout.load_file.read_text())["rps"]
        except (OSError, ValueError, KeyError):
            st["load_rps"] = None
        st["load_rps_by_model"] = {}
        for model in dict.fromkeys(r.model for r in REPLICAS):
            try:
                rps = json.loads(self.layout.model_load_file(model).read_text())["rps"]
            except (OSError, ValueError, KeyError):
                rps = None
            st["load_rps_by_model"][model] = rps
        # ok: the infrastructure works. Node states and stopped emulators are the product's
        # business (a lent node is drained/allocated, its engine stopped), so they do not count.
        engines = [r.name for r in REPLICAS if running.get(f"emulator-{r.name}")]
        st["gpu_holds"] = self.gpu_holds()
        st["ok"] = (len(st["nodes"]) == len(sandboxconf.GPU_NODES)
                    and all(n["gpus"] == sandboxconf.node_gpus(n["name"])
                            and not n["state"].startswith(("down", "unk", "inval", "fail"))
                            for n in st["nodes"])
                    and all(emus[n]["healthy"] for n in engines) and st["sacct"] and st["docker"]
                    and targets["up"] >= len(engines)
                    and gpu_targets["up"] == len(sandboxconf.GPU_NODES)
                    and textfile_targets["up"] == len(self.layout.textfiles))
        return st

    def _targets(self, job: str = "vllm") -> dict[str, int]:
        """How many scrape targets of `job` Prometheus has (emulators: vllm; GPU exporter:
        dcgm; the agents' textfiles: slurm-idle), and how many are up."""
        targets = {"up": 0, "total": 0}
        try:
            data = json.loads(_http_get(f"{self.prometheus_url}/api/v1/targets", 2)[1])
            for t in data["data"]["activeTargets"]:
                if t["labels"].get("job") == job:
                    targets["total"] += 1
                    targets["up"] += t["health"] == "up"
        except (OSError, ValueError, KeyError, TypeError):
            pass
        return targets

    def _component_names(self) -> list[str]:
        return (["munged", "mariadb", "slurmdbd", "slurmctld"]
                + [f"slurmd-{n}" for n in sandboxconf.GPU_NODES]
                + ["dockerd", "prometheus", "gpu-exporter", "textfile-exporter", "haproxy"]
                + [f"emulator-{r.name}" for r in REPLICAS])


if __name__ == "__main__":
    from slurm_idle.testing.sandbox_cli import main

    sys.exit(main())
