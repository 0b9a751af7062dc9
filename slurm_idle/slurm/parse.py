"""Pure parsers of Slurm's JSON output (22.05 openapi v0.0.38 and 24.11 data_parser v0.0.40-42).

No I/O here: the CLI backend hands in the decoded JSON document, tests hand in captured files
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
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Any

from slurm_idle.errors import SlurmIdleError
from slurm_idle.hostlist import expand_hostlist
from slurm_idle.model import SlurmJob, SlurmNode
from slurm_idle.slurm.protocol import AcctJob

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
_EMPTY = {"", "(null)", "N/A", "none", "None", "None assigned"}


class SlurmJsonError(SlurmIdleError, ValueError):
    """The document is not Slurm JSON of a shape we know."""


# --- scalars -------------------------------------------------------------------------------


def number(value: Any) -> float | None:
    """A Slurm number: plain, or `{set, infinite, number}` (None when unset or infinite)."""
    if type(value) is int:  # the common case first (bool is a subclass, not this type)
        return float(value)
    if value is None or isinstance(value, bool):
        return None
    if isinstance(value, int | float):
        return float(value)
    if isinstance(value, Mapping):
        if not value.get("set", True) or value.get("infinite", False):
            return None
        return number(value.get("number"))
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return None
    return None


def timestamp(value: Any) -> float | None:
    """A unix time, None when unset or 0 (Slurm's "never")."""
    ts = number(value)
    return ts if ts else None


def text(value: Any) -> str:
    """A Slurm string: plain, or an object with a `description` (24.11 sinfo reasons)."""
    if type(value) is str:  # the common case first
        return value
    if value is None:
        return ""
    if isinstance(value, Mapping):
        return text(value.get("description", ""))
    return str(value)


def meta_release(doc: Mapping[str, Any]) -> str | None:
    """The Slurm release a JSON document was made by (`meta.Slurm` in 22.05, `meta.slurm` later)."""
    meta = doc.get("meta") or {}
    slurm = meta.get("Slurm") or meta.get("slurm") or {}
    release = slurm.get("release")
    if release:
        return str(release)
    version = slurm.get("version") or {}
    if "major" in version:
        return f"{int(version['major'])}.{int(version['minor']):02d}.{int(version.get('micro', 0))}"
    return None


def parse_version_output(output: str) -> str:
    """`sinfo --version` ("slurm 22.05.8", "slurm-wlm 24.11.5") -> "22.05.8"."""
    match = re.search(r"(\d+)\.(\d+)(?:\.(\d+))?", output)
    if not match:
        raise SlurmJsonError(f"cannot read a Slurm version from {output.strip()!r}")
    major, minor, micro = match.groups()
    return f"{int(major)}.{int(minor):02d}.{int(micro or 0)}"


def major_minor(version: str) -> tuple[int, int]:
    """ "24.11.5" -> (24, 11)."""
    parts = re.findall(r"\d+", version)
    if len(parts) < 2:
        raise SlurmJsonError(f"not a Slurm version: {version!r}")
    return int(parts[0]), int(parts[1])


# --- GRES / TRES strings -------------------------------------------------------------------


def _split_outside_parens(s: str) -> list[str]:
    parts: list[str] = []
    cur: list[str] = []
    depth = 0
    for ch in s:
        depth += ch == "("
        depth -= ch == ")"
        if ch == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    parts.append("".join(cur))
    return [p.strip() for p in parts if p.strip()]


def gres_count(gres: Any, name: str = "gpu") -> int:
    """Count of one GRES in a node/job GRES string.

    Handles `gpu:4`, `gpu:tesla:4(S:0)`, `gpu:2(IDX:0-1)`, `gpu:(null):0(IDX:N/A)`,
    `gpu` (one), lists of several types (summed) and other GRES (ignored).
    """
    return _gres_count_text(text(gres), name)


@lru_cache(maxsize=1024)  # a fleet repeats a handful of GRES strings over thousands of records
def _gres_count_text(gres: str, name: str) -> int:
    total = 0
    for item in _split_outside_parens(gres):
        if item in _EMPTY:
            continue
        fields = re.sub(r"\([^()]*\)$", "", item).split(":")
        if fields[0].strip() != name:
            continue
        last = fields[-1].strip()
        # "gpu" and "gpu:tesla" mean one; "gpu:(null):0" and "gpu:tesla:4" carry a count.
        count = int(last) if len(fields) > 1 and last.isdigit() else int(len(fields) <= 2)
        total += count
    return total


def gres_list_count(details: Any, name: str = "gpu") -> int:
    """Sum of a GRES over a per-node list such as a job's `gres_detail`."""
    if isinstance(details, str):
        return gres_count(details, name)
    return sum(gres_count(d, name) for d in details or ())


def tres_count(tres: Any, name: str = "gpu") -> int:
    """Count of `gres/<name>` in a TRES string: `gres/gpu:2`, `gres:gpu:2`, `gres/gpu=4`,
    `gres/gpu:a100=4`, `gres:gpu:a100:2` (typed entries count only when no untyped total is
    given, since Slurm lists both the total and its typed parts)."""
    return _tres_count_text(text(tres), name)


@lru_cache(maxsize=1024)
def _tres_count_text(tres: str, name: str) -> int:
    untyped: int | None = None
    typed = 0
    for item in _split_outside_parens(tres):
        if not item.startswith(("gres/", "gres:")):
            continue
        body = item[5:]
        if "=" in body:
            left, _, right = body.partition("=")
            fields, count = left.split(":"), int(right) if right.isdigit() else 0
        else:
            fields = body.split(":")
            if len(fields) > 1 and fields[-1].isdigit():
                count, fields = int(fields[-1]), fields[:-1]
            else:
                count = 1
        if fields[0] != name:
            continue
        if len(fields) == 1:
            untyped = (untyped or 0) + count
        else:
            typed += count
    return untyped if untyped is not None else typed


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
        comment=text(rec.get("comment")),
        user=text(rec.get("user_name")),
        state_reason=text(rec.get("state_reason")),
        batch=bool(rec.get("batch_flag", True)),
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
    )


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


# --- a job's own --signal --------------------------------------------------------------------


@dataclass(frozen=True)
class JobSignal:
    """A job's `--signal=[{R|B}:]SIG[@TIME]`: the signal it asked for before its end, and
    whether to the batch shell only (`B:`) or to its steps (Slurm's default)."""

    signal: str  # a name without SIG (USR2) or a number, as scancel --signal takes it
    batch_shell: bool = False


_SIGNAL_OPTION = re.compile(r"^(?:(?P<flags>[RB]+):)?(?P<sig>[A-Za-z0-9+]+)(?:@\d+)?$")


def parse_signal_option(value: str) -> JobSignal | None:
    """`B:USR2@60` -> JobSignal("USR2", batch_shell=True); None for anything else."""
    m = _SIGNAL_OPTION.match(value.strip())
    if m is None:
        return None
    sig = m.group("sig").upper().removeprefix("SIG")
    if not sig.replace("+", "").isalnum():
        return None
    return JobSignal(sig, batch_shell="B" in (m.group("flags") or ""))


def signal_from_script(script: str) -> JobSignal | None:
    """The `#SBATCH --signal` of a batch script, as sbatch reads it: `#SBATCH` lines up to the
    first command (submitit writes `#SBATCH --signal=USR2@90` there). Slurm's job JSON does
    not carry the option (neither 22.05 nor 24.11: checked on captured output), so the
    script is where it can be read back; `--signal` given on the sbatch command line is not
    visible anywhere and gets the configured default."""
    found: JobSignal | None = None
    for line in script.splitlines()[1:] if script.startswith("#!") else script.splitlines():
        stripped = line.strip()
        if not stripped or (stripped.startswith("#") and not stripped.startswith("#SBATCH")):
            continue
        if not stripped.startswith("#SBATCH"):
            break  # sbatch stops reading options at the first command
        words = stripped[len("#SBATCH"):].split()
        for i, word in enumerate(words):
            if word.startswith("--signal="):
                found = parse_signal_option(word.split("=", 1)[1]) or found
            elif word == "--signal" and i + 1 < len(words):
                found = parse_signal_option(words[i + 1]) or found
    return found
