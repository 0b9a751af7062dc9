"""Pipelines like their users expect: params, matrix fan-out, outputs -> inputs, retry, DAG."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from slurm_idle import dag
from slurm_idle.errors import ConfigError, SlurmIdleError
from slurm_idle.jobs import SubmitOptions
from slurm_idle.pipeline import (
    StepStatus,
    parse_pipeline,
    read_pipeline_record,
    record_pipeline,
    submit_pipeline,
)
from slurm_idle.pipeline_expand import parse_overrides, template
from slurm_idle.pipeline_retry import plan_retry, retry_pipeline
from tests.unit.test_pipeline import FakeSlurm

IMG = {"image": "img:1"}


def fan_out(**over: Any) -> dict[str, Any]:
    return {
        "name": "sweep",
        "data_dir": "/shared/{pipeline}",
        "params": {"lr": 0.001, "epochs": 2, "tag": "base", "fast": False},
        "defaults": IMG,
        "steps": [
            {"name": "prep", "outputs": True},
            {"name": "train", "depends_on": ["prep"], "outputs": True, "retries": 1,
             "matrix": {"seed": [1, 2, 3]},
             "job": {"params": {"lr": "{params.lr}", "seed": "{matrix.seed}"},
                     "args": ["--tag={params.tag}-{matrix.seed}"]}},
            {"name": "join", "depends_on": ["train"]},
        ],
        **over,
    }


def test_params_default_and_typed_overrides() -> None:
    """-p overrides a declared parameter, typed like its default; a whole placeholder keeps the type."""
    p = parse_pipeline(fan_out(), overrides=parse_overrides(["lr=3e-4", "tag=x"]))
    train = p.step("train-0").spec
    assert train.params["lr"] == pytest.approx(3e-4) and isinstance(train.params["lr"], float)
    assert train.params["seed"] == 1 and train.args == ("--tag=x-1",)
    assert dict(p.params)["epochs"] == 2


@pytest.mark.parametrize("pairs, match", [
    (["nope=1"], "unknown pipeline parameter"),
    (["epochs=two"], "is a int"),
    (["fast=maybe"], "is a bool"),
    (["noequals"], "NAME=VALUE"),
])
def test_bad_overrides_are_one_clear_error(pairs: list[str], match: str) -> None:
    """Typos in -p and values of the wrong type are refused before anything is submitted."""
    with pytest.raises(ConfigError, match=match):
        parse_pipeline(fan_out(), overrides=parse_overrides(pairs))


def test_unknown_placeholder_names_the_step() -> None:
    """{params.x} without a declared x is an error naming the step."""
    data = fan_out()
    data["steps"][2]["job"] = {"env": {"X": "{params.missing}"}}
    with pytest.raises(ConfigError, match="step 'join'.*missing"):
        parse_pipeline(data)
    assert template("a{matrix.k}b", {"matrix": {"k": True}}) == "atrueb"


def test_matrix_fans_out_and_the_join_waits_for_all() -> None:
    """A matrix of 3 values is 3 jobs; the dependent step depends on all three."""
    p = parse_pipeline(fan_out())
    assert [s.name for s in p.steps] == ["prep", "train-0", "train-1", "train-2", "join"]
    assert p.step("join").depends_on == ("train-0", "train-1", "train-2")
    assert [p.step(f"train-{i}").spec.params["seed"] for i in range(3)] == [1, 2, 3]
    assert {p.step(f"train-{i}").group for i in range(3)} == {"train"}
    assert p.step("train-1").spec.retries == 1 and p.step("prep").spec.retries == 0
    fake = FakeSlurm()
    ids = submit_pipeline(p, fake, SubmitOptions(python="/usr/bin/python3"))
    assert fake.submitted[-1][1][0] == "--dependency=afterok:" + ":".join(
        str(ids[f"train-{i}"]) for i in range(3))


def test_outputs_become_read_only_inputs_of_dependents() -> None:
    """prep's outputs dir is train's /inputs/prep; the join sees the whole fan-out's dir."""
    p = parse_pipeline(fan_out())
    prep = p.step("prep").spec.mounts
    assert [(m.source, m.target) for m in prep.outputs] == [("/shared/sweep/prep", "/outputs")]
    t1 = p.step("train-1").spec.mounts
    assert [(m.source, m.target) for m in t1.inputs] == [("/shared/sweep/prep", "/inputs/prep")]
    assert [(m.source, m.target) for m in t1.outputs] == [("/shared/sweep/train/1", "/outputs")]
    join = p.step("join").spec.mounts
    assert [(m.source, m.target) for m in join.inputs] == [("/shared/sweep/train", "/inputs/train")]
    assert join.outputs == ()


def test_outputs_need_a_data_dir() -> None:
    """Derived paths need somewhere shared to live."""
    with pytest.raises(ConfigError, match="data_dir"):
        parse_pipeline(fan_out(data_dir=None))


def status(name: str, job_id: int, state: str, ups: tuple[str, ...] = ()) -> StepStatus:
    return StepStatus(name, job_id, state, ups)


DIAMOND = [
    status("a", 1, "COMPLETED"),
    status("b", 2, "FAILED", ("a",)),
    status("c", 3, "CANCELLED", ("b",)),
    status("d", 4, "RUNNING", ("a",)),
    status("e", 5, "PENDING", ("c", "d")),
]


def test_retry_plan_takes_failed_and_downstream_only() -> None:
    """b failed -> b, c, e are redone; a (completed) and d (running, independent) are kept."""
    plan = plan_retry(DIAMOND)
    assert plan.redo == ("b", "c", "e") and plan.kept == ("a", "d") and plan.cancel == (5,)


def test_retry_with_nothing_failed_says_so() -> None:
    """A pipeline without failures has nothing to retry."""
    with pytest.raises(SlurmIdleError, match="nothing to retry"):
        plan_retry([status("a", 1, "COMPLETED"), status("b", 2, "RUNNING", ("a",))])
    assert plan_retry([status("a", 1, "UNKNOWN")], frozenset()).redo == ("a",)
    with pytest.raises(SlurmIdleError):
        plan_retry([status("a", 1, "UNKNOWN")], frozenset({"a"}))  # the ledger saw it complete


def test_retry_resubmits_recorded_scripts_with_the_right_dependencies(tmp_path: Path) -> None:
    """Completed upstreams give no dependency, live kept ones keep theirs, redone ones chain."""
    data = {"name": "d", "defaults": IMG, "steps": [
        {"name": "a"}, {"name": "b", "depends_on": ["a"]}, {"name": "c", "depends_on": ["b"]},
        {"name": "d", "depends_on": ["a"]}, {"name": "e", "depends_on": ["c", "d"]}]}
    pipe = parse_pipeline(data)
    opts = SubmitOptions(python="/usr/bin/python3")
    record_pipeline(tmp_path, pipe, {s.name: s.job_id for s in DIAMOND}, 0.0, opts=opts)
    record = read_pipeline_record(tmp_path, "d")
    fake = FakeSlurm()
    new = retry_pipeline(record, DIAMOND, fake, plan_retry(DIAMOND), 10.0)
    assert fake.cancelled == [5]
    assert [args for _, args in fake.submitted] == [
        [],  # b: a completed
        ["--dependency=afterok:101", "--kill-on-invalid-dep=yes"],  # c after new b
        ["--dependency=afterok:102:4", "--kill-on-invalid-dep=yes"],  # e after new c, live d
    ]
    assert fake.submitted[0][0] == next(s["script"] for s in record["steps"] if s["name"] == "b")
    ids = {s["name"]: s["job_id"] for s in new["steps"]}
    assert ids == {"a": 1, "b": 101, "c": 102, "d": 4, "e": 103} and new["attempt"] == 2
    assert next(s for s in new["steps"] if s["name"] == "b")["previous_job_ids"] == [2]


def test_retry_of_an_old_record_without_scripts_is_refused() -> None:
    """Records written before scripts were kept cannot be retried faithfully."""
    record = {"pipeline": "old", "steps": [{"name": "a", "job_id": 1, "depends_on": []}]}
    with pytest.raises(SlurmIdleError, match="run the pipeline again"):
        retry_pipeline(record, [status("a", 1, "FAILED")], FakeSlurm(),
                       plan_retry([status("a", 1, "FAILED")]), 0.0)


def test_dag_text_and_svg_show_stages_and_states() -> None:
    """Stages follow the longest upstream chain; every step appears with its state."""
    assert [[s.name for s in st] for st in dag.stages(DIAMOND)] == [["a"], ["b", "d"], ["c"], ["e"]]
    text = dag.render_text("d", DIAMOND)
    assert "stage 4" in text and "✗ b" in text and "<- c, d" in text
    svg = dag.render_svg(DIAMOND)
    assert svg.count('class="step"') == 5 and svg.count("<line") == 5
    assert 'data-step="b" data-state="FAILED"' in svg
    assert "<script" not in dag.render_svg([status("<script>", 1, "FAILED")])
