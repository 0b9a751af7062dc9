"""A vLLM emulator: one replica's HTTP surface (metrics, health, completions, sleep API).

Speaks what slurm-idle reads from a real vLLM server so the product can be tested without
GPUs: `/metrics` (v1 names), `/health`, `/v1/models`, `/v1/completions`, and the dev-mode
sleep API (`POST /sleep?level=&mode=`, `POST /wake_up`, `GET /is_sleeping`).

Stopping behaves like vLLM's (vllm/entrypoints/launcher.py, tests/entrypoints/launchers/
test_shutdown.py): on SIGTERM new requests get 503 at once; in-flight requests are aborted
(answered with finish_reason "abort") unless `--shutdown-timeout S` lets them finish for up to
S seconds. A sleeping engine fails requests (503). So a router that still sends traffic to a
replica being stopped or put to sleep makes clients see errors, as in production.

Background load: the total request rate in `--load-file` (JSON `{"rps": R}`, written by
`scripts/sandbox load R`) is spread evenly over the replicas that are up and awake. Each
emulator announces itself in `--state-dir/<node>.json` (a heartbeat) so the others know how
many share the load. With `--router-socket` (not used by the sandbox by default: tests set
replicas' states by hand), only a replica that HAProxy has in load balancing (not drained)
takes a share, as traffic arriving through the router would.
The capacity model lives in engine_model.py.

Serving (emulator_http.py): one asyncio loop, as vLLM's uvicorn, so a connection or a request
queued in the engine costs a coroutine, not a thread; the simulation runs on one more thread. A
request queues in the engine as in vLLM (`max_num_seqs` run, the rest wait, no limit on the
queue); a client that goes away gets its request aborted, as vLLM aborts a disconnected one.

GPUs (`--gpu-device PATH`, or `--gpu-dir D --gpus LIST`; fakegpu.py): the emulator holds its
fake GPUs' device files as vLLM holds its GPUs: `--weights-mib` on each while awake,
`--residue-mib` while asleep (what sleep mode leaves: a CUDA context and more). A `/wake_up`
while the other holders' MiB plus the weights exceed a GPU answers 500 with vLLM's error
(`{"error": {"message": "Call to wake_up method failed: CUDA Error: out of memory ...",
"type": "InternalServerError", "param": null, "code": 500}}`, the shape since vLLM 0.10.1) and
stays asleep; a cold start in that state exits 1 with the same CUDA error.

Version: `GET /version` answers `--vllm-version` (default DEFAULT_VLLM_VERSION). Below 0.17
the emulator behaves as those servers do: `/sleep` ignores `mode` and aborts whatever is in
flight (slurm_idle.engine_version has the feature table).

Run: python -m slurm_idle.testing.emulator --port P --model sandbox-model --node gpu1 \
        --state-dir DIR [--load-file FILE] [--vllm-version 0.16.0]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol, runtime_checkable

from slurm_idle.engine_version import SLEEP_MODE_WAIT, supports
from slurm_idle.testing import fakegpu
from slurm_idle.testing.emulator_http import AsyncServer
from slurm_idle.testing.engine_model import Capacity, EngineModel, Request

TICK_S = 0.1
#: The first release with every feature slurm-idle uses (sleep mode=wait, --shutdown-timeout).
DEFAULT_VLLM_VERSION = "0.18.0"
HEARTBEAT_STALE_S = 3.0


def read_rps(load_file: Path | None) -> float:
    """Total requests/s asked for by `sandbox load`; 0 when absent or unreadable."""
    if load_file is None:
        return 0.0
    try:
        return max(0.0, float(json.loads(load_file.read_text()).get("rps", 0.0)))
    except (OSError, ValueError, AttributeError, TypeError):
        return 0.0


def _pid_alive(pid: int) -> bool:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("State:"):
                return line.split()[1] not in ("Z", "X")
    except OSError:
        return False
    return False


def count_awake(state_dir: Path, now: float, pid_alive: Callable[[int], bool] = _pid_alive) -> int:
    """How many replicas announced themselves awake recently (a live pid, a fresh heartbeat)."""
    n = 0
    for f in state_dir.glob("*.json"):
        try:
            st = json.loads(f.read_text())
        except (OSError, ValueError):
            continue
        if st.get("awake") and now - float(st.get("ts", 0)) < HEARTBEAT_STALE_S and pid_alive(int(st.get("pid", 0))):
            n += 1
    return n


def haproxy_check(socket_path: str, backend: str, server: str) -> Callable[[], bool]:
    """True while HAProxy has `backend/server` in load balancing; True too when it cannot be
    asked (the emulator then behaves as without a router)."""
    from slurm_idle.errors import SlurmIdleError
    from slurm_idle.router.haproxy import OUT_BITS, parse_servers_state, unix_send

    send = unix_send(socket_path, 1.0)

    def check() -> bool:
        try:
            found = parse_servers_state(send(f"show servers state {backend}")).get((backend, server))
        except SlurmIdleError:
            return True
        return found is None or not found[1] & OUT_BITS

    return check


class GpuMemory:
    """What the engine holds on its GPUs: its weights awake, the residue asleep."""

    def __init__(self, devices: list[Path], weights_mib: int, residue_mib: int,
                 awake: bool) -> None:
        self.devices = devices
        self.dev = devices[0].parent.parent  # `{dev}` of `{dev}/NODE/nvidiaI`
        self.weights_mib = weights_mib
        self.residue_mib = residue_mib
        self.holder: fakegpu.Holder | None = None
        self.need_now = weights_mib if awake else residue_mib

    def crowded(self, need_mib: int) -> list[str]:
        return fakegpu.crowded(self.dev, self.devices, need_mib, os.getpid())

    def take(self) -> None:
        self.holder = fakegpu.Holder(self.devices, self.need_now)

    def asleep(self) -> None:
        if self.holder is not None:
            self.holder.set_mib(self.residue_mib)

    def wake_error(self) -> str | None:
        """vLLM's wake_up error while the weights do not fit beside the other holders; else
        holds them and None."""
        crowded = self.crowded(self.weights_mib)
        if crowded:
            print(f"vllm-emulator: wake_up refused: {'; '.join(crowded)}", file=sys.stderr,
                  flush=True)
            return f"Call to wake_up method failed: {fakegpu.CUDA_OOM}"
        if self.holder is not None:
            self.holder.set_mib(self.weights_mib)
        return None

    def release(self) -> None:
        if self.holder is not None:
            self.holder.close()
            self.holder = None


@runtime_checkable
class Done(Protocol):
    """What finishing a request sets: a threading.Event, or the HTTP server's LoopEvent."""

    def set(self) -> None: ...


def _finished(req: Request) -> None:
    if isinstance(req.done, Done):
        req.done.set()


class Emulator:
    """The simulation thread and the state shared with the HTTP server (all under one lock)."""

    def __init__(self, model: EngineModel, node: str, state_dir: Path | None, load_file: Path | None,
                 vllm_version: str = DEFAULT_VLLM_VERSION) -> None:
        self.model = model
        self.vllm_version = vllm_version
        self.node = node
        self.state_dir = state_dir
        self.load_file = load_file
        self.lock = threading.Lock()
        self.draining = False  # sleep(mode=wait) in progress: take no new load
        self.shutting_down = False  # SIGTERM received: new requests get 503
        self.stop = threading.Event()
        self.share_rps = 0.0
        self.port = 0
        self.in_router: Callable[[], bool] = lambda: True
        # vLLM's --served-model-name: every name is listed by /v1/models and accepted by a
        # completion; the first names the metrics (the model's own). The agent proves an
        # engine is its replica's by a secret second name (engine/identity.py).
        self.served_names: tuple[str, ...] = (model.model_name,)
        self.gpus: GpuMemory | None = None  # its fake GPUs, when it was given some

    # --- load sharing -------------------------------------------------------------------

    def heartbeat(self) -> None:
        if self.state_dir is None:
            return
        now = time.time()
        awake = (self.model.awake and not self.draining and not self.shutting_down
                 and self.in_router())
        tmp = self.state_dir / f".{self.node}.json.tmp"
        tmp.write_text(json.dumps({"node": self.node, "pid": os.getpid(), "port": self.port,
                                   "awake": awake, "ts": now}))
        tmp.replace(self.state_dir / f"{self.node}.json")
        total = read_rps(self.load_file)
        n = count_awake(self.state_dir, now)
        self.share_rps = total / n if (awake and n) else 0.0

    def forget(self) -> None:
        if self.state_dir is not None:
            (self.state_dir / f"{self.node}.json").unlink(missing_ok=True)

    def run(self) -> None:
        last = time.monotonic()
        last_beat = 0.0
        while not self.stop.wait(TICK_S):
            now = time.monotonic()
            if now - last_beat >= 0.5:
                try:
                    self.heartbeat()
                except OSError:
                    pass
                last_beat = now
            with self.lock:
                rps = 0.0 if self.draining else self.share_rps
                for req in self.model.step(now - last, rps):
                    _finished(req)
            last = now

    # --- lifecycle API ------------------------------------------------------------------

    def sleep(self, level: int, mode: str, timeout_s: float = 300.0) -> None:
        if not supports(self.vllm_version, SLEEP_MODE_WAIT):
            mode = "abort"  # before 0.17 /sleep had no mode: in-flight requests were aborted
        if mode == "wait":
            with self.lock:
                self.draining = True
            self.heartbeat()
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline:
                with self.lock:
                    if not self.model.running and not self.model.waiting:
                        break
                time.sleep(0.05)
        with self.lock:
            if mode != "keep":
                for req in self.model.abort_all():
                    _finished(req)
            self.model.go_to_sleep(level)
            self.draining = False
            if self.gpus is not None:
                self.gpus.asleep()
        self.heartbeat()

    def wake_up(self) -> str | None:
        """Wake the engine; vLLM's error instead when its weights do not fit on its GPUs."""
        with self.lock:
            if not self.model.awake and self.gpus is not None:
                error = self.gpus.wake_error()
                if error is not None:
                    return error
            self.model.wake_up()
        self.heartbeat()
        return None

    def shutdown(self, timeout_s: float) -> int:
        """SIGTERM: refuse new requests, let in-flight ones finish for up to `timeout_s`
        (vLLM's --shutdown-timeout, default 0), abort the rest. Returns how many were aborted."""
        with self.lock:
            self.shutting_down = True
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self.lock:
                if not self.model.running and not self.model.waiting:
                    break
            time.sleep(0.05)
        with self.lock:
            aborted = self.model.abort_all()
            for req in aborted:
                _finished(req)
        return len(aborted)

    # --- requests -----------------------------------------------------------------------

    def admit(self, prompt_tokens: int, max_tokens: int, done: Done) -> Request | None:
        """Queue a request in the engine (None: sleeping, draining or stopping); `done` is
        set when it finishes or is aborted."""
        with self.lock:
            if not self.model.awake or self.draining or self.shutting_down:
                return None
            req = self.model.submit(prompt_tokens, max_tokens)
            req.done = done
        return req

    def cancel(self, req: Request) -> None:
        """Its client went away: abort the request (vLLM does) so it holds no place."""
        with self.lock:
            self.model.cancel(req)
        _finished(req)

    def complete(self, prompt_tokens: int, max_tokens: int, timeout_s: float = 120.0) -> Request | None:
        """Queue a request and wait for it on this thread (tests of the engine's behaviour)."""
        done = threading.Event()
        req = self.admit(prompt_tokens, max_tokens, done)
        if req is not None and not done.wait(timeout_s):
            self.cancel(req)
        return req


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m slurm_idle.testing.emulator", description=__doc__.splitlines()[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--model", default="sandbox-model")
    p.add_argument("--served-model-name", nargs="+", default=None,
                   help="as vLLM's: the names /v1/models lists and completions accept (default: "
                        "--model); the first names the metrics")
    p.add_argument("--node", default="gpu1")
    p.add_argument("--state-dir", type=Path, default=None)
    p.add_argument("--load-file", type=Path, default=None)
    p.add_argument("--max-num-seqs", type=int, default=Capacity.max_num_seqs)
    p.add_argument("--tokens-per-s", type=float, default=Capacity.tokens_per_s)
    p.add_argument("--seq-tokens-per-s", type=float, default=Capacity.seq_tokens_per_s)
    p.add_argument("--start-delay-s", type=float, default=0.0, help="simulated cold start before listening")
    p.add_argument("--asleep", action="store_true", help="start in sleep level 1")
    p.add_argument("--vllm-version", default=DEFAULT_VLLM_VERSION,
                   help="what GET /version says; below 0.17 /sleep ignores mode and aborts")
    p.add_argument("--router-socket", default=None,
                   help="HAProxy admin socket: simulated load only while this node is in its backend")
    p.add_argument("--router-backend", default="vllm")
    p.add_argument("--shutdown-timeout", type=float, default=0.0,
                   help="on SIGTERM, let in-flight requests finish this long (vLLM's flag; 0 aborts them)")
    fakegpu.add_device_args(p)
    p.add_argument("--weights-mib", type=int, default=70000,
                   help="MiB held on each GPU while awake (weights, KV cache)")
    p.add_argument("--residue-mib", type=int, default=1024,
                   help="MiB held on each GPU while asleep (what sleep mode leaves)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cap = Capacity(max_num_seqs=args.max_num_seqs, tokens_per_s=args.tokens_per_s,
                   seq_tokens_per_s=args.seq_tokens_per_s)
    model = EngineModel(args.served_model_name[0] if args.served_model_name else args.model, cap)
    if args.asleep:
        model.go_to_sleep(1)
    if args.state_dir is not None:
        args.state_dir.mkdir(parents=True, exist_ok=True)
    emu = Emulator(model, args.node, args.state_dir, args.load_file, args.vllm_version)
    if args.served_model_name:
        emu.served_names = tuple(args.served_model_name)
    if args.router_socket:
        emu.in_router = haproxy_check(args.router_socket, args.router_backend, args.node)
    if args.start_delay_s > 0:
        time.sleep(args.start_delay_s)
    devices = fakegpu.devices_from_args(args)
    if devices:
        emu.gpus = GpuMemory(devices, args.weights_mib, args.residue_mib, model.awake)
        crowded = emu.gpus.crowded(emu.gpus.need_now)
        if crowded:  # as vLLM's cold start fails loading its weights
            print(f"vllm-emulator: {'; '.join(crowded)}\n{fakegpu.CUDA_OOM}", file=sys.stderr)
            return 1
        emu.gpus.take()
    sim = threading.Thread(target=emu.run, name="sim", daemon=True)
    gpus = os.environ.get("CUDA_VISIBLE_DEVICES")  # the GPUs Slurm gave a replica job

    def listening(port: int) -> None:
        emu.port = port
        emu.heartbeat()
        sim.start()
        print(f"vllm-emulator {args.model} node={args.node} listening on {args.host}:{port}"
              + (f" gpus={gpus} host={os.environ.get('SLURMD_NODENAME', '')}" if gpus is not None else ""),
              flush=True)

    try:
        asyncio.run(AsyncServer(emu).serve(args.host, args.port, args.shutdown_timeout, listening))
    finally:
        emu.stop.set()
        emu.forget()
        if emu.gpus is not None:
            emu.gpus.release()
    return 0


if __name__ == "__main__":
    sys.exit(main())
