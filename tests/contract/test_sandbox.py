"""Contract tests of the sandbox: the real daemons behave the way the product relies on.

Slurm (submit, drain/resume, preemption with requeue, accounting), Prometheus scraping the
emulators, the docker engine, the emulators' lifecycle through the generated config's engine
commands, and a clean `down`.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from slurm_idle.config import load_config
from slurm_idle.engine import IdentityStore, format_command, identity_dir
from slurm_idle.testing import fakegpu, procs
from slurm_idle.testing.sandbox import Sandbox
from slurm_idle.testing.waiting import poll

pytestmark = pytest.mark.sandbox


def ok(sb: Sandbox, argv: list[str]) -> str:
    r = sb.run(argv)
    assert r.returncode == 0, f"{argv} failed: {r.stderr}"
    return r.stdout


def job_field(sb: Sandbox, job: str, key: str) -> str | None:
    out = sb.run(["scontrol", "show", "job", job]).stdout
    for word in out.split():
        k, _, v = word.partition("=")
        if k == key:
            return v
    return None


def get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status, r.read()
    except OSError:
        return 0, b""


def post(url: str) -> int:
    req = urllib.request.Request(url, data=b"", method="POST")
    with urllib.request.urlopen(req, timeout=10) as r:
        return int(r.status)


def test_four_idle_nodes_with_four_gpus(sandbox: Sandbox) -> None:
    """After `up` the cluster has gpu1..gpu4, each plain idle with 4 GPUs, the 8-GPU
    gpu5..gpu7 of the topology model (issue 13) and gpu8 (8 GPUs, the `placement: jobs` node,
    closed until a test opens it); status is OK."""
    st = sandbox.status()
    assert [(n["name"], n["state"], n["gpus"]) for n in st["nodes"]] == [
        (n, "idle", 4) for n in sandbox.nodes] + [(n, "idle", 8) for n in ("gpu5", "gpu6", "gpu7")
                                                  ] + [("gpu8", "drained", 8)]
    assert [*sandbox.all_nodes, "gpu8"] == [n["name"] for n in st["nodes"]]
    assert st["ok"], st


def test_batch_job_on_idle_partition_runs_and_is_accounted(sandbox: Sandbox, tmp_path: Path) -> None:
    """A job submitted to `idle` runs with its GPUs and sacct lists it COMPLETED afterwards."""
    out = tmp_path / "out.txt"
    r = sandbox.run(["sbatch", "--wait", "--parsable", "-p", "idle", "-w", "gpu3", "--gres=gpu:2",
                     "-o", str(out), "--wrap", "echo gpus=$CUDA_VISIBLE_DEVICES"], timeout=60)
    assert r.returncode == 0, r.stderr
    job = r.stdout.strip().split(";")[0]
    assert out.read_text().strip() == "gpus=0,1"

    def accounted() -> list[str] | None:
        # A short job's completion can reach slurmdbd before its start record (partition, TRES).
        fields = sandbox.run(["sacct", "-n", "-X", "-P", "-j", job, "-o",
                              "JobID,Partition,State,AllocTRES"]).stdout.strip().split("|")
        return fields if len(fields) == 4 and fields[1] and fields[3] else None

    fields = poll(accounted, 20, f"job {job} fully accounted in sacct")
    assert fields[1:3] == ["idle", "COMPLETED"] and "gres/gpu=2" in fields[3]


def test_drain_and_resume_a_node(sandbox: Sandbox) -> None:
    """scontrol drains a node with a reason and resumes it back to idle."""
    ok(sandbox, ["scontrol", "update", "nodename=gpu2", "state=DRAIN", "reason=contract test"])
    poll(lambda: "drain" in ok(sandbox, ["sinfo", "-h", "-n", "gpu2", "-o", "%T"]), 10, "gpu2 drained")
    assert "contract test" in ok(sandbox, ["sinfo", "-h", "-n", "gpu2", "-o", "%E"])
    ok(sandbox, ["scontrol", "update", "nodename=gpu2", "state=RESUME"])
    poll(lambda: ok(sandbox, ["sinfo", "-h", "-n", "gpu2", "-o", "%T"]).split()[0] == "idle",
         10, "gpu2 idle again")


def test_inference_job_preempts_and_requeues_idle_job(sandbox: Sandbox) -> None:
    """A requeueable idle job is preempted by an inference job on its node and requeued (Restarts>=1)."""
    idle = ok(sandbox, ["sbatch", "--parsable", "-p", "idle", "--requeue", "-w", "gpu4",
                        "--gres=gpu:4", "-o", "/dev/null", "--wrap", "sleep 300"]).strip()
    try:
        poll(lambda: job_field(sandbox, idle, "JobState") == "RUNNING", 60, "idle job running")
        serve = ok(sandbox, ["sbatch", "--parsable", "-p", "inference", "-w", "gpu4",
                             "--gres=gpu:4", "-o", "/dev/null", "--wrap", "sleep 2"]).strip()
        # GraceTime is 10 s: the preemption lands after ~10-15 s (longer on a loaded CI machine;
        # poll returns as soon as it holds, so generous limits cost nothing when all is well).
        restarts = poll(lambda: int(job_field(sandbox, idle, "Restarts") or 0), 90,
                        "idle job requeued")
        assert restarts >= 1
        # COMPLETING: requeued (Restarts counted) while its old allocation is still released.
        assert job_field(sandbox, idle, "JobState") in ("PENDING", "REQUEUED", "RUNNING",
                                                        "COMPLETING")
        poll(lambda: "PREEMPTED" in ok(sandbox, ["sacct", "-n", "-j", idle, "-o", "State", "-D"]),
             60, "PREEMPTED run in sacct")
        sandbox.run(["scancel", serve])
    finally:
        sandbox.run(["scancel", idle])


def test_prometheus_scrapes_every_emulator(sandbox: Sandbox) -> None:
    """Prometheus (via prometheus-api-client) returns vllm:num_requests_running for all 4 emulators."""
    from prometheus_api_client import PrometheusConnect

    prom = PrometheusConnect(url=sandbox.prometheus_url, disable_ssl=True)

    def series() -> list[dict[str, Any]] | None:
        res = prom.custom_query('vllm:num_requests_running{model_name="sandbox-model"}')
        return res if len(res) == len(sandbox.nodes) else None

    res = poll(series, 30, "4 emulator series in Prometheus", interval_s=1)
    assert sorted(r["metric"]["node"] for r in res) == sandbox.nodes
    assert {r["metric"]["engine"] for r in res} == {"0"}


def test_prometheus_evaluates_the_products_alert_rules(sandbox: Sandbox) -> None:
    """The sandbox's Prometheus loads etc/prometheus/slurm-idle-alerts.yml, every rule of it."""
    rules = json.loads(get(f"{sandbox.prometheus_url}/api/v1/rules")[1])["data"]["groups"]
    names = {r["name"] for g in rules for r in g["rules"]}
    shipped = (Path(__file__).resolve().parents[2] / "etc" / "prometheus"
               / "slurm-idle-alerts.yml").read_text()
    assert "SlurmIdleTickStale" in names
    assert names == {line.split("alert:")[1].strip() for line in shipped.splitlines()
                     if "- alert:" in line}


def test_prometheus_scrapes_each_agents_textfile(sandbox: Sandbox) -> None:
    """Job `slurm-idle` has one target per agent textfile, up before any agent wrote one; what
    an agent writes to its paths.textfile reaches Prometheus under that file's label."""
    lay = sandbox.layout
    targets = json.loads(get(f"{sandbox.prometheus_url}/api/v1/targets")[1])["data"]
    mine = sorted(t["labels"]["textfile"] for t in targets["activeTargets"]
                  if t["labels"]["job"] == "slurm-idle" and t["health"] == "up")
    assert mine == sorted(lay.textfiles)
    assert str(lay.textfiles["slurm_idle.prom"]) == load_config(sandbox.config_path).paths.textfile
    jobs_file = lay.textfiles["slurm_idle-jobs.prom"]
    assert str(jobs_file) == load_config(lay.jobs_config_path).paths.textfile
    jobs_file.write_text("# written by the contract test\nslurm_idle_tick_errors_total 7\n")
    try:
        def seven() -> bool:
            query = urllib.parse.quote('slurm_idle_tick_errors_total{textfile="slurm_idle-jobs.prom"}')
            res = json.loads(get(f"{sandbox.prometheus_url}/api/v1/query?query={query}")[1])
            return [r["value"][1] for r in res["data"]["result"]] == ["7"]

        poll(seven, 30, "the jobs agent's textfile in Prometheus", interval_s=1)
    finally:
        jobs_file.unlink(missing_ok=True)


def test_load_reaches_every_awake_replica(sandbox: Sandbox) -> None:
    """`load RPS` is spread over the serving emulators: each one sees prompt tokens."""
    def prompt_tokens(node: str) -> float:
        body = get(f"{sandbox.emulator_url(node)}/metrics")[1].decode()
        for line in body.splitlines():
            if line.startswith("vllm:prompt_tokens_total"):
                return float(line.split()[-1])
        return 0.0

    before = {n: prompt_tokens(n) for n in sandbox.nodes}
    sandbox.load(8.0)
    try:
        poll(lambda: all(prompt_tokens(n) > before[n] for n in sandbox.nodes), 10,
             "prompt tokens on every replica")
    finally:
        sandbox.load(0.0)


def test_docker_engine_answers(sandbox: Sandbox) -> None:
    """The private dockerd answers the docker SDK on DOCKER_HOST."""
    import docker

    client = docker.DockerClient(base_url=sandbox.docker_host, timeout=10)
    try:
        assert client.ping() is True
    finally:
        client.close()


def test_emulator_sleep_api(sandbox: Sandbox) -> None:
    """An emulator sleeps and wakes through vLLM's dev API, visible in /is_sleeping and the gauge."""
    url = sandbox.emulator_url("gpu3")
    assert post(f"{url}/sleep?level=1&mode=wait") == 200
    try:
        assert json.loads(get(f"{url}/is_sleeping")[1]) == {"is_sleeping": True}
        assert 'sleep_state="weights_offloaded"} 1.0' in get(f"{url}/metrics")[1].decode()
    finally:
        assert post(f"{url}/wake_up") == 200
    assert json.loads(get(f"{url}/is_sleeping")[1]) == {"is_sleeping": False}


def test_generated_config_engine_commands_stop_and_start_a_replica(sandbox: Sandbox) -> None:
    """The generated slurm-idle config validates and its stop/start commands control the emulator."""
    cfg = load_config(sandbox.config_path)
    assert [r.node for r in cfg.model("sandbox-model").replicas] == sandbox.nodes
    engine = cfg.engine_for("sandbox-model")
    assert engine.start_command and engine.stop_command
    url = sandbox.emulator_url("gpu2")
    env = {**os.environ, **sandbox.env()}
    # Filled as the agent fills them: gpu2's own identity name, so it serves as ours again.
    [replica] = [r for r in cfg.model("sandbox-model").replicas if r.node == "gpu2"]
    identity = IdentityStore(identity_dir(cfg.paths.journal)).current(replica.name or "gpu2") or ""

    def command(template: str) -> str:
        return format_command(template, "gpu2", replica.url, "sandbox-model", replica.port,
                              replica.index, replica.name, identity)

    subprocess.run(command(engine.stop_command), shell=True, check=True, env=env, timeout=30)
    assert get(f"{url}/health")[0] == 0
    subprocess.run(command(engine.start_command), shell=True, check=True, env=env, timeout=30)
    poll(lambda: get(f"{url}/health")[0] == 200, 15, "gpu2 emulator healthy again", 0.2)


def test_second_sandbox_runs_beside_and_down_leaves_nothing(sandbox: Sandbox, tmp_path: Path) -> None:
    """A second sandbox (other root, other ports) comes up beside the first and `down` leaves no
    process: no GPU holder either, a job's (the Prolog's, outside the job) or a gpu-hold's."""
    other = Sandbox(Path(f"{sandbox.root}-2"))
    try:
        assert other.base_port != sandbox.base_port
        other.up()
        assert other.run(["sinfo", "-h", "-o", "%P=%D"]).stdout.split() == [
            "inference=7", "serve=1", "idle*=8"]
        job = ok(other, ["sbatch", "--parsable", "-p", "idle", "--gres=gpu:1", "-o", "/dev/null",
                         "--wrap", "sleep 300"]).strip()
        poll(lambda: job_field(other, job, "JobState") == "RUNNING", 20, "job running in 2nd sandbox")
        other.gpu_hold("gpu3", 0)
        poll(lambda: {h.job for h in fakegpu.scan(other.layout.dev)} >= {job, None}, 10,
             "a job's and a gpu-hold's holders")
    finally:
        res = other.down()
        holders = fakegpu.scan(other.layout.dev)
        shutil.rmtree(other.root, ignore_errors=True)
    assert res["left"] == [] and res["mounts_left"] == [] and holders == []
    assert procs.pids_with_env(lambda e: e.get(procs.MARKER) == str(other.root)
                               or e.get("SLURM_CLUSTER_NAME") == other.layout.cluster_name) == []
    assert sandbox.status()["ok"], "the first sandbox must be untouched"


def test_the_topology_model_load_reaches_each_of_its_replicas(sandbox: Sandbox) -> None:
    """`load --model sandbox-large` is spread over gpu5's two emulators and gpu6's; Prometheus
    has a series per replica (two on gpu5) and HAProxy a server per replica."""
    from slurm_idle.testing.sandboxconf import TOPOLOGY_MODEL

    names = ["gpu5-0", "gpu5-1", "gpu6-0"]

    def prompt_tokens(name: str) -> float:
        body = get(f"{sandbox.emulator_url(name)}/metrics")[1].decode()
        return next((float(line.split()[-1]) for line in body.splitlines()
                     if line.startswith("vllm:prompt_tokens_total")), 0.0)

    assert all(sandbox.router_states().get(n) == "UP" for n in names)
    before = {n: prompt_tokens(n) for n in [*names, "gpu1"]}
    sandbox.load(8.0, TOPOLOGY_MODEL)
    try:
        poll(lambda: all(prompt_tokens(n) > before[n] for n in names), 10,
             "prompt tokens on every replica of the topology model")
        assert prompt_tokens("gpu1") == before["gpu1"]  # the default model's: not its load
    finally:
        sandbox.load(0.0, TOPOLOGY_MODEL)
    from prometheus_api_client import PrometheusConnect

    prom = PrometheusConnect(url=sandbox.prometheus_url, disable_ssl=True)
    res = poll(lambda: (r := prom.custom_query(
        f'vllm:num_requests_running{{model_name="{TOPOLOGY_MODEL}"}}')) and len(r) == 3 and r,
        30, "3 topology series in Prometheus", interval_s=1)
    assert sorted(r["metric"]["replica"] for r in res) == names
