"""etc/job_submit.lua run by a stock Lua 5.3 with a stand-in `slurm` table (no slurmctld).

The contract test (tests/contract/test_job_submit_lua.py) runs the same file in a real
slurmctld; this one reaches cases a live cluster with JobRequeue=1 cannot show, such as a
requeue flag left unset being turned into 1 by the plugin itself.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

LUA_SCRIPT = Path(__file__).resolve().parents[2] / "etc" / "job_submit.lua"
LUA = shutil.which("lua5.3") or shutil.which("lua")

pytestmark = pytest.mark.skipif(LUA is None, reason="no lua interpreter (apt-get install lua5.3)")

DRIVER = """
local user_msg = ""
slurm = {SUCCESS = 0, ERROR = -1,
         log_info = function(...) end,
         log_user = function(fmt, ...) user_msg = string.format(fmt, ...) end}
dofile(SCRIPT)
local parts = {idle = {name = "idle", flag_default = PART_DEFAULT_IDLE},
               inference = {name = "inference", flag_default = 0}}
local job = {partition = PARTITION, requeue = REQUEUE, name = "j", script = SCRIPT_TEXT}
local rc
if MODIFY then
  rc = slurm_job_modify(job, {partition = RECORD_PARTITION}, parts, 0)
else
  rc = slurm_job_submit(job, parts, 0)
end
print(rc, tostring(job.requeue), user_msg)
"""

NO_VAL16 = 65534


def run_lua(partition: str | None, requeue: int | None, modify: bool = False,
            record_partition: str = "idle", idle_default: int = 1,
            script: str | None = "#!/bin/sh\\nsleep 1") -> tuple[int, str, str]:
    def lua_value(v: object) -> str:
        return "nil" if v is None else (f'"{v}"' if isinstance(v, str) else str(v))

    prelude = (f"SCRIPT = {lua_value(str(LUA_SCRIPT))}\nPARTITION = {lua_value(partition)}\n"
               f"REQUEUE = {lua_value(requeue)}\nMODIFY = {'true' if modify else 'false'}\n"
               f"RECORD_PARTITION = {lua_value(record_partition)}\n"
               f"PART_DEFAULT_IDLE = {idle_default}\n"
               f"SCRIPT_TEXT = {lua_value(script)}\n")
    assert LUA is not None
    out = subprocess.run([LUA, "-"], input=prelude + DRIVER, capture_output=True, text=True,
                         timeout=30, check=True).stdout
    rc, requeue_out, msg = out.rstrip("\n").split("\t")
    return int(rc), requeue_out, msg


def test_unset_requeue_on_idle_becomes_requeueable() -> None:
    """A job on idle that did not say --requeue gets requeue=1 from the plugin."""
    assert run_lua("idle", NO_VAL16)[:2] == (0, "1")


def test_default_partition_idle_counts_as_idle() -> None:
    """No -p at all, idle being the default partition: the rule applies too."""
    assert run_lua(None, NO_VAL16)[:2] == (0, "1")
    assert run_lua(None, NO_VAL16, idle_default=0)[:2] == (0, str(NO_VAL16))


def test_no_requeue_on_idle_is_rejected_with_a_clear_message() -> None:
    """--no-requeue (requeue=0) on idle, even in a partition list, is refused and says why."""
    for partition in ("idle", "inference,idle"):
        rc, _, msg = run_lua(partition, 0)
        assert rc == -1 and "--no-requeue is not allowed" in msg and "'idle'" in msg


def test_other_partitions_are_untouched() -> None:
    """Jobs on inference keep whatever the user asked for."""
    assert run_lua("inference", 0)[:2] == (0, "0")
    assert run_lua("inference", NO_VAL16)[:2] == (0, str(NO_VAL16))


def test_modify_to_no_requeue_is_refused_on_idle_only() -> None:
    """`scontrol update job requeue=0` is refused for an idle job, allowed elsewhere."""
    assert run_lua(None, 0, modify=True)[0] == -1
    assert run_lua(None, 0, modify=True, record_partition="inference")[0] == 0
    assert run_lua(None, NO_VAL16, modify=True)[0] == 0


def test_moving_a_job_onto_idle_makes_it_requeueable() -> None:
    """`scontrol update job=N partition=idle` of a job from elsewhere (perhaps --no-requeue:
    the lua API does not show the record's flag) sets requeue=1 in the same update."""
    assert run_lua("idle", NO_VAL16, modify=True, record_partition="inference")[:2] == (0, "1")
    assert run_lua("inference,idle", NO_VAL16, modify=True,
                   record_partition="inference")[:2] == (0, "1")
    rc, _, msg = run_lua("idle", 0, modify=True, record_partition="inference")
    assert rc == -1 and "--no-requeue is not allowed" in msg


def test_other_updates_leave_the_requeue_flag_alone() -> None:
    """An update that does not change the partition, or moves a job off idle, sets nothing."""
    assert run_lua(None, NO_VAL16, modify=True)[:2] == (0, str(NO_VAL16))
    assert run_lua("inference", NO_VAL16, modify=True)[:2] == (0, str(NO_VAL16))


def test_interactive_job_on_idle_is_rejected() -> None:
    """srun/salloc hand the plugin no script (job_desc.script nil): refused on idle with a
    message; on inference the same job passes."""
    rc, _, msg = run_lua("idle", NO_VAL16, script=None)
    assert rc == -1 and "takes batch jobs only" in msg
    assert run_lua("inference", NO_VAL16, script=None)[0] == 0
