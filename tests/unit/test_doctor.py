"""The doctor's parsers and checks, on captured `scontrol` text of Slurm 22.05 and 24.11."""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

import pytest

from slurm_idle.config import Config, parse_config
from slurm_idle.doctor.checks import (
    EngineFacts,
    SiteFacts,
    SubmitProbe,
    check_engines,
    check_gpus,
    check_grace_time,
    check_job_submit,
    check_metrics,
    check_nodes,
    check_partitions,
    check_paths,
    check_power_save,
    check_preemption,
    check_router,
    check_serve_access,
    exit_code,
    run_checks,
)
from slurm_idle.doctor.gather import _command_program, engine_problems, path_problem
from slurm_idle.model import GpuReading, ReplicaLoad
from slurm_idle.slurm.parse import parse_nodes
from slurm_idle.slurm.text import parse_duration_s, parse_show_config, parse_show_partitions

DATA = Path(__file__).resolve().parents[1] / "data"
TEXT_22 = DATA / "slurm-text" / "22.05"
DIR_24 = DATA / "slurm-json" / "24.11"
HAPROXY = "{kind: haproxy, admin_socket: /run/haproxy.sock}"


def config(nodes: str = "gpu[1-4]", **extra: str) -> Config:
    lines = [
        "engine: {kind: command, start_command: 'true', stop_command: 'true'}",
        "models:",
        f"  - {{name: m, gpus_per_replica: 4, nodes: '{nodes}'}}",
        "slurm: {requeue_grace_s: 10}",
        "timeouts: {tick_budget_s: 60}",
    ]
    lines += [f"{k}: {v}" for k, v in extra.items()]
    return parse_config("\n".join(lines))


def facts_22(**changes: object) -> SiteFacts:
    """A healthy 22.05 sandbox as captured (gpu1 lent, gpu2-4 serving)."""
    facts = SiteFacts(
        slurm_config=parse_show_config((TEXT_22 / "scontrol-show-config.txt").read_text()),
        partitions=tuple(parse_show_partitions((TEXT_22 / "scontrol-show-partition.txt").read_text())),
        nodes=tuple(parse_nodes(json.loads((DATA / "slurm-json/22.05/power/sinfo-powered-down.json").read_text()))),
        submit=SubmitProbe(1, (TEXT_22 / "sbatch-test-only-no-requeue.out").read_text(),
                           0, (TEXT_22 / "sbatch-test-only-requeue.out").read_text()),
        replicas={n: ReplicaLoad(model="m", node=n) for n in ("gpu1", "gpu2", "gpu3", "gpu4")},
        engines=(EngineFacts("gpu1", "m", "command"),),
        gpus={n: tuple(GpuReading(i, 0, 81559) for i in range(4))
              for n in ("gpu1", "gpu2", "gpu3", "gpu4")},
    )
    return replace(facts, **changes)  # type: ignore[arg-type]


def statuses(checks: list) -> dict[str, str]:  # type: ignore[type-arg]
    return {c.name: c.status for c in checks}


# --- parsers -------------------------------------------------------------------------------


@pytest.mark.parametrize("path", [TEXT_22 / "scontrol-show-config.txt", DIR_24 / "scontrol-show-config.txt"])
def test_show_config_reads_the_preemption_keys(path: Path) -> None:
    """Both releases' `scontrol show config` give PreemptType, PreemptMode and JobRequeue."""
    cfg = parse_show_config(path.read_text())
    assert cfg["PreemptType"] == "preempt/partition_prio"
    assert cfg["PreemptMode"] == "REQUEUE"
    assert cfg["JobRequeue"] == "1"
    assert parse_duration_s(cfg["KillWait"]) in {5.0, 30.0}


@pytest.mark.parametrize("path", [TEXT_22 / "scontrol-show-partition.txt", DIR_24 / "scontrol-show-partition.txt"])
def test_show_partition_reads_tiers_modes_and_grace(path: Path) -> None:
    """Both releases' partition text give PriorityTier, PreemptMode, GraceTime and the nodes."""
    parts = {p.name: p for p in parse_show_partitions(path.read_text())}
    assert parts["idle"].preempt_mode == "REQUEUE" and parts["inference"].preempt_mode == "OFF"
    assert parts["idle"].grace_time_s == 10.0 and parts["inference"].grace_time_s == 0.0
    assert parts["inference"].priority_tier == 10 and parts["idle"].priority_tier == 1
    assert parts["idle"].nodes[:2] == ("gpu1", "gpu2") and parts["idle"].state == "UP"


def test_show_partition_reads_who_may_submit() -> None:
    """AllowGroups/AllowAccounts/AllowQos/RootOnly as printed: the 24.11 capture's inference
    partition is open to every user, 22.05's (AllowGroups=root, as the sandbox ships) is not;
    a partition whose AllowGroups Slurm did not print is not claimed open."""
    open_24 = {p.name: p for p in parse_show_partitions((DIR_24 / "scontrol-show-partition.txt").read_text())}
    closed_22 = {p.name: p for p in parse_show_partitions((TEXT_22 / "scontrol-show-partition.txt").read_text())}
    assert open_24["inference"].open_to_all and open_24["inference"].allow_groups == "ALL"
    assert not closed_22["inference"].open_to_all and closed_22["inference"].allow_groups == "root"
    assert closed_22["idle"].open_to_all  # the lend partition stays every user's
    [bare] = parse_show_partitions("PartitionName=x Nodes=n1 State=UP")
    assert not bare.open_to_all
    [root_only] = parse_show_partitions("PartitionName=x AllowGroups=ALL RootOnly=YES")
    assert not root_only.open_to_all


def test_show_partition_one_line_form() -> None:
    """`scontrol -o show partition` (a record per line) parses the same."""
    text = ("PartitionName=a Nodes=n[1-2] PriorityTier=3 PreemptMode=GANG,REQUEUE GraceTime=60 State=UP\n"
            "PartitionName=b Nodes=(null) PriorityTier=1 PreemptMode=OFF GraceTime=0 State=DOWN\n")
    a, b = parse_show_partitions(text)
    assert a.nodes == ("n1", "n2") and a.preempt_modes == {"GANG", "REQUEUE"}
    assert b.nodes == () and b.state == "DOWN"


@pytest.mark.parametrize(("text", "seconds"), [
    ("5 sec", 5.0), ("30", 30.0), ("00:02:00", 120.0), ("1-00:00:01", 86401.0), ("2 min", 120.0),
    ("INFINITE", None), ("(null)", None), ("NONE", None), ("soon", None),
])
def test_durations(text: str, seconds: float | None) -> None:
    """Slurm's duration spellings as seconds; unset and infinite as None."""
    assert parse_duration_s(text) == seconds


# --- checks --------------------------------------------------------------------------------


def test_healthy_22_05_sandbox_passes() -> None:
    """The captured 22.05 sandbox (HAProxy in front) fails nothing and warns of nothing."""
    routed = facts_22(router_states={n: "in" for n in ("gpu1", "gpu2", "gpu3", "gpu4")})
    checks = run_checks(routed, config(router=HAPROXY))
    assert {c.status for c in checks} == {"ok"}, checks
    assert exit_code(checks) == 0


def test_serve_partition_open_to_every_user_fails_naming_it_and_the_fix() -> None:
    """A user's job in the serve partition preempts lent jobs and holds a reclaim up: the serve
    partition (and a `placement: jobs` model's own partition) open to every user fails, named
    with the slurm.conf fix; AllowGroups or RootOnly closes it."""
    (check,) = check_serve_access(facts_22(), config())  # the sandbox's: AllowGroups=root
    assert check.status == "ok", check.detail
    text = (TEXT_22 / "scontrol-show-partition.txt").read_text()
    open_parts = tuple(parse_show_partitions(text.replace("AllowGroups=root", "AllowGroups=ALL")))
    (check,) = check_serve_access(facts_22(partitions=open_parts), config())
    assert check.status == "fail" and "partition(s) inference open to every user" in check.detail
    assert "AllowGroups=root" in check.detail and "scontrol reconfigure" in check.detail
    assert exit_code(run_checks(facts_22(partitions=open_parts), config())) == 1
    parts = tuple(parse_show_partitions(text.replace("AllowGroups=root", "AllowGroups=ALL RootOnly=YES", 1)))
    assert check_serve_access(facts_22(partitions=parts), config())[0].status == "ok"
    # a jobs-placement model's own partition is checked too
    one_line = ("PartitionName=inference Nodes=gpu[1-4] AllowGroups=root AllowAccounts=ALL\n"
                "PartitionName=gpu-serve Nodes=gpu[1-4] AllowGroups=ALL AllowAccounts=ALL AllowQos=ALL\n")
    cfg = parse_config(
        "engine: {kind: command, start_command: 'true', stop_command: 'true'}\n"
        "models: [{name: j, placement: jobs, job: {replicas: 2, command: serve, port_base: 9000, "
        "partition: gpu-serve}}]")
    (check,) = check_serve_access(facts_22(partitions=tuple(parse_show_partitions(one_line))), cfg)
    assert check.status == "fail" and "gpu-serve open" in check.detail
    # unreadable partitions: a fail naming the reading, never a silent pass
    (check,) = check_serve_access(facts_22(partitions=None), config())
    assert check.status == "fail" and "scontrol show partition" in check.detail


def test_serve_partition_closed_by_an_account_users_may_name_warns() -> None:
    """AllowAccounts (or AllowQos) is what a job asks for: without AccountingStorageEnforce a
    user names the service's account and gets in, so it warns; with it enforced, ok."""
    text = (TEXT_22 / "scontrol-show-partition.txt").read_text()
    by_account = tuple(parse_show_partitions(
        text.replace("AllowGroups=root AllowAccounts=ALL", "AllowGroups=ALL AllowAccounts=svc", 1)))
    (check,) = check_serve_access(facts_22(partitions=by_account), config())  # Enforce = none
    assert check.status == "warn" and "AccountingStorageEnforce=none" in check.detail
    enforced = dict(facts_22().slurm_config or {}, AccountingStorageEnforce="associations,limits")
    (check,) = check_serve_access(facts_22(partitions=by_account, slurm_config=enforced), config())
    assert check.status == "ok", check.detail


def test_idle_partition_without_requeue_fails_naming_preemption() -> None:
    """PreemptMode=OFF on the lend partition is a failure of the preemption check."""
    text = (TEXT_22 / "scontrol-show-partition.txt").read_text()
    off = text.replace("GraceTime=10", "GraceTime=10").replace("PreemptMode=REQUEUE", "PreemptMode=OFF")
    checks = check_preemption(facts_22(partitions=tuple(parse_show_partitions(off))), config())
    assert checks[0].status == "fail" and "PreemptMode=OFF" in checks[0].detail
    assert exit_code(run_checks(facts_22(partitions=tuple(parse_show_partitions(off))), config())) == 1


def test_no_preempt_type_and_inverted_tiers_fail() -> None:
    """preempt/none, or a serve partition not above the lend one, fails."""
    cfg = dict(facts_22().slurm_config or {}, PreemptType="preempt/none")
    assert check_preemption(facts_22(slurm_config=cfg), config())[0].status == "fail"
    text = (TEXT_22 / "scontrol-show-partition.txt").read_text().replace("PriorityTier=10", "PriorityTier=1")
    check = check_preemption(facts_22(partitions=tuple(parse_show_partitions(text))), config())[0]
    assert check.status == "fail" and "PriorityTier" in check.detail


def test_24_11_capture_preemption_ok_but_no_lua_fails() -> None:
    """The 24.11 capture (no JobSubmitPlugins, no accounting) passes preemption, fails job_submit."""
    facts = SiteFacts(
        slurm_config=parse_show_config((DIR_24 / "scontrol-show-config.txt").read_text()),
        partitions=tuple(parse_show_partitions((DIR_24 / "scontrol-show-partition.txt").read_text())),
        nodes=tuple(parse_nodes(json.loads((DIR_24 / "scontrol-show-node.json").read_text()))),
    )
    checks = statuses(run_checks(facts, config("gpu[1-2]")))
    assert checks["slurm.preemption"] == "ok" and checks["slurm.partitions"] == "ok"
    assert checks["slurm.job_submit"] == "fail" and checks["slurm.accounting"] == "warn"
    assert checks["slurm.nodes"] == "ok"


def test_missing_pool_node_in_a_partition_fails() -> None:
    """A pool node outside the partitions is named."""
    check = check_partitions(facts_22(), config("gpu[1-5]"))[0]
    assert check.status == "fail" and "gpu5" in check.detail


def test_node_with_fewer_gpus_fails_naming_it() -> None:
    """A pool node whose gres lost GPUs fails the nodes check, named; an unknown one too."""
    nodes = tuple(replace(n, gpus_total=0) if n.name == "gpu3" else n for n in facts_22().nodes or ())
    check = check_nodes(facts_22(nodes=nodes), config())[0]
    assert check.status == "fail" and "gpu3" in check.detail and "gpu2" not in check.detail
    check = check_nodes(facts_22(), config("gpu[1-5]"))[0]
    assert check.status == "fail" and "gpu5 is not known" in check.detail


def test_an_8_gpu_node_with_two_4_gpu_replicas_is_used_whole() -> None:
    """Two 4-GPU replicas on an 8-GPU node use all of it (no "rest lent only with the node"
    warning); one 4-GPU replica there does leave 4 unused, and says so."""
    nodes = tuple(replace(n, gpus_total=8) for n in facts_22().nodes or ())
    two = parse_config("""
engine: {kind: command, start_command: 'true', stop_command: 'true'}
models:
  - {name: m, gpus_per_replica: 4, nodes: 'gpu[1-4]', replicas_per_node: 2,
     url: 'http://{node}:{port}', ports: [8000, 8001]}
""")
    assert check_nodes(facts_22(nodes=nodes), two)[0].status == "ok"
    check = check_nodes(facts_22(nodes=nodes), config())[0]
    assert check.status == "warn" and "uses 4" in check.detail


def test_grace_time_against_budget() -> None:
    """requeue_grace_s at or above the tick budget fails; GraceTime above it warns."""
    assert check_grace_time(facts_22(), config(slurm="{requeue_grace_s: 60}"))[0].status == "fail"
    check = check_grace_time(facts_22(), config(slurm="{requeue_grace_s: 5}"))[0]
    assert check.status == "warn" and "GraceTime" in check.detail


@pytest.mark.parametrize(("probe", "status"), [
    (SubmitProbe(1, "refused", 0, "ok"), "ok"),
    (SubmitProbe(0, "Job 3 to start", 0, "ok"), "fail"),
    (SubmitProbe(1, "refused", 1, "Requested node configuration is not available"), "warn"),
])
def test_job_submit_probe(probe: SubmitProbe, status: str) -> None:
    """--no-requeue refused and --requeue accepted is ok; accepted fails; both refused warns."""
    assert check_job_submit(facts_22(submit=probe), config())[0].status == status


def test_job_submit_without_lua_plugin_fails() -> None:
    cfg = dict(facts_22().slurm_config or {}, JobSubmitPlugins="(null)")
    assert check_job_submit(facts_22(slurm_config=cfg), config())[0].status == "fail"


def _power(**keys: str) -> SiteFacts:
    cfg = dict(facts_22().slurm_config or {}, SuspendProgram="/usr/sbin/suspend", SuspendTime="600 sec")
    cfg.update(keys)
    return facts_22(slurm_config=cfg)


def test_power_save_names_unprotected_serving_nodes() -> None:
    """With automatic suspend, pool nodes outside the exclusions fail, named."""
    check = check_power_save(_power(SuspendExcNodes="gpu[3-4]"), config())[0]
    assert check.status == "fail" and "gpu1, gpu2" in check.detail and "gpu3" not in check.detail


@pytest.mark.parametrize("keys", [
    {"SuspendExcNodes": "gpu[1-4]"}, {"SuspendExcParts": "inference"}, {"SuspendExcStates": "DOWN,DRAIN"},
])
def test_power_save_exclusions_that_cover_the_pool(keys: dict[str, str]) -> None:
    """Excluded by name, by partition or by the DRAIN state: ok."""
    assert check_power_save(_power(**keys), config())[0].status == "ok"


def test_power_save_partial_exclusion_is_not_protection() -> None:
    """`gpu[1-4]:2` keeps any two up: none of them is safe."""
    assert check_power_save(_power(SuspendExcNodes="gpu[1-4]:2"), config())[0].status == "fail"


def test_power_save_manual_only_warns() -> None:
    """SuspendProgram without a finite SuspendTime suspends only on request: a warning."""
    assert check_power_save(_power(SuspendTime="INFINITE"), config())[0].status == "warn"


def test_metrics_missing_for_a_serving_replica_fails() -> None:
    """A serving replica without fresh series fails, named; a lent one may be silent."""
    replicas = {"gpu1": ReplicaLoad("m", "gpu1", known=False), "gpu2": ReplicaLoad("m", "gpu2"),
                "gpu3": ReplicaLoad("m", "gpu3"), "gpu4": ReplicaLoad("m", "gpu4", known=False)}
    check = check_metrics(facts_22(replicas=replicas), config())[0]
    assert check.status == "fail" and "gpu4" in check.detail and "gpu1" not in check.detail
    unreachable = check_metrics(facts_22(replicas=None, errors={"replicas": "connection refused"}), config())[0]
    assert unreachable.status == "fail" and "connection refused" in unreachable.detail


def test_metrics_of_two_replicas_on_one_node_are_checked_each() -> None:
    """Two replicas on gpu2: the one without fresh series fails the check by its name, even
    though its neighbour on the same node has series (keyed by node, one hid the other)."""
    from slurm_idle.metrics.serving import loads_by_replica

    two = parse_config("""
engine: {kind: command, start_command: 'true', stop_command: 'true'}
models:
  - {name: m, gpus_per_replica: 4, nodes: 'gpu[1-4]', replicas_per_node: 2,
     url: 'http://{node}:{port}', ports: [8000, 8001]}
""")
    pairs = [("m", r) for r in two.models[0].replicas]
    loads = [ReplicaLoad("m", r.node, url=r.url, known=not r.url.endswith(":8001") or r.node != "gpu2")
             for _, r in pairs]
    replicas = loads_by_replica(pairs, reversed(loads))  # the healthy neighbour read last
    check = check_metrics(facts_22(replicas=replicas), two)[0]
    blind = next(r.name for _, r in pairs if r.node == "gpu2" and r.url.endswith(":8001"))
    assert check.status == "fail" and blind in check.detail, check.detail
    healthy = loads_by_replica(pairs, [replace(x, known=True) for x in loads])
    assert check_metrics(facts_22(replicas=healthy), two)[0].status == "ok"


def test_engine_command_missing_fails() -> None:
    """A start/stop command whose program is not installed is a failure."""
    cfg = parse_config("engine: {kind: command, start_command: 'env A=1 /nonexistent/vllm-up {node}', "
                       "stop_command: 'true'}\nmodels: [{name: m, nodes: gpu1}]")
    problems = engine_problems(cfg.engine_for("m"), "gpu1", lambda n: True, None)
    assert len(problems) == 1 and "/nonexistent/vllm-up" in problems[0]
    assert _command_program("env PYTHONPATH=/x /usr/bin/python3 -m y") == "/usr/bin/python3"
    facts = facts_22(engines=(EngineFacts("gpu1", "m", "command", problems),))
    assert check_engines(facts, config())[0].status == "fail"


def test_engine_sleep_endpoint_and_container() -> None:
    """http-sleep needs /is_sleeping (dev mode); docker needs the container."""
    sleep = parse_config("engine: {kind: http-sleep}\nmodels: [{name: m, nodes: gpu1}]").engine_for("m")
    assert engine_problems(sleep, "gpu1", lambda n: True, lambda: 200) == ()
    assert "404" in engine_problems(sleep, "gpu1", lambda n: True, lambda: 404)[0]
    assert engine_problems(sleep, "gpu1", lambda n: True, lambda: None)
    docker = parse_config("engine: {kind: docker}\nmodels: [{name: m, nodes: gpu1}]").engine_for("m")
    assert engine_problems(docker, "gpu1", lambda n: "container 'vllm-gpu1': 404 Not Found", None)
    assert engine_problems(docker, "gpu1", lambda n: True, None) == ()


def test_path_problems(tmp_path: Path) -> None:
    """Writable root-or-own directories pass; world-writable ones and symlinks do not."""
    good = tmp_path / "lib" / "journal.jsonl"
    assert path_problem(str(good)) is None  # a missing directory under ours is creatable
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    assert "world-writable" in (path_problem(str(shared / "lock")) or "")
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "elsewhere")
    assert "symlink" in (path_problem(str(link)) or "")
    if os.geteuid() == 0:  # a directory another user owns can be swapped under us
        theirs = tmp_path / "theirs"
        theirs.mkdir()
        os.chown(theirs, 12345, 12345)
        assert "uid 12345" in (path_problem(str(theirs / "journal.jsonl")) or "")
    facts = facts_22(paths=(("lock", str(shared / "lock"), "world-writable"),))
    assert check_paths(facts, config())[0].status == "fail"


def test_unreadable_slurm_config_fails_with_the_reason() -> None:
    """scontrol that cannot be run fails every check that needs it, with its error."""
    facts = SiteFacts(errors={"slurm_config": "scontrol: command not found",
                              "partitions": "scontrol: command not found"})
    checks = run_checks(facts, config())
    assert statuses(checks)["slurm.preemption"] == "fail"
    assert "command not found" in checks[0].detail


# --- the request router --------------------------------------------------------------------


def test_router_none_warns_that_clients_may_see_errors() -> None:
    """Without a router nobody takes a replica out before it stops: a warning, never ok."""
    checks = check_router(facts_22(), config())
    assert [(c.name, c.status) for c in checks] == [("router", "warn")]
    assert "clients may see errors" in checks[0].detail and "m" in checks[0].detail



def test_router_that_knows_every_replica_is_ok() -> None:
    """A configured router that answers and has a server for every pool replica passes."""
    states = {n: "in" for n in ("gpu1", "gpu2", "gpu3", "gpu4")} | {"gpu1": "out"}
    checks = check_router(facts_22(router_states=states), config(router=HAPROXY))
    assert [(c.name, c.status) for c in checks] == [("router", "ok")]


@pytest.mark.parametrize(("state", "named"), [("unknown", "unreadable"), ("missing", "no server")])
def test_router_unreadable_or_missing_a_replica_fails_naming_it(state: str, named: str) -> None:
    """A router that cannot be read, or lacks a replica, fails naming the node."""
    states = {n: "in" for n in ("gpu1", "gpu2", "gpu3", "gpu4")} | {"gpu3": state}
    (check,) = check_router(facts_22(router_states=states), config(router=HAPROXY))
    assert check.status == "fail" and named in check.detail and "gpu3" in check.detail


def test_router_not_read_at_all_fails_with_the_reason() -> None:
    """No state at all (the read raised): fail with the recorded reason."""
    facts = facts_22(errors={"router": "connection refused"})
    (check,) = check_router(facts, config(router=HAPROXY))
    assert check.status == "fail" and "connection refused" in check.detail


def test_replica_job_partition_checked_only_with_jobs_placement() -> None:
    """`placement: jobs`: the replica jobs' partition must exist, never be preempted, outrank
    the lend partition and share its nodes; node placement alone adds no check."""
    from slurm_idle.doctor.checks import check_replica_job_partitions

    assert check_replica_job_partitions(facts_22(), config()) == []
    jobs_model = "[{name: j, placement: jobs, job: {replicas: 2, command: serve, port_base: 9000}}]"
    cfg = parse_config("\n".join([
        "engine: {kind: command, start_command: 'true', stop_command: 'true'}",
        f"models: {jobs_model}"]))
    (check,) = check_replica_job_partitions(facts_22(), cfg)
    assert check.status == "ok", check.detail
    parts = tuple(replace(p, priority_tier=1, preempt_mode="REQUEUE") if p.name == "inference" else p
                  for p in facts_22().partitions or ())
    (check,) = check_replica_job_partitions(facts_22(partitions=parts), cfg)
    assert check.status == "fail" and "PreemptMode=REQUEUE" in check.detail
    assert "PriorityTier of inference (1)" in check.detail
    other = parse_config("\n".join([
        "engine: {kind: command, start_command: 'true', stop_command: 'true'}",
        f"models: {jobs_model.replace('port_base: 9000', 'port_base: 9000, partition: gpu-serve')}"]))
    (check,) = check_replica_job_partitions(facts_22(), other)
    assert check.status == "fail" and "gpu-serve (replica jobs) does not exist" in check.detail


def test_preempt_user_signal_is_checked_with_jobs_placement_in_both_releases_spellings() -> None:
    """`placement: jobs` reclaims by Slurm's preemption: without send_user_signal a submitit job
    gets SIGTERM (which it ignores) and loses its work: warn, naming both releases' keys; either
    spelling is ok; node placement (the agent signals jobs itself) adds no check."""
    from slurm_idle.doctor.checks import check_preempt_user_signal

    assert check_preempt_user_signal(facts_22(), config()) == []
    cfg = parse_config(
        "engine: {kind: command, start_command: 'true', stop_command: 'true'}\n"
        "models: [{name: j, placement: jobs, job: {replicas: 2, command: serve, port_base: 9000}}]")
    (check,) = check_preempt_user_signal(facts_22(), cfg)
    assert check.status == "warn" and "PreemptParameters=send_user_signal" in check.detail
    assert "SlurmctldParameters=preempt_send_user_signal" in check.detail
    base = facts_22().slurm_config or {}
    for extra in ({"SlurmctldParameters": "enable_configless,preempt_send_user_signal"},
                  {"PreemptParameters": "reclaim_licenses,send_user_signal"}):
        (check,) = check_preempt_user_signal(facts_22(slurm_config={**base, **extra}), cfg)
        assert check.status == "ok", (extra, check.detail)
    cfg_24 = parse_show_config((DIR_24 / "scontrol-show-config.txt").read_text())
    (check,) = check_preempt_user_signal(facts_22(slurm_config=cfg_24), cfg)
    assert check.status == "warn"  # PreemptParameters = reclaim_licenses only


# --- a dead engine: named by the engine check, not blamed on the scrape config ---------------


def test_a_dead_serving_engine_fails_the_engine_check_by_its_health_url() -> None:
    """A serving replica whose engine does not answer /health fails `engine`, naming its URL;
    the lent gpu1's stopped engine is expected and not named."""
    down = "engine not answering GET http://gpu4:8000/health (connection refused)"
    facts = facts_22(engines=(EngineFacts("gpu1", "m", "command", down="engine not answering x"),
                              EngineFacts("gpu4", "m", "command", down=down)))
    check = check_engines(facts, config())[0]
    assert check.status == "fail"
    assert check.detail == f"gpu4: {down}"
    lent_only = facts_22(engines=(EngineFacts("gpu1", "m", "command", down="engine not answering x"),))
    assert check_engines(lent_only, config())[0].status == "ok"


def test_metrics_do_not_blame_the_scrape_config_for_a_dead_engine() -> None:
    """No series from a replica whose engine is down points to the engine check; a replica
    with a live engine and no series still blames the scrape config."""
    replicas = {"gpu1": ReplicaLoad("m", "gpu1", known=False), "gpu2": ReplicaLoad("m", "gpu2"),
                "gpu3": ReplicaLoad("m", "gpu3"), "gpu4": ReplicaLoad("m", "gpu4", known=False)}
    dead = (EngineFacts("gpu4", "m", "command", down="engine not answering GET http://gpu4:8000/health"),)
    check = check_metrics(facts_22(replicas=replicas, engines=dead), config())[0]
    assert check.status == "warn", check
    assert "scrape config" not in check.detail and "gpu4" in check.detail
    assert "engine check" in check.detail
    replicas["gpu3"] = ReplicaLoad("m", "gpu3", known=False)
    check = check_metrics(facts_22(replicas=replicas, engines=dead), config())[0]
    assert check.status == "fail" and "scrape config" in check.detail
    assert "gpu3" in check.detail.split(":")[0] and "gpu4: engine down" in check.detail


def test_engine_facts_name_a_dead_engine_and_skip_its_sleep_endpoint() -> None:
    """The doctor asks each engine for /health: refused reads `engine not answering GET
    URL/health (connection refused)`, and an http-sleep engine that is down is not told to
    start in dev mode (its /is_sleeping is not the problem)."""
    from slurm_idle.doctor import _engine_facts
    from slurm_idle.errors import EngineError

    class Refusing:
        def request(self, method: str, url: str, timeout: float) -> object:
            raise EngineError(f"{method} {url}: [Errno 111] Connection refused")

    cfg = parse_config("engine: {kind: http-sleep}\nmodels: [{name: m, replicas: "
                       "[{node: gpu1, url: 'http://127.0.0.1:8001'}]}]")
    facts = _engine_facts(cfg, Refusing())("gpu1", "m", cfg.engine_for("m"))
    assert facts.down == "engine not answering GET http://127.0.0.1:8001/health (connection refused)"
    assert facts.problems == ()
    [check] = check_engines(SiteFacts(engines=(facts,)), cfg)
    assert check.status == "fail" and "http://127.0.0.1:8001/health" in check.detail


def test_two_replicas_on_a_node_are_each_asked_for_health() -> None:
    """Two replicas on gpu5, the one on port 8001 dead: the engine check names it by its
    name and its own /health URL (each replica asked at its URL, not the node's first)."""
    from slurm_idle.doctor import _engine_facts
    from slurm_idle.doctor.gather import gather
    from slurm_idle.errors import CommandError, EngineError
    from slurm_idle.httpdeadline import HttpResponse
    from slurm_idle.lifecycle import format_reason
    from slurm_idle.model import Phase
    from slurm_idle.testing.fakes import FakeMetrics, FakeSlurm

    class Http:
        def request(self, method: str, url: str, timeout: float) -> HttpResponse:
            if ":8001/" in url:
                raise EngineError(f"{method} {url}: [Errno 111] Connection refused")
            return HttpResponse(200, b'{"version": "0.20.0"}' if url.endswith("/version") else b"")

    class NoSlurmCommands:
        def run(self, argv: object, input: str | None = None, timeout: float | None = None) -> object:
            raise CommandError(["scontrol"], 1, "not in this test")

    two = parse_config("""
engine: {kind: command, start_command: 'true', stop_command: 'true'}
models:
  - {name: m, gpus_per_replica: 4, nodes: gpu5, replicas_per_node: 2,
     url: 'http://127.0.0.1:{port}', ports: [8000, 8001]}
""")
    slurm = FakeSlurm.with_nodes(["gpu5"], gpus=8)
    slurm.drain("gpu5", format_reason(two.slurm.tag, Phase.SERVING, 0.0))
    facts = gather(two, NoSlurmCommands(), slurm, FakeMetrics(), _engine_facts(two, Http()))
    [check] = check_engines(facts, two)
    dead = next(r.name for r in two.models[0].replicas if r.url.endswith(":8001"))
    assert check.status == "fail", check.detail
    assert check.detail.startswith(
        f"{dead}: engine not answering GET http://127.0.0.1:8001/health (connection refused)"), check.detail
    assert ":8000/health" not in check.detail


# --- GPU memory series ---------------------------------------------------------------------


def test_gpu_series_for_every_pool_node_pass() -> None:
    """Fresh GPU memory series for all 4 pool nodes: ok, counting nodes and GPUs."""
    [check] = check_gpus(facts_22(), config())
    assert check.status == "ok", check.detail
    assert check.detail == ("fresh GPU memory series (DCGM_FI_DEV_FB_USED by Hostname) for all 4 "
                            "node(s), 16 GPU(s)")


def test_a_pool_node_without_gpu_series_fails_naming_it_and_what_is_lost() -> None:
    """gpu3 has no series: fail naming gpu3 (not the others), what is lost without them, and
    the fix; `doctor`'s order puts it right after the metrics check."""
    facts = facts_22()
    assert facts.gpus is not None
    [check] = check_gpus(replace(facts, gpus={n: g for n, g in facts.gpus.items() if n != "gpu3"}),
                         config())
    assert check.status == "fail"
    assert check.detail.startswith("no fresh GPU memory series (DCGM_FI_DEV_FB_USED by Hostname) "
                                   "for node(s) gpu3: a leftover process on these GPUs is not seen: "
                                   "engines would be woken on held GPUs (vLLM: CUDA out of memory) "
                                   "and lends not measured"), check.detail
    names = [c.name for c in run_checks(facts_22(), config())]
    assert names.index("gpus") == names.index("metrics") + 1


def test_gpu_series_are_checked_on_the_jobs_placement_nodes_too() -> None:
    """With a `placement: jobs` model, every node of its partition needs series as well."""
    cfg = parse_config("""
engine: {kind: command, start_command: 'true', stop_command: 'true'}
models:
  - {name: m, gpus_per_replica: 4, nodes: 'gpu[1-4]'}
  - {name: j, placement: jobs, job: {replicas: 2, command: serve, port_base: 9000}}
""")
    facts = facts_22()
    assert facts.nodes is not None and facts.gpus is not None
    partitioned = tuple(replace(n, partitions=("inference", "idle")) for n in facts.nodes)
    extra = replace(partitioned[0], name="gpu8")
    [check] = check_gpus(replace(facts, nodes=(*partitioned, extra)), cfg)
    assert check.status == "fail" and "for node(s) gpu8:" in check.detail, check.detail
    [check] = check_gpus(replace(facts, nodes=(*partitioned, extra),
                                 gpus={**facts.gpus, "gpu8": (GpuReading(0, 0),)}), cfg)
    assert check.status == "ok", check.detail


def test_gpu_series_not_read_fail_with_the_reason() -> None:
    """Prometheus down (or metrics.source scrape): the check fails with the reading's error."""
    [check] = check_gpus(facts_22(gpus=None, errors={"gpus": "cannot connect to Prometheus"}), config())
    assert check.status == "fail"
    assert check.detail.startswith("no GPU memory series read (cannot connect to Prometheus): "
                                   "a leftover process on these GPUs is not seen")


def test_gather_reads_the_gpus_of_the_pool_or_says_why_not() -> None:
    """gather asks the GPU source for every pool node; without a source (metrics.source
    scrape) the reason is recorded, and a failing source's error too."""
    from slurm_idle.doctor.gather import gather
    from slurm_idle.errors import CommandError
    from slurm_idle.testing.fakes import FakeGpus, FakeMetrics, FakeSlurm

    class NoCommands:
        def run(self, argv: object, input: str | None = None, timeout: float | None = None) -> object:
            raise CommandError(["scontrol"], 1, "not in this test")

    cfg = config()
    gpus = FakeGpus(nodes={"gpu1": (GpuReading(0, 5),)})
    slurm = FakeSlurm.with_nodes(["gpu1", "gpu2", "gpu3", "gpu4"])
    facts = gather(cfg, NoCommands(), slurm, FakeMetrics(), lambda *a: EngineFacts("gpu1", "m", "command"),
                   gpus=gpus)
    assert gpus.asked == [("gpu1", "gpu2", "gpu3", "gpu4")]
    assert facts.gpus == {"gpu1": (GpuReading(0, 5),)}
    bare = gather(cfg, NoCommands(), slurm, FakeMetrics(), lambda *a: EngineFacts("gpu1", "m", "command"))
    assert bare.gpus is None and "metrics.source is scrape" in bare.errors["gpus"]
    gpus.fail = True
    down = gather(cfg, NoCommands(), slurm, FakeMetrics(), lambda *a: EngineFacts("gpu1", "m", "command"),
                  gpus=gpus)
    assert down.gpus is None and down.errors["gpus"] == "fake GPU exporter is down"
