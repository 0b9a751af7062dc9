"""Job specs and the sbatch scripts rendered from them (validation, golden files, quoting)."""

from __future__ import annotations

import base64
import json
import os
import subprocess
from pathlib import Path

import pytest

from slurm_idle.errors import ConfigError
from slurm_idle.jobs import (
    JobSpec,
    SubmitOptions,
    decode_spec,
    encode_spec,
    job_comment,
    load_job_spec,
    parse_job_comment,
    parse_job_spec,
    render_script,
    sbatch_args,
)

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "etc" / "examples"
GOLDEN = ROOT / "tests" / "data" / "golden"
FIXED = SubmitOptions(python="/usr/bin/python3")  # golden files must not depend on the venv


def minimal(**over: object) -> dict[str, object]:
    return {"name": "demo", "image": "slurm-idle/demo:latest", **over}


@pytest.mark.parametrize("example", ["demo-job.yaml", "train-job.yaml"])
def test_examples_validate(example: str) -> None:
    """Every shipped job spec example is valid."""
    spec = load_job_spec(EXAMPLES / example)
    assert spec.name


@pytest.mark.parametrize("example", ["demo-job", "train-job"])
def test_rendered_script_matches_golden_file(example: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The batch script of each example equals its reviewed golden file (UPDATE_GOLDEN=1 rewrites);
    `~` in an example is the submitting user's home (here a fixed one)."""
    monkeypatch.setenv("HOME", "/home/ada")
    script = render_script(load_job_spec(EXAMPLES / f"{example}.yaml"), FIXED)
    golden = GOLDEN / f"{example}.sbatch"
    if os.environ.get("UPDATE_GOLDEN"):
        golden.write_text(script)
    assert script == golden.read_text()


def test_script_carries_the_required_sbatch_options() -> None:
    """idle partition, requeue, early-warning signal, append log, GPUs, name and our comment tag."""
    spec = parse_job_spec(minimal(gpus=2, time="1:00:00", warn_s=90))
    args = sbatch_args(spec)
    for expected in ("--partition=idle", "--requeue", "--open-mode=append", "--gres=gpu:2",
                     "--job-name=demo", "--comment=slurm-idle:job", "--signal=USR1@90",
                     "--time=1:00:00", "--output=slurm-idle-%x-%j.out"):
        assert expected in args
    script = render_script(spec)
    assert all(f"#SBATCH {a}" in script for a in args)


def test_partition_and_tag_come_from_options() -> None:
    """The lend partition and tag of the config replace the defaults."""
    args = sbatch_args(parse_job_spec(minimal()), SubmitOptions(partition="lent", tag="acme"))
    assert "--partition=lent" in args and "--comment=acme:job" in args


def test_runner_is_an_srun_step_of_this_interpreter() -> None:
    """The script starts the runner with srun and the interpreter given (sys.executable by default)."""
    script = render_script(parse_job_spec(minimal()), SubmitOptions(python="/opt/py/bin/python"))
    assert "srun --ntasks=1 --kill-on-bad-exit=1 /opt/py/bin/python -m slurm_idle.job_step" in script


def test_spec_round_trips_through_base64() -> None:
    """What the runner decodes is exactly the spec that was rendered."""
    spec = load_job_spec(EXAMPLES / "train-job.yaml")
    assert decode_spec(encode_spec(spec)) == spec


def test_comment_round_trip_and_foreign_comments() -> None:
    """Our comment parses back to its fields; anyone else's comment is not ours."""
    c = job_comment(SubmitOptions(comment_extra=(("pipeline", "p1"), ("step", "sft"))))
    assert c == "slurm-idle:job,pipeline=p1,step=sft"
    assert parse_job_comment(c) == {"pipeline": "p1", "step": "sft"}
    assert parse_job_comment("slurm-idle:jobx") is None
    assert parse_job_comment("my own note") is None
    assert parse_job_comment("") is None


@pytest.mark.parametrize(
    "over, words",
    [
        ({"surprise": 1}, "unknown key 'surprise'"),
        ({"name": "a b"}, "job name"),
        ({"name": "x\n#SBATCH --partition=inference"}, "job name"),
        ({"image": "img:1 --privileged"}, "image reference"),
        ({"env": {"BAD-NAME": "1"}}, "environment variable name"),
        ({"mem": "lots"}, "mem"),
        ({"time": "tomorrow"}, "time"),
        ({"log": "/tmp/a b.out"}, "log path"),
        ({"log": "/tmp/x\n#SBATCH --partition=inference"}, "log path"),
        ({"mounts": {"inputs": [{"source": "data", "target": "/d"}]}}, "absolute"),
        ({"mounts": {"outputs": [{"source": "/var/run/docker.sock", "target": "/s"}]}}, "engine socket"),
        # a directory above the socket shows it just the same
        ({"mounts": {"outputs": [{"source": "/var/run", "target": "/s"}]}}, "engine socket"),
        ({"mounts": {"inputs": [{"source": "/run/", "target": "/s"}]}}, "engine socket"),
        ({"mounts": {"inputs": [{"source": "/", "target": "/host"}]}}, "engine socket"),
        ({"mounts": {"checkpoint": {"source": "/run/podman", "target": "/c"}}}, "engine socket"),
        ({"network": "bridge"}, "network"),
        ({"gpus": -1}, "gpus"),
        # a warning due at the start would requeue every run at once
        ({"time": "2", "warn_s": 120}, "warn_s 120 is not below the time limit (time '2' = 120 s)"),
        ({"time": "1:30", "warn_s": 300}, "time '1:30' = 90 s"),
        # the checkpoint after the warning must end before the limit does
        ({"warn_s": 20, "grace_s": 30}, "warn_s 20 must exceed grace_s 30"),
        ({"params": {"lr": 1, "LR": 2}}, "params 'lr' and 'LR' both become PARAM_LR"),
        ({"env": {"PARAM_LR": "1"}, "params": {"lr": 2}}, "env PARAM_LR collides with params.lr"),
    ],
)
def test_bad_specs_fail_with_one_clear_line(over: dict[str, object], words: str) -> None:
    """Invalid specs raise ConfigError naming the problem, never a traceback."""
    with pytest.raises(ConfigError) as err:
        parse_job_spec(minimal(**over), source="job.yaml")
    assert str(err.value).startswith("job.yaml: ") and words in str(err.value)
    assert "\n" not in str(err.value).rstrip()


def test_env_scalars_become_strings_and_params_become_env() -> None:
    """YAML numbers/booleans in env and params arrive as strings; params as PARAM_<KEY>."""
    spec = parse_job_spec(minimal(env={"THREADS": 4, "DEBUG": True}, params={"lr": 0.1, "fast": False}))
    assert spec.env == {"THREADS": "4", "DEBUG": "true"}
    assert spec.param_env() == {"PARAM_LR": "0.1", "PARAM_FAST": "false"}
    assert parse_job_spec(minimal(params={"a": 1}, params_as=["file"])).param_env() == {}


HOSTILE = [
    "$(touch {marker})",
    "`touch {marker}`",
    '"; touch {marker}; #',
    "'; touch {marker}; '",
    "\n touch {marker}\n",
    "${{IFS}}$(touch${{IFS}}{marker})",
    "a\\\"; touch {marker} #",
]


def _hostile_spec(marker: Path) -> JobSpec:
    values = [h.format(marker=marker) for h in HOSTILE]
    return parse_job_spec(minimal(
        command=values,
        args=values,
        env={f"E{i}": v for i, v in enumerate(values)},
        params={f"p{i}": v for i, v in enumerate(values)},
        mounts={"checkpoint": {"source": "/tmp/ck " + values[0].replace("\n", " "), "target": "/ck"}},
        workdir="/w$(touch " + str(marker) + ")",
    ))


def _run_with_stubs(script: str, tmp_path: Path) -> list[list[str]]:
    """`bash -n`, then run the script with srun/scontrol/docker as inert argv recorders."""
    path = tmp_path / "job.sbatch"
    path.write_text(script)
    subprocess.run(["bash", "-n", str(path)], check=True)
    stubs = tmp_path / "bin"
    stubs.mkdir(exist_ok=True)
    argv_file = tmp_path / "argv.json"
    for name in ("srun", "scontrol", "docker"):
        stub = stubs / name
        stub.write_text(
            "#!/usr/bin/env python3\nimport json, sys\n"
            f"open({str(argv_file)!r}, 'a').write(json.dumps(sys.argv) + '\\n')\n"
        )
        stub.chmod(0o755)
    env = {"PATH": f"{stubs}:/usr/bin:/bin", "HOME": str(tmp_path)}
    done = subprocess.run(["bash", str(path)], env=env, cwd=tmp_path, capture_output=True,
                          text=True, timeout=30, check=False)
    assert done.returncode == 0, done.stderr
    if not argv_file.exists():
        return []
    return [json.loads(line) for line in argv_file.read_text().splitlines()]


def test_hostile_strings_are_valid_bash_and_never_execute(tmp_path: Path) -> None:
    """A script full of shell metacharacters passes `bash -n` and, run with srun/scontrol
    stubbed, creates no file and hands the runner the exact spec."""
    marker = tmp_path / "pwned"
    spec = _hostile_spec(marker)
    calls = _run_with_stubs(render_script(spec, SubmitOptions(python="/usr/bin/python3")), tmp_path)
    assert not marker.exists()
    assert len(calls) == 1 and calls[0][0].endswith("/srun")
    assert decode_spec(calls[0][-1]) == spec


def test_the_stub_harness_does_catch_an_injection(tmp_path: Path) -> None:
    """Control: the same harness sees the marker file when a value is pasted unquoted."""
    marker = tmp_path / "pwned"
    _run_with_stubs(f"#!/bin/bash\necho {HOSTILE[0].format(marker=marker)}\n", tmp_path)
    assert marker.exists()


def test_no_user_string_appears_raw_in_the_script(tmp_path: Path) -> None:
    """User strings travel only inside the base64 spec: none shows up in the script text."""
    spec = _hostile_spec(tmp_path / "pwned")
    script = render_script(spec)
    assert "touch" not in script
    payload = script.split("SPEC=", 1)[1].split("\n", 1)[0]
    assert json.loads(base64.b64decode(payload))["args"][0].startswith("$(touch")


def test_job_id_placeholder_in_mount_sources() -> None:
    """{job_id} in mount sources becomes the job id (one dir per submission, kept on requeue)."""
    spec = parse_job_spec(minimal(mounts={
        "checkpoint": {"source": "/ck/{job_id}", "target": "/ck"},
        "outputs": [{"source": "/out/{job_id}/x", "target": "/o"}]}))
    resolved = spec.for_job("77")
    assert resolved.mounts.checkpoint is not None
    assert resolved.mounts.checkpoint.source == "/ck/77"
    assert resolved.mounts.outputs[0].source == "/out/77/x"
    assert resolved.mounts.checkpoint.target == "/ck"


@pytest.mark.parametrize(("value", "seconds"), [
    ("30", 1800), ("1:30", 90), ("2:00:00", 7200), ("1-12", 129600), ("1-12:30", 131400),
    ("1-00:00:01", 86401), ("0", 0),
])
def test_time_limit_seconds_follow_slurm_syntax(value: str, seconds: int) -> None:
    """M, M:S, H:M:S, D-H, D-H:M and D-H:M:S, as sbatch --time reads them."""
    from slurm_idle.jobs import time_limit_s

    assert time_limit_s(value) == seconds


def test_warning_checks_allow_what_makes_sense() -> None:
    """warn_s below the limit, no time limit, time 0 (none) or warn_s 0 (no warning) are fine,
    and an env PARAM_* name is free when params only go to the file."""
    parse_job_spec(minimal(time="1", warn_s=55, grace_s=5))  # the e2e time-limit job
    parse_job_spec(minimal(warn_s=120))
    parse_job_spec(minimal(time="0", warn_s=600))
    parse_job_spec(minimal(time="1", warn_s=0, grace_s=90))
    parse_job_spec(minimal(env={"PARAM_LR": "1"}, params={"lr": 2}, params_as=["file"]))


def test_grace_longer_than_the_site_requeue_grace_is_refused() -> None:
    """With the site's slurm.requeue_grace_s known, a grace_s that cannot fit is rejected at
    render time (submit, dry run, pipelines); without it nothing is assumed."""
    spec = parse_job_spec(minimal(grace_s=50))
    with pytest.raises(ConfigError, match=r"grace_s 50 does not fit .*requeue_grace_s 30.*e.g. 25"):
        render_script(spec, SubmitOptions(requeue_grace_s=30))
    with pytest.raises(ConfigError, match="grace_s 30 does not fit"):
        sbatch_args(parse_job_spec(minimal(grace_s=30)), SubmitOptions(requeue_grace_s=30))
    assert "--grace-s 50" in render_script(spec)
    sbatch_args(parse_job_spec(minimal(grace_s=25)), SubmitOptions(requeue_grace_s=30))
    sbatch_args(parse_job_spec(minimal(grace_s=0)), SubmitOptions(requeue_grace_s=0))


def test_examples_fit_the_shipped_site_config() -> None:
    """Every example job's grace_s fits the requeue_grace_s of etc/slurm-idle.yaml."""
    from slurm_idle.jobs import read_yaml

    site = read_yaml(ROOT / "etc" / "slurm-idle.yaml")["slurm"]["requeue_grace_s"]
    for example in ("demo-job.yaml", "train-job.yaml"):
        spec = load_job_spec(EXAMPLES / example)
        sbatch_args(spec, SubmitOptions(requeue_grace_s=float(site)))
