"""The sandbox's generated files (pure): Slurm config per version, slurm-idle config, capacity."""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import pytest
import yaml

from slurm_idle.config import parse_config
from slurm_idle.testing import sandboxconf
from slurm_idle.testing.engine_model import Capacity
from slurm_idle.testing.sandboxconf import Layout

REMOVED_IN_24_11 = ("AccountingStoreJobComment", "TaskPluginParam", "MemLimitEnforce")


def layout(version: str = "22.05.8", lua: Path | None = None) -> Layout:
    return Layout(root=Path("/tmp/sb"), base_port=30000, slurm_version=version, hostname="vm",
                  python="/usr/bin/python3", job_submit_lua=lua)


def conf_keys(text: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.partition("=")
            out.setdefault(key, value)
    return out


@pytest.mark.parametrize("text,version", [("slurm-wlm 22.05.8\n", "22.05.8"), ("slurm 24.11.5", "24.11.5")])
def test_parse_slurm_version(text: str, version: str) -> None:
    """`slurmd -V` output of Debian 12 and 13 gives the version number."""
    assert sandboxconf.parse_slurm_version(text) == version


@pytest.mark.parametrize("version", ["22.05.8", "24.11.5"])
def test_slurm_conf_has_preemption_accounting_and_no_removed_keys(version: str) -> None:
    """slurm.conf sets partition preemption, fast requeue, gres accounting, and no key 24.11 rejects."""
    lay = layout(version)
    text = sandboxconf.slurm_conf(lay)
    keys = conf_keys(text)
    assert keys["PreemptType"] == "preempt/partition_prio" and keys["JobRequeue"] == "1"
    assert "cred_expire=5" in keys["AuthInfo"] and keys["AccountingStorageTRES"] == "gres/gpu"
    assert keys["SlurmctldPort"] == "30000" and "Port=30010-30013" in text
    assert "PartitionName=inference Nodes=gpu[1-7] PriorityTier=10 PreemptMode=OFF" in text
    assert "PartitionName=idle Nodes=gpu[1-7],gpu8 PriorityTier=1 PreemptMode=REQUEUE GraceTime=10" in text
    # the 8-GPU nodes of the topology model: slurmd ports after gpu4's, last in Slurm's choice
    assert "NodeName=gpu[5-7] " in text and "Port=30014-30016 Gres=gpu:8 " in text
    assert "Weight=100" in text
    # gpu8: the `placement: jobs` node, in a serve partition of its own that outranks idle.
    assert "PartitionName=serve Nodes=gpu8 PriorityTier=10 PreemptMode=OFF" in text
    assert "NodeName=gpu8 " in text and "Port=30036 Gres=gpu:8" in text
    assert not set(REMOVED_IN_24_11) & set(keys)
    assert "JobSubmitPlugins" not in keys
    # A preempted job gets its own --signal: PreemptParameters is a fatal unknown key on 22.05.
    if version.startswith("22."):
        assert "PreemptParameters" not in keys
        assert keys["SlurmctldParameters"] == "preempt_send_user_signal"
    else:
        assert keys["PreemptParameters"] == "send_user_signal"


def test_cgroup_conf_only_for_newer_slurm() -> None:
    """24.11 needs cgroup.conf (CgroupPlugin=disabled); 22.05 runs without it."""
    assert layout("24.11.5").needs_cgroup_conf and not layout("22.05.8").needs_cgroup_conf


def test_job_submit_lua_enabled_when_present() -> None:
    """A job_submit.lua turns on JobSubmitPlugins=lua."""
    assert "JobSubmitPlugins=lua\n" in sandboxconf.slurm_conf(layout(lua=Path("/x/job_submit.lua")))


def test_gres_conf_gives_each_node_device_files_of_its_own() -> None:
    """gres.conf lists each node's character devices (a count-only gres.conf leaves nodes
    INVAL), in a directory per node, so that a process holding gpu2's GPU 0 holds no other
    node's: 4 on gpu1-gpu4, 8 on gpu5-gpu7 and gpu8."""
    assert sandboxconf.gres_conf(layout()) == "".join(
        [f"NodeName=gpu{i} Name=gpu File=/tmp/sb/dev/gpu{i}/nvidia[0-3]\n" for i in range(1, 5)]
        + [f"NodeName=gpu{i} Name=gpu File=/tmp/sb/dev/gpu{i}/nvidia[0-7]\n" for i in range(5, 9)])


@pytest.mark.parametrize("version", ["22.05.8", "24.11.5"])
def test_jobs_hold_their_gpus_from_prolog_to_epilog(version: str) -> None:
    """slurm.conf runs the sandbox's Prolog at allocation (PrologFlags=Alloc) and its Epilog."""
    keys = conf_keys(sandboxconf.slurm_conf(layout(version)))
    assert (keys["Prolog"], keys["Epilog"], keys["PrologFlags"]) == (
        "/tmp/sb/etc/prolog.sh", "/tmp/sb/etc/epilog.sh", "Alloc")


def test_each_replica_holds_the_gpus_of_its_nodes() -> None:
    """A whole-node replica holds its node's GPUs, gpu5's two replicas GPUs 0-3 and 4-7, and
    the replica over gpu[6-7] all 16 GPUs of both."""
    lay = layout()
    devices = {r.name: [str(d) for d in lay.replica_devices(r)] for r in sandboxconf.REPLICAS}
    assert devices["gpu2"] == [f"/tmp/sb/dev/gpu2/nvidia{i}" for i in range(4)]
    assert devices["gpu5-1"] == [f"/tmp/sb/dev/gpu5/nvidia{i}" for i in range(4, 8)]
    assert devices["gpu6-0"] == [f"/tmp/sb/dev/gpu{n}/nvidia{i}" for n in (6, 7) for i in range(8)]


def test_jobs_config_runs_the_emulator_in_replica_jobs() -> None:
    """The jobs-mode agent config: one `placement: jobs` model whose command starts the
    emulator via srun on the agent's port, no router, files of its own, a valid config."""
    from slurm_idle.config import parse_config

    lay = layout()
    text = sandboxconf.slurm_idle_jobs_config(lay, 600.0, {"max_num_seqs": 16})
    cfg = parse_config(text)
    (model,) = cfg.models
    assert model.placement == "jobs" and model.job is not None and model.job.partition == "serve"
    assert model.job.port_base == lay.jobs_port_base and "--port {port}" in (model.job.command or "")
    # the emulator holds the GPUs Slurm gave the job, on gpu8
    assert '--gpu-dir /tmp/sb/dev/gpu8 --gpus "$SLURM_JOB_GPUS"' in (model.job.command or "")
    assert cfg.router.kind == "none" and cfg.paths.file_sd == str(lay.jobs_targets)
    assert cfg.paths.lock != parse_config(sandboxconf.slurm_idle_config(lay, 600.0)).paths.lock


def test_prometheus_scrapes_each_emulator_every_second() -> None:
    """prometheus.yml scrapes the 4 emulator ports every 1 s, labelled by node."""
    doc = yaml.safe_load(sandboxconf.prometheus_yml(layout()))
    assert doc["global"]["scrape_interval"] == "1s"
    vllm = doc["scrape_configs"][0]
    assert [(sc["targets"], sc["labels"]["node"]) for sc in vllm["static_configs"]] == [
        ([f"127.0.0.1:{30020 + i}"], f"gpu{i + 1}") for i in range(4)] + [
        (["127.0.0.1:30024"], "gpu5"), (["127.0.0.1:30025"], "gpu5"), (["127.0.0.1:30026"], "gpu6")]
    assert [sc["labels"].get("replica") for sc in vllm["static_configs"]][4:] == [
        "gpu5-0", "gpu5-1", "gpu6-0"]


def test_prometheus_loads_the_products_alert_rules_when_given() -> None:
    """rule_files names the product's alerts file when the layout has one, nothing otherwise."""
    lay = Layout(root=Path("/tmp/sb"), base_port=30000, slurm_version="22.05.8", hostname="vm",
                 python="/usr/bin/python3", alert_rules=Path("/src/etc/prometheus/a.yml"))
    assert yaml.safe_load(sandboxconf.prometheus_yml(lay))["rule_files"] == [
        "/src/etc/prometheus/a.yml"]
    assert "rule_files" not in yaml.safe_load(sandboxconf.prometheus_yml(layout()))


def test_prometheus_scrapes_each_nodes_gpu_exporter_every_second() -> None:
    """Job `dcgm` scrapes one GPU exporter port per node, gpu1-gpu8 (offsets 27-34), inside
    the block and on no other part's port."""
    lay = layout()
    doc = yaml.safe_load(sandboxconf.prometheus_yml(lay))
    (dcgm,) = [sc for sc in doc["scrape_configs"] if sc["job_name"] == "dcgm"]
    assert dcgm["static_configs"] == [{"targets": [f"127.0.0.1:{30027 + i}" for i in range(8)]}]
    assert "scrape_interval" not in dcgm and doc["global"]["scrape_interval"] == "1s"
    others = {lay.ctld_port, lay.dbd_port, lay.mysql_port, lay.prometheus_port, lay.haproxy_port,
              lay.registry_trap_port, lay.jobs_slurmd_port, *range(lay.jobs_port_base,
                                                                   lay.jobs_port_base + 2),
              *(lay.slurmd_port(n) for n in sandboxconf.ALL_NODES),
              *(lay.emulator_port(r.name) for r in sandboxconf.REPLICAS)}
    exporters = {lay.gpu_exporter_port(n) for n in sandboxconf.GPU_NODES}
    assert not exporters & others and max(exporters) < 30000 + sandboxconf.PORT_SPAN


def test_prometheus_scrapes_each_agents_textfile_on_a_port_of_its_own() -> None:
    """Job `slurm-idle` scrapes each agent's textfile (the configs' paths.textfile) from the
    textfile exporter (offset 35), a target per file labelled by it, on no other part's port."""
    from slurm_idle.config import parse_config

    lay = layout()
    doc = yaml.safe_load(sandboxconf.prometheus_yml(lay))
    (job,) = [sc for sc in doc["scrape_configs"] if sc["job_name"] == "slurm-idle"]
    assert job["static_configs"] == [
        {"targets": ["127.0.0.1:30035"], "labels": {"__metrics_path__": f"/{name}", "textfile": name}}
        for name in ("slurm_idle.prom", "slurm_idle-topology.prom", "slurm_idle-jobs.prom")]
    written = {parse_config(text).paths.textfile for text in (
        sandboxconf.slurm_idle_config(lay, 600.0), sandboxconf.topology_config(lay, 600.0),
        sandboxconf.slurm_idle_jobs_config(lay, 600.0, {}))}
    assert written == {str(p) for p in lay.textfiles.values()}
    others = {lay.gpu_exporter_port(n) for n in sandboxconf.GPU_NODES} | {
        lay.jobs_slurmd_port, *range(lay.jobs_port_base, lay.jobs_port_base + 2)}
    assert lay.textfile_exporter_port not in others
    assert lay.textfile_exporter_port < 30000 + sandboxconf.PORT_SPAN


def test_engine_commands_carry_the_package_path() -> None:
    """The engine commands find slurm_idle even when the product runs them without PYTHONPATH."""
    lay = Layout(root=Path("/tmp/sb"), base_port=30000, slurm_version="22.05.8", hostname="vm",
                 python="/usr/bin/python3", pythonpath="/src/slurm idle")
    cfg = parse_config(sandboxconf.slurm_idle_config(lay, 600.0), source="sandbox")
    assert cfg.engine_for("sandbox-model").stop_command == (
        "env PYTHONPATH='/src/slurm idle' /usr/bin/python3 -m slurm_idle.testing.sandbox "
        "--root /tmp/sb engine-stop {node}")


def test_generated_slurm_idle_config_validates() -> None:
    """The generated slurm-idle config passes the product's own validation with sandbox values."""
    lay = layout()
    cfg = parse_config(sandboxconf.slurm_idle_config(lay, 600.0), source="sandbox")
    model = cfg.model("sandbox-model")
    assert [r.url for r in model.replicas] == [f"http://127.0.0.1:{30020 + i}" for i in range(4)]
    assert cfg.metrics.prometheus_url == "http://127.0.0.1:30003"
    engine = cfg.engine_for("sandbox-model")
    assert engine.kind == "command"
    assert engine.start_command == "/usr/bin/python3 -m slurm_idle.testing.sandbox --root /tmp/sb engine-start {node} --identity {identity}"
    assert cfg.paths.journal == "/tmp/sb/journal.jsonl"


@pytest.mark.parametrize("rps,replicas", [(0.2, 1), (6.0, 2), (15.0, 4)])
def test_capacity_figure_sizes_replicas_sensibly(rps: float, replicas: int) -> None:
    """With the emulator's capacity, the planner's formula needs 1 replica at 0.2 req/s, all 4 near 15."""
    cap = Capacity()
    demand = rps * (cap.output_tokens + 0.1 * cap.prompt_tokens)
    assert math.ceil(demand / (cap.weighted_tokens_per_s(0.1) * 0.8)) == replicas


def test_500_rps_overloads_all_four_replicas() -> None:
    """500 req/s is far beyond what 4 replicas complete per second."""
    assert 500 > 4 * Capacity().requests_per_s * 10


def test_the_topology_config_has_two_replicas_on_gpu5_and_one_over_gpu6_7() -> None:
    """slurm-idle-topology.yaml: gpu5's replicas on GPUs 0-3 and 4-7 (a port each), one replica
    over gpu[6-7] headed on gpu6; engine commands per replica; a HAProxy server per replica."""
    from slurm_idle.router import all_targets, fill
    from slurm_idle.topology import lend_groups

    cfg = parse_config(sandboxconf.topology_config(layout(), 600.0), source="sandbox")
    [model] = cfg.models
    assert [(r.nodes, r.gpus, r.url, r.index) for r in model.replicas] == [
        (("gpu5",), (0, 1, 2, 3), "http://127.0.0.1:30024", 0),
        (("gpu5",), (4, 5, 6, 7), "http://127.0.0.1:30025", 1),
        (("gpu6", "gpu7"), None, "http://127.0.0.1:30026", 0)]
    assert [g.nodes for g in lend_groups(cfg)] == [("gpu5",), ("gpu6", "gpu7")]
    assert cfg.engine_for(model.name).start_command.endswith("engine-start {node} --identity {identity} --index {index}")
    assert [fill(cfg.router.server, t) for t in all_targets(cfg)] == ["gpu5-0", "gpu5-1", "gpu6-0"]
    assert cfg.router.backend == sandboxconf.HAPROXY_TOPOLOGY_BACKEND
    haproxy = sandboxconf.haproxy_cfg(layout())
    for i, name in enumerate(["gpu5-0", "gpu5-1", "gpu6-0"]):
        assert f"    server {name} 127.0.0.1:{30024 + i}\n" in haproxy
    assert cfg.paths.journal == "/tmp/sb/journal-topology.jsonl"


def _bases(n: int) -> set[int]:
    """The bases of n blocks chosen one after another, each let go at once."""
    from slurm_idle.testing import ports, sandboxconf

    out = set()
    for _ in range(n):
        lease = ports.lease_free_block(sandboxconf.PORT_SPAN, bindable=lambda port: True)
        out.add(lease.base)
        lease.release()
    return out


def test_two_sandboxes_port_blocks_never_overlap() -> None:
    """Blocks are aligned to a step no smaller than the span: a block picked while another
    sandbox's last ports (bound late, by replica jobs) were still free cannot take them."""
    from slurm_idle.testing import sandboxconf

    span = sandboxconf.PORT_SPAN
    ordered = sorted(_bases(300))
    assert len(ordered) > 1
    assert all(b - a >= span for a, b in itertools.pairwise(ordered))


def test_port_blocks_stay_below_the_ephemeral_range(monkeypatch: pytest.MonkeyPatch,
                                                    tmp_path: Path) -> None:
    """Ports the sandbox rebinds late must not be ones the kernel lends to outgoing
    connections (a CI lane's emulator port taken as a client's local port)."""
    from slurm_idle.testing import ports, sandboxconf

    assert ports.ephemeral_port_floor() >= 1024
    rng = tmp_path / "range"
    rng.write_text("24000\t60999\n")
    assert ports.ephemeral_port_floor(rng) == 24000
    monkeypatch.setattr(ports, "ephemeral_port_floor", lambda: 32768)
    assert all(b + sandboxconf.PORT_SPAN <= 32768 for b in _bases(300))
    monkeypatch.setattr(ports, "ephemeral_port_floor", lambda: 24000)
    assert all(b + sandboxconf.PORT_SPAN <= 24000 for b in _bases(300))


def test_a_port_in_time_wait_is_not_bindable_for_a_new_block() -> None:
    """A port whose server closed a connection first sits in TIME_WAIT: a bind with
    SO_REUSEADDR succeeds there, a plain bind (as some servers and tests do) fails, so a new
    block's check binds plainly and counts it as taken."""
    import socket

    from slurm_idle.testing import ports

    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the sandbox's daemons
    server.bind(("127.0.0.1", 0))
    server.listen()
    port = server.getsockname()[1]
    client = socket.create_connection(("127.0.0.1", port))
    conn, _ = server.accept()
    conn.close()  # the server closes first: its side goes to TIME_WAIT
    client.recv(1)
    client.close()
    server.close()
    with socket.socket() as reuse:
        reuse.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        reuse.bind(("127.0.0.1", port))  # the old check's view: "free"
    assert not ports.port_bindable(port)


def test_the_sandbox_never_pulls_and_dockerds_registry_requests_stay_on_loopback() -> None:
    """job_policy.pull is never in the sandbox's config; dockerd's proxy variables (both
    spellings, NO_PROXY emptied) send any registry request to a loopback port of the sandbox's
    own block that no part of the sandbox binds, so a registry's name is never resolved."""
    lay = layout()
    doc = yaml.safe_load(sandboxconf.slurm_idle_config(lay, 100.0))
    assert doc["job_policy"]["pull"] == "never"
    env = sandboxconf.dockerd_proxy_env(lay)
    trap = f"http://127.0.0.1:{lay.registry_trap_port}"
    assert {k: env[k] for k in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy")} == {
        k: trap for k in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy")}
    assert env["NO_PROXY"] == env["no_proxy"] == ""
    assert lay.base_port <= lay.registry_trap_port < lay.base_port + sandboxconf.PORT_SPAN
    used = [lay.ctld_port, lay.dbd_port, lay.mysql_port, lay.prometheus_port, lay.haproxy_port,
            lay.base_port + sandboxconf.HAPROXY_TOPOLOGY, lay.jobs_slurmd_port,
            *(lay.slurmd_port(n) for n in sandboxconf.ALL_NODES),
            *(lay.emulator_port(r.name) for r in sandboxconf.REPLICAS),
            *(lay.jobs_port_base + i for i in range(sandboxconf.JOBS_REPLICAS))]
    assert lay.registry_trap_port not in used


def test_dockerds_resolver_is_a_closed_loopback_address_only() -> None:
    """dockerd's private resolv.conf names one nameserver, on loopback, tried once; the wrapper
    binds it over /etc/resolv.conf in a mount namespace of dockerd's own and execs the daemon."""
    import ipaddress

    lines = sandboxconf.dockerd_resolv_conf().splitlines()
    servers = [ln.split()[1] for ln in lines if ln.startswith("nameserver")]
    assert servers == [sandboxconf.CLOSED_RESOLVER]
    assert ipaddress.ip_address(servers[0]).is_loopback
    assert not any(ln.startswith(("search", "domain")) for ln in lines)
    argv = sandboxconf.with_private_resolver(Path("/sb/docker/resolv.conf"), ["dockerd", "-D"])
    assert argv[:4] == ["unshare", "--mount", "--propagation", "slave"]
    assert 'mount --bind "$0" /etc/resolv.conf && exec "$@"' in argv
    assert argv[-3:] == ["/sb/docker/resolv.conf", "dockerd", "-D"]
