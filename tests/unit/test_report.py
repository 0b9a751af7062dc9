"""Aggregation of accounting runs and journal records into the report (pure)."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from slurm_idle.report import build_report, journal_facts, lost_seconds, percentile
from slurm_idle.report_model import Period, ReportSettings, csv_rows, render_text
from slurm_idle.slurm.parse import parse_accounting
from slurm_idle.slurm.protocol import AcctJob

DATA = Path(__file__).resolve().parents[1] / "data" / "sacct" / "22.05"
H = 3600.0


def ts(text: str) -> float:
    return datetime.fromisoformat(text).replace(tzinfo=UTC).timestamp()


def run(job_id: int, start: str, end: str | None, gpus: int = 1, state: str = "COMPLETED",
        partition: str = "idle", restarts: int = 0) -> AcctJob:
    s, e = ts(start), (ts(end) if end else None)
    return AcctJob(job_id=job_id, name=f"j{job_id}", partition=partition, state=state, start=s,
                   end=e, elapsed_s=(e or s) - s, gpus=gpus, restarts=restarts)


def step(node: str, src: str, dst: str, at: str, duration_s: float = 0.0,
         outcome: str = "ok") -> dict[str, Any]:
    return {"event": "transition", "ts": ts(at), "node": node, "model": "m", "action": "x",
            "from": src, "to": dst, "reason": "r", "outcome": outcome, "duration_s": duration_s}


def report(runs: list[AcctJob], journal: list[dict[str, Any]] | None = None, **kw: Any) -> Any:
    args: dict[str, Any] = {
        "since": ts("2026-12-01T00:00:00"), "until": ts("2026-12-03T00:00:00"),
        "now": ts("2026-12-10T00:00:00"), "partition": "idle", "price_per_gpu_hour": 2.0, "currency": "EUR",
    }
    args.update(kw)
    period = Period(args.pop("since"), args.pop("until"), args.pop("now"), args.pop("timezone", "UTC"))
    journal_path = args.pop("journal_path", None)
    return build_report(runs, journal or [], period, ReportSettings(**args), journal_path)


def test_job_crossing_midnight_is_split_between_days() -> None:
    """A 4-GPU job from 22:00 to 02:00 puts 8 GPU-hours on each day and 16 in the total."""
    r = report([run(1, "2026-12-01T22:00:00", "2026-12-02T02:00:00", gpus=4)])
    assert [d.day.isoformat() for d in r.days] == ["2026-12-01", "2026-12-02"]
    assert [d.gpu_hours for d in r.days] == pytest.approx([8.0, 8.0])
    assert r.gpu_hours == pytest.approx(16.0)
    assert [d.jobs for d in r.days] == [1, 1]
    assert r.jobs == 1


def test_days_split_at_local_midnight_of_the_timezone() -> None:
    """In Europe/Paris (UTC+1 in December) the same job splits 4 + 12 GPU-hours."""
    r = report([run(1, "2026-12-01T22:00:00", "2026-12-02T02:00:00", gpus=4)],
               timezone="Europe/Paris")
    by_day = {d.day.isoformat(): d.gpu_hours for d in r.days}
    # 22:00Z = 23:00 Paris: one hour before local midnight, three after.
    assert by_day["2026-12-01"] == pytest.approx(4.0)
    assert by_day["2026-12-02"] == pytest.approx(12.0)


def test_runs_are_clipped_to_the_period() -> None:
    """Only the part of a run inside [since, until) counts."""
    r = report([run(1, "2026-11-30T23:00:00", "2026-12-01T01:00:00", gpus=2)])
    assert r.gpu_hours == pytest.approx(2.0)


def test_running_job_counts_until_now_not_until_the_end_of_the_period() -> None:
    """A run without an end counts up to `now`, never into the future."""
    r = report([run(1, "2026-12-01T10:00:00", None, gpus=1, state="RUNNING")],
               now=ts("2026-12-01T13:00:00"))
    assert r.gpu_hours == pytest.approx(3.0)


def test_requeued_job_counts_once_with_each_preemption() -> None:
    """Two preempted runs then a completed one: 1 job, 3 runs, 2 preemptions, all GPU-hours."""
    runs = [
        run(7, "2026-12-01T01:00:00", "2026-12-01T02:00:00", gpus=4, state="PREEMPTED"),
        run(7, "2026-12-01T03:00:00", "2026-12-01T03:30:00", gpus=4, state="REQUEUED"),
        run(7, "2026-12-01T04:00:00", "2026-12-01T06:00:00", gpus=4, state="COMPLETED"),
    ]
    r = report(runs)
    assert (r.jobs, r.job_runs, r.preemptions) == (1, 3, 2)
    assert (r.jobs_completed, r.jobs_requeued) == (1, 1)
    assert r.gpu_hours == pytest.approx(4 * 3.5)
    # No checkpoint interval configured: the whole interrupted runs are lost (upper bound).
    assert r.lost_gpu_hours == pytest.approx(4 * 1.5)
    job = r.per_job[0]
    assert (job.runs, job.preemptions, job.state) == (3, 2, "COMPLETED")


def test_lost_work_with_a_checkpoint_interval_is_the_tail_of_each_run() -> None:
    """With checkpoints every 20 min a preempted run loses at most 20 min x its GPUs."""
    runs = [
        run(7, "2026-12-01T01:00:00", "2026-12-01T02:00:00", gpus=4, state="PREEMPTED"),
        run(7, "2026-12-01T03:00:00", "2026-12-01T03:10:00", gpus=4, state="PREEMPTED"),
    ]
    r = report(runs, checkpoint_interval_s=1200)
    assert r.lost_gpu_hours == pytest.approx(4 * (20 + 10) / 60)
    assert lost_seconds(3600, None) == 3600
    assert lost_seconds(3600, 600) == 600


def test_preemption_is_counted_on_the_day_the_run_ended() -> None:
    """A run preempted after midnight adds its preemption to the second day."""
    r = report([run(1, "2026-12-01T23:00:00", "2026-12-02T00:30:00", state="PREEMPTED")])
    assert [d.preemptions for d in r.days] == [0, 1]


def test_other_partitions_and_never_started_runs_are_ignored() -> None:
    """Inference jobs and runs without a start add nothing."""
    runs = [
        run(1, "2026-12-01T01:00:00", "2026-12-01T02:00:00", gpus=4, partition="inference"),
        AcctJob(job_id=2, name="p", partition="idle", state="PENDING", start=None, end=None,
                elapsed_s=0, gpus=1),
    ]
    r = report(runs)
    assert (r.gpu_hours, r.jobs) == (0.0, 0)


def test_savings_are_gpu_hours_at_the_configured_price() -> None:
    """10 GPU-hours at 2 EUR are 20 EUR, per day and in total."""
    r = report([run(1, "2026-12-01T00:00:00", "2026-12-01T05:00:00", gpus=2)])
    out = r.to_json()
    assert (out["savings"], out["currency"]) == (20.0, "EUR")
    assert out["days"][0]["savings"] == 20.0


def test_percentile_interpolates_between_ranks() -> None:
    """p95 of 1..20 is 19.05 and p50 10.5; an empty list has no percentile."""
    values = [float(v) for v in range(20, 0, -1)]
    assert percentile(values, 95) == pytest.approx(19.05)
    assert percentile(values, 50) == pytest.approx(10.5)
    assert percentile([42.0], 95) == 42.0
    assert percentile([], 95) is None


def test_reclaim_latency_runs_from_reclaim_start_to_serving() -> None:
    """lent->reclaiming at 10:00 and starting->serving ending 10:02 is a 120 s reclaim."""
    journal = [
        step("gpu1", "lent", "reclaiming", "2026-12-01T10:00:00", 1.0),
        step("gpu1", "reclaiming", "starting", "2026-12-01T10:00:30", 0.5),
        step("gpu1", "starting", "serving", "2026-12-01T10:01:00", 0.0, outcome="waiting"),
        step("gpu1", "starting", "serving", "2026-12-01T10:01:50", 10.0),
    ]
    r = report([], journal)
    assert r.reclaims == 1
    assert r.reclaim_latencies == 1
    assert r.reclaim_latency_s_p95 == pytest.approx(120.0)
    assert r.reclaim_latency_s_p50 == pytest.approx(120.0)


def test_reclaim_latency_p95_over_several_nodes() -> None:
    """Reclaims of 60, 120 and 600 s have p50 120 s and p95 552 s."""
    journal = []
    for node, seconds in (("a", 60), ("b", 120), ("c", 600)):
        journal.append(step(node, "lent", "reclaiming", "2026-12-01T10:00:00"))
        end = datetime.fromtimestamp(ts("2026-12-01T10:00:00") + seconds, UTC)
        journal.append(step(node, "starting", "serving", end.strftime("%Y-%m-%dT%H:%M:%S")))
    r = report([], journal)
    assert r.reclaim_latency_s_p50 == pytest.approx(120.0)
    assert r.reclaim_latency_s_p95 == pytest.approx(120 + 0.9 * 480)


def test_failed_steps_change_no_phase_and_count_nothing() -> None:
    """An errored lend step is neither a lend nor a phase change."""
    journal = [
        step("gpu1", "lending", "lent", "2026-12-01T10:00:00", outcome="error"),
        step("gpu2", "lending", "lent", "2026-12-01T11:00:00"),
    ]
    facts = journal_facts(journal, since=ts("2026-12-01T00:00:00"),
                          until=ts("2026-12-02T00:00:00"), now=ts("2026-12-05T00:00:00"))
    assert facts.lends == 1
    assert {iv.node for iv in facts.intervals} == {"gpu2"}


def facts_of(journal: list[dict[str, Any]]) -> Any:
    return journal_facts(journal, since=ts("2026-12-01T00:00:00"),
                         until=ts("2026-12-02T00:00:00"), now=ts("2026-12-05T00:00:00"))


def test_a_lend_is_a_node_that_reached_lent() -> None:
    """A retirement called off (retiring -> serving) lends nothing; the full
    serving -> retiring -> lending -> lent chain is one lend."""
    journal = [
        step("gpu1", "serving", "retiring", "2026-12-01T10:00:00"),
        step("gpu1", "retiring", "serving", "2026-12-01T10:01:00"),
        step("gpu2", "serving", "retiring", "2026-12-01T10:00:00"),
        step("gpu2", "retiring", "lending", "2026-12-01T10:01:00"),
        step("gpu2", "lending", "lent", "2026-12-01T10:02:00"),
    ]
    assert facts_of(journal).lends == 1


def test_an_abandoned_reclaim_does_not_stretch_the_next_latency() -> None:
    """A reclaim that never reached serving (the node went lending -> starting, say) is
    dropped; the next reclaim's latency starts at its own lent -> reclaiming step."""
    journal = [
        step("gpu1", "lent", "reclaiming", "2026-12-01T08:00:00"),
        step("gpu1", "reclaiming", "starting", "2026-12-01T08:01:00"),
        # the start failed for hours; the admin lent it again by hand, then a new reclaim
        step("gpu1", "starting", "serving", "2026-12-01T08:05:00", outcome="error"),
        step("gpu1", "serving", "retiring", "2026-12-01T09:00:00"),
        step("gpu1", "retiring", "lending", "2026-12-01T09:01:00"),
        step("gpu1", "lending", "lent", "2026-12-01T09:02:00"),
        step("gpu1", "lent", "reclaiming", "2026-12-01T10:00:00"),
        step("gpu1", "reclaiming", "starting", "2026-12-01T10:00:30"),
        step("gpu1", "starting", "serving", "2026-12-01T10:01:30"),
    ]
    facts = facts_of(journal)
    assert facts.reclaim_latencies_s == (90.0,)
    assert facts.reclaims == 2
    # The node put back to lent by hand (no journaled step): the newer reclaim still counts.
    gap = [journal[0], *journal[6:]]
    assert facts_of(gap).reclaim_latencies_s == (90.0,)


def test_a_reclaim_left_by_lending_to_starting_is_abandoned() -> None:
    """lent -> reclaiming, then (journal gap) lending -> starting -> serving: no latency, as the
    node left the reclaim chain before reaching serving."""
    journal = [
        step("gpu1", "lent", "reclaiming", "2026-12-01T08:00:00"),
        step("gpu1", "lending", "starting", "2026-12-01T09:00:00"),
        step("gpu1", "starting", "serving", "2026-12-01T09:01:00"),
    ]
    assert facts_of(journal).reclaim_latencies_s == ()


def test_phase_hours_and_lent_gpu_hours_follow_the_node_timeline() -> None:
    """A 4-GPU node lent from 02:00 to 05:00 spends 3 h lent (12 lent GPU-hours)."""
    journal = [
        {"event": "tick", "ts": ts("2026-12-01T00:00:00"), "errors": 0},
        step("gpu1", "lending", "lent", "2026-12-01T02:00:00"),
        step("gpu1", "lent", "reclaiming", "2026-12-01T05:00:00"),
        step("gpu1", "reclaiming", "starting", "2026-12-01T05:10:00"),
        step("gpu1", "starting", "serving", "2026-12-01T05:20:00"),
    ]
    r = report([], journal, until=ts("2026-12-02T00:00:00"), node_gpus={"gpu1": 4})
    ph = r.phase_hours
    assert ph["lending"] == pytest.approx(2.0)  # from the journal's first record
    assert ph["lent"] == pytest.approx(3.0)
    assert ph["reclaiming"] == pytest.approx(10 / 60)
    assert ph["serving"] == pytest.approx(24 - 5 - 20 / 60)
    assert r.lent_gpu_hours == pytest.approx(12.0)
    assert r.lent_gpus_per_hour[2:5] == pytest.approx((4.0, 4.0, 4.0))
    assert r.lent_gpus_per_hour[5] == 0.0
    assert r.ticks == 1


def test_used_gpus_per_hour_is_the_mean_over_the_hour() -> None:
    """A 2-GPU job running half of an hour shows 1 GPU used in that hour."""
    r = report([run(1, "2026-12-01T03:00:00", "2026-12-01T03:30:00", gpus=2)],
               until=ts("2026-12-01T06:00:00"))
    assert r.used_gpus_per_hour == pytest.approx((0, 0, 0, 1.0, 0, 0))


def test_json_has_the_documented_keys() -> None:
    """`report --json` carries every key the issue names."""
    out = report([run(1, "2026-12-01T00:00:00", "2026-12-01T01:00:00")]).to_json()
    required = {"gpu_hours", "jobs", "preemptions", "lost_gpu_hours", "reclaim_latency_s_p95",
                "savings", "currency", "days"}
    assert required <= set(out)
    json.dumps(out)  # serialisable as is
    assert isinstance(out["jobs"], int) and isinstance(out["days"], list)


def test_empty_period_is_refused() -> None:
    """until <= since is an error, not an empty report."""
    with pytest.raises(ValueError):
        report([], since=ts("2026-12-02T00:00:00"), until=ts("2026-12-01T00:00:00"))


def test_captured_sacct_output_gives_the_hand_computed_numbers() -> None:
    """Real 22.05 `sacct --json -D -X`: 6 idle jobs, 2 interrupted runs, GPU-hours by hand."""
    doc = json.loads((DATA / "sacct-XD.json").read_text())
    runs = parse_accounting(doc)
    r = report(runs, since=ts("2026-12-02T00:00:00"), until=ts("2026-12-03T00:00:00"))
    # job 1: 3 s x1, job 2: (24+25) s x4, job 4: (8+20) s x2, job 5: cancelled 1x(its run),
    # job 6: 2 s x1, job 7: no GPU; job 3 ran in `inference`.
    per_job = {j.job_id: j for j in r.per_job}
    assert set(per_job) == {1, 2, 4, 5, 6, 7}
    assert per_job[2].gpu_hours == pytest.approx(4 * 49 / H)
    assert per_job[4].gpu_hours == pytest.approx(2 * 28 / H)
    assert (per_job[2].preemptions, per_job[4].preemptions) == (1, 1)
    assert r.preemptions == 2
    assert r.lost_gpu_hours == pytest.approx((4 * 24 + 2 * 8) / H)
    expected = sum(
        (x.end - x.start) * x.gpus for x in runs if x.partition == "idle" and x.start and x.end
    )
    assert r.gpu_hours == pytest.approx(expected / H)


def test_csv_rows_end_with_a_total() -> None:
    """The CSV table has one row per day and a total row."""
    rows = csv_rows(report([run(1, "2026-12-01T22:00:00", "2026-12-02T02:00:00", gpus=4)]))
    assert [r["date"] for r in rows] == ["2026-12-01", "2026-12-02", "total"]
    assert rows[-1]["gpu_hours"] == pytest.approx(16.0)


def test_text_report_names_the_totals() -> None:
    """The human report shows GPU-hours, money saved with its currency, and preemptions."""
    text = render_text(report([run(1, "2026-12-01T00:00:00", "2026-12-01T05:00:00", gpus=2,
                                   state="PREEMPTED")]))
    assert "10.00" in text and "20.00 EUR" in text and "preemptions" in text


def test_a_run_requeued_at_its_time_limit_is_not_a_preemption() -> None:
    """A 1-hour job that checkpointed and requeued itself at 58 min (SIGUSR1) was not
    preempted and lost nothing; one requeued at 20 min was (the agent's reclaim)."""
    from dataclasses import replace

    limit = 3600.0
    runs = [
        replace(run(7, "2026-12-01T01:00:00", "2026-12-01T01:58:00", gpus=2, state="REQUEUED"),
                time_limit_s=limit),
        replace(run(7, "2026-12-01T02:00:00", "2026-12-01T02:20:00", gpus=2, state="REQUEUED"),
                time_limit_s=limit),
        replace(run(7, "2026-12-01T02:30:00", "2026-12-01T03:00:00", gpus=2), time_limit_s=limit),
    ]
    r = report(runs)
    assert r.preemptions == 1 and r.per_job[0].preemptions == 1
    assert r.lost_gpu_hours == pytest.approx(2 * 20 / 60)
    assert r.gpu_hours == pytest.approx(2 * (58 + 20 + 30) / 60)


def limited(job_id: int, start: str, end: str, limit_s: float, state: str = "REQUEUED",
            nodes: tuple[str, ...] = ("gpu1",), gpus: int = 4) -> AcctJob:
    from dataclasses import replace

    return replace(run(job_id, start, end, gpus=gpus, state=state), time_limit_s=limit_s,
                   nodes=nodes)


def test_a_reclaim_in_the_journal_makes_a_requeue_a_preemption_whatever_the_limit() -> None:
    """A 1-day job requeued at 23:36 by the agent's reclaim of its node is a preemption with
    its work lost, although it ran 98% of its limit; the same run with no reclaim journaled
    on its node ended 24 min early: an admin's requeue, a preemption too."""
    day = 86400.0
    job = limited(7, "2026-12-01T00:00:00", "2026-12-01T23:36:40", day)  # 85000 s
    journal = [
        step("gpu1", "lent", "reclaiming", "2026-12-01T23:36:00", duration_s=30.0),
        step("gpu1", "reclaiming", "starting", "2026-12-01T23:37:00"),
    ]
    r = report([job], journal)
    assert r.preemptions == 1
    assert r.lost_gpu_hours == pytest.approx(4 * 85000 / H)
    assert report([job]).preemptions == 1  # 1400 s before the limit: not its own requeue


def test_a_short_job_requeued_by_a_reclaim_is_a_preemption() -> None:
    """A 10-minute job requeued after 9 min by the agent's reclaim was preempted; without a
    reclaim journaled on its node the same run is taken for a time-limit requeue."""
    job = limited(8, "2026-12-01T10:00:00", "2026-12-01T10:09:00", 600.0)
    reclaim = [step("gpu1", "lent", "reclaiming", "2026-12-01T10:08:50", duration_s=5.0)]
    assert report([job], reclaim).preemptions == 1
    assert report([job]).preemptions == 0


def test_a_reclaim_on_another_node_or_at_another_time_explains_nothing() -> None:
    """Only a reclaim step on the run's own node, from its start to a minute after its end,
    counts: the job that requeued itself 2 min before its limit stays a time-limit requeue."""
    job = limited(9, "2026-12-01T10:00:00", "2026-12-01T10:58:00", 3600.0)
    elsewhere = [step("gpu2", "lent", "reclaiming", "2026-12-01T10:57:50")]
    later = [step("gpu1", "lent", "reclaiming", "2026-12-01T11:00:00")]
    before = [step("gpu1", "lent", "reclaiming", "2026-12-01T09:00:00", duration_s=60.0)]
    for journal in (elsewhere, later, before):
        assert report([job], journal).preemptions == 0
    # a dry run or skipped step requeued nothing; an errored one may have
    dry = [step("gpu1", "lent", "reclaiming", "2026-12-01T10:57:50", outcome="dry-run")]
    failed = [step("gpu1", "lent", "reclaiming", "2026-12-01T10:57:50", outcome="error")]
    assert report([job], dry).preemptions == 0
    assert report([job], failed).preemptions == 1


def test_the_time_limit_window_is_the_warning_plus_slurms_early_signal() -> None:
    """Without a journaled reclaim, a requeue at most 3 min (120 s warning + 60 s) before the
    limit is the job's own; 4 min before it is a preemption, however long the limit."""
    day = 86400.0
    own = limited(1, "2026-12-01T00:00:00", "2026-12-01T23:57:00", day)
    early = limited(2, "2026-12-01T00:00:00", "2026-12-01T23:56:00", day)
    r = report([own, early])
    assert {j.job_id: j.preemptions for j in r.per_job} == {1: 0, 2: 1}


def test_the_default_warning_is_the_submit_default() -> None:
    """The report's time-limit window follows `slurm-idle submit`'s default --signal=USR1@warn_s."""
    from slurm_idle.jobs import JobSpec
    from slurm_idle.report import DEFAULT_WARN_S

    assert JobSpec.model_fields["warn_s"].default == DEFAULT_WARN_S


def test_report_json_names_the_journal_it_read() -> None:
    """`journal` in --json is the journal's path, or null when there was none."""
    assert report([]).to_json()["journal"] is None
    assert report([], journal_path="/var/lib/slurm-idle/journal.jsonl").to_json()["journal"] == (
        "/var/lib/slurm-idle/journal.jsonl")


def test_sacct_time_limits_of_both_releases_are_read() -> None:
    """22.05 writes `limit` as minutes or null (unlimited); 24.11 as {set, infinite, number}."""
    from slurm_idle.slurm.parse import parse_accounting

    def doc(limit: Any) -> dict[str, Any]:
        return {"jobs": [{"job_id": 1, "name": "j", "partition": "idle", "state": {"current": "REQUEUED"},
                          "time": {"start": 100, "end": 200, "elapsed": 100, "limit": limit}}]}

    assert parse_accounting(doc(60))[0].time_limit_s == 3600
    assert parse_accounting(doc(None))[0].time_limit_s is None
    assert parse_accounting(doc({"set": True, "infinite": False, "number": 2}))[0].time_limit_s == 120
    assert parse_accounting(doc({"set": True, "infinite": True, "number": 0}))[0].time_limit_s is None
