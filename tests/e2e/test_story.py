"""The whole lend/reclaim story on the real sandbox (issue 3's done-when), then its report.

Low load lends >= 2 nodes; an admin's drain survives every later tick untouched; the demo
container job runs on a lent node; a load rise brings every lent node back to serving with the
job requeued (Restarts >= 1, never FAILED/CANCELLED); load down again and the job finishes,
having resumed from its checkpoint. Afterwards `slurm-idle report --json` shows the demo job's
GPU-hours and its preemption, matching sacct for that job (issue 7). The README's quote of the
demo's output is checked against this run's lines.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import pytest

from slurm_idle.journal import Journal
from slurm_idle.testing.demo import ADMIN_REASON, CLIENT_RPS, DemoReport, Story, verdict
from tests.readme_excerpt import README, excerpt, missing_lines

pytestmark = [pytest.mark.sandbox, pytest.mark.slow]


@pytest.fixture(scope="module")
def story_output() -> list[str]:
    """Every line the story printed, in order (filled by the story fixture)."""
    return []


@pytest.fixture(scope="module")
def story(sandbox: Any, story_output: list[str]) -> tuple[Any, DemoReport]:
    def out(line: str) -> None:
        story_output.append(line)
        print(line, flush=True)

    report = Story(sandbox, out=out, step_s=0.5).run()  # the job's 120 steps in a minute
    print(f"MEASURE reclaim_to_serving_s={report.reclaim_to_serving_s} "
          f"timings_s={report.timings_s} lost_gpu_s={report.lost_gpu_s}")
    return sandbox, report


def test_low_load_lends_at_least_two_nodes(story: tuple[Any, DemoReport]) -> None:
    """A few ticks at 0.2 req/s lend >= 2 nodes and the job runs on one of them."""
    _, r = story
    assert len(r.lent_nodes_at_low_load) >= 2
    assert r.job_first_node in r.lent_nodes_at_low_load


def test_admin_drain_is_never_touched(story: tuple[Any, DemoReport]) -> None:
    """The admin-drained node keeps its Reason and no transition ever names it afterwards."""
    sb, r = story
    assert r.admin_reason_after == ADMIN_REASON
    from slurm_idle.config import load_config

    journal = Journal(__import__("pathlib").Path(load_config(sb.config_path).paths.journal))
    drained_at = None
    for rec in journal.records():
        if rec.get("event") == "transition" and rec.get("node") == r.admin_node:
            drained_at = rec["ts"]  # the adoption, before the admin drained it
    later = [rec for rec in journal.records() if rec.get("event") == "transition"
             and rec.get("node") == r.admin_node and drained_at is not None and rec["ts"] > drained_at]
    assert later == []
    assert r.admin_node not in r.reclaim_to_serving_s


def test_high_load_reclaims_every_lent_node_and_requeues_the_job(story: tuple[Any, DemoReport]) -> None:
    """The load rise brings every lent node back with a healthy engine; the job is requeued, not failed."""
    _, r = story
    assert r.reclaimed_all_serving
    assert set(r.reclaim_to_serving_s) == set(r.lent_nodes_at_low_load)
    assert r.job_restarts >= 1
    assert r.job_state_after_reclaim not in {"FAILED", "CANCELLED", "NODE_FAIL", "TIMEOUT"}


def test_job_resumes_from_checkpoint_and_completes(story: tuple[Any, DemoReport]) -> None:
    """Load down again: the job finishes with resumed_from=K>0 and the uninterrupted result."""
    _, r = story
    assert r.job_final_state == "COMPLETED"
    assert r.resumed_from is not None and r.resumed_from > 0
    workload = [line for line in r.job_output_tail if not line.startswith("slurm-idle-run:")]
    assert workload[-1] == "done steps=120 sum=7260"


def test_the_demo_verdict_is_ok(story: tuple[Any, DemoReport]) -> None:
    """What `scripts/demo` would print: OK, so no client request through the router failed
    because of a lend or a reclaim (aborted, reset, 502/503) or for an unexplained reason."""
    _, r = story
    ok, lines = verdict(r)
    assert ok, (lines, r.client_traffic)
    assert r.client_traffic["drain_failures"] == 0
    # the clients' CLIENT_RPS ran through the whole story (open loop: about one a second)
    assert r.client_traffic["requests"] >= 0.7 * CLIENT_RPS * r.timings_s["whole"], r.timings_s


def test_report_matches_sacct_for_the_demo_job(story: tuple[Any, DemoReport]) -> None:
    """`slurm-idle report --json` counts the demo job's GPU-hours and its preemption as sacct does."""
    sb, r = story
    proc = sb.run([sys.executable, "-m", "slurm_idle.cli", "report", "--json"],
                  capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    acct = sb.run(["sacct", "-D", "-X", "-n", "-P", "-j", str(r.job_id),
                   "--format=JobID,State,ElapsedRaw,AllocTRES"], capture_output=True, text=True)
    runs = [line.split("|") for line in acct.stdout.splitlines() if line.strip()]
    gpu_seconds = 0
    for _, _, elapsed, tres in runs:
        gpus = next((int(t.split("=")[1]) for t in tres.split(",") if t.startswith("gres/gpu=")), 0)
        gpu_seconds += int(elapsed or 0) * gpus
    assert len(runs) >= 2  # the preempted run and the completed one
    per_job = {int(j["job_id"]): j for j in report["per_job"]}
    demo = per_job[r.job_id]
    assert demo["preemptions"] >= 1 and demo["runs"] == len(runs)
    assert demo["gpu_hours"] == pytest.approx(gpu_seconds / 3600, abs=2e-3)
    assert report["preemptions"] >= demo["preemptions"]
    assert report["gpu_hours"] >= demo["gpu_hours"]


def test_readme_demo_excerpt_is_what_the_story_prints(story: tuple[Any, DemoReport],
                                                       story_output: list[str]) -> None:
    """Every line the README quotes from `scripts/demo` appears in this run's output, in order
    (times ignored; `...` in a quoted line stands for the text that varies from run to run)."""
    quoted = excerpt(README.read_text())
    assert len(quoted) >= 10
    missing = missing_lines(quoted, story_output)
    assert missing == [], f"README demo excerpt lines not printed (in order) by the story: {missing}"
