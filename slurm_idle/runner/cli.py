"""`slurm-idle-run`'s command line: read the spec, check it against the node's policy, pick the
container runtime (a rootless podman service, docker, or charliecloud's ch-run), then
run_container."""

from __future__ import annotations

import argparse
import os
import pwd
import sys
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from slurm_idle.charliecloud import CharliecloudClient
from slurm_idle.commands import SubprocessRunner
from slurm_idle.config import JobPolicyConfig
from slurm_idle.errors import SlurmIdleError
from slurm_idle.jobpolicy import check_spec, ignored_config_env, site_policy
from slurm_idle.jobs import JobSpec, decode_spec, load_job_spec
from slurm_idle.pipeline import state_dir
from slurm_idle.podman import PodmanService
from slurm_idle.runner.container import (
    LABEL_JOB,
    Engine,
    engine_sockets,
    remove_job_containers,
    slurm_context,
)
from slurm_idle.runner.run import EXIT_START_FAILED, run_container
from slurm_idle.runner.slurmjob import job_is_ending, requeue_if_preempted, was_preempted
from slurm_idle.runner.supervise import Reporter, RunSettings, Signals


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="slurm-idle-run",
        description="Run a slurm-idle job spec's container inside a Slurm job step.",
        epilog=("The job policy (job_policy) is the site's: the config named in "
                "/etc/slurm-idle/runner.conf, else /etc/slurm-idle/slurm-idle.yaml, else the safe "
                "defaults. $SLURM_IDLE_CONFIG is followed only in a job of root's; any other "
                "job's is ignored with a warning in the job log."),
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--spec-b64", help="the job spec as base64 JSON (what scripts pass)")
    src.add_argument("--spec", help="a job spec YAML/JSON file")
    src.add_argument("--cleanup", metavar="JOBID", help="remove JOBID's containers and exit")
    p.add_argument(
        "--grace-s", type=float, default=None,
        help=(
            "seconds from SIGTERM to killing the container (default: the spec's grace_s; "
            "generated batch scripts pass the spec's value). A second SIGTERM stops it at once"
        ),
    )
    p.add_argument(
        "--gpu-mode", choices=["auto", "nvidia", "env", "off"],
        default=os.environ.get("SLURM_IDLE_GPU_MODE", "auto"),
        help="auto: nvidia device requests only if the engine has an nvidia runtime",
    )
    p.add_argument(
        "--docker-host", default=None,
        help=("engine URL (default: the site's job_policy.runtime: a rootless podman service "
              "started for this job; docker: $DOCKER_HOST or the local socket; charliecloud: "
              "none, ch-run runs the image directory under job_policy.charliecloud_images)"),
    )
    return p.parse_args(argv)


def _client(docker_host: str | None, timeout: int | None = 60) -> Any:
    import docker

    if docker_host:
        return docker.DockerClient(base_url=docker_host, timeout=timeout)
    return docker.from_env(timeout=timeout)


def _charliecloud(policy: JobPolicyConfig) -> CharliecloudClient:
    """ch-run children as the job's user (ch-run needs $USER, which a job may lack)."""
    user = os.environ.get("USER") or pwd.getpwuid(os.getuid()).pw_name
    return CharliecloudClient(policy.charliecloud_images, user)


def main(argv: Sequence[str] | None = None, held: Sequence[int] = ()) -> int:
    """Entry point of `slurm-idle-run` (through job_step, which `held` the signals that came
    while this was imported); returns (and exits with) the codes documented above."""
    signals = Signals()
    signals.install(held)
    try:
        return _main(argv, signals)
    finally:
        signals.settle()


def _main(argv: Sequence[str] | None, signals: Signals) -> int:
    args = _parse_args(argv)
    report = Reporter(sys.stdout.buffer)
    service: PodmanService | None = None
    try:
        policy = site_policy(os.environ)
        if (ignored := ignored_config_env(os.environ)) is not None:
            report.say(f"warning: {ignored}")
        spec = None
        if not args.cleanup:  # checked before any engine is reached or started
            spec = decode_spec(args.spec_b64) if args.spec_b64 else load_job_spec(args.spec)
            # The node's policy, not the script's say-so: resolved mounts, this process's uid.
            check_spec(spec.for_job(os.environ.get("SLURM_JOB_ID") or "none",
                                    os.environ.get("SLURM_CLUSTER_NAME", "")),
                       policy, os.geteuid(), resolve=True)
        host = args.docker_host
        engine: Engine = "docker" if host is not None else policy.runtime
        if engine == "charliecloud" and args.cleanup:
            report.say("charliecloud: nothing to remove (a ch-run container ends with its job step)")
            return 0
        if host is None and engine == "podman" and not args.cleanup:
            service = PodmanService.for_job(os.environ.get("SLURM_JOB_ID", ""), os.environ,
                                            report.say)
            host = service.start()
            report.say(f"rootless podman service at {host}")
        elif host is None and engine != "charliecloud":
            host = os.environ.get("DOCKER_HOST")
            engine = "docker"
        return _run(args, host, spec, engine, signals, report, policy)
    except SlurmIdleError as exc:
        report.say(f"error: {exc}")
        return EXIT_START_FAILED
    finally:
        if service is not None:
            _sweep_without_api(service, args, spec, report)
            service.stop()


def _sweep_without_api(
    service: PodmanService, args: argparse.Namespace, spec: JobSpec | None, report: Reporter
) -> None:
    """The API service died under the runner (a site whose Slurm signals every process of the
    step, e.g. proctrack/cgroup): stop and remove this job's containers through the podman
    command line, so none outlives the job on a node that goes back to inference."""
    job_id = os.environ.get("SLURM_JOB_ID")
    if not job_id or service.running():
        return
    grace = args.grace_s if args.grace_s is not None else (spec.grace_s if spec else 0.0)
    try:
        for name in service.remove_labelled(f"{LABEL_JOB}={job_id}", grace):
            report.say(f"podman service gone: removed container {name} with the podman command")
    except SlurmIdleError as exc:
        report.say(f"error: {exc}")


def _run(
    args: argparse.Namespace, host: str | None, spec: JobSpec | None, engine: Engine,
    signals: Signals, report: Reporter, policy: JobPolicyConfig,
) -> int:
    try:
        client = _charliecloud(policy) if engine == "charliecloud" else _client(host)
        if args.cleanup:
            for name in remove_job_containers(client, args.cleanup):
                report.say(f"removed container {name}")
            return 0
    except SlurmIdleError as exc:
        report.say(f"error: {exc}")
        return EXIT_START_FAILED
    except Exception as exc:  # noqa: BLE001 - docker.errors.DockerException and friends
        report.say(f"error: cannot reach the container engine: {exc}")
        return EXIT_START_FAILED
    assert spec is not None  # only --cleanup runs without one
    grace = args.grace_s if args.grace_s is not None else spec.grace_s
    gpu_mode = args.gpu_mode
    if engine == "charliecloud" and gpu_mode == "nvidia":
        report.say("--gpu-mode nvidia needs an engine runtime; charliecloud passes the GPUs "
                   "by environment (--gpu-mode env)")
        gpu_mode = "env"
    rootless = engine == "podman"
    settings = RunSettings(
        grace_s=grace, gpu_mode=gpu_mode,
        # Charliecloud's image is a directory on the node: never pulled, whatever pull says.
        pull="never" if engine == "charliecloud" else policy.pull, engine=engine,
        engine_sockets=engine_sockets(host),
        # Rootless: the container's root is the job's user outside (its user namespace), so
        # files it writes in the mounts are the user's; a uid inside would be a subuid.
        uid=0 if rootless else os.getuid(), gid=0 if rootless else os.getgid(),
    )
    # Logs and wait block for as long as the container runs: no read timeout on that client.
    stream_client = client if engine == "charliecloud" else _client(host, timeout=None)
    ctx = slurm_context(os.environ)
    slurm = SubprocessRunner()
    settings = replace(settings, ledger_dir=state_dir(os.environ))
    return run_container(
        client, spec, ctx, settings, signals, report, stream_client=stream_client,
        early_requeue=lambda: requeue_if_preempted(ctx.job_id, slurm),
        # Short (slurmjob.ENDING_CHECK_TIMEOUT_S): it runs inside the grace, maybe inside KillWait.
        job_ending=lambda: job_is_ending(ctx.job_id, slurm),
        preempted=lambda: was_preempted(ctx.job_id, slurm),
    )

