"""The text of every config file the sandbox writes (Slurm and its Prolog/Epilog, slurmdbd,
Prometheus, slurm-idle).

Pure functions of a `Layout` (root dir + base port + Slurm version), so the files are
reviewable in tests without starting anything. Slurm version differences live here:
24.11 needs `cgroup.conf` with `CgroupPlugin=disabled`; keys removed in 24.11 are not used.
Longer than most modules (~700 lines) because every generated file reads the same node and
replica table (NODES, TOPOLOGY_NODES, REPLICAS, the jobs node) and Layout: one place to change
a port or a node.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import yaml

from slurm_idle.testing import procs

NODES = ("gpu1", "gpu2", "gpu3", "gpu4")  # the default model's: one 4-GPU replica each (the demo)
GPUS_PER_NODE = 4
MODEL_NAME = "sandbox-model"
GRACE_TIME_S = 10

# Fleets as they are (issue 13): 8-GPU nodes under a model of their own, in a config of their
# own (`topology_config_path`), so the default config and every story on it are unchanged.
# gpu5 runs two 4-GPU replicas on two ports; one replica spans gpu[6-7] (its head, the only
# emulator, on gpu6). Slurm gives them a higher Weight: jobs of the default stories land on
# gpu1-gpu4 while those fit, never on an 8-GPU node left idle by the default config.
TOPOLOGY_NODES = ("gpu5", "gpu6", "gpu7")
TOPOLOGY_GPUS_PER_NODE = 8
TOPOLOGY_MODEL = "sandbox-large"
TOPOLOGY_WEIGHT = 100
ALL_NODES = NODES + TOPOLOGY_NODES

# Port offsets from the base port.
CTLD, DBD, MYSQL, PROMETHEUS = 0, 1, 2, 3
SLURMD0, EMULATOR0 = 10, 20  # + the node's place in ALL_NODES / the replica's in REPLICAS
HAPROXY = 8  # the router in front of the emulators (issue 14)
HAPROXY_TOPOLOGY = 9  # the topology model's own frontend (clients pick a model by its port)
# dockerd's HTTP(S)_PROXY: a registry request, were one ever made, goes whole to this loopback
# port (nothing listens unless a test does) instead of resolving a registry's name in the
# host's DNS. Not bound by the sandbox itself.
REGISTRY_TRAP = 4
# dockerd's only DNS server (its own /etc/resolv.conf, in a mount namespace of its own): a
# loopback address nothing listens on, so a lookup fails at once and never leaves the machine.
# Measured: with the proxy alone, a pull still asked the host's resolver for `docker.io`.
CLOSED_RESOLVER = "127.255.53.53"
HAPROXY_BACKEND = "vllm"
HAPROXY_TOPOLOGY_BACKEND = "vllm-large"
GPU_EXPORTER0 = 27  # + the node's place in GPU_NODES: its fake DCGM exporter (27-34)
TEXTFILE_EXPORTER = 35  # the agents' textfiles, for Prometheus (textfile_exporter.py)
PORT_SPAN = 40  # 36-38: gpu8 and its replica jobs (placement: jobs)

# `placement: jobs` (issue 17): node gpu8 with 8 GPUs in the serve partition `serve` and the
# idle partition. It comes up DRAINED with an admin-like Reason, so no other story's idle jobs
# land there; `Sandbox.jobs_node(True)` (or `scripts/sandbox jobs-node on`) opens it and the
# jobs-mode agent runs with `jobs_config_path` (journal, lock and targets of its own).
JOBS_NODE = "gpu8"
JOBS_NODE_GPUS = 8
JOBS_MODEL = "jobs-model"
JOBS_PARTITION = "serve"
JOBS_REPLICAS = 2
JOBS_OFF_REASON = "sandbox: jobs-mode node closed (scripts/sandbox jobs-node on)"
JOBS_SLURMD, JOBS_PORT0 = 36, 37  # slurmd of gpu8; the replica jobs' ports (JOBS_REPLICAS)
GPU_NODES = (*ALL_NODES, JOBS_NODE)  # every Slurm node, each with fake GPUs of its own
#: The agents' textfiles (paths.textfile) under the root: default, topology, jobs configs.
TEXTFILE, TOPOLOGY_TEXTFILE, JOBS_TEXTFILE = ("slurm_idle.prom", "slurm_idle-topology.prom",
                                              "slurm_idle-jobs.prom")
#: What an idle-partition job holds on each of its GPUs while it runs (the Prolog's holder).
JOB_HOLD_MIB = 40000


def node_gpus(node: str) -> int:
    """How many GPUs a sandbox node has (Slurm's gres, its device files)."""
    if node in NODES:
        return GPUS_PER_NODE
    if node in TOPOLOGY_NODES:
        return TOPOLOGY_GPUS_PER_NODE
    if node == JOBS_NODE:
        return JOBS_NODE_GPUS
    raise ValueError(f"unknown sandbox node {node!r}; nodes are {', '.join(GPU_NODES)}")


@dataclass(frozen=True)
class SandboxReplica:
    """One emulated vLLM replica: `name` is its emulator's and HAProxy server's name (the node
    for the default model's whole-node replicas, `{node}-{index}` for the topology model's)."""

    name: str
    model: str
    nodes: tuple[str, ...]
    index: int  # among the replicas headed on its node: `{index}` in engine commands
    gpus: str | None = None  # its GPUs on each node ("0-3"); None: the whole node

    @property
    def node(self) -> str:
        return self.nodes[0]

    @property
    def backend(self) -> str:
        return HAPROXY_BACKEND if self.model == MODEL_NAME else HAPROXY_TOPOLOGY_BACKEND


REPLICAS = (
    *(SandboxReplica(n, MODEL_NAME, (n,), 0) for n in NODES),
    SandboxReplica("gpu5-0", TOPOLOGY_MODEL, ("gpu5",), 0, "0-3"),
    SandboxReplica("gpu5-1", TOPOLOGY_MODEL, ("gpu5",), 1, "4-7"),
    SandboxReplica("gpu6-0", TOPOLOGY_MODEL, ("gpu6", "gpu7"), 0),
)


def replica_named(name: str) -> SandboxReplica:
    for r in REPLICAS:
        if r.name == name:
            return r
    raise ValueError(f"unknown sandbox replica {name!r}; replicas are "
                     f"{', '.join(r.name for r in REPLICAS)}")


def replicas_headed(node: str, index: int | None = None) -> list[SandboxReplica]:
    """The replicas headed on `node` (one of them: `index`); ValueError for another node."""
    if node not in ALL_NODES:
        raise ValueError(f"unknown sandbox node {node!r}; nodes are {', '.join(ALL_NODES)}")
    return [r for r in REPLICAS if r.node == node and (index is None or r.index == index)]


def agent_replica_name(lay: Layout, r: SandboxReplica) -> str:
    """The name the agent's config gives replica `r` (fleetspec's default: the node for a
    whole-node replica, else `node:port`): the key of its identity name (engine/identity.py)."""
    return r.node if r.gpus is None else f"{r.node}:{lay.emulator_port(r.name)}"


def parse_slurm_version(text: str) -> str:
    """'slurm-wlm 22.05.8' / 'slurm 24.11.5' -> '22.05.8'."""
    m = re.search(r"(\d+)\.(\d+)\.(\d+)", text)
    if not m:
        raise ValueError(f"cannot read a Slurm version from {text!r}")
    return m.group(0)


def version_tuple(version: str) -> tuple[int, int]:
    major, minor = version.split(".")[:2]
    return int(major), int(minor)


@dataclass(frozen=True)
class Layout:
    """Where everything of one sandbox lives: dirs under `root`, ports from `base_port`."""

    root: Path
    base_port: int
    slurm_version: str
    hostname: str
    python: str
    job_submit_lua: Path | None = None
    alert_rules: Path | None = None  # Prometheus loads them (etc/prometheus/slurm-idle-alerts.yml)
    pythonpath: str | None = None  # where slurm_idle is importable from, for the engine commands
    #: Nodes whose engine is a real vLLM (`up --real-vllm`), not the emulator: their start
    #: takes what a real start takes, and the config's start timeouts say so.
    real_vllm: tuple[str, ...] = ()

    # --- ports ---
    @property
    def ctld_port(self) -> int:
        return self.base_port + CTLD

    @property
    def dbd_port(self) -> int:
        return self.base_port + DBD

    @property
    def mysql_port(self) -> int:
        return self.base_port + MYSQL

    @property
    def prometheus_port(self) -> int:
        return self.base_port + PROMETHEUS

    def slurmd_port(self, node: str) -> int:
        return self.base_port + SLURMD0 + ALL_NODES.index(node)

    def emulator_port(self, replica: str) -> int:
        """The port of a replica's emulator, by replica name (a default-model node's name)."""
        return self.base_port + EMULATOR0 + REPLICAS.index(replica_named(replica))

    def emulator_url(self, replica: str) -> str:
        return f"http://127.0.0.1:{self.emulator_port(replica)}"

    def gpu_exporter_port(self, node: str) -> int:
        """The port of `node`'s GPU exporter (DCGM's metric names, gpu_exporter.py)."""
        return self.base_port + GPU_EXPORTER0 + GPU_NODES.index(node)

    @property
    def textfile_exporter_port(self) -> int:
        return self.base_port + TEXTFILE_EXPORTER

    @property
    def textfiles(self) -> dict[str, Path]:
        """Each agent's textfile (paths.textfile of the default, topology and jobs configs) by
        its file name, the path the textfile exporter serves it at."""
        return {name: self.root / name for name in (TEXTFILE, TOPOLOGY_TEXTFILE, JOBS_TEXTFILE)}

    def node_dev(self, node: str) -> Path:
        """`node`'s fake GPUs: `nvidia0`..., `held/` (fakegpu.py), `exporter-off`."""
        return self.dev / node

    def replica_devices(self, r: SandboxReplica) -> list[Path]:
        """The device files of replica `r`'s GPUs, on each of its nodes."""
        from slurm_idle.testing.fakegpu import device_path, parse_indexes

        return [device_path(self.node_dev(node), i) for node in r.nodes
                for i in (parse_indexes(r.gpus) if r.gpus else range(node_gpus(node)))]

    @property
    def jobs_slurmd_port(self) -> int:
        return self.base_port + JOBS_SLURMD

    @property
    def jobs_port_base(self) -> int:
        return self.base_port + JOBS_PORT0

    @property
    def jobs_config_path(self) -> Path:
        return self.root / "slurm-idle-jobs.yaml"

    @property
    def jobs_load_file(self) -> Path:
        return self.root / "load-jobs.json"

    @property
    def jobs_targets(self) -> Path:
        return self.root / "targets-jobs.json"

    @property
    def haproxy_port(self) -> int:
        return self.base_port + HAPROXY

    @property
    def registry_trap_port(self) -> int:
        return self.base_port + REGISTRY_TRAP

    @property
    def router_url(self) -> str:
        """Where clients send requests: HAProxy in front of every emulator."""
        return f"http://127.0.0.1:{self.haproxy_port}"

    def model_router_url(self, model: str) -> str:
        """Where clients of `model` send requests (each model has its own frontend)."""
        port = self.haproxy_port if model == MODEL_NAME else self.base_port + HAPROXY_TOPOLOGY
        return f"http://127.0.0.1:{port}"

    def model_load_file(self, model: str) -> Path:
        """The simulated request rate of `model`'s emulators (`load_file` for the default)."""
        return self.load_file if model == MODEL_NAME else self.root / f"load-{model}.json"

    def model_state_dir(self, model: str) -> Path:
        """Where `model`'s emulators announce themselves: the load is spread over these."""
        d = self.emulator_state_dir
        return d if model == MODEL_NAME else d / model

    @property
    def haproxy_socket(self) -> Path:
        return self.run / "haproxy.sock"

    @property
    def haproxy_cfg(self) -> Path:
        return self.etc / "haproxy.cfg"

    @property
    def traffic_file(self) -> Path:
        """Client-side results of `sandbox load` (one JSON line per request)."""
        return self.root / "traffic.jsonl"

    @property
    def prometheus_url(self) -> str:
        return f"http://127.0.0.1:{self.prometheus_port}"

    # --- paths ---
    @property
    def etc(self) -> Path:
        return self.root / "etc"

    @property
    def run(self) -> Path:
        return self.root / "run"

    @property
    def log(self) -> Path:
        return self.root / "log"

    @property
    def dev(self) -> Path:
        return self.root / "dev"

    @property
    def slurm_conf(self) -> Path:
        return self.etc / "slurm.conf"

    @property
    def prolog(self) -> Path:
        return self.etc / "prolog.sh"

    @property
    def bin(self) -> Path:
        """Commands on the replica jobs' PATH: the fake `nvidia-smi` (nvidia_smi_sh)."""
        return self.root / "bin"

    @property
    def epilog(self) -> Path:
        return self.etc / "epilog.sh"

    @property
    def munge_socket(self) -> Path:
        return self.run / "munge.sock"

    @property
    def mysql_socket(self) -> Path:
        return self.run / "mysql.sock"

    @property
    def docker_socket(self) -> Path:
        return self.run / "docker.sock"

    @property
    def config_path(self) -> Path:
        return self.root / "slurm-idle.yaml"

    @property
    def topology_config_path(self) -> Path:
        """slurm-idle's config for the topology model alone (gpu5, gpu[6-7])."""
        return self.root / "slurm-idle-topology.yaml"

    @property
    def load_file(self) -> Path:
        return self.root / "load.json"

    @property
    def emulator_state_dir(self) -> Path:
        return self.root / "emulators"

    @property
    def cluster_name(self) -> str:
        # Unique per root: job processes carry SLURM_CLUSTER_NAME, which lets `down` find them.
        import hashlib

        return "sb" + hashlib.sha1(str(self.root).encode()).hexdigest()[:8]

    @property
    def preempt_user_signal(self) -> str:
        """A preempted job gets its own --signal at once (submitit: USR2), as doctor asks of a
        site with `placement: jobs`; the key moved in 23.02 (22.05 rejects the new one)."""
        if version_tuple(self.slurm_version) >= (23, 2):
            return "PreemptParameters=send_user_signal"
        return "SlurmctldParameters=preempt_send_user_signal"

    @property
    def needs_cgroup_conf(self) -> bool:
        return version_tuple(self.slurm_version) >= (23, 2)


def _hostlist(nodes: tuple[str, ...]) -> str:
    """gpu1..gpu4 -> gpu[1-4] (the sandbox's names: `gpu` + consecutive numbers)."""
    first, last = nodes[0][3:], nodes[-1][3:]
    return nodes[0] if first == last else f"gpu[{first}-{last}]"


def slurm_conf(lay: Layout) -> str:
    first, last = lay.slurmd_port(NODES[0]), lay.slurmd_port(NODES[-1])
    nodes = _hostlist(NODES)
    big = _hostlist(TOPOLOGY_NODES)
    every = _hostlist(ALL_NODES)
    lines = [
        "# Generated by slurm_idle.testing.sandbox: a private test cluster on loopback.",
        f"ClusterName={lay.cluster_name}",
        f"SlurmctldHost={lay.hostname}(127.0.0.1)",
        f"SlurmctldPort={lay.ctld_port}",
        "SlurmUser=root",
        "SlurmdUser=root",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        # cred_expire: a requeued job waits cred_expire + 1 s (BeginTime) before it may run
        # again, 121 s by default; 5 is Slurm's minimum (22.05 and 24.11). The credential
        # must reach slurmd within it: batch launches here take < 0.1 s even on a loaded machine.
        f"AuthInfo=socket={lay.munge_socket},cred_expire=5",
        f"StateSaveLocation={lay.root}/state/slurmctld",
        f"SlurmdSpoolDir={lay.root}/state/slurmd-%n",
        f"SlurmctldPidFile={lay.run}/slurmctld.pid",
        f"SlurmdPidFile={lay.run}/slurmd-%n.pid",
        f"SlurmctldLogFile={lay.log}/slurmctld.log",
        f"SlurmdLogFile={lay.log}/slurmd-%n.log",
        "SlurmctldDebug=info",
        "SlurmdDebug=info",
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_Core",
        "GresTypes=gpu",
        "SlurmdParameters=config_overrides",  # 4 fake nodes share this machine's CPUs
        "ReturnToService=2",
        "MpiDefault=none",
        "MailProg=/bin/true",
        "PreemptType=preempt/partition_prio",
        "PreemptMode=REQUEUE",
        lay.preempt_user_signal,
        "JobRequeue=1",
        "KillWait=5",
        "MinJobAge=300",
        "InactiveLimit=0",
        "SchedulerType=sched/backfill",
        "SchedulerParameters=sched_interval=2,bf_interval=1,bf_resolution=1,batch_sched_delay=1",
        "AccountingStorageType=accounting_storage/slurmdbd",
        "AccountingStorageHost=127.0.0.1",
        f"AccountingStoragePort={lay.dbd_port}",
        f"AccountingStoragePass={lay.munge_socket}",
        "AccountingStorageTRES=gres/gpu",
        "JobAcctGatherType=jobacct_gather/none",
        "JobCompType=jobcomp/filetxt",
        f"JobCompLoc={lay.log}/jobcomp.txt",
        # A job's GPUs hold memory while it runs (prolog_sh); Alloc: at allocation, on every
        # node of the job, before the batch script starts.
        f"Prolog={lay.prolog}",
        f"Epilog={lay.epilog}",
        "PrologFlags=Alloc",
    ]
    if lay.job_submit_lua is not None:
        lines.append("JobSubmitPlugins=lua")
    lines += [
        (f"NodeName={nodes} NodeHostname={lay.hostname} NodeAddr=127.0.0.1 Port={first}-{last} "
         f"Gres=gpu:{GPUS_PER_NODE} CPUs=8 RealMemory=16000 State=UNKNOWN"),
        (f"NodeName={big} NodeHostname={lay.hostname} NodeAddr=127.0.0.1 "
         f"Port={lay.slurmd_port(TOPOLOGY_NODES[0])}-{lay.slurmd_port(TOPOLOGY_NODES[-1])} "
         f"Gres=gpu:{TOPOLOGY_GPUS_PER_NODE} CPUs=8 RealMemory=16000 Weight={TOPOLOGY_WEIGHT} "
         "State=UNKNOWN"),
        # AllowGroups=root: closed to users, as etc/slurm.conf.snippet ships it (root, which
        # runs the agent and the replica jobs, may always submit): a user's job here would
        # preempt lent jobs and hold the reclaim of its node up (issue 24).
        (f"PartitionName=inference Nodes={every} PriorityTier=10 PreemptMode=OFF Default=NO "
         "MaxTime=INFINITE State=UP AllowGroups=root"),
        # Features=gpu8: a feature naming the node, for `--prefer` steering (slurm.prefer_feature)
        (f"NodeName={JOBS_NODE} NodeHostname={lay.hostname} NodeAddr=127.0.0.1 "
         f"Port={lay.jobs_slurmd_port} Gres=gpu:{JOBS_NODE_GPUS} CPUs=8 RealMemory=16000 "
         f"Features={JOBS_NODE} State=UNKNOWN"),
        (f"PartitionName={JOBS_PARTITION} Nodes={JOBS_NODE} PriorityTier=10 PreemptMode=OFF "
         "Default=NO MaxTime=INFINITE State=UP AllowGroups=root"),
        (f"PartitionName=idle Nodes={every},{JOBS_NODE} PriorityTier=1 PreemptMode=REQUEUE "
         f"GraceTime={GRACE_TIME_S} Default=YES MaxTime=INFINITE State=UP"),
    ]
    return "\n".join(lines) + "\n"


def dockerd_proxy_env(lay: Layout) -> dict[str, str]:
    """dockerd's proxy variables: every registry request (a pull, a login, a search) goes whole
    to the sandbox's loopback trap port; Go's net/http hands the target's name to the proxy
    unresolved, so no DNS query for a registry leaves the machine. Both spellings, and an
    empty NO_PROXY, so that the caller's own proxy settings cannot let a request around it."""
    trap = f"http://127.0.0.1:{lay.registry_trap_port}"
    env = {name: trap for name in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy")}
    env.update({"NO_PROXY": "", "no_proxy": ""})
    return env


def dockerd_resolv_conf() -> str:
    """dockerd's /etc/resolv.conf: the closed loopback resolver only, one try, no search list."""
    return f"nameserver {CLOSED_RESOLVER}\noptions timeout:1 attempts:1\n"


def with_private_resolver(resolv_conf: Path, argv: list[str]) -> list[str]:
    """`argv` in a mount namespace of its own whose /etc/resolv.conf is `resolv_conf` (bound
    over it there only; the host's stays as it is). Propagation is slave: mounts made on the
    host later still show inside (a job's mount sources), the daemon's own (its netns file,
    container roots) never show outside and go with the namespace. `unshare` and `sh` exec,
    so the pid spawned is the daemon's."""
    return ["unshare", "--mount", "--propagation", "slave", "sh", "-c",
            'mount --bind "$0" /etc/resolv.conf && exec "$@"', str(resolv_conf), *argv]


def haproxy_cfg(lay: Layout) -> str:
    """HAProxy on loopback in front of every emulator, runtime API on a private socket.

    Health checks as a production setup has them (`/health`, 1 s): with `router: none` they
    are all that takes a stopped replica out, and a sleeping vLLM passes them.
    """
    def servers(backend: str) -> list[str]:
        return [f"    server {r.name} 127.0.0.1:{lay.emulator_port(r.name)}"
                for r in REPLICAS if r.backend == backend]

    return "\n".join([
        "# Generated by slurm_idle.testing.sandbox: the request router of the sandbox.",
        "global",
        f"    stats socket {lay.haproxy_socket} mode 600 level admin",
        "    maxconn 2000",
        "defaults",
        "    mode http",
        "    timeout connect 2s",
        "    timeout client 60s",
        "    timeout server 60s",
        "    option http-server-close",
        "frontend clients",
        f"    bind 127.0.0.1:{lay.haproxy_port}",
        f"    default_backend {HAPROXY_BACKEND}",
        f"backend {HAPROXY_BACKEND}",
        "    balance roundrobin",
        "    option httpchk GET /health",
        "    default-server check inter 1s fall 2 rise 2",
        *servers(HAPROXY_BACKEND),
        # The topology model: a server per replica, two of them on gpu5 (issue 13).
        "frontend clients-large",
        f"    bind 127.0.0.1:{lay.base_port + HAPROXY_TOPOLOGY}",
        f"    default_backend {HAPROXY_TOPOLOGY_BACKEND}",
        f"backend {HAPROXY_TOPOLOGY_BACKEND}",
        "    balance roundrobin",
        "    option httpchk GET /health",
        "    default-server check inter 1s fall 2 rise 2",
        *servers(HAPROXY_TOPOLOGY_BACKEND),
    ]) + "\n"


def gres_conf(lay: Layout) -> str:
    """One line per node, each naming device files of its own: a process holding gpu2's GPU 0
    holds `{dev}/gpu2/nvidia0`, which no other node's GPU is (fakegpu.py)."""
    return "".join(f"NodeName={n} Name=gpu File={lay.node_dev(n)}/nvidia[0-{node_gpus(n) - 1}]\n"
                   for n in GPU_NODES)


def _fakegpu(lay: Layout) -> str:
    """The command line of `python -m slurm_idle.testing.fakegpu`, its environment set: the
    sandbox's marker (`down` sweeps what carries it) and where slurm_idle is importable."""
    env = f"{procs.MARKER}={shlex.quote(str(lay.root))}"
    if lay.pythonpath:
        env += f" PYTHONPATH={shlex.quote(lay.pythonpath)}"
    return f"env {env} {shlex.quote(lay.python)} -m slurm_idle.testing.fakegpu"


def job_hold_pidfile(lay: Layout, job: str, node: str) -> Path:
    """The pid file of the holder the Prolog starts for `job` on `node` (`$VAR`s in scripts)."""
    return lay.run / f"jobhold-{job}-{node}.pidj"


def prolog_sh(lay: Layout) -> str:
    """Slurm's Prolog: a job's GPUs hold JOB_HOLD_MIB each while it runs, by a holder process
    outside the job (`hold --detach`: a session of its own, so slurmd neither waits for it nor
    kills it). The serve partition's replica jobs are skipped: their emulator holds its own.
    Returns once the holder holds, so an Epilog never misses it; ALWAYS exits 0, as a failing
    Prolog drains the node."""
    pidfile = job_hold_pidfile(lay, "$SLURM_JOB_ID", "$SLURMD_NODENAME")
    return "\n".join([
        "#!/bin/sh",
        "# Generated by slurm_idle.testing.sandbox: the job's fake GPUs hold memory while it runs.",
        f'[ "$SLURM_JOB_PARTITION" = {JOBS_PARTITION} ] && exit 0',
        '[ -n "$SLURM_JOB_GPUS" ] || exit 0',
        (f'{_fakegpu(lay)} hold --detach --gpu-dir "{lay.dev}/$SLURMD_NODENAME" '
         f'--gpus "$SLURM_JOB_GPUS" --mib {JOB_HOLD_MIB} --job "$SLURM_JOB_ID" '
         f'--pidfile "{pidfile}" </dev/null >>"{lay.log}/jobhold.log" 2>&1'),
        "exit 0",
    ]) + "\n"


def nvidia_smi_sh(lay: Layout) -> str:
    """`{root}/bin/nvidia-smi`: nvidia-smi's answer for the fake GPUs of the node a job runs
    on (fakegpu.py; the node from SLURMD_NODENAME), for the replica jobs' GPU wait."""
    return "\n".join([
        "#!/bin/sh",
        "# Generated by slurm_idle.testing.sandbox: nvidia-smi of the sandbox's fake GPUs.",
        f'exec {_fakegpu(lay)} nvidia-smi --dev={shlex.quote(str(lay.dev))} "$@"',
    ]) + "\n"


def epilog_sh(lay: Layout) -> str:
    """Slurm's Epilog: ends the job's holder (prolog_sh) and waits for it; ALWAYS exits 0."""
    pidfile = job_hold_pidfile(lay, "$SLURM_JOB_ID", "$SLURMD_NODENAME")
    return "\n".join([
        "#!/bin/sh",
        "# Generated by slurm_idle.testing.sandbox: the job's fake GPUs are let go.",
        f'pidfile="{pidfile}"',
        '[ -e "$pidfile" ] || exit 0',
        f'{_fakegpu(lay)} release --pidfile "$pidfile" >>"{lay.log}/jobhold.log" 2>&1',
        "exit 0",
    ]) + "\n"


def cgroup_conf(lay: Layout) -> str:
    return "CgroupPlugin=disabled\n"


def slurmdbd_conf(lay: Layout, db_user: str, db_pass: str) -> str:
    return "\n".join([
        "AuthType=auth/munge",
        f"AuthInfo=socket={lay.munge_socket}",
        "DbdAddr=127.0.0.1",
        "DbdHost=localhost",
        f"DbdPort={lay.dbd_port}",
        "SlurmUser=root",
        "DebugLevel=info",
        f"LogFile={lay.log}/slurmdbd.log",
        f"PidFile={lay.run}/slurmdbd.pid",
        "StorageType=accounting_storage/mysql",
        "StorageHost=127.0.0.1",
        f"StoragePort={lay.mysql_port}",
        f"StorageUser={db_user}",
        f"StoragePass={db_pass}",
        "StorageLoc=slurm_acct_db",
    ]) + "\n"


def prometheus_yml(lay: Layout) -> str:
    doc = {
        "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
        "scrape_configs": [
            # Every replica, two on gpu5 among them; `node` is its head, `replica` its name.
            {"job_name": "vllm", "static_configs": [
                {"targets": [f"127.0.0.1:{lay.emulator_port(r.name)}"],
                 "labels": {"node": r.node} if r.model == MODEL_NAME
                 else {"node": r.node, "replica": r.name}}
                for r in REPLICAS]},
            # The replica jobs of `placement: jobs`, wherever Slurm runs them (filesd.py).
            {"job_name": "vllm-jobs", "file_sd_configs": [
                {"files": [str(lay.jobs_targets)], "refresh_interval": "1s"}]},
            # Each node's GPUs, as dcgm-exporter reports them (gpu_exporter.py).
            {"job_name": "dcgm", "static_configs": [
                {"targets": [f"127.0.0.1:{lay.gpu_exporter_port(n)}" for n in GPU_NODES]}]},
            # Each agent's textfile, a target of its own (the same families in each file),
            # as node_exporter's textfile collector serves it on a site: the product's
            # alerts (rule_files) evaluate what the agents wrote.
            {"job_name": "slurm-idle", "static_configs": [
                {"targets": [f"127.0.0.1:{lay.textfile_exporter_port}"],
                 "labels": {"__metrics_path__": f"/{name}", "textfile": name}}
                for name in lay.textfiles]},
            {"job_name": "prometheus", "static_configs": [
                {"targets": [f"127.0.0.1:{lay.prometheus_port}"]}]},
        ],
    }
    if lay.alert_rules is not None:  # the product's alerts, evaluated as a site's Prometheus does
        doc["rule_files"] = [str(lay.alert_rules)]
    return "# Generated by slurm_idle.testing.sandbox\n" + str(yaml.safe_dump(doc, sort_keys=False))


#: The start timeout of a sandbox with a real vLLM: its start is what it is (36-160 s measured
#: on 2 busy cores, ~300 s at a load average of 24), not the emulator's second.
REAL_VLLM_START_S = 600


def slurm_idle_config(lay: Layout, tokens_per_s_per_replica: float) -> str:
    base = f"{shlex.quote(lay.python)} -m slurm_idle.testing.sandbox --root {shlex.quote(str(lay.root))}"
    if lay.pythonpath:
        base = f"env PYTHONPATH={shlex.quote(lay.pythonpath)} {base}"
    doc = {
        "slurm": {"backend": "cli", "lend_partition": "idle", "serve_partition": "inference",
                  "tag": "slurm-idle", "command_timeout_s": 30,
                  "requeue_grace_s": GRACE_TIME_S},
        "metrics": {"source": "prometheus", "prometheus_url": lay.prometheus_url,
                    "query_timeout_s": 5, "rate_window_s": 10, "staleness_s": 30},
        # The fake exporter reads the GPUs at each scrape (a 0.5 s cache), scraped every second.
        "gpu": {"sample_lag_s": 2},
        "engine": {"kind": "command",
                   "start_command": f"{base} engine-start {{node}} --identity {{identity}}",
                   "stop_command": f"{base} engine-stop {{node}}",
                   "drain_timeout_s": 10, "start_timeout_s": 60,
                   # A real vLLM's stop waits for its engine core to exit (seconds).
                   "stop_timeout_s": 60 if lay.real_vllm else 15,
                   "http_timeout_s": 2},
        # No warm-up here: the emulators' *simulated* load reaches every awake replica, in the
        # router or not, so under an overload a warm-up would queue behind it (a real replica
        # outside the router gets no traffic). tests/e2e/test_router.py turns it on.
        "router": {"kind": "haproxy", "admin_socket": str(lay.haproxy_socket),
                   "backend": HAPROXY_BACKEND, "server": "{node}", "timeout_s": 5},
        "models": [{"name": MODEL_NAME, "gpus_per_replica": GPUS_PER_NODE,
                    "tokens_per_s_per_replica": tokens_per_s_per_replica,
                    "min_serving_replicas": 1,
                    "replicas": [{"node": n, "url": lay.emulator_url(n)} for n in NODES]}],
        # Seconds, not minutes: Prometheus scrapes every second here and the tests are short.
        "policy": {"scale_down_window_s": 20, "queue_sustain_s": 5, "max_transitions_per_tick": 4,
                   "forecast": False},
        "timeouts": {"retire_s": 60, "lend_s": 60, "reclaim_s": 120,
                     "start_s": REAL_VLLM_START_S if lay.real_vllm else 120,
                     "tick_budget_s": 60},
        "paths": {"journal": str(lay.root / "journal.jsonl"),
                  "lock": str(lay.root / "run" / "tick.lock"),
                  "textfile": str(lay.root / TEXTFILE)},
        # SANDBOX ONLY: the tests run jobs as root with mounts under /tmp, through dockerd
        # (`job_policy` defaults: no root, no host network, /home /scratch /data /shared,
        # rootless podman). Images are never pulled: `up` builds the demo's, and a job's
        # missing image must not make dockerd ask DNS for a registry (traffic off loopback);
        # were one pulled anyway, dockerd's proxy is the loopback trap (dockerd_proxy_env).
        # /root and /home: the demo example writes under the submitting user's home.
        "job_policy": {"mount_prefixes": ["/tmp", "/root", "/home"], "allow_root": True,
                       "networks": ["none", "host"], "runtime": "docker", "pull": "never"},
    }
    return ("# Generated by slurm_idle.testing.sandbox for the sandbox at "
            f"{lay.root}\n" + str(yaml.safe_dump(doc, sort_keys=False)))


def topology_config(lay: Layout, tokens_per_s_per_replica: float) -> str:
    """The config of the topology model alone: the default one's settings, its own journal
    and textfile (the same tick lock), its HAProxy backend with a server per replica."""
    doc = yaml.safe_load(slurm_idle_config(lay, tokens_per_s_per_replica))
    model = topology_model(lay, tokens_per_s_per_replica)
    doc["router"] = model.pop("router")
    doc["models"] = [model]
    for key in ("start_command", "stop_command"):  # each of gpu5's replicas on its own
        doc["engine"][key] += " --index {index}"
    doc["paths"].update(journal=str(lay.root / "journal-topology.jsonl"),
                        textfile=str(lay.root / TOPOLOGY_TEXTFILE))
    return ("# Generated by slurm_idle.testing.sandbox: gpu5 (8 GPUs, two 4-GPU replicas) and "
            f"one replica over gpu[6-7], sandbox at {lay.root}\n"
            + str(yaml.safe_dump(doc, sort_keys=False)))


def topology_model(lay: Layout, tokens_per_s_per_replica: float) -> dict[str, object]:
    """The topology model's config: gpu5's two replicas (GPUs 0-3 and 4-7, a port each) and
    the replica over gpu[6-7]; its own HAProxy backend, a server per replica."""
    replicas: list[dict[str, object]] = []
    for r in REPLICAS:
        if r.model != TOPOLOGY_MODEL:
            continue
        entry: dict[str, object] = {"url": lay.emulator_url(r.name)}
        if len(r.nodes) > 1:
            entry["nodes"] = _hostlist(r.nodes)
        else:
            entry.update(node=r.node, gpus=r.gpus)
        replicas.append(entry)
    return {"name": TOPOLOGY_MODEL, "gpus_per_replica": TOPOLOGY_GPUS_PER_NODE // 2,
            "gpus_per_node": TOPOLOGY_GPUS_PER_NODE,
            "tokens_per_s_per_replica": tokens_per_s_per_replica,
            "min_serving_replicas": 1, "replicas": replicas,
            "router": {"kind": "haproxy", "admin_socket": str(lay.haproxy_socket),
                       "backend": HAPROXY_TOPOLOGY_BACKEND, "server": "{node}-{index}",
                       "timeout_s": 5}}


def slurm_idle_jobs_config(lay: Layout, tokens_per_s_per_replica: float, capacity: dict[str, float]) -> str:
    """The jobs-mode agent's config: one model whose 2 replicas run as Slurm jobs on gpu8 (the
    emulator started by srun on the GPUs Slurm gave the job), no router, its own files."""
    doc = yaml.safe_load(slurm_idle_config(lay, tokens_per_s_per_replica))
    env = f"env PYTHONPATH={shlex.quote(lay.pythonpath)} " if lay.pythonpath else ""
    command = (f"{env}{shlex.quote(lay.python)} -m slurm_idle.testing.emulator --port {{port}} "
               f"--model {{model}} --node {JOBS_NODE}-{{index}} "
               f"--state-dir {shlex.quote(str(lay.root / 'emulators-jobs'))} "
               f"--load-file {shlex.quote(str(lay.jobs_load_file))} --shutdown-timeout 5 "
               # the GPUs Slurm gave the job, held by the emulator (fakegpu.py)
               f'--gpu-dir {shlex.quote(str(lay.node_dev(JOBS_NODE)))} --gpus "$SLURM_JOB_GPUS" '
               + " ".join(f"--{k.replace('_', '-')} {v:g}" for k, v in capacity.items()))
    doc["engine"] = {"kind": "command", "start_command": "true", "stop_command": "true",
                     "drain_timeout_s": 10, "start_timeout_s": 60, "stop_timeout_s": 15,
                     "http_timeout_s": 2}
    doc["router"] = {"kind": "none"}
    doc["slurm"]["prefer_feature"] = "{node}"  # steering by --prefer (replicajobs.steer_args)
    # Short e2e runs: size for the present load and the window's maximum, not for a noise
    # estimate taken from a few minutes of a test's square-wave load.
    doc["policy"]["headroom_sigmas"] = 0
    doc["models"] = [{
        "name": JOBS_MODEL, "placement": "jobs", "gpus_per_replica": 4,
        "tokens_per_s_per_replica": tokens_per_s_per_replica, "min_serving_replicas": 1,
        "job": {"replicas": JOBS_REPLICAS, "partition": JOBS_PARTITION,
                "port_base": lay.jobs_port_base, "url": "http://127.0.0.1:{port}",
                # the fake nvidia-smi first on the PATH, for the script's GPU wait
                "sbatch_args": [f"--output={lay.log}/replica-%j.out",
                                f"--export=ALL,PATH={lay.bin}:/usr/local/bin:/usr/bin:/bin"],
                "command": command}}]
    doc["paths"] = {"journal": str(lay.root / "journal-jobs.jsonl"),
                    "lock": str(lay.root / "run" / "tick-jobs.lock"),
                    "textfile": str(lay.root / JOBS_TEXTFILE),
                    "file_sd": str(lay.jobs_targets)}
    return ("# Generated by slurm_idle.testing.sandbox: the jobs-mode (issue 17) agent of the "
            f"sandbox at {lay.root}\n" + str(yaml.safe_dump(doc, sort_keys=False)))
