"""The emulator stops like vLLM (issue 14), so a router e2e can fail when the order is wrong:
SIGTERM aborts in-flight requests unless a shutdown timeout lets them finish; new requests are
refused from the moment it began. And the client-side counts of `sandbox load-stats`."""

from __future__ import annotations

import threading
from typing import Any

from slurm_idle.testing.emulator import Emulator
from slurm_idle.testing.engine_model import EngineModel
from slurm_idle.testing.loadgen import summarize


def running_emulator() -> tuple[Emulator, threading.Thread]:
    emu = Emulator(EngineModel("m"), "gpu1", None, None)
    sim = threading.Thread(target=emu.run, daemon=True)
    sim.start()
    return emu, sim


def in_flight(emu: Emulator, max_tokens: int) -> tuple[dict[str, Any], threading.Thread]:
    out: dict[str, Any] = {}

    def call() -> None:
        out["req"] = emu.complete(10, max_tokens, timeout_s=60)

    t = threading.Thread(target=call)
    t.start()
    while True:  # until the engine has it
        with emu.lock:
            if emu.model.running or emu.model.waiting:
                return out, t


def test_sigterm_without_timeout_aborts_in_flight_requests() -> None:
    """shutdown(0) (vLLM's default): the request in flight ends with finish_reason abort."""
    emu, sim = running_emulator()
    out, t = in_flight(emu, max_tokens=10_000)
    assert emu.shutdown(0.0) == 1
    t.join(10)
    assert out["req"].finished_reason == "abort"
    assert emu.complete(1, 1) is None  # refused once shutting down (the handler answers 503)
    emu.stop.set()
    sim.join(5)


def test_a_shutdown_timeout_lets_in_flight_requests_finish() -> None:
    """shutdown(S): a request that ends within S completes normally; nothing is aborted."""
    emu, sim = running_emulator()
    out, t = in_flight(emu, max_tokens=5)
    assert emu.shutdown(30.0) == 0
    t.join(10)
    assert out["req"].finished_reason == "length"
    emu.stop.set()
    sim.join(5)


def test_a_sleeping_emulator_refuses_requests() -> None:
    """Asleep (or falling asleep): no request is taken (the handler answers 503)."""
    emu = Emulator(EngineModel("m"), "gpu1", None, None)
    emu.model.go_to_sleep(1)
    assert emu.complete(1, 1) is None


def test_load_stats_count_failures_and_quantiles_in_a_window() -> None:
    """failed = every kind of failure; p50/p99 over the successful ones; a window by start."""
    rows = [{"t": float(i), "d": 1.0 + i / 100, "ok": i % 10 != 0,
             "why": "" if i % 10 else "http 503"} for i in range(100)]
    st = summarize(rows)
    assert (st["requests"], st["ok"], st["failed"]) == (100, 90, 10)
    assert st["failures"] == {"http 503": 10}
    assert st["p50_s"] == 1.49 and st["p99_s"] == 1.99
    assert summarize(rows, since=50, until=60)["requests"] == 10
    assert summarize([])["p99_s"] is None
