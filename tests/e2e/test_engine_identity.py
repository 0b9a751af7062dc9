"""Engine identity on the real sandbox: a user's process that lists the right model on a
stopped replica's port is never taken for the engine (it lacks the replica's secret served
name), gets no HAProxy traffic, and the engine comes up once the port is free; a serving
replica whose engine dies is restarted within two ticks instead of blocking all lending."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from slurm_idle.testing.waiting import poll
from tests.e2e.test_attacks import (
    MAX_TICKS,
    SERVERS,
    _get,
    attacker,  # noqa: F401 - a fixture
    cli,
    lent,  # noqa: F401 - a fixture
    phases,
    port_of,
    squatted_config,
)

pytestmark = pytest.mark.sandbox

SQUATTED = "gpu3"


def _tick(sb: Any, *args: str) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(cli(sb, *args, "tick", "--json").stdout)
    print([(s["node"], s.get("action"), s["to"], s["outcome"], s.get("error") or s.get("detail"))
           for s in doc["steps"]], doc["observation_errors"], flush=True)
    return doc


@pytest.mark.slow
def test_a_squatter_listing_the_model_never_joins_the_router(lent: Any, attacker: str,  # noqa: F811
                                                             tmp_path: Path) -> None:
    """The attacker's server on gpu3's port answers /health 200 and lists sandbox-model: the
    reclaim starts the engine but does not admit the squatter (no identity name), HAProxy
    never marks it UP and no client prompt reaches it; once it is gone the engine serves."""
    sb = lent
    port = port_of(sb, SQUATTED)
    squat = subprocess.Popen(["runuser", "-u", attacker, "--", "python3", str(SERVERS), "model",
                              str(port)])
    try:
        poll(lambda: b"sandbox-model" in _get(f"http://127.0.0.1:{port}/v1/models"), 20,
             "squatter listing the model")
        sb.traffic(20.0)  # real prompts through HAProxy
        sb.load(500.0)
        time.sleep(12)
        states = []
        config = squatted_config(sb, tmp_path)
        for _ in range(MAX_TICKS):
            _tick(sb, "--config", str(config))
            states.append(sb.router_states().get(SQUATTED))
        now = phases(sb)
        assert now[SQUATTED] == "starting", now  # not serving on the squatter's answers
        assert "UP" not in states, states
        time.sleep(2)
        assert _get(f"http://127.0.0.1:{port}/squatter-count") == b"0"
    finally:
        squat.terminate()
        squat.wait(timeout=10)
        sb.traffic(0)
    for _ in range(MAX_TICKS + 1):
        _tick(sb)
        if phases(sb)[SQUATTED] == "serving":
            break
    assert phases(sb)[SQUATTED] == "serving"
    poll(lambda: sb.router_states().get(SQUATTED) == "UP", 30, f"{SQUATTED} UP in HAProxy")


@pytest.mark.slow
def test_a_serving_replica_whose_engine_died_is_restarted(lent: Any) -> None:  # noqa: F811
    """gpu4's engine is killed while it serves: the next tick takes it out of the router and
    restarts it (action `repair`); it serves again within two ticks."""
    sb = lent
    assert phases(sb)["gpu4"] == "serving"
    sb.engine_stop("gpu4")
    started = time.monotonic()
    repaired = False
    for ticks in range(1, MAX_TICKS + 1):
        doc = _tick(sb)
        repaired |= any(s["node"] == "gpu4" and s.get("action") == "repair" for s in doc["steps"])
        if repaired and phases(sb)["gpu4"] == "serving":
            print(f"MEASURE engine-died: gpu4 serving again after {ticks} tick(s), "
                  f"{time.monotonic() - started:.1f}s", flush=True)
            break
    assert repaired and phases(sb)["gpu4"] == "serving", phases(sb)
    assert b"slurm-idle-" in _get(f"http://127.0.0.1:{port_of(sb, 'gpu4')}/v1/models")
