"""Pure parsers of Slurm's plain-text `scontrol show config`, `show partition` and `show job`.

`slurm-idle doctor` reads the cluster's configuration, which has no JSON form that serves both
releases: 22.05's scontrol knows no `--json` at all, and 24.11's `scontrol show partition
--json` (data_parser v0.0.42) leaves out each partition's PreemptMode, the one field the doctor
needs most (see tests/data/slurm-json/24.11/scontrol-show-partition.json). The text output
carries everything in both releases, so it is what these functions read; they are tested on
captured output of both (tests/data/slurm-text/22.05, tests/data/slurm-json/24.11).
The in-job runner reads `scontrol show job JOBID` text for its own job's state and preemption
time (the same on both releases; no JSON form on 22.05).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from slurm_idle.hostlist import expand_hostlist

#: Values Slurm prints for "not set".
UNSET = frozenset({"", "(null)", "N/A", "NONE", "none", "None"})


def parse_show_config(text: str) -> dict[str, str]:
    """`scontrol show config` as {key: value}; `Key = Value` lines, the first of a key wins
    (later sections such as the cgroup or MPI ones repeat nothing the doctor reads)."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition("=")
        key = key.strip()
        if not sep or not key or " " in key:
            continue
        out.setdefault(key, value.strip())
    return out


def is_unset(value: str | None) -> bool:
    return value is None or value.strip() in UNSET


_DURATION_UNITS = {"sec": 1.0, "secs": 1.0, "min": 60.0, "mins": 60.0, "hour": 3600.0, "hours": 3600.0}


def parse_duration_s(value: str | None) -> float | None:
    """A Slurm duration as seconds: `5 sec`, `30`, `00:02:00`, `1-00:00:00`, `2 min`.

    None for unset, `INFINITE`, `UNLIMITED` or anything unreadable.
    """
    if value is None:
        return None
    text = value.strip()
    if is_unset(text) or text.upper() in {"INFINITE", "UNLIMITED"}:
        return None
    match = re.fullmatch(r"(\d+)\s*([a-z]*)", text)
    if match:
        unit = match.group(2)
        if unit and unit not in _DURATION_UNITS:
            return None
        return float(match.group(1)) * _DURATION_UNITS.get(unit, 1.0)
    days = 0
    if "-" in text:
        head, _, text = text.partition("-")
        if not head.isdigit():
            return None
        days = int(head)
    parts = text.split(":")
    if not all(p.isdigit() for p in parts) or not 1 <= len(parts) <= 3:
        return None
    seconds = 0
    for part in parts:
        seconds = seconds * 60 + int(part)
    return float(days * 86400 + seconds)


@dataclass(frozen=True)
class PartitionInfo:
    """What the doctor needs of one partition."""

    name: str
    nodes: tuple[str, ...]
    priority_tier: int | None
    preempt_mode: str  # upper case as Slurm prints it (REQUEUE, OFF, CANCEL, GANG,REQUEUE...)
    grace_time_s: float | None
    state: str
    # Who may submit (None: Slurm did not print it). All ALL and RootOnly=NO: open to every user.
    allow_groups: str | None = None
    allow_accounts: str | None = None
    allow_qos: str | None = None
    root_only: bool = False

    @property
    def preempt_modes(self) -> frozenset[str]:
        return frozenset(m.strip().upper() for m in self.preempt_mode.split(",") if m.strip())

    @property
    def open_to_all(self) -> bool:
        """Every user may submit here: AllowGroups, AllowAccounts and AllowQos all ALL and not
        RootOnly (False when Slurm did not print AllowGroups: unknown is not claimed open)."""
        if self.root_only or self.allow_groups is None:
            return False
        return all((v or "ALL").upper() == "ALL"
                   for v in (self.allow_groups, self.allow_accounts, self.allow_qos))


def _records(text: str, first_key: str) -> list[dict[str, str]]:
    """`Key=Value` tokens grouped into records, each starting at `first_key`.

    Works on the multi-line default output and on `scontrol -o` (one line a record).
    """
    records: list[dict[str, str]] = []
    for token in text.split():
        key, sep, value = token.partition("=")
        if not sep:
            continue
        if key == first_key:
            records.append({})
        if records:
            records[-1].setdefault(key, value)
    return records


def _int_or_none(value: str | None) -> int | None:
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


def parse_show_partitions(text: str) -> list[PartitionInfo]:
    """`scontrol show partition` (22.05 or 24.11, multi-line or `-o`) as PartitionInfo."""
    out = []
    for rec in _records(text, "PartitionName"):
        nodes = rec.get("Nodes", "")
        out.append(PartitionInfo(
            name=rec["PartitionName"],
            nodes=() if is_unset(nodes) else tuple(expand_hostlist(nodes)),
            priority_tier=_int_or_none(rec.get("PriorityTier")),
            preempt_mode=rec.get("PreemptMode", "").upper(),
            grace_time_s=parse_duration_s(rec.get("GraceTime")),
            state=rec.get("State", "").upper(),
            allow_groups=rec.get("AllowGroups"),
            allow_accounts=rec.get("AllowAccounts"),
            allow_qos=rec.get("AllowQos"),
            root_only=rec.get("RootOnly", "NO").upper() == "YES",
        ))
    return out



def preempted_in_this_run(show_job: str) -> bool:
    """True when `scontrol show job` says this run was preempted (PreemptTime >= StartTime).

    Both are local ISO times (2026-12-02T16:33:38) or None/Unknown: comparable as text.
    """
    fields = dict(
        word.split("=", 1) for word in show_job.split() if "=" in word and not word.startswith("=")
    )
    preempt, start = fields.get("PreemptTime", "None"), fields.get("StartTime", "Unknown")
    if not preempt[:1].isdigit() or not start[:1].isdigit():
        return False
    return preempt >= start


# --- `scontrol show job` (what the in-job runner asks about its own job) ----------------------

#: JobStates in which Slurm is ending the job (a requeue, scancel, the time limit, ...): a
#: SIGTERM then starts KillWait, not a grace period. RUNNING (a preemption's GraceTime, the
#: agent's step-only SIGTERM) and anything unknown keep the grace.
ENDING_STATES = frozenset({
    "COMPLETING", "CANCELLED", "TIMEOUT", "PENDING", "REQUEUED", "REQUEUE_FED",
    "REQUEUE_HOLD", "FAILED", "NODE_FAIL", "PREEMPTED", "DEADLINE", "OUT_OF_MEMORY",
    "COMPLETED", "BOOT_FAIL", "SPECIAL_EXIT",
})


def show_job_state(show_job: str) -> str:
    """JobState from `scontrol show job` text ("" when absent)."""
    for word in show_job.split():
        if word.startswith("JobState="):
            return word.split("=", 1)[1].split("+", 1)[0].upper()
    return ""
