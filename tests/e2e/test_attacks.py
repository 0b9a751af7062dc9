"""Issue 11's service-side attacks on the real sandbox, each under 500 req/s: with the attack in
place every lent node is reclaimed within two ticks (ticks run back to back here; cron runs
them a minute apart). Attacks that a user mounts run as an unprivileged local user (`attacker`,
created if missing) through Slurm, like any researcher's job.

Each test prints a `MEASURE` line (ticks and seconds from the first tick to every lent node
serving) for the report.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from slurm_idle.config import load_config
from slurm_idle.testing.demo import reset_cluster
from slurm_idle.testing.waiting import poll

pytestmark = pytest.mark.sandbox

ATTACKER = "attacker"
SERVERS = Path(__file__).with_name("attack_servers.py")
LENT = ("gpu2", "gpu3")
LOAD_RPS = 500.0
MAX_TICKS = 2


@pytest.fixture(scope="module")
def attacker() -> str:
    """An unprivileged local user (created once, like a researcher's account)."""
    from slurm_idle.testing.users import ensure_user

    return ensure_user(ATTACKER).pw_name


def cli(sb: Any, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = sb.run([sys.executable, "-m", "slurm_idle.cli", *args], timeout=180)
    if check:
        assert proc.returncode == 0, (args, proc.stderr[-2000:])
    return proc


def as_user(sb: Any, user: str, *argv: str, **kw: Any) -> subprocess.CompletedProcess[str]:
    """Run a command as `user` against the sandbox's Slurm (its SLURM_CONF)."""
    return sb.run(["runuser", "-u", user, "--", "env", f"SLURM_CONF={sb.env()['SLURM_CONF']}",
                   *argv], **kw)


def port_of(sb: Any, node: str) -> int:
    return int(sb.emulator_url(node).rsplit(":", 1)[1].split("/")[0])


def phases(sb: Any) -> dict[str, str]:
    doc = json.loads(cli(sb, "status", "--json").stdout)
    return {n["name"]: n["phase"] for n in doc["nodes"]}


@pytest.fixture
def lent(sandbox: Any, attacker: str) -> Iterator[Any]:
    """Every node serving, then gpu2 and gpu3 lent; afterwards no attacker job or load left."""
    sb = sandbox
    sb.run(["scancel", "--full", "-u", attacker])
    reset_cluster(sb, load_config(sb.config_path).paths.journal)
    cli(sb, "tick")  # adopt every node into serving
    for node in LENT:
        cli(sb, "lend", node)
    assert {n: p for n, p in phases(sb).items() if n in LENT} == dict.fromkeys(LENT, "lent")
    yield sb
    sb.run(["scancel", "--full", "-u", attacker])
    # leave the shared session sandbox as other tests expect it: nodes undrained, engines up
    reset_cluster(sb, load_config(sb.config_path).paths.journal)


def surge_and_count_ticks(sb: Any, name: str, *tick_args: str) -> tuple[int, float]:
    """Load 500 req/s; once the queue is visible (sustained for policy.queue_sustain_s), tick
    until no node is lent or reclaiming (at most MAX_TICKS + 1 ticks); (ticks, seconds)."""
    sb.load(LOAD_RPS)
    cfg = load_config(sb.config_path)
    # the load is seen through a rate window and a sustain span: wait for both, not a tick
    time.sleep(cfg.metrics.rate_window_s / 2 + cfg.policy.queue_sustain_s + 2)
    started = time.monotonic()
    for ticks in range(1, MAX_TICKS + 2):
        doc = json.loads(cli(sb, *tick_args, "tick", "--json").stdout)
        print(f"tick {ticks}: {[(s['node'], s['to'], s['outcome']) for s in doc['steps']]} "
              f"{doc['observation_errors']}", flush=True)
        now = phases(sb)
        if all(now[n] == "serving" for n in LENT):
            took = time.monotonic() - started
            print(f"MEASURE {name}: every lent node serving after {ticks} tick(s), {took:.1f}s "
                  f"at {LOAD_RPS:g} req/s", flush=True)
            return ticks, took
    raise AssertionError(f"{name}: lent nodes not serving after {MAX_TICKS + 1} ticks: {phases(sb)}")


@pytest.mark.slow
def test_fake_nan_metrics_on_a_lent_node_do_not_freeze_reclaims(lent: Any, attacker: str) -> None:
    """A user's job on a lent node serves NaN under the model's name on the freed vLLM port:
    the model's demand comes from the serving replicas only, so the surge still reclaims."""
    sb = lent
    port = port_of(sb, "gpu2")
    r = as_user(sb, attacker, "sbatch", "-p", "idle", "-w", "gpu2", "-o", "/dev/null", "--wrap",
                f"python3 {SERVERS} nan {port}")
    assert r.returncode == 0, r.stderr
    poll(lambda: b"NaN" in _get(f"http://127.0.0.1:{port}/metrics"), 30, "the fake page served")
    # Prometheus scrapes it as gpu2's target
    time.sleep(3)
    ticks, _ = surge_and_count_ticks(sb, "fake-nan-metrics")
    assert ticks <= MAX_TICKS


@pytest.mark.slow
def test_an_interactive_job_does_not_pin_a_lent_node(lent: Any, attacker: str) -> None:
    """`srun -p idle` (admitted here: job_submit.lua relaxed for the test) beside a batch job:
    the srun cannot be requeued, so it is signalled, given the grace and cancelled; the batch
    job is requeued all the same; the node comes back within two ticks; the journal says so."""
    sb = lent
    lua = Path(sb.env()["SLURM_CONF"]).with_name("job_submit.lua")
    original = lua.read_text()
    lua.write_text(original.replace("local ALLOW_INTERACTIVE = false", "local ALLOW_INTERACTIVE = true"))
    srun = None
    try:
        time.sleep(1.5)  # slurmctld re-reads the script when it changes
        srun = subprocess.Popen(
            ["runuser", "-u", attacker, "--", "env", f"SLURM_CONF={sb.env()['SLURM_CONF']}",
             "srun", "-p", "idle", "-w", "gpu2", "bash", "-c", "trap '' TERM; sleep 900"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        batch = as_user(sb, attacker, "sbatch", "--parsable", "-p", "idle", "-w", "gpu2",
                        "-o", "/dev/null", "--wrap", "sleep 900")
        assert batch.returncode == 0, batch.stderr
        batch_id = int(batch.stdout.strip().split(";")[0])
        poll(lambda: len(_running(sb, "gpu2")) >= 2, 60, "srun and batch job running on gpu2")
    finally:
        lua.write_text(original)
    ticks, _ = surge_and_count_ticks(sb, "interactive-job")
    assert ticks <= MAX_TICKS
    state = _job_field(sb, batch_id, "JobState")
    assert state not in {"FAILED", "CANCELLED"} and int(_job_field(sb, batch_id, "Restarts")) >= 1
    records = [json.loads(line) for line in
               Path(load_config(sb.config_path).paths.journal).read_text().splitlines()]
    cancelled = [r for r in records if r.get("event") == "job" and r["action"] == "cancelled"]
    assert cancelled and "not a batch job" in cancelled[0]["detail"]
    assert srun is not None
    srun.wait(timeout=30)


@pytest.mark.slow
def test_a_prometheus_outage_falls_back_to_scraping_the_replicas(lent: Any) -> None:
    """Prometheus stopped: the tick scrapes the serving replicas itself and still reclaims;
    the textfile says `slurm_idle_metrics_source{source="scrape"} 1` for the alert."""
    sb = lent
    sb.stop_prometheus()
    try:
        ticks, _ = surge_and_count_ticks(sb, "prometheus-outage")
        assert ticks <= MAX_TICKS
        textfile = load_config(sb.config_path).paths.textfile
        assert textfile is not None
        assert 'slurm_idle_metrics_source{source="scrape"} 1' in Path(textfile).read_text()
    finally:
        sb.start_prometheus()


@pytest.mark.slow
def test_a_foreign_server_on_a_reclaimed_port_is_not_serving(lent: Any, attacker: str,
                                                            tmp_path: Path) -> None:
    """Something of a user's answers /health 200 on gpu3's port: the reclaim does not take it
    for vLLM (its /v1/models does not list the model), the engine start is issued, and the node
    is not counted as serving while the squatter holds the port; once it is gone the next tick
    brings the real engine up. gpu2 comes back within two ticks meanwhile."""
    sb = lent
    port = port_of(sb, "gpu3")
    squat = subprocess.Popen(["runuser", "-u", attacker, "--", "python3", str(SERVERS), "squat",
                              str(port)])
    try:
        poll(lambda: _get(f"http://127.0.0.1:{port}/health") == b"ok", 20, "squatter answering")
        sb.load(LOAD_RPS)
        time.sleep(12)
        config = squatted_config(sb, tmp_path)
        for _ in range(MAX_TICKS):
            doc = json.loads(cli(sb, "--config", str(config), "tick", "--json").stdout)
            print([(s["node"], s["to"], s["outcome"], s.get("detail")) for s in doc["steps"]])
        now = phases(sb)
        assert now["gpu2"] == "serving"
        assert now["gpu3"] == "starting", now  # not serving on a foreign 200
    finally:
        squat.terminate()
        squat.wait(timeout=10)
    for _ in range(MAX_TICKS):
        cli(sb, "tick")
        if phases(sb)["gpu3"] == "serving":
            break
    assert phases(sb)["gpu3"] == "serving"


@pytest.mark.slow
def test_a_plain_job_gets_its_own_signal_and_is_requeued(lent: Any, attacker: str) -> None:
    """A plain `sbatch` job asking `--signal=B:USR2@60` (submitit's way) receives USR2 at the
    reclaim, checkpoints within requeue_grace_s, and is requeued, never failed."""
    sb = lent
    shared = Path(tempfile.mkdtemp(prefix="slurm-idle-attack-"))  # the user's job reads/writes here
    shared.chmod(0o777)
    log = shared / "sig.log"
    log.touch()
    log.chmod(0o666)
    script = shared / "sig.sh"
    script.write_text(
        "#!/bin/bash\n#SBATCH --signal=B:USR2@60\n"
        f"trap 'echo checkpoint >> {log}' USR2\n"
        f"echo start >> {log}\n"
        "for i in $(seq 900); do sleep 1; done\n")
    script.chmod(0o755)
    r = as_user(sb, attacker, "sbatch", "--parsable", "-p", "idle", "-w", "gpu2", "-o", "/dev/null",
                str(script))
    assert r.returncode == 0, r.stderr
    job_id = int(r.stdout.strip().split(";")[0])
    poll(lambda: "start" in log.read_text(), 60, "the job started")
    ticks, _ = surge_and_count_ticks(sb, "plain-signal-job")
    assert ticks <= MAX_TICKS
    assert "checkpoint" in log.read_text()
    assert _job_field(sb, job_id, "JobState") not in {"FAILED", "CANCELLED"}
    assert int(_job_field(sb, job_id, "Restarts")) >= 1
    shutil.rmtree(shared, ignore_errors=True)


@pytest.mark.slow
def test_a_slow_prometheus_cannot_stall_the_tick(lent: Any, tmp_path: Path) -> None:
    """Prometheus answering one byte every 2 s (a per-read timeout never fires: 81 s for a
    5 s timeout before): each query ends at its total deadline, the tick falls back to the
    replicas' own /metrics, stays within its budget and still reclaims."""
    sb = lent
    port = _free_port()
    trickle = subprocess.Popen([sys.executable, str(SERVERS), "trickle", str(port)])
    try:
        doc = yaml.safe_load(Path(sb.config_path).read_text())
        doc["metrics"]["prometheus_url"] = f"http://127.0.0.1:{port}"
        config = tmp_path / "slow-prometheus.yaml"
        config.write_text(yaml.safe_dump(doc))
        ticks, took = surge_and_count_ticks(sb, "slow-prometheus", "--config", str(config))
        assert ticks <= MAX_TICKS
        budget = load_config(config).timeouts.tick_budget_s
        assert took < ticks * budget, (took, budget)
    finally:
        trickle.terminate()
        trickle.wait(timeout=10)


# --- helpers -------------------------------------------------------------------------------


# While a squatter holds a reclaimed node's port, each tick waits out its whole budget for an
# engine that cannot come up (the sandbox's 60 s): a shorter one, above the requeue grace
# (10 s), as `config check` asks, still lets a tick start every other engine and see it serve.
SQUATTED_TICK_BUDGET_S = 20


def squatted_config(sb: Any, tmp_path: Path) -> Path:
    """The sandbox's config with tick_budget_s = SQUATTED_TICK_BUDGET_S, for the ticks a
    squatter makes wait (the test's clock, not the behaviour under test)."""
    doc = yaml.safe_load(Path(sb.config_path).read_text())
    doc["timeouts"]["tick_budget_s"] = SQUATTED_TICK_BUDGET_S
    path = tmp_path / "squatted.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def _get(url: str) -> bytes:
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return bytes(resp.read())
    except OSError:
        return b""


def _free_port() -> int:
    """A port for this test's own server, leased (ports.free_port): an ephemeral port found
    free could be taken by an outgoing connection before the server binds it."""
    from slurm_idle.testing import ports

    return ports.free_port()


def _running(sb: Any, node: str) -> list[str]:
    out = sb.run(["squeue", "-h", "-w", node, "-t", "RUNNING", "-o", "%i"]).stdout
    return out.split()


def _job_field(sb: Any, job_id: int, key: str) -> str:
    out = sb.run(["scontrol", "-o", "show", "job", str(job_id)]).stdout
    return dict(tok.split("=", 1) for tok in out.split() if "=" in tok).get(key, "")

