"""policy.min_job_runtime_s: a job under the minimum run time is reclaimed last, never when
another lent node can go instead, and always when the service needs every node."""

from __future__ import annotations

from slurm_idle.config import PolicyConfig
from slurm_idle.model import ActionKind, Phase, SlurmJob
from slurm_idle.policy import plan
from slurm_idle.policy.reclaim_order import reclaim_rank, young_jobs

from .test_policy_helpers import NOW, config, load, node, observation


def job(start: float | None, job_id: int = 1, gpus: int = 4) -> SlurmJob:
    return SlurmJob(job_id=job_id, name="j", partition="idle", state="RUNNING", start_time=start, gpus=gpus)


def with_minimum(replicas: int, min_s: float):  # type: ignore[no-untyped-def]
    cfg = config(replicas=replicas)
    return cfg.model_copy(update={"policy": cfg.policy.model_copy(update={"min_job_runtime_s": min_s})})


def reclaimed(actions):  # type: ignore[no-untyped-def]
    return [a.node for a in actions if a.kind is ActionKind.RECLAIM]


def two_lent():  # type: ignore[no-untyped-def]
    """n1 runs a job started 2 min ago (least work lost), n2 one started 3 h ago."""
    return (node("m0-n1", Phase.LENT, jobs=(job(NOW - 120, job_id=11),)),
            node("m0-n2", Phase.LENT, jobs=(job(NOW - 3 * 3600, job_id=12),)))


def test_without_a_minimum_the_young_job_goes_first() -> None:
    """Default (0): least work lost first, so the 2-minute-old job is reclaimed."""
    obs = observation(node("m0-n0"), *two_lent(), loads=(load(1500.0),))
    assert PolicyConfig().min_job_runtime_s == 0
    assert reclaimed(plan(obs, config(replicas=3), NOW)) == ["m0-n1"]


def test_a_job_under_the_minimum_is_left_while_another_node_can_go() -> None:
    """min 10 min: the node of the 2-minute-old job stays lent, the other is reclaimed."""
    obs = observation(node("m0-n0"), *two_lent(), loads=(load(1500.0),))
    actions = plan(obs, with_minimum(3, 600), NOW)
    assert reclaimed(actions) == ["m0-n2"]


def test_service_needs_every_node_so_the_young_job_goes_too() -> None:
    """Needing both lent nodes back reclaims the protected one as well, and says so."""
    obs = observation(node("m0-n0"), *two_lent(), loads=(load(2400.0),))
    actions = plan(obs, with_minimum(3, 600), NOW)
    assert reclaimed(actions) == ["m0-n2", "m0-n1"]
    young = next(a for a in actions if a.node == "m0-n1")
    assert "11 under policy.min_job_runtime_s" in young.reason


def test_an_empty_lent_node_still_goes_before_any_job() -> None:
    """Protection only reorders: an empty node is first, an old job next, a young job last."""
    obs = observation(node("m0-n0"), *two_lent(), node("m0-n3", Phase.LENT), loads=(load(2400.0),))
    assert reclaimed(plan(obs, with_minimum(4, 600), NOW)) == ["m0-n3", "m0-n2"]


def test_rank_and_young_jobs() -> None:
    """Unknown starts are not young; the minimum boundary is exclusive."""
    view = node("m0-n1", Phase.LENT, jobs=(job(None, 1), job(NOW - 600, 2), job(NOW - 599, 3)))
    assert young_jobs(view, NOW, 600) == [3]
    assert young_jobs(view, NOW, 0) == []
    assert reclaim_rank(view, NOW, None, 600)[0] is True
    assert reclaim_rank(view, NOW, None, 0)[0] is False
