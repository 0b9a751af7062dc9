"""`placement: jobs`: config, the replica jobs read back from squeue, the script, the planner."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from slurm_idle.config import Config, parse_config
from slurm_idle.errors import ConfigError
from slurm_idle.filesd import targets
from slurm_idle.model import ActionKind, ModelLoad, Observation, Phase, ReplicaLoad, SlurmJob
from slurm_idle.policy.jobs import plan_jobs
from slurm_idle.policy.planner import assess, plan
from slurm_idle.replicajobs import (
    format_comment,
    gpu_report,
    parse_comment,
    render_script,
    replica_views,
    submit_args,
)
from slurm_idle.replicatrust import ReplicaTrust

T0 = 1_796_205_600.0
#: The agent as these tests' jobs know it: user `svc`, a key made an hour before T0.
TRUST = ReplicaTrust("svc", b"k" * 32, T0 - 3600)

CONFIG = """
engine: {kind: command, start_command: "true", stop_command: "true", drain_timeout_s: 5}
slurm: {serve_partition: serve}
models:
  - name: jm
    placement: jobs
    tokens_per_s_per_replica: 100
    job:
      replicas: 2
      gpus_per_replica: 4
      cpus: 2
      mem: 8G
      time: "1-00:00:00"
      sbatch_args: ["--qos=inference"]
      command: "vllm serve {model} --port {port} --shutdown-timeout 30"
      port_base: 9100
      url: "http://{node}:{port}"
policy: {scale_down_window_s: 60, forecast: false}
"""


def config(text: str = CONFIG) -> Config:
    return parse_config(text)


def comment(phase: Phase, index: int, since: float = T0) -> str:
    return format_comment("slurm-idle", phase, since, "jm", index, 9100 + index, trust=TRUST)


def job(job_id: int, state: str, text: str, nodes: tuple[str, ...] = ("gpu8",),
        partition: str = "serve", reason: str = "") -> SlurmJob:
    return SlurmJob(job_id, "x", partition, state, nodes=nodes if state != "PENDING" else (),
                    start_time=T0 if state != "PENDING" else None, gpus=4, comment=text,
                    state_reason=reason, user="svc")


# --- config ----------------------------------------------------------------------------

def test_jobs_model_parses() -> None:
    """A jobs-placement model has no replicas of its own and its job block as written."""
    m = config().models[0]
    assert m.placement == "jobs" and m.replicas == () and m.job is not None
    assert m.job.replicas == 2 and m.job_gpus_per_replica == 4


@pytest.mark.parametrize(("old", "new", "words"), [
    ("    placement: jobs\n", "", "job: a `job:` block needs `placement: jobs`"),
    ("    job:\n      replicas: 2\n", "    nodes: gpu[1-2]\n    job:\n      replicas: 2\n", "replicas:"),
    ("{model} --port {port}", "{model} --port {prt}", "unknown placeholder {prt}"),
    ('["--qos=inference"]', '["--partition=x"]', "--partition is set by slurm-idle"),
    ("mem: 8G", "mem: lots", "mem 'lots'"),
    ('      command: "vllm', '      script: /opt/serve.sh\n      command: "vllm', "exactly one of"),
])
def test_bad_jobs_config_names_the_field(old: str, new: str, words: str) -> None:
    """A wrong job block is a ConfigError naming what to fix (the CLI exits 2 on it)."""
    assert old in CONFIG
    with pytest.raises(ConfigError, match="models.0") as err:
        config(CONFIG.replace(old, new))
    assert words in str(err.value)


def test_placement_jobs_needs_a_job_block() -> None:
    """`placement: jobs` without `job:` is refused, naming `job`."""
    text = CONFIG[:CONFIG.index("    job:")] + "policy: {forecast: false}\n"
    with pytest.raises(ConfigError, match="job: placement jobs needs"):
        config(text)


def test_two_jobs_models_may_not_share_ports() -> None:
    """Two jobs models whose port ranges overlap are refused (two replicas on one port)."""
    second = CONFIG.split("models:\n")[1].split("policy:")[0].replace("name: jm", "name: other")
    second = second.replace("port_base: 9100", "port_base: 9101")
    text = CONFIG.replace("policy:", second + "policy:")
    with pytest.raises(ConfigError, match="job.port_base: port 9101"):
        config(text)


# --- comments and squeue ---------------------------------------------------------------

def test_comment_round_trip_keeps_any_model_name() -> None:
    """Our Comment reads back whole, a model name with spaces and slashes included."""
    text = format_comment("slurm-idle", Phase.SERVING, T0, "meta/Llama 3", 1, 8101)
    back = parse_comment(text, "slurm-idle")
    assert back is not None and (back.word, back.since, back.index, back.port, back.model) == (
        "serving", T0, 1, 8101, "meta/Llama 3")
    assert parse_comment("slurm-idle:serving since=garbage index=1 port=1 model=x", "slurm-idle") is None
    assert parse_comment(text, "other-tag") is None


def test_replica_views_derive_every_phase() -> None:
    """No job is LENT, PENDING is RECLAIMING (with Slurm's reason), running is STARTING until
    our Comment says serving or retiring, COMPLETING is LENDING."""
    cfg = config()
    cases = [
        ([], [Phase.LENT, Phase.LENT]),
        ([job(5, "PENDING", comment(Phase.RECLAIMING, 0), reason="Resources")],
         [Phase.RECLAIMING, Phase.LENT]),
        ([job(5, "RUNNING", comment(Phase.RECLAIMING, 0)), job(6, "RUNNING", comment(Phase.SERVING, 1))],
         [Phase.STARTING, Phase.SERVING]),
        ([job(5, "RUNNING", comment(Phase.RETIRING, 0)), job(6, "COMPLETING", comment(Phase.LENDING, 1))],
         [Phase.RETIRING, Phase.LENDING]),
        ([job(5, "CANCELLED", comment(Phase.LENDING, 0))], [Phase.LENT, Phase.LENT]),
    ]
    for jobs, phases in cases:
        views = replica_views(cfg, jobs, TRUST)
        assert [v.phase for v in views] == phases, jobs
    pending = replica_views(cfg, cases[1][0], TRUST)[0]
    assert pending.state_reason == "Resources" and pending.job_id == 5 and pending.name == "jm#0"
    running = replica_views(cfg, cases[2][0], TRUST)[1]
    assert running.url == "http://gpu8:9101" and running.nodes == ("gpu8",)


def test_jobs_not_ours_are_never_read_as_replicas() -> None:
    """A job in another partition, with a port or index not the model's, or a Comment not in
    our exact shape, is not a replica: its replica reads LENT."""
    cfg = config()
    foreign = [
        job(5, "RUNNING", comment(Phase.SERVING, 0), partition="idle"),
        job(6, "RUNNING", format_comment("slurm-idle", Phase.SERVING, T0, "jm", 0, 9999)),
        job(7, "RUNNING", format_comment("slurm-idle", Phase.SERVING, T0, "jm", 5, 9105)),
        job(8, "RUNNING", "slurm-idle:serving index=0 port=9100 model=jm"),
    ]
    assert [v.phase for v in replica_views(cfg, foreign, TRUST)] == [Phase.LENT, Phase.LENT]


def test_duplicates_keep_the_running_then_oldest_job() -> None:
    """Two jobs for one replica: the running one is the replica, the other a duplicate."""
    views = replica_views(config(), [job(9, "PENDING", comment(Phase.RECLAIMING, 0)),
                                     job(7, "RUNNING", comment(Phase.SERVING, 0))], TRUST)
    assert views[0].job_id == 7 and views[0].duplicates == (9,)


GPU_WAIT = """\
# slurm-idle: start vLLM only once no one else holds memory on this job's GPUs.
slurm_idle_gpus_held() {
  command -v nvidia-smi >/dev/null 2>&1 || {
    echo 'slurm-idle: nvidia-smi not found: GPUs not checked before vLLM starts'; return 1; }
  [ -n "${CUDA_VISIBLE_DEVICES:-}" ] || {
    echo 'slurm-idle: no CUDA_VISIBLE_DEVICES: GPUs not checked before vLLM starts'; return 1; }
  nvidia-smi --query-gpu=index,memory.used --format=csv,noheader,nounits -i "$CUDA_VISIBLE_DEVICES" |
    awk -F', *' -v max=1024 '$2 + 0 > max { held = 1
      printf "slurm-idle: GPU %s holds %s MiB (allowed %s): not starting vLLM\\n", $1, $2, max }
      END { exit !held }'
}
if slurm_idle_gpus_held >&2; then
  scontrol update JobId="$SLURM_JOB_ID" Comment='{held}' || true
  while sleep 10 && slurm_idle_gpus_held >&2; do :; done
  for _ in 1 2 3 4 5 6; do scontrol update JobId="$SLURM_JOB_ID" Comment='{back}' && break; sleep 5; done
fi
"""


def test_script_and_submit_args() -> None:
    """The batch script asks for the replica's GPUs, waits while one of them is held (saying
    so on stderr, and `held` in the job's Comment from a text the agent signed), then runs the
    command under srun with the agent's port; partition, name and our RECLAIMING Comment go
    on sbatch's command line."""
    cfg = config()
    report = gpu_report(cfg, cfg.models[0], 1, T0, trust=TRUST)
    script = render_script(cfg, cfg.models[0], 1, report=report)
    assert script == (
        "#!/bin/bash\n#SBATCH --nodes=1\n#SBATCH --ntasks-per-node=1\n#SBATCH --gres=gpu:4\n"
        "#SBATCH --cpus-per-task=2\n#SBATCH --mem=8G\n#SBATCH --time=1-00:00:00\n"
        "#SBATCH --qos=inference\n"
        "export SLURM_IDLE_MODEL=jm SLURM_IDLE_INDEX=1 SLURM_IDLE_PORT=9101\n"
        + GPU_WAIT.replace("{held}", comment(Phase.HELD, 1)).replace("{back}", comment(Phase.RECLAIMING, 1))
        + "exec srun --kill-on-bad-exit=1 vllm serve jm --port 9101 --shutdown-timeout 30\n")
    args = submit_args(cfg, cfg.models[0], 1, T0, trust=TRUST)
    assert args[:2] == ["--partition=serve", "--job-name=slurm-idle-jm-1"]
    assert args[2] == f"--comment={report.back}"
    assert parse_comment(args[2].removeprefix("--comment="), "slurm-idle") is not None


def test_a_site_script_gets_the_gpu_wait_first(tmp_path: Path) -> None:
    """`script:` runs after SLURM_IDLE_* and the same GPU wait (its own #! line dropped)."""
    cfg = config(CONFIG.replace('      command: "vllm serve {model} --port {port} --shutdown-timeout 30"',
                                f"      script: {tmp_path / 'serve.sh'}"))
    script = render_script(cfg, cfg.models[0], 0, "#!/bin/bash\nexec my-vllm\n")
    wait = script.index("slurm_idle_gpus_held() {")
    assert script.index("export SLURM_IDLE_MODEL") < wait < script.index("exec my-vllm")
    assert script.endswith("fi\nexec my-vllm\n") and script.count("#!") == 1


def _run_script(tmp_path: Path, held_mib: int | None, visible: str = "4,5") -> tuple[str, str, str]:
    """The rendered script under bash, nvidia-smi/scontrol/srun/sleep faked in PATH: nvidia-smi
    answers GPU 4 with `held_mib` until the first sleep (None: no nvidia-smi at all)."""
    import subprocess

    cfg = config()
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "calls"
    fakes = {"scontrol": f'echo "scontrol $*" >> {calls}', "srun": f'echo "srun $*" >> {calls}',
             "sleep": f'echo sleep >> {calls}; rm -f {tmp_path / "held"}'}
    if held_mib is not None:
        (tmp_path / "held").touch()
        fakes["nvidia-smi"] = (f'echo "nvidia-smi $*" >> {calls}\n'
                               f'if [ -e {tmp_path / "held"} ]; then echo "4, {held_mib}"; '
                               'else echo "4, 300"; fi\necho "5, 0"')
    for name, body in fakes.items():
        (bin_dir / name).write_text(f"#!/bin/sh\n{body}\n")
        (bin_dir / name).chmod(0o755)
    script = tmp_path / "job.sh"
    script.write_text(render_script(cfg, cfg.models[0], 1, report=gpu_report(cfg, cfg.models[0], 1, T0)))
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "SLURM_JOB_ID": "77", "CUDA_VISIBLE_DEVICES": visible}
    done = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=30,
                          check=False)
    assert done.returncode == 0, done.stderr
    return calls.read_text(), done.stderr, done.stdout


def test_the_script_waits_while_a_gpu_is_held_and_reports_it(tmp_path: Path) -> None:
    """A GPU of the job over gpu.free_tolerance_mib: named on stderr, the job's Comment says
    held, vLLM (srun) starts only after the GPU is free and the Comment is back."""
    calls, stderr, _ = _run_script(tmp_path, 20000)
    lines = calls.splitlines()
    assert lines[0] == ("nvidia-smi --query-gpu=index,memory.used --format=csv,noheader,nounits "
                        "-i 4,5")
    assert lines[1].startswith("scontrol update JobId=77 Comment=slurm-idle:held since=")
    assert lines[2:4] == ["sleep", lines[0]]
    assert lines[4].startswith("scontrol update JobId=77 Comment=slurm-idle:reclaiming since=")
    assert lines[5].startswith("srun --kill-on-bad-exit=1 vllm serve jm") and len(lines) == 6
    assert stderr == "slurm-idle: GPU 4 holds 20000 MiB (allowed 1024): not starting vLLM\n"


@pytest.mark.parametrize(("held_mib", "visible", "said"), [
    (1024, "4,5", ""),  # within the tolerance: free
    (None, "4,5", "slurm-idle: nvidia-smi not found: GPUs not checked before vLLM starts\n"),
    (20000, "", "slurm-idle: no CUDA_VISIBLE_DEVICES: GPUs not checked before vLLM starts\n"),
])
def test_the_script_starts_vllm_at_once_when_nothing_is_held_or_it_cannot_check(
        tmp_path: Path, held_mib: int | None, visible: str, said: str) -> None:
    """Free GPUs, no nvidia-smi on the node, or no GPU list: vLLM starts at once (the check
    never blocks a start it cannot make), the Comment untouched."""
    calls, stderr, _ = _run_script(tmp_path, held_mib, visible)
    assert [c.split()[0] for c in calls.splitlines()] == (
        ["nvidia-smi", "srun"] if held_mib is not None and visible else ["srun"])
    assert stderr == said


def test_file_sd_targets_name_placed_replicas_only() -> None:
    """Prometheus targets: one per replica that runs somewhere, labelled with its job."""
    views = replica_views(config(), [job(6, "RUNNING", comment(Phase.SERVING, 1))], TRUST)
    assert targets(views) == [{"targets": ["gpu8:9101"], "labels": {
        "slurm_idle_model": "jm", "slurm_idle_replica": "jm#1", "slurm_job_id": "6", "node": "gpu8"}}]


# --- planner ---------------------------------------------------------------------------

def obs(cfg: Config, jobs: list[SlurmJob], demand: float | None, window: float | None = None,
        waiting: float = 0.0) -> Observation:
    views = replica_views(cfg, jobs, TRUST)
    loads = []
    for v in views:
        load = None
        if v.phase in (Phase.SERVING, Phase.RETIRING):
            load = ReplicaLoad(model="jm", node="gpu8", url=v.url, generation_tokens_per_s=(demand or 0) / 2)
        loads.append(load)
    from dataclasses import replace
    views = tuple(replace(v, load=ld) for v, ld in zip(views, loads, strict=True))
    model = (ModelLoad("jm", known=False) if demand is None else
             ModelLoad("jm", generation_tokens_per_s=demand, waiting=waiting,
                       demand_tokens_per_s_max_window=window if window is not None else demand,
                       waiting_max_window=waiting, waiting_min_recent=waiting))
    return Observation(now=T0, nodes=(), models=(model,), replica_jobs=views)


BOTH = [job(5, "RUNNING", comment(Phase.SERVING, 0)), job(6, "RUNNING", comment(Phase.SERVING, 1))]


def test_low_load_lends_one_replica_job() -> None:
    """Low load over the window: the highest-index idle replica retires; the floor stays."""
    cfg = config()
    actions = plan(obs(cfg, BOTH, demand=10.0), cfg, T0)
    assert [(a.kind, a.node, a.to_phase) for a in actions] == [(ActionKind.LEND, "jm#1", Phase.RETIRING)]
    assert assess(obs(cfg, BOTH, demand=10.0), cfg, T0)[0].needed_replicas == 1


def test_window_peak_holds_the_lend() -> None:
    """A peak within the window keeps both replicas (no lend)."""
    cfg = config()
    assert plan(obs(cfg, BOTH, demand=10.0, window=150.0), cfg, T0) == []


def test_high_load_submits_the_lent_replica() -> None:
    """Load above one replica's capacity: the lent replica is reclaimed (sbatch) at once."""
    cfg = config()
    one = BOTH[:1]
    actions = plan_jobs(obs(cfg, one, demand=150.0), cfg, T0)
    assert [(a.kind, a.node, a.to_phase) for a in actions] == [(ActionKind.RECLAIM, "jm#1", Phase.RECLAIMING)]


def held_job(job_id: int, index: int, held_s: float) -> SlurmJob:
    """A running replica job whose script has said `held` for `held_s` seconds at T0."""
    return replace(job(job_id, "RUNNING", comment(Phase.HELD, index)), start_time=T0 - held_s)


def test_a_held_replica_counts_as_coming_back_until_gpu_free_s() -> None:
    """Within timeouts.gpu_free_s a HELD replica job is on its way back: carried on (waiting
    for its GPUs), and no other replica is submitted for it."""
    cfg = config(CONFIG.replace("replicas: 2", "replicas: 3"))
    actions = plan_jobs(obs(cfg, [held_job(5, 0, 60.0)], demand=150.0), cfg, T0)
    assert [(a.kind, a.node, a.from_phase, a.to_phase) for a in actions] == [
        (ActionKind.RECLAIM, "jm#1", Phase.LENT, Phase.RECLAIMING),
        (ActionKind.CONTINUE, "jm#0", Phase.HELD, Phase.STARTING)]


def test_a_replica_held_past_gpu_free_s_is_handed_over_and_replaced_in_the_same_tick() -> None:
    """Past timeouts.gpu_free_s: HAND_OVER (HELD -> LENDING: its node to the admin, the job
    cancelled), and it no longer counts, so the LENT replica is submitted in the same tick."""
    cfg = config(CONFIG.replace("replicas: 2", "replicas: 3"))
    late = cfg.timeouts.gpu_free_s + 1
    actions = plan_jobs(obs(cfg, [held_job(5, 0, late), BOTH[1]], demand=150.0), cfg, T0)
    assert [(a.kind, a.node, a.to_phase) for a in actions] == [
        (ActionKind.HAND_OVER, "jm#0", Phase.LENDING), (ActionKind.RECLAIM, "jm#2", Phase.RECLAIMING)]
    assert "gpu_free_s" in actions[0].reason
    early = plan_jobs(obs(cfg, [held_job(5, 0, late - 2), BOTH[1]], demand=150.0), cfg, T0)
    assert [(a.kind, a.node) for a in early] == [(ActionKind.CONTINUE, "jm#0")]


def test_unknown_metrics_lend_nothing_and_start_the_floor() -> None:
    """With no metrics nothing is lent, and a model with no replica job starts its floor."""
    cfg = config()
    assert plan_jobs(obs(cfg, BOTH, demand=None), cfg, T0) == []
    actions = plan_jobs(obs(cfg, [], demand=None), cfg, T0)
    assert [(a.kind, a.node) for a in actions] == [(ActionKind.RECLAIM, "jm#0")]


def test_no_lend_while_a_replica_is_on_its_way_back() -> None:
    """A replica job PENDING (reclaiming) blocks any lend of the model; it is carried on."""
    cfg = config(CONFIG.replace("replicas: 2", "replicas: 3"))
    jobs = [BOTH[0], job(7, "RUNNING", comment(Phase.SERVING, 2)),
            job(6, "PENDING", comment(Phase.RECLAIMING, 1), reason="Resources")]
    actions = plan_jobs(obs(cfg, jobs, demand=1.0), cfg, T0)
    assert [(a.kind, a.node, a.to_phase) for a in actions] == [
        (ActionKind.CONTINUE, "jm#1", Phase.STARTING)]
    assert "PENDING: Resources" in actions[0].reason


def test_a_rise_aborts_a_retiring_replica_first() -> None:
    """Load back while a replica retires: it goes back to serving, nothing is submitted."""
    cfg = config()
    jobs = [BOTH[0], job(6, "RUNNING", comment(Phase.RETIRING, 1))]
    actions = plan_jobs(obs(cfg, jobs, demand=150.0), cfg, T0)
    assert [(a.kind, a.node, a.to_phase) for a in actions] == [
        (ActionKind.ABORT_LEND, "jm#1", Phase.SERVING)]


def test_report_counts_replica_job_and_lent_gpu_hours(tmp_path: Path) -> None:
    """`report`: the replica jobs' GPU-hours from accounting (by their name) beside the GPU-hours
    their replicas were lent (journal: `model#index` lent x job GPUs)."""
    from slurm_idle.journal import Journal
    from slurm_idle.report_io import make_report
    from slurm_idle.slurm.protocol import AcctJob

    cfg = config(CONFIG + f"paths: {{journal: {tmp_path}/j.jsonl}}\n")
    journal = Journal(tmp_path / "j.jsonl")
    for ts, frm, to in ((T0, "lending", "lent"), (T0 + 1800, "lent", "reclaiming")):
        journal.append({"event": "transition", "ts": ts, "node": "jm#1", "model": "jm",
                        "action": "x", "from": frm, "to": to, "reason": "", "outcome": "ok",
                        "duration_s": 0})
    runs = [AcctJob(7, "slurm-idle-jm-0", "serve", "RUNNING", T0, None, 3600, 4),
            AcctJob(8, "someone-else", "serve", "RUNNING", T0, None, 3600, 4)]
    report = make_report(cfg, T0 - 3600, T0 + 3600, T0 + 3600, [], inference_runs=runs)
    assert report.inference_gpu_hours == 4.0  # job 7 only: 1 h x 4 GPUs
    assert report.lent_gpu_hours == 2.0  # jm#1 lent 30 min x 4 GPUs
    assert report.to_json()["inference_gpu_hours"] == 4.0


def placement(*nodes: tuple[str, int, list[SlurmJob]]) -> tuple:  # type: ignore[type-arg]
    from slurm_idle.model import NodeView, SlurmNode

    return tuple(NodeView(SlurmNode(name, "mixed", gpus_total=8, gpus_used=used,
                                    partitions=("serve", "idle")), "", Phase.UNKNOWN,
                          jobs=tuple(jobs)) for name, used, jobs in nodes)


def idle_job(job_id: int, started: float) -> SlurmJob:
    return SlurmJob(job_id, "train", "idle", "RUNNING", nodes=("n",), start_time=started, gpus=4)


def test_reclaim_steers_to_the_node_whose_idle_jobs_lose_least() -> None:
    """No free GPUs anywhere: the replica job is sent (--nodelist) to the node whose idle jobs
    started last (least work lost), as long as what it can free covers the replica: the second
    reclaim of the tick goes to the other node."""
    from dataclasses import replace

    cfg = config()
    base = obs(cfg, [], demand=150.0)
    nodes = placement(("old", 8, [idle_job(1, T0 - 7200), idle_job(2, T0 - 7200)]),
                      ("new", 8, [idle_job(3, T0 - 60)]))  # its other 4 GPUs: not preemptible
    actions = plan_jobs(replace(base, placement_nodes=nodes), cfg, T0)
    assert [(a.node, a.details.get("nodelist")) for a in actions] == [("jm#0", "new"), ("jm#1", "old")]
    assert "steered to new" in actions[0].reason


def test_free_gpus_need_no_steering() -> None:
    """A node with the replica's GPUs free: Slurm places the job there itself, no --nodelist."""
    from dataclasses import replace

    cfg = config()
    nodes = placement(("busy", 8, [idle_job(1, T0 - 60), idle_job(2, T0 - 60)]), ("half", 4, []))
    actions = plan_jobs(replace(obs(cfg, BOTH[:1], demand=150.0), placement_nodes=nodes), cfg, T0)
    assert [(a.node, a.details.get("nodelist")) for a in actions] == [("jm#1", None)]


@pytest.mark.parametrize("broken", [{"foreign": True}, {"healthy": False}])
def test_a_retiring_replica_out_of_service_is_carried_on_not_put_back(broken: dict[str, bool]) -> None:
    """A replica job RETIRING whose engine is gone, not ours or failing (a repair or a lend
    whose engine died while it drained) is carried on to its cancel: never aborted back into
    serving (the router) because the model's evidence is bad."""
    cfg = config()
    jobs = [BOTH[0], job(6, "RUNNING", comment(Phase.RETIRING, 1))]
    o = obs(cfg, jobs, demand=50.0)
    o = replace(o, replica_jobs=tuple(replace(r, load=replace(r.load, **broken)) if r.index == 1 else r
                                      for r in o.replica_jobs))
    actions = plan_jobs(o, cfg, T0)
    assert [(a.kind, a.node, a.to_phase) for a in actions] == [
        (ActionKind.CONTINUE, "jm#1", Phase.LENDING)]
