"""Pipelines: parsing and resolving steps, dependency order, dry-run shape, submission, status."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest

from slurm_idle.errors import CommandError, ConfigError, SlurmIdleError
from slurm_idle.jobs import SubmitOptions
from slurm_idle.model import SlurmJob
from slurm_idle.pipeline import (
    cancel_pipeline,
    dependency_args,
    dry_run,
    explain_steps,
    load_pipeline,
    parse_pipeline,
    pipeline_status,
    read_pipeline_record,
    record_pipeline,
    state_dir,
    submit_pipeline,
    topo_order,
)

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "etc" / "examples" / "pipeline.yaml"


class FakeSlurm:
    """Records submissions; fails the submission number `fail_at` (1-based) if set."""

    def __init__(self, fail_at: int | None = None, jobs: Sequence[SlurmJob] = ()) -> None:
        self.submitted: list[tuple[str, list[str]]] = []
        self.cancelled: list[int] = []
        self.fail_at = fail_at
        self._jobs = list(jobs)

    def submit(self, script: str, extra_args: Sequence[str] = ()) -> int:
        if self.fail_at is not None and len(self.submitted) + 1 == self.fail_at:
            raise CommandError(["sbatch"], 1, "sbatch: error: Batch job submission failed")
        self.submitted.append((script, list(extra_args)))
        return 100 + len(self.submitted)

    def cancel(self, job_ids: Sequence[int], signal: str | None = None) -> None:
        self.cancelled.extend(job_ids)

    def jobs(self) -> list[SlurmJob]:
        return self._jobs


def test_example_pipeline_has_five_steps_and_a_parallel_pair() -> None:
    """The shipped pipeline resolves to 5 steps, two of which share their only upstream."""
    p = load_pipeline(EXAMPLE)
    assert [s.name for s in p.steps] == ["pre-process", "pre-train", "sft", "rl", "eval"]
    assert p.step("rl").depends_on == p.step("eval").depends_on == ("sft",)


def test_steps_merge_defaults_file_and_inline_fields() -> None:
    """A step = defaults < referenced file < inline job; params merge key by key; {step} expands."""
    p = load_pipeline(EXAMPLE)
    sft = p.step("sft").spec
    assert sft.name == "llm-recipe.sft"
    assert sft.mem == "256M"  # from demo-job.yaml
    assert sft.params["stage"] == "sft" and sft.params["step_s"] == 1  # inline over file
    assert sft.mounts.checkpoint is not None
    assert sft.mounts.checkpoint.source == "/tmp/slurm-idle-demo/llm-recipe/sft/checkpoint"
    pre = p.step("pre-process").spec
    assert pre.gpus == 0 and pre.params["checkpoint_every"] == 2  # default kept


def test_topo_order_is_stable_and_rejects_cycles_and_unknown_steps() -> None:
    """Steps come after their dependencies in file order; cycles and typos are clear errors."""
    assert topo_order({"c": ["a"], "a": [], "b": ["a"]}) == ["a", "c", "b"]
    with pytest.raises(ConfigError, match="cycle"):
        topo_order({"a": ["b"], "b": ["a"]})
    with pytest.raises(ConfigError, match="unknown step 'x'"):
        topo_order({"a": ["x"]})
    with pytest.raises(ConfigError, match="itself"):
        topo_order({"a": ["a"]})


def test_bad_pipelines_fail_clearly() -> None:
    """Duplicate names, unknown keys and invalid step jobs name the pipeline and step."""
    base = {"name": "p", "defaults": {"image": "img:1"}}
    with pytest.raises(ConfigError, match="repeated: a"):
        parse_pipeline({**base, "steps": [{"name": "a"}, {"name": "a"}]}, "p.yaml")
    with pytest.raises(ConfigError, match="unknown key"):
        parse_pipeline({**base, "steps": [{"name": "a", "after": ["b"]}]}, "p.yaml")
    with pytest.raises(ConfigError, match="step 'a'.*gpus"):
        parse_pipeline({**base, "steps": [{"name": "a", "job": {"gpus": "many"}}]}, "p.yaml")


def test_dry_run_json_shape_uses_placeholders_for_upstream_ids() -> None:
    """`--dry-run --json` lists name, depends_on and sbatch_args with {step} placeholders."""
    doc = dry_run(load_pipeline(EXAMPLE), SubmitOptions())
    rl = next(s for s in doc["steps"] if s["name"] == "rl")
    assert set(rl) == {"name", "depends_on", "sbatch_args"}
    assert "--dependency=afterok:{sft}" in rl["sbatch_args"]
    assert "--kill-on-invalid-dep=yes" in rl["sbatch_args"]
    first = doc["steps"][0]
    assert not any(a.startswith("--dependency") for a in first["sbatch_args"])


def test_submission_chains_real_ids_in_dependency_order() -> None:
    """Each step is submitted after its upstreams, with afterok on their job ids."""
    slurm = FakeSlurm()
    ids = submit_pipeline(load_pipeline(EXAMPLE), slurm, SubmitOptions())
    assert ids == {"pre-process": 101, "pre-train": 102, "sft": 103, "rl": 104, "eval": 105}
    extra = [args for _, args in slurm.submitted]
    assert extra[0] == []
    assert extra[3] == ["--dependency=afterok:103", "--kill-on-invalid-dep=yes"]
    assert extra[4] == ["--dependency=afterok:103", "--kill-on-invalid-dep=yes"]
    assert "--comment=slurm-idle:job,pipeline=llm-recipe,step=rl" in slurm.submitted[3][0]


def test_a_failed_submission_cancels_the_steps_already_submitted() -> None:
    """All or nothing: when step 3 cannot be submitted, steps 1-2 are cancelled."""
    slurm = FakeSlurm(fail_at=3)
    with pytest.raises(CommandError):
        submit_pipeline(load_pipeline(EXAMPLE), slurm, SubmitOptions())
    assert slurm.cancelled == [101, 102]


def test_dependency_args_for_several_upstreams() -> None:
    """Several upstreams are joined with ':' in one afterok."""
    assert dependency_args([7, 9])[0] == "--dependency=afterok:7:9"
    assert dependency_args([]) == []


def test_status_names_the_failed_upstream_of_cancelled_steps() -> None:
    """Downstream of a failed step reads 'upstream step X failed', not a bare CANCELLED."""
    steps = [("a", 1, ()), ("b", 2, ("a",)), ("c", 3, ("b",)), ("d", 4, ("a",))]
    states = {1: ("COMPLETED", 0, "", ""), 2: ("FAILED", 0, "gpu1", ""),
              3: ("CANCELLED", 0, "", ""), 4: ("RUNNING", 1, "gpu2", "")}
    rows = {r.name: r for r in explain_steps(steps, states)}
    assert rows["c"].reason == "upstream step 'b' failed: this step will not run"
    assert rows["d"].reason == "" and rows["d"].restarts == 1
    assert rows["b"].reason == ""


def test_status_reads_live_jobs_then_accounting(tmp_path: Path) -> None:
    """Live steps come from squeue; the rest from accounting; unknown ones say why."""
    p = load_pipeline(EXAMPLE)
    ids = {s.name: 10 + i for i, s in enumerate(p.steps)}
    path = record_pipeline(tmp_path, p, ids, now=1000.0, source=str(EXAMPLE))
    assert path == tmp_path / "pipelines" / "llm-recipe.json"
    record = read_pipeline_record(tmp_path, "llm-recipe")
    live = [SlurmJob(job_id=12, name="llm-recipe.sft", partition="idle", state="RUNNING",
                     nodes=("gpu3",), restart_count=2)]
    rows = pipeline_status(record, FakeSlurm(jobs=live), lambda ids_: {10: "COMPLETED"})
    by = {r.name: r for r in rows}
    assert by["pre-process"].state == "COMPLETED"
    assert by["sft"].state == "RUNNING" and by["sft"].restarts == 2 and by["sft"].node == "gpu3"
    assert by["pre-train"].state == "UNKNOWN" and "no longer known" in by["pre-train"].reason


def test_cancel_cancels_every_recorded_step(tmp_path: Path) -> None:
    """`pipeline cancel` scancels the whole DAG."""
    p = load_pipeline(EXAMPLE)
    record_pipeline(tmp_path, p, {s.name: 50 + i for i, s in enumerate(p.steps)}, now=0.0)
    slurm = FakeSlurm()
    assert cancel_pipeline(read_pipeline_record(tmp_path, "llm-recipe"), slurm) == [50, 51, 52, 53, 54]
    assert slurm.cancelled == [50, 51, 52, 53, 54]


def test_missing_record_says_what_to_do(tmp_path: Path) -> None:
    """Status of a pipeline never run here explains where it looked."""
    with pytest.raises(SlurmIdleError, match="pipeline run"):
        read_pipeline_record(tmp_path, "nope")


def test_state_dir_precedence() -> None:
    """$SLURM_IDLE_STATE_DIR, then $XDG_STATE_HOME/slurm-idle, then ~/.local/state/slurm-idle."""
    assert state_dir({"SLURM_IDLE_STATE_DIR": "/x"}) == Path("/x")
    assert state_dir({"XDG_STATE_HOME": "/s"}) == Path("/s/slurm-idle")
    assert str(state_dir({})).endswith(".local/state/slurm-idle")


@pytest.mark.parametrize("job", [{"env": None}, {"params": None}, {"mounts": ["x"]}])
def test_a_null_or_list_override_is_one_clear_line(job: dict[str, object]) -> None:
    """Regression: `job: {env: null}` crashed with TypeError; now it names file, step and key."""
    base = {"name": "p", "defaults": {"image": "img:1", "env": {"A": "1"}, "params": {"a": 1},
                                      "mounts": {}}}
    key = next(iter(job))
    with pytest.raises(ConfigError, match=rf"^p.yaml: step 'a': {key} must be a mapping") as err:
        parse_pipeline({**base, "steps": [{"name": "a", "job": job}]}, "p.yaml")
    assert "\n" not in str(err.value)


def test_a_referenced_file_with_a_null_env_names_the_file() -> None:
    """A step's job spec file with `env: null` is reported with the pipeline, step and file."""
    data = {"name": "p", "defaults": {"image": "img:1", "env": {"A": "1"}},
            "steps": [{"name": "a", "file": "job.yaml"}]}
    with pytest.raises(ConfigError, match=r"^p.yaml: step 'a': job.yaml: env must be a mapping"):
        parse_pipeline(data, "p.yaml", load_file=lambda f: {"env": None})


def test_long_names_cut_to_63_characters_stay_unique() -> None:
    """Steps whose `<pipeline>.<step>` names agree on their first 63 characters get distinct
    Slurm job names (a hash of the step), still valid and at most 63 characters."""
    from slurm_idle.jobs import NAME_RE

    long = "p" * 60
    data = {"name": long, "defaults": {"image": "img:1"},
            "steps": [{"name": "stage-a"}, {"name": "stage-b"}, {"name": "x"}]}
    p = parse_pipeline(data, "p.yaml")
    names = [s.job_name for s in p.steps]
    assert len(set(names)) == 3 and all(len(n) <= 63 and NAME_RE.match(n) for n in names)
    assert p.step("x").job_name == f"{long}.x"  # unique already: kept as it was
    assert names == [s.spec.name for s in p.steps]


def test_step_options_carry_the_site_requeue_grace() -> None:
    """Pipelines check every step's grace_s against the site's requeue grace too."""
    data = {"name": "p", "defaults": {"image": "img:1", "grace_s": 40},
            "steps": [{"name": "a"}]}
    with pytest.raises(ConfigError, match="grace_s 40 does not fit"):
        dry_run(parse_pipeline(data, "p.yaml"), SubmitOptions(requeue_grace_s=30))
