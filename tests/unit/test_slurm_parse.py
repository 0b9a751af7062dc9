"""Slurm JSON parsers read captured 22.05 and 24.11 output into the same domain values."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from slurm_idle.slurm import parse
from slurm_idle.slurm.parse import SlurmJsonError

DATA = Path(__file__).parent.parent / "data" / "slurm-json"


def load(rel: str) -> Any:
    return json.loads((DATA / rel).read_text())


# --- nodes ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "sample",
    ["22.05/sinfo.json", "24.11/scontrol-show-node.json", "24.11/sinfo.json"],
)
def test_drained_node_same_in_every_shape(sample: str) -> None:
    """gpu1, drained with our tagged reason, parses identically from every node JSON shape."""
    nodes = {n.name: n for n in parse.parse_nodes(load(sample))}
    gpu1 = nodes["gpu1"]
    assert gpu1.state == "idle"
    assert gpu1.flags == frozenset({"DRAIN"})
    assert gpu1.drained
    assert gpu1.reason == "slurm-idle:serving since=2026-12-02T10:00:00Z"
    assert (gpu1.gpus_total, gpu1.gpus_used) == (4, 0)
    assert gpu1.partitions == ("inference", "idle")
    assert gpu1.reason_changed_at is not None and gpu1.reason_changed_at > 1.7e9


@pytest.mark.parametrize(
    "sample",
    ["22.05/sinfo.json", "24.11/scontrol-show-node.json", "24.11/sinfo.json"],
)
def test_busy_node_counts_used_gpus(sample: str) -> None:
    """gpu2 running a 2-GPU job is mixed, not drained, with 2 of 4 GPUs used and no reason time."""
    gpu2 = {n.name: n for n in parse.parse_nodes(load(sample))}["gpu2"]
    assert gpu2.state == "mixed" and not gpu2.flags and not gpu2.drained
    assert (gpu2.gpus_total, gpu2.gpus_used) == (4, 2)
    assert gpu2.reason == "" and gpu2.reason_changed_at is None


def test_all_22_05_nodes_listed() -> None:
    """22.05 `sinfo --json` lists every node once."""
    assert [n.name for n in parse.parse_nodes(load("22.05/sinfo.json"))] == [
        "gpu1", "gpu2", "gpu3", "gpu4",
    ]


def test_24_11_grouped_sinfo_merges_partitions() -> None:
    """24.11 `sinfo --json` has one entry per partition; each node appears once with both."""
    nodes = parse.parse_nodes(load("24.11/sinfo.json"))
    assert sorted(n.name for n in nodes) == ["gpu1", "gpu2"]
    assert all(n.partitions == ("inference", "idle") for n in nodes)


def test_older_24_11_data_parser_reads_the_same() -> None:
    """The v0.0.40 rendering of the node gives the same SlurmNode as the default v0.0.42."""
    old = parse.parse_nodes(load("24.11/older-parsers/scontrol-show-node-gpu1.v0.0.40.json"))
    new = parse.parse_nodes(load("24.11/scontrol-show-node-gpu1.json"))
    assert old == new


def test_node_comment_and_down_flags() -> None:
    """A comment is kept and DOWN+NOT_RESPONDING reads as a down node with that flag."""
    doc = {"nodes": [{"name": "n1", "state": ["DOWN", "NOT_RESPONDING"], "comment": "x=1"}]}
    (node,) = parse.parse_nodes(doc)
    assert node.state == "down" and node.flags == {"NOT_RESPONDING"} and node.down
    assert node.comment == "x=1"


def test_draining_node_22_05_string_flags() -> None:
    """A 22.05 busy drained node (mixed + DRAIN) keeps its base state and the flag."""
    doc = {"nodes": [{"name": "n1", "state": "mixed", "state_flags": ["DRAIN"]}]}
    (node,) = parse.parse_nodes(doc)
    assert node.state == "mixed" and node.drained


# --- jobs ----------------------------------------------------------------------------------


@pytest.mark.parametrize("version", ["22.05", "24.11"])
def test_running_and_pending_jobs(version: str) -> None:
    """A running 2-GPU idle job on gpu2 and a pending 4-GPU one parse alike in both versions."""
    running, pending = parse.parse_jobs(load(f"{version}/squeue.json"))
    assert (running.job_id, running.state, running.partition) == (1, "RUNNING", "idle")
    assert running.nodes == ("gpu2",) and running.gpus == 2
    assert running.requeue and running.restart_count == 0
    assert running.start_time is not None and running.user == "root"
    assert (pending.job_id, pending.state, pending.nodes) == (2, "PENDING", ())
    assert pending.gpus == 4 and pending.start_time is None
    assert pending.state_reason == "Resources"
    # Submit time and account: what tells a replica job of an older agent (replicatrust.py).
    assert running.submit_time == {"22.05": 1796218592, "24.11": 1796218665}[version]
    assert running.account == ""  # the captures ran without accounting: no account set


@pytest.mark.parametrize("name", ["22.05/squeue.json", "24.11/squeue.json",
                                  "24.11/older-parsers/squeue.v0.0.40.json",
                                  "24.11/older-parsers/squeue.v0.0.41.json",
                                  "24.11/scontrol-show-job-1-after-requeue.json"])
def test_a_jobs_account_is_read(name: str) -> None:
    """A job's account (a plain string in every release's JSON): replica jobs under another
    account than the model's `--account` are not the agent's (replicatrust.py)."""
    doc = load(name)
    doc["jobs"][0]["account"] = "inference"
    job = parse.parse_jobs(doc)[0]
    assert job.account == "inference" and job.submit_time is not None and job.user == "root"


@pytest.mark.parametrize("version", ["22.05", "24.11"])
def test_requeued_job_counts_restart(version: str) -> None:
    """After `scontrol requeue`, the job is PENDING (BeginTime) with restart count 1."""
    jobs = {j.job_id: j for j in parse.parse_jobs(load(f"{version}/squeue-after-requeue.json"))}
    assert jobs[1].state == "PENDING" and jobs[1].restart_count == 1
    assert jobs[1].state_reason == "BeginTime"
    assert jobs[2].state == "RUNNING" and jobs[2].gpus == 4


def test_preempted_job_goes_back_pending() -> None:
    """24.11: a job preempted by the inference partition is PENDING with a restart counted."""
    jobs = {j.job_id: j for j in parse.parse_jobs(load("24.11/preempt/squeue-after-preempt.json"))}
    assert jobs[2].state == "PENDING" and jobs[2].restart_count == 1
    assert jobs[4].partition == "inference" and jobs[4].nodes == ("gpu2",)


def test_scontrol_show_job_json_is_accepted() -> None:
    """24.11 `scontrol show job --json` parses with the same parser as squeue."""
    (job,) = parse.parse_jobs(load("24.11/scontrol-show-job-1.json"))
    assert job.job_id == 1 and job.state == "RUNNING" and job.gpus == 2


def test_job_state_lists() -> None:
    """A state list reads as its base state, COMPLETING wins, a plain string is upper-cased."""
    assert parse.job_state(["PENDING", "REQUEUED"]) == "PENDING"
    assert parse.job_state(["RUNNING", "COMPLETING"]) == "COMPLETING"
    assert parse.job_state("running") == "RUNNING"
    assert parse.job_state([]) == "UNKNOWN"


def test_multi_node_job_hostlist_expanded() -> None:
    """A job's hostlist expression becomes the list of its nodes; GPUs sum over gres_detail."""
    doc = {"jobs": [{"job_id": 7, "job_state": ["RUNNING"], "nodes": "gpu[1-2]",
                     "gres_detail": ["gpu:4(IDX:0-3)", "gpu:4(IDX:0-3)"],
                     "start_time": {"set": True, "infinite": False, "number": 100}}]}
    (job,) = parse.parse_jobs(doc)
    assert job.nodes == ("gpu1", "gpu2") and job.gpus == 8 and job.start_time == 100.0


@pytest.mark.parametrize("version", ["22.05", "24.11"])
def test_a_running_jobs_gpu_indexes_per_node(version: str) -> None:
    """`gres_detail` "gpu:4(IDX:0-3)": the GPUs Slurm gave the job on each of its nodes (what
    a replica job's GPU wait is named by); a pending job has none."""
    jobs = {j.state: j for j in parse.parse_jobs(load(f"{version}/squeue-after-requeue.json"))}
    assert jobs["RUNNING"].gpu_indexes == ((0, 1, 2, 3),) and jobs["PENDING"].gpu_indexes == ()


@pytest.mark.parametrize(("detail", "indexes"), [
    (["gpu:4(IDX:0-1,4-5)", "gpu:a100:2(IDX:3,7)"], ((0, 1, 4, 5), (3, 7))),
    (["gpu:(null):0(IDX:N/A)"], ((),)),
    ("gpu:1(IDX:6)", ((6,),)),
])
def test_gpu_indexes_of_each_shape(detail: Any, indexes: tuple[tuple[int, ...], ...]) -> None:
    """Ranges, lists and typed GPUs per node; no index for a node without a GPU."""
    doc = {"jobs": [{"job_id": 7, "job_state": "RUNNING", "nodes": "gpu[1-2]", "gres_detail": detail}]}
    assert parse.parse_jobs(doc)[0].gpu_indexes == indexes


def test_pending_multi_node_request() -> None:
    """A pending job's per-node GPU request is multiplied by its node count."""
    doc = {"jobs": [{"job_id": 8, "job_state": "PENDING", "nodes": "",
                     "node_count": {"set": True, "infinite": False, "number": 2},
                     "tres_per_node": "gres/gpu:4"}]}
    assert parse.parse_jobs(doc)[0].gpus == 8


# --- GRES / TRES / numbers -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("gres", "count"),
    [
        ("gpu:4", 4),
        ("gpu:tesla:4(S:0)", 4),
        ("gpu:2(IDX:0-1)", 2),
        ("gpu:2(IDX:0,2)", 2),
        ("gpu:(null):0(IDX:N/A)", 0),
        ("gpu", 1),
        ("gpu:a100:2(S:0),gpu:v100:1", 3),
        ("shard:8,gpu:1", 1),
        ("N/A", 0),
        ("(null)", 0),
        ("", 0),
    ],
)
def test_gres_count(gres: str, count: int) -> None:
    """GPU counts are read from every GRES string form Slurm prints."""
    assert parse.gres_count(gres) == count


@pytest.mark.parametrize(
    ("tres", "count"),
    [
        ("gres:gpu:2", 2),
        ("gres/gpu:2", 2),
        ("cpu=1,mem=1000M,node=1,billing=1,gres/gpu=4", 4),
        ("gres/gpu=4,gres/gpu:a100=4", 4),
        ("gres/gpu:a100=2,gres/gpu:v100=1", 3),
        ("gres:gpu:a100:2", 2),
        ("gres/shard:3", 0),
        ("cpu=1", 0),
    ],
)
def test_tres_count(tres: str, count: int) -> None:
    """GPU counts are read from TRES strings without double counting typed entries."""
    assert parse.tres_count(tres) == count


def test_numbers_and_timestamps() -> None:
    """Plain numbers pass; unset or infinite number objects are None; time 0 means never."""
    assert parse.number(5) == 5.0
    assert parse.number({"set": True, "infinite": False, "number": 7}) == 7.0
    assert parse.number({"set": False, "infinite": False, "number": 7}) is None
    assert parse.number({"set": True, "infinite": True, "number": 0}) is None
    assert parse.timestamp(0) is None and parse.timestamp({"set": True, "number": 0}) is None


def test_versions() -> None:
    """Releases are read from both meta shapes and from `sinfo --version`."""
    assert parse.meta_release(load("22.05/sinfo.json")) == "22.05.8"
    assert parse.meta_release(load("24.11/squeue.json")) == "24.11.5"
    assert parse.meta_release({"meta": {"Slurm": {"version": {"major": 23, "minor": 2, "micro": 1}}}}) == "23.02.1"
    assert parse.parse_version_output("slurm-wlm 24.11.5\n") == "24.11.5"
    assert parse.major_minor("22.05.8") == (22, 5)


# --- errors and accounting -----------------------------------------------------------------


def test_errors_in_document_raise() -> None:
    """A document whose `errors` list is not empty raises with Slurm's message."""
    doc = {"errors": [{"error": "x", "description": "Unable to contact slurm controller"}],
           "nodes": []}
    with pytest.raises(SlurmJsonError, match="Unable to contact"):
        parse.parse_nodes(doc)


def test_unknown_shape_raises() -> None:
    """A JSON object without nodes or jobs is refused, naming what it had."""
    with pytest.raises(SlurmJsonError, match="no 'nodes'"):
        parse.parse_nodes({"meta": {}})
    with pytest.raises(SlurmJsonError, match="no 'jobs'"):
        parse.parse_jobs({"meta": {}})


def _acct(job_id: int, state: Any, start: Any, end: Any, **extra: Any) -> dict[str, Any]:
    return {"job_id": job_id, "name": "demo", "partition": "idle", "nodes": "gpu1",
            "state": {"current": state, "reason": "None"},
            "time": {"start": start, "end": end, "elapsed": 10},
            "tres": {"allocated": [{"type": "cpu", "name": "", "count": 1},
                                   {"type": "gres", "name": "gpu", "count": 2}]},
            "comment": {"job": "c", "administrator": "", "system": ""}, **extra}


def test_accounting_runs_numbered() -> None:
    """Each run of a requeued job is one record; restarts counts the earlier runs."""
    doc = {"jobs": [_acct(5, "COMPLETED", 200, 210), _acct(5, "REQUEUED", 100, 110),
                    _acct(6, ["RUNNING"], {"set": True, "infinite": False, "number": 300}, 0)]}
    runs = parse.parse_accounting(doc)
    assert [(r.job_id, r.state, r.restarts) for r in runs] == [
        (5, "REQUEUED", 0), (5, "COMPLETED", 1), (6, "RUNNING", 0)]
    assert runs[2].end is None and runs[2].start == 300.0
    assert all(r.gpus == 2 and r.nodes == ("gpu1",) and r.comment == "c" for r in runs)


def test_accounting_restart_count_when_reported() -> None:
    """When sacct reports restart_cnt, it is taken as is."""
    (run,) = parse.parse_accounting({"jobs": [_acct(9, ["COMPLETED"], 1, 2, restart_cnt=3)]})
    assert run.restarts == 3 and run.elapsed_s == 10.0


def test_accounting_22_05_requeued_run() -> None:
    """Captured 22.05 sacct: a requeued job has a REQUEUED run then a COMPLETED one, 1 GPU each."""
    runs = parse.parse_accounting(load("22.05/sacct-requeued.json"))
    assert [(r.job_id, r.state, r.restarts, r.gpus, r.nodes) for r in runs] == [
        (1, "REQUEUED", 0, 1, ("gpu1",)), (1, "COMPLETED", 1, 1, ("gpu1",))]
    assert runs[0].elapsed_s == 3 and runs[0].start and runs[0].end


def test_accounting_22_05_preempted_run() -> None:
    """Captured 22.05 sacct: a preempted idle job shows PREEMPTED, then a pending run on no node."""
    runs = {(r.job_id, r.restarts): r for r in parse.parse_accounting(load("22.05/sacct-preempted.json"))}
    assert runs[(2, 0)].state == "PREEMPTED" and runs[(2, 0)].gpus == 4
    assert runs[(2, 0)].elapsed_s == 19
    pending = runs[(2, 1)]
    assert pending.state == "PENDING" and pending.nodes == () and pending.start is None
    assert runs[(3, 0)].partition == "inference" and runs[(3, 0)].state == "COMPLETED"


def test_accounting_24_11_requeued_run() -> None:
    """Captured 24.11 sacct: the requeued run (["PENDING","REQUEUED"]) reads REQUEUED, as in
    22.05, and restart_cnt numbers the runs."""
    runs = parse.parse_accounting(load("24.11/sacct-requeued.json"))
    assert [(r.state, r.restarts, r.gpus, r.nodes) for r in runs] == [
        ("REQUEUED", 0, 1, ("gpu2",)), ("CANCELLED", 1, 1, ("gpu2",))]


def test_accounting_24_11_preempted_run() -> None:
    """Captured 24.11 sacct: a preempted run, the inference job, then the resumed run."""
    runs = parse.parse_accounting(load("24.11/sacct-preempted.json"))
    assert [(r.job_id, r.state, r.restarts, r.gpus) for r in runs] == [
        (2, "PREEMPTED", 0, 4), (3, "COMPLETED", 0, 4), (2, "RUNNING", 1, 4)]
    assert runs[0].elapsed_s == 19 and runs[2].end is None


def test_accounting_of_an_empty_window_is_no_job_not_an_error() -> None:
    """22.05's sacct answers a window without jobs with error 9003 "Nothing found" and no
    jobs: that is an empty list (a report of a quiet day), while any other error still raises."""
    empty = {"errors": [{"description": "Nothing found", "error_number": 9003,
                         "error": "Nothing found with query", "source": "slurmdb_jobs_get"}],
             "jobs": []}
    assert parse.parse_accounting(empty) == []
    other = {"errors": [*empty["errors"], {"error": "Unable to connect", "error_number": 7000}],
             "jobs": []}
    with pytest.raises(parse.SlurmJsonError, match="Nothing found"):
        parse.parse_accounting(other)


def test_interactive_jobs_are_told_from_batch_jobs() -> None:
    """`batch_flag` (22.05 and 24.11): an srun job is not a batch job (Slurm cannot requeue it)."""
    import json as _json

    from slurm_idle.slurm.parse import parse_jobs as _parse_jobs

    base = Path(__file__).parent.parent / "data" / "slurm-json"
    (srun,) = _parse_jobs(_json.loads((base / "22.05" / "squeue-interactive.json").read_text()))
    assert srun.batch is False and srun.state == "RUNNING"
    for release in ("22.05", "24.11"):
        jobs = _parse_jobs(_json.loads((base / release / "squeue.json").read_text()))
        assert jobs and all(j.batch for j in jobs)


def test_a_jobs_own_signal_is_read_from_its_batch_script() -> None:
    """`#SBATCH --signal` lines (captured 22.05 batch script; submitit's form), as sbatch reads
    them: up to the first command; `B:` means the batch shell."""
    from slurm_idle.slurm.parse import JobSignal, parse_signal_option, signal_from_script

    base = Path(__file__).parent.parent / "data" / "slurm-json" / "22.05"
    assert signal_from_script((base / "batch-script-signal.txt").read_text()) == \
        JobSignal("USR2", batch_shell=True)
    assert signal_from_script("#!/bin/bash\n#SBATCH --signal=USR2@90\nsrun x\n") == JobSignal("USR2")
    assert signal_from_script("#!/bin/bash\n#SBATCH -J x\n#SBATCH --signal SIGUSR1@30\n") == \
        JobSignal("USR1")
    assert signal_from_script("#!/bin/bash\necho\n#SBATCH --signal=USR2@90\n") is None
    assert parse_signal_option("R:10@60") == JobSignal("10")
    assert parse_signal_option("USR2;rm -rf") is None


@pytest.mark.parametrize("release", ["22.05", "24.11"])
def test_accounting_carries_user_exit_code_and_no_none_reason(release: str) -> None:
    """Each run's user and exit code (22.05: a plain int; 24.11: a {set, number} object) are
    read; Slurm's reason "None" is "" (never the string "None" in `jobs --json`)."""
    runs = parse.parse_accounting(load(f"{release}/sacct-preempted.json"))
    assert runs and all(r.user == "root" and r.exit_code == 0 for r in runs)
    assert {r.reason for r in runs} == {"", "BeginTime"}  # the pending run waited for its begin
    assert all(r.signal in (None, 0) for r in runs)


def test_exit_codes_from_sacct_text_per_run_in_order() -> None:
    """`JobIDRaw|ExitCode` lines: code and signal apart, one per run, junk skipped."""
    text = "12|0:0\n12|3:0\n13|0:9\nbatch|1:0\n14|\n"
    assert parse.parse_exit_codes(text) == {12: [(0, 0), (3, 0)], 13: [(0, 9)]}
