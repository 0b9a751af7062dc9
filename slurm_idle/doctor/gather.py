"""Read the live site once for the doctor: Slurm's configuration, partitions and nodes, a
test submission, the metrics, the GPUs' memory, the engines and the agent's files.

Every effect is injected (command runner, Slurm backend, metrics source, engine factory, HTTP
client), and every failure becomes an entry of `SiteFacts.errors` or an engine/path problem,
never an exception: the doctor's job is to report what is broken, so a broken part must not
stop it from looking at the rest. Nothing here changes the cluster: `sbatch --test-only` makes
no job, and the files are only stat'ed.
"""

from __future__ import annotations

import os
import shlex
import shutil
import stat
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from slurm_idle.commands import CommandRunner
from slurm_idle.config import Config, EngineConfig, ReplicaConfig
from slurm_idle.doctor.checks import EngineFacts, SiteFacts, SubmitProbe
from slurm_idle.errors import CommandError, SlurmIdleError
from slurm_idle.metrics.serving import loads_by_replica
from slurm_idle.replicajobs import placement_nodes_of
from slurm_idle.slurm.text import parse_show_config, parse_show_partitions

if TYPE_CHECKING:
    from slurm_idle.metrics.gpus import GpuSource

#: A test job that does nothing; `--test-only` never queues it.
_TEST_JOB = ("--wrap", "true")


def _argv(config: Config, command: str, *args: str) -> list[str]:
    exe = os.path.join(config.slurm.bin_dir, command) if config.slurm.bin_dir else command
    return [exe, *args]


def _output(exc: CommandError) -> str:
    return exc.stderr


def read_show_config(config: Config, runner: CommandRunner | None = None) -> dict[str, str]:
    """`scontrol show config`, parsed; CommandError when it cannot be run."""
    from slurm_idle.commands import SubprocessRunner

    runner = runner or SubprocessRunner()
    out = runner.run(_argv(config, "scontrol", "show", "config"), timeout=config.slurm.command_timeout_s)
    return parse_show_config(out.stdout)


def probe_submit(config: Config, runner: CommandRunner) -> SubmitProbe:
    """`sbatch --test-only` on the lend partition with --no-requeue (the lua plugin must refuse
    it) and with --requeue (a control: a refusal of both is about something else)."""
    lend = config.slurm.lend_partition
    results = []
    for flag in ("--no-requeue", "--requeue"):
        argv = _argv(config, "sbatch", "--test-only", f"--partition={lend}", flag, *_TEST_JOB)
        try:
            done = runner.run(argv, timeout=config.slurm.command_timeout_s)
            results.append((done.rc, done.stdout + done.stderr))
        except CommandError as exc:
            results.append((exc.rc or 1, _output(exc)))
    (no_rc, no_out), (re_rc, re_out) = results
    return SubmitProbe(no_rc, no_out, re_rc, re_out)


def _command_program(template: str) -> str | None:
    """The program a start/stop command runs (after `env VAR=...`, `sudo`), None if unparsable."""
    try:
        words = shlex.split(template)
    except ValueError:
        return None
    while words and (words[0] in {"env", "sudo", "exec", "nice"} or "=" in words[0]):
        words = words[1:]
    return words[0] if words else None


def engine_problems(engine: EngineConfig, node: str, container_exists: Callable[[str], bool | str],
                    sleep_endpoint: Callable[[], int | None] | None) -> tuple[str, ...]:
    """What stops the configured engine control from working on one replica."""
    problems: list[str] = []
    if engine.kind == "command":
        for key in ("start_command", "stop_command"):
            template = getattr(engine, key) or ""
            program = _command_program(template)
            if program is None:
                problems.append(f"engine.{key} cannot be parsed as a shell command")
            elif shutil.which(program) is None:
                problems.append(f"engine.{key} runs {program!r}, which is not found or not "
                                "executable here: install it or fix the path")
    elif engine.kind == "docker":
        found = container_exists(node)
        if found is not True:
            problems.append(str(found) if isinstance(found, str) else
                            f"container for {node} ({engine.container}) does not exist: create it once")
    elif sleep_endpoint is not None:
        status = sleep_endpoint()
        if status is None:
            problems.append("vLLM does not answer /is_sleeping: start it with "
                            "VLLM_SERVER_DEV_MODE=1 --enable-sleep-mode")
        elif status == 404:
            problems.append("vLLM answers 404 on /is_sleeping: sleep mode needs "
                            "VLLM_SERVER_DEV_MODE=1 --enable-sleep-mode")
    return tuple(problems)


def path_problem(path: str, euid: int | None = None) -> str | None:
    """Why the agent cannot safely write `path` (its directory must exist or be creatable,
    belong to us or root, and not be writable by others), None when it can."""
    euid = os.geteuid() if euid is None else euid
    p = Path(path)
    target = p if p.exists() or p.is_symlink() else None
    parent = p.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    try:
        st = parent.stat()
    except OSError as exc:
        return f"cannot read its directory {parent}: {exc.strerror}"
    if st.st_uid not in {0, euid}:
        return f"directory {parent} belongs to uid {st.st_uid}: chown it to root"
    if st.st_mode & stat.S_IWOTH and not st.st_mode & stat.S_ISVTX:
        return f"directory {parent} is world-writable: chmod o-w it or move the path"
    if st.st_mode & stat.S_IWOTH:
        return (f"directory {parent} is world-writable (sticky): another user can plant a symlink "
                "there; use a root-owned directory such as /run/slurm-idle")
    if not os.access(parent, os.W_OK):
        return f"directory {parent} is not writable by uid {euid}"
    if target is not None:
        if target.is_symlink():
            return "is a symlink: the agent does not follow symlinks for its files; remove it"
        tst = target.stat()
        if tst.st_uid not in {0, euid}:
            return f"belongs to uid {tst.st_uid}: chown it to root"
        if not os.access(target, os.W_OK):
            return f"not writable by uid {euid}"
    return None


def gather(
    config: Config,
    runner: CommandRunner,
    slurm: Any,
    metrics: Any,
    engine_checks: Callable[[str, str, EngineConfig, ReplicaConfig], EngineFacts],
    router_states: Callable[[list[str]], dict[str, str]] | None = None,
    gpus: GpuSource | None = None,
) -> SiteFacts:
    """Read everything the checks need; parts that fail are recorded in `errors`.
    `router_states` (replica name -> in/out/missing/unknown) reads the request routers, when any;
    `gpus` the nodes' GPU memory (None: there is no source to read it from)."""
    errors: dict[str, str] = {}
    timeout = config.slurm.command_timeout_s

    def read(part: str, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except SlurmIdleError as exc:
            errors[part] = str(exc)
        except (OSError, ValueError) as exc:
            errors[part] = f"{type(exc).__name__}: {exc}"
        return None

    slurm_config = read("slurm_config", lambda: read_show_config(config, runner))
    partitions = read("partitions", lambda: tuple(parse_show_partitions(
        runner.run(_argv(config, "scontrol", "show", "partition"), timeout=timeout).stdout)))
    nodes = read("nodes", lambda: tuple(slurm.nodes()))
    submit = read("submit", lambda: probe_submit(config, runner))
    replicas_list = [(m.name, r) for m in config.models for r in m.replicas]
    loads = read("replicas", lambda: metrics.replica_loads(replicas_list))
    replicas = loads_by_replica(replicas_list, loads) if loads is not None else None
    engines = tuple(engine_checks(r.node, m, config.engine_for(m), r) for m, r in replicas_list)
    paths = tuple(
        (key, value, path_problem(value))
        for key, value in (("journal", config.paths.journal), ("lock", config.paths.lock),
                           ("textfile", config.paths.textfile))
        if value
    )
    gpu_readings = None
    if gpus is None:
        errors["gpus"] = ("metrics.source is scrape: GPU memory is read from Prometheus only "
                          "(metrics.source: prometheus)")
    else:
        placed = placement_nodes_of(config, nodes or ())
        asked = list(dict.fromkeys([*config.pool_nodes, *(n.name for n in placed)]))
        budget = config.metrics.query_timeout_s
        gpu_readings = read("gpus", lambda: gpus.readings(asked, budget_s=budget))
    routed = None
    if router_states is not None:
        pool = [r.name for _, r in replicas_list]  # each replica its own router target
        routed = read("router", lambda: router_states(pool))
    return SiteFacts(slurm_config=slurm_config, partitions=partitions, nodes=nodes, submit=submit,
                     replicas=replicas, engines=engines, paths=paths, errors=errors,
                     router_states=routed, gpus=gpu_readings)
