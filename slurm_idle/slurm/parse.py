"""Pure parsers of Slurm's JSON output (22.05 openapi v0.0.38 and 24.11 data_parser v0.0.40-42).

Scalars and GRES/TRES strings are read in parse_values.py, a job's `--signal` in jobsignal.py
(both re-exported here). No I/O here: the CLI backend hands in the decoded JSON document, tests hand in captured files
(tests/data/slurm-json/). The version is told by the content, not by asking Slurm:

- nodes: 22.05 `sinfo --json` has `nodes[]` with a lower-case `state` string + `state_flags`;
  24.11 `scontrol show node --json` has `nodes[]` with `state` as ONE upper-case list (base state
  and flags, e.g. ["IDLE", "DRAIN"]); 24.11 `sinfo --json` has `sinfo[]` grouped per partition
  with `nodes.nodes` name lists, `node.state` lists, `gres.{total,used}` and a `reason` object.
- numbers: plain ints in 22.05; often `{"set", "infinite", "number"}` objects in 24.11.
- jobs: `job_state` a string (22.05) or a list (24.11); GPU requests as `tres_per_node`
  "gres:gpu:2" (22.05) or "gres/gpu:2" (24.11); allocations as `gres_detail` "gpu:2(IDX:0-1)".
- accounting (`sacct --json`): `state.current` a string ("REQUEUED") or a list (["PENDING",
  "REQUEUED"] for the same run in 24.11); `restart_cnt` only in 24.11; a pending run's nodes
  read "None assigned"; GPUs from the allocated TRES list (`type` gres, `name` gpu).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import replace
from functools import lru_cache
from typing import Any

from slurm_idle.hostlist import expand_hostlist
from slurm_idle.model import SlurmJob, SlurmNode
from slurm_idle.slurm.jobsignal import (
    JobSignal,
    parse_signal_option,
    signal_from_script,
)
from slurm_idle.slurm.parse_values import (
    _EMPTY,
    SlurmJsonError,
    gres_count,
    gres_indexes,
    gres_list_count,
    major_minor,
    meta_release,
    number,
    parse_version_output,
    text,
    timestamp,
    tres_count,
)
from slurm_idle.slurm.protocol import AcctJob

__all__ = [
    "JobSignal",
    "SlurmJsonError",
    "gres_count",
    "gres_list_count",
    "major_minor",
    "meta_release",
    "number",
    "parse_signal_option",
    "parse_version_output",
    "signal_from_script",
    "text",
    "timestamp",
    "tres_count",
]

NODE_BASE_STATES = frozenset(
    {"UNKNOWN", "DOWN", "IDLE", "ALLOCATED", "ERROR", "MIXED", "FUTURE", "END"}
)
JOB_BASE_STATES = frozenset(
    {
        "PENDING",
        "RUNNING",
        "SUSPENDED",
        "COMPLETED",
        "CANCELLED",
        "FAILED",
        "TIMEOUT",
        "NODE_FAIL",
        "PREEMPTED",
        "BOOT_FAIL",
        "DEADLINE",
        "OUT_OF_MEMORY",
    }
)
# --- nodes ---------------------------------------------------------------------------------


def _split_state(state: Any, flags: Any = ()) -> tuple[str, frozenset[str]]:
    """Base state (lower case) and flags (upper case) from either version's fields."""
    try:  # a fleet has a handful of distinct states: parse each once
        key = (state if isinstance(state, str) else tuple(state or ()), tuple(flags or ()))
        return _split_state_cached(key)
    except TypeError:  # unhashable or not iterable: the uncached path (and its error)
        return _split_state_uncached(state, flags)


@lru_cache(maxsize=256)
def _split_state_cached(key: tuple[Any, tuple[Any, ...]]) -> tuple[str, frozenset[str]]:
    return _split_state_uncached(*key)


def _split_state_uncached(state: Any, flags: Any = ()) -> tuple[str, frozenset[str]]:
    if isinstance(state, str):
        words = [w for w in re.split(r"[+ ]", state) if w]
    else:
        words = [str(w) for w in state or ()]
    words = [w.upper() for w in words]
    base = next((w for w in words if w in NODE_BASE_STATES), words[0] if words else "UNKNOWN")
    rest = {w for w in words if w != base}
    rest.update(str(f).upper() for f in flags or ())
    return base.lower(), frozenset(rest)


def _node_from_record(rec: Mapping[str, Any]) -> SlurmNode:
    base, flags = _split_state(rec.get("state"), rec.get("state_flags"))
    return SlurmNode(
        name=str(rec["name"]),
        state=base,
        flags=flags,
        reason=text(rec.get("reason")),
        gpus_total=gres_count(rec.get("gres")),
        gpus_used=gres_count(rec.get("gres_used")),
        partitions=tuple(map(str, rec.get("partitions") or ())),
        comment=text(rec.get("comment")),
        reason_changed_at=timestamp(rec.get("reason_changed_at")),
    )


def _nodes_from_sinfo_groups(groups: Iterable[Mapping[str, Any]]) -> list[SlurmNode]:
    """24.11 `sinfo --json`: one entry per (partition, node group); merged back per node."""
    merged: dict[str, SlurmNode] = {}
    for group in groups:
        node_block = group.get("node") or {}
        base, flags = _split_state(node_block.get("state"))
        gres = group.get("gres") or {}
        reason = group.get("reason")
        partition = text((group.get("partition") or {}).get("name"))
        names = (group.get("nodes") or {}).get("nodes") or ()
        for name in names:
            prior = merged.get(name)
            parts = prior.partitions if prior else ()
            if partition and partition not in parts:
                parts = (*parts, partition)
            merged[name] = SlurmNode(
                name=str(name),
                state=base,
                flags=flags,
                reason=text(reason),
                gpus_total=gres_count(gres.get("total")),
                gpus_used=gres_count(gres.get("used")),
                partitions=parts,
                comment=text(group.get("comment")),
                reason_changed_at=timestamp(
                    reason.get("time") if isinstance(reason, Mapping) else None
                ),
            )
    return list(merged.values())


def parse_nodes(doc: Mapping[str, Any]) -> list[SlurmNode]:
    """Nodes from `sinfo --json` (22.05 or 24.11) or `scontrol show node --json` (23.02+)."""
    _raise_errors(doc)
    if "sinfo" in doc:
        return _nodes_from_sinfo_groups(doc["sinfo"] or ())
    if "nodes" in doc:
        return [_node_from_record(rec) for rec in doc["nodes"] or ()]
    raise SlurmJsonError(f"no 'nodes' or 'sinfo' in Slurm JSON (keys: {sorted(doc)[:8]})")


# --- jobs ----------------------------------------------------------------------------------


def job_state(state: Any) -> str:
    """Upper-case job state from a string (22.05) or a list with flags (24.11).

    A list carrying COMPLETING reads as COMPLETING, as 22.05's single string does.
    """
    if isinstance(state, str):
        return state.upper() or "UNKNOWN"
    words = [str(w).upper() for w in state or ()]
    if "COMPLETING" in words:
        return "COMPLETING"
    return next((w for w in words if w in JOB_BASE_STATES), words[0] if words else "UNKNOWN")


def acct_state(state: Any) -> str:
    """Upper-case state of one accounting run; a requeued run reads REQUEUED in both versions
    (22.05 says "REQUEUED", 24.11 ["PENDING", "REQUEUED"])."""
    if not isinstance(state, str) and "REQUEUED" in {str(w).upper() for w in state or ()}:
        return "REQUEUED"
    return job_state(state)


def _job_gpus(rec: Mapping[str, Any], node_count: int) -> int:
    """GPUs the job holds (allocated detail) or, if not running, asks for."""
    held = gres_list_count(rec.get("gres_detail"))
    if held:
        return held
    alloc = tres_count(rec.get("tres_alloc_str"))
    if alloc:
        return alloc
    per_job = tres_count(rec.get("tres_per_job"))
    if per_job:
        return per_job
    per_node = tres_count(rec.get("tres_per_node"))
    return per_node * max(node_count, 1)


def _job_gpu_indexes(rec: Mapping[str, Any]) -> tuple[tuple[int, ...], ...]:
    """Per node of the job (`gres_detail` is one entry per node, in node order), the indexes
    of the GPUs Slurm gave it there; () when it holds none (pending, or no GPU)."""
    details = rec.get("gres_detail") or ()
    if isinstance(details, str):
        details = [details]
    return tuple(gres_indexes(d) for d in details)


def _job_nodes(hostlist: str) -> tuple[str, ...]:
    """A job's node names; one plain name (most jobs of a GPU pool) without the hostlist parser."""
    if not hostlist:
        return ()
    if "[" not in hostlist and "," not in hostlist:
        name = hostlist.strip()  # what expand_hostlist makes of a single name
        return (name,) if name else ()
    return tuple(expand_hostlist(hostlist))


def _job_from_record(rec: Mapping[str, Any]) -> SlurmJob:
    state = job_state(rec.get("job_state"))
    nodes = _job_nodes(text(rec.get("nodes")))
    node_count = int(number(rec.get("node_count")) or len(nodes) or 1)
    started = timestamp(rec.get("start_time"))
    if state == "PENDING":
        started = None  # for a pending job Slurm puts its expected start here
    return SlurmJob(
        job_id=int(number(rec.get("job_id")) or 0),
        name=text(rec.get("name")),
        partition=text(rec.get("partition")),
        state=state,
        nodes=nodes,
        restart_count=int(number(rec.get("restart_cnt")) or 0),
        requeue=bool(rec.get("requeue", True)),
        start_time=started,
        gpus=_job_gpus(rec, node_count),
        gpu_indexes=_job_gpu_indexes(rec),
        comment=text(rec.get("comment")),
        user=text(rec.get("user_name")),
        state_reason=text(rec.get("state_reason")),
        batch=bool(rec.get("batch_flag", True)),
        account=text(rec.get("account")),
        submit_time=timestamp(rec.get("submit_time")),
    )


def parse_jobs(doc: Mapping[str, Any]) -> list[SlurmJob]:
    """Jobs from `squeue --json` (22.05 or 24.11) or `scontrol show job --json` (23.02+)."""
    _raise_errors(doc)
    if "jobs" not in doc:
        raise SlurmJsonError(f"no 'jobs' in Slurm JSON (keys: {sorted(doc)[:8]})")
    return [_job_from_record(rec) for rec in doc["jobs"] or ()]


# --- accounting ----------------------------------------------------------------------------


def _acct_gpus(rec: Mapping[str, Any]) -> int:
    tres = rec.get("tres") or {}
    allocated = tres.get("allocated") if isinstance(tres, Mapping) else None
    if isinstance(allocated, list):
        untyped, typed = 0, 0
        for item in allocated:
            if item.get("type") == "gres" and str(item.get("name", "")).split(":")[0] == "gpu":
                count = int(number(item.get("count")) or 0)
                if ":" in str(item.get("name")):
                    typed += count
                else:
                    untyped += count
        return untyped or typed
    return tres_count(rec.get("alloc_tres") or rec.get("tres_alloc_str"))


def _acct_comment(value: Any) -> str:
    if isinstance(value, Mapping):
        return text(value.get("job"))
    return text(value)


def _acct_from_record(rec: Mapping[str, Any]) -> AcctJob:
    state_block = rec.get("state") or {}
    current = state_block.get("current") if isinstance(state_block, Mapping) else state_block
    times = rec.get("time") or {}
    start, end = timestamp(times.get("start")), timestamp(times.get("end"))
    elapsed = number(times.get("elapsed"))
    if elapsed is None:
        elapsed = (end - start) if start and end else 0.0
    nodes_text = text(rec.get("nodes"))
    return AcctJob(
        job_id=int(number(rec.get("job_id")) or 0),
        name=text(rec.get("name")),
        partition=text(rec.get("partition")),
        state=acct_state(current),
        start=start,
        end=end,
        elapsed_s=float(elapsed),
        gpus=_acct_gpus(rec),
        restarts=int(number(rec.get("restart_cnt")) or 0),
        nodes=tuple(expand_hostlist(nodes_text)) if nodes_text not in _EMPTY else (),
        comment=_acct_comment(rec.get("comment")),
        time_limit_s=None if (limit := number(times.get("limit"))) is None else limit * 60.0,
        user=text(rec.get("user")),
        exit_code=_exit_number(rec.get("exit_code"), "return_code"),
        signal=_exit_signal(rec.get("exit_code")),
        reason=_reason(state_block.get("reason") if isinstance(state_block, Mapping) else None),
    )


#: Run states whose exit code 22.05's JSON may have lost (cli_backend._mend_exit_codes).
EXIT_SUSPECT_STATES = frozenset({"FAILED", "TIMEOUT", "OUT_OF_MEMORY", "NODE_FAIL"})


def parse_exit_codes(text: str) -> dict[int, list[tuple[int, int]]]:
    """`sacct -P -o JobIDRaw,ExitCode` lines (`12|3:0`) -> {job id: [(code, signal)] per run,
    in sacct's order}."""
    out: dict[int, list[tuple[int, int]]] = {}
    for line in text.splitlines():
        job, _, value = line.strip().partition("|")
        code, _, sig = value.partition(":")
        if job.isdigit() and code.isdigit() and (not sig or sig.isdigit()):
            out.setdefault(int(job), []).append((int(code), int(sig or 0)))
    return out


def _exit_number(block: Any, key: str) -> int | None:
    """`exit_code.return_code`: an int (22.05) or a `{set, number}` object (24.11)."""
    if not isinstance(block, Mapping):
        return None
    value = number(block.get(key))
    return None if value is None else int(value)


def _exit_signal(block: Any) -> int | None:
    """The signal that ended a run: `exit_code.signal.id` (24.11); 22.05 says only `status`
    SIGNALED and puts the signal number in `return_code`."""
    if not isinstance(block, Mapping):
        return None
    sig = block.get("signal")
    if isinstance(sig, Mapping) and (value := number(sig.get("id"))) is not None:
        return int(value)
    status = block.get("status")
    statuses = status if isinstance(status, list) else [status]
    if "SIGNALED" in statuses:
        return _exit_number(block, "return_code")
    return None


def _reason(value: Any) -> str:
    """Slurm's state reason, "" for its placeholder "None"."""
    reason = text(value)
    return "" if reason in ("None", "none") else reason


def parse_accounting(doc: Mapping[str, Any]) -> list[AcctJob]:
    """Job records from `sacct --json` (one per run when `--duplicates` was given).

    A requeued job has one record per run, oldest first; when the JSON has no restart count,
    each record's `restarts` is the number of earlier runs of the same job in the document.
    An empty window is no error: 22.05's sacct answers it with error 9003 ("Nothing found",
    ESLURM_REST_EMPTY_RESULT) beside an empty `jobs`.
    """
    if isinstance(doc, Mapping) and not doc.get("jobs") and _only_empty_result(doc.get("errors")):
        return []
    _raise_errors(doc)
    if "jobs" not in doc:
        raise SlurmJsonError(f"no 'jobs' in sacct JSON (keys: {sorted(doc)[:8]})")
    records = [_acct_from_record(rec) for rec in doc["jobs"] or ()]
    has_count = any("restart_cnt" in rec for rec in doc["jobs"] or ())
    if has_count:
        return records
    seen: dict[int, int] = {}
    numbered = []
    for rec in sorted(records, key=lambda r: (r.job_id, r.start or float("inf"))):
        runs = seen.get(rec.job_id, 0)
        seen[rec.job_id] = runs + 1
        numbered.append(replace(rec, restarts=runs))
    return numbered


# --- errors --------------------------------------------------------------------------------


#: Slurm's ESLURM_REST_EMPTY_RESULT: a query that matched nothing.
EMPTY_RESULT = 9003


def _only_empty_result(errors: Any) -> bool:
    """The errors list holds only "nothing found" entries (at least one)."""
    return bool(errors) and isinstance(errors, list) and all(
        isinstance(e, Mapping) and e.get("error_number") == EMPTY_RESULT for e in errors)


def _raise_errors(doc: Mapping[str, Any]) -> None:
    if not isinstance(doc, Mapping):
        raise SlurmJsonError(f"Slurm JSON must be an object, got {type(doc).__name__}")
    errors = doc.get("errors") or ()
    if errors:
        first = errors[0]
        if isinstance(first, Mapping):
            message = first.get("description") or first.get("error") or str(first)
        else:
            message = str(first)
        raise SlurmJsonError(f"Slurm reported an error: {message}")


