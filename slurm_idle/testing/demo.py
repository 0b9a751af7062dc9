"""The whole lend/reclaim story on the sandbox, printed as it happens (`scripts/demo`).

low load -> nodes lent -> an admin drains a node (never touched) -> the demo container job
runs on a lent node -> load rises -> node reclaimed, job requeued (not failed) -> load falls ->
job resumes from its checkpoint and completes. The end-to-end test runs this same story and
checks its `DemoReport`; the README's first command runs it for people.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import pwd
import re
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from slurm_idle.config import load_config
from slurm_idle.engine_notes import notes_path
from slurm_idle.journal import StepOutcome
from slurm_idle.model import Phase
from slurm_idle.testing.loadgen import CLIENT_OVERLOAD, failure_kind
from slurm_idle.testing.waiting import poll

REPO = Path(__file__).resolve().parents[2]
DEMO_SPEC = REPO / "etc" / "examples" / "demo-job.yaml"
ADMIN_REASON = "admin: disk check"
# Simulated load. A replica serves 5 req/s (engine_model.Capacity). At the rise, the one or
# two replicas left awake (a serving one, the admin's) get more than that, so queues build
# and every lent node comes back; once they serve, 12 req/s is 60% of four. The queues stay
# short enough that no client request waits out its timeout (30 s): a timeout here would be
# the overload's, and the demo would have to explain it instead of measuring the reclaim.
LOW_RPS, HIGH_RPS = 0.2, 12.0
OUTSIDE_REASON = "demo: not in this story"  # the sandbox nodes the story leaves closed
CLIENT_RPS = 1.0  # real requests through the router (HAProxy), counted on the client side


@dataclass
class DemoReport:
    """What the story measured; the e2e test asserts on it."""

    lent_nodes_at_low_load: list[str] = field(default_factory=list)
    admin_node: str = ""
    admin_reason_after: str = ""
    job_id: int = 0
    job_first_node: str = ""
    reclaim_to_serving_s: dict[str, float] = field(default_factory=dict)
    reclaimed_all_serving: bool = False
    job_state_after_reclaim: str = ""
    job_restarts: int = 0
    job_final_state: str = ""
    resumed_from: int | None = None
    job_output_tail: list[str] = field(default_factory=list)
    lost_gpu_s: float | None = None
    timings_s: dict[str, float] = field(default_factory=dict)
    client_traffic: dict[str, Any] = field(default_factory=dict)  # sandbox load-stats at the end


class Story:
    """Drives the sandbox and the real agent, printing each phase change with its time."""

    def __init__(self, sandbox: Any, out: Callable[[str], None] = print, tick_every_s: float = 2.0,
                 step_s: float | None = None) -> None:
        """step_s: the demo job's seconds per step, when not the example's (1 s); the tests use
        0.5 s, so its 120 steps, the story's longest clock, take a minute, not two."""
        from slurm_idle.wiring import build_agent

        self.sb = sandbox
        self.out = out
        self.tick_every_s = tick_every_s
        self.step_s = step_s
        os.environ.update(sandbox.env())
        self.config = load_config(sandbox.config_path)
        self.agent = build_agent(self.config)
        self.t0 = time.monotonic()
        self.report = DemoReport()
        self._last_summary = ""

    # -- helpers ----------------------------------------------------------------------------
    def say(self, text: str) -> None:
        self.out(f"[{time.monotonic() - self.t0:6.1f}s] {text}")

    def phases(self) -> dict[str, Phase]:
        return {v.name: v.phase for v in self.agent.observe().nodes}

    def tick(self) -> dict[str, Phase]:
        result = self.agent.tick()
        for step in result.steps:
            if step.outcome is StepOutcome.OK:
                self.say(f"  {step.node}: {step.from_phase.value} -> {step.to_phase.value} ({step.reason})")
                if step.action != "adopt" and step.to_phase in (Phase.LENT, Phase.SERVING) \
                        and step.from_phase in (Phase.LENDING, Phase.STARTING):
                    self.say(f"  clients through the router so far: {self.client_line()}")
            elif step.outcome is not StepOutcome.WAITING:
                self.say(f"  {step.node}: {step.from_phase.value} -> {step.to_phase.value} "
                         f"{step.outcome}: {step.error}")
        phases = self.phases()
        summary = " ".join(f"{n}={p.value}" for n, p in sorted(phases.items()))
        if summary != self._last_summary:
            self.say(f"phases: {summary}")
            self._last_summary = summary
        return phases

    def client_line(self) -> str:
        st = self.sb.traffic_stats()
        p99 = "-" if st["p99_s"] is None else f"{st['p99_s']:.2f}s"
        return client_summary(st, p99)

    def until(self, what: str, cond: Callable[[], bool], timeout_s: float, tick: bool = True) -> float:
        """Tick (or just poll) until cond() holds; returns the seconds it took."""
        start = time.monotonic()
        while True:
            if tick:
                self.tick()
            if cond():
                return time.monotonic() - start
            if time.monotonic() - start > timeout_s:
                raise TimeoutError(f"demo: gave up waiting {timeout_s:.0f}s for {what}")
            time.sleep(self.tick_every_s)

    def job(self) -> Any | None:
        for j in self.agent.slurm.jobs():
            if j.job_id == self.report.job_id:
                return j
        return None

    def scontrol_job(self) -> dict[str, str]:
        proc = self.sb.run(["scontrol", "-o", "show", "job", str(self.report.job_id)],
                           capture_output=True, text=True)
        fields: dict[str, str] = {}
        for token in proc.stdout.split():
            if "=" in token:
                key, _, value = token.partition("=")
                fields[key] = value
        return fields

    def demo_spec(self) -> Path:
        """etc/examples/demo-job.yaml with its checkpoint dir and log under this run's own
        directory: Slurm job ids restart at 1 in every new sandbox, so a checkpoint dir keyed
        by job id alone would hand a new job an old run's checkpoint."""
        import yaml

        run_dir = Path(self.sb.root) / "demo" / time.strftime("%Y%m%dT%H%M%S")
        run_dir.mkdir(parents=True, exist_ok=True)
        spec = yaml.safe_load(DEMO_SPEC.read_text())
        spec["mounts"]["checkpoint"]["source"] = str(run_dir / "checkpoint-{job_id}")
        spec["log"] = str(run_dir / "demo-%j.out")
        if self.step_s is not None:
            spec["params"]["step_s"] = self.step_s
        path = run_dir / "demo-job.yaml"
        path.write_text(yaml.safe_dump(spec, sort_keys=False))
        return path

    def reset(self) -> None:
        """Start from a plain cluster: no jobs, nodes undrained without comments, engines up,
        and the sandbox's other nodes (the topology and jobs-mode ones, in the idle partition
        too) closed: the researcher's job is to run on a node the story lends. Their higher
        Weight keeps jobs off them only while a pool node is free, and a job submitted right
        after a lend once ran on gpu5, never to be reclaimed by this story."""
        reset_cluster(self.sb, self.config.paths.journal)
        for node in self.outside():
            self.sb.run(["scontrol", "update", f"nodename={node}", "state=DRAIN",
                         f"reason={OUTSIDE_REASON}"], check=True)
        build_images()

    def outside(self) -> list[str]:
        """The sandbox's nodes that are not the story's pool (closed while it runs)."""
        return [n for n in getattr(self.sb, "all_nodes", self.sb.nodes) if n not in self.sb.nodes]

    # -- the story ----------------------------------------------------------------------------
    def run(self) -> DemoReport:
        """The story; the nodes outside it open again afterwards, as the sandbox has them."""
        try:
            return self._run()
        finally:
            for node in self.outside():
                self.sb.run(["scontrol", "update", f"nodename={node}", "state=RESUME"])

    def _run(self) -> DemoReport:
        r = self.report
        sb = self.sb
        self.say(f"sandbox at {sb.root}: Slurm {sb.slurm_version}, nodes {', '.join(sb.nodes)}")
        self.reset()
        sb.traffic(CLIENT_RPS)
        self.say(f"clients send {CLIENT_RPS:g} req/s through the router ({self.config.router.kind}, "
                 f"{sb.router_url}); their outcome is printed at every lend and reclaim")
        sb.load(LOW_RPS)
        self.say(f"load {LOW_RPS} req/s: the first tick adopts every node into serving")
        self.until("every node serving", lambda: all(
            p is Phase.SERVING for p in self.phases().values()), 120)

        r.admin_node = sb.nodes[-1]
        sb.run(["scontrol", "update", f"nodename={r.admin_node}", "state=DRAIN",
                f"reason={ADMIN_REASON}"], check=True)
        self.say(f"admin drains {r.admin_node} with reason {ADMIN_REASON!r}: slurm-idle must never touch it")

        self.say(f"low load for {self.config.policy.scale_down_window_s}s window: lending idle replicas")
        r.timings_s["lend"] = self.until(">=2 nodes lent", lambda: sum(
            p is Phase.LENT for p in self.phases().values()) >= 2, 240)
        r.lent_nodes_at_low_load = sorted(n for n, p in self.phases().items() if p is Phase.LENT)
        self.say(f"lent: {', '.join(r.lent_nodes_at_low_load)} (in {r.timings_s['lend']:.0f}s)")

        spec_file = self.demo_spec()
        proc = sb.run([sys.executable, "-m", "slurm_idle.cli", "submit", str(spec_file), "--json"],
                      capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"demo: submit failed: {proc.stderr.strip()}")
        r.job_id = int(json.loads(proc.stdout)["job_id"])
        self.say(f"researcher submits the demo container job: job {r.job_id} on partition idle")
        try:
            self.until("the demo job running",
                       lambda: (j := self.job()) is not None and j.state == "RUNNING", 180, tick=False)
        except TimeoutError as exc:
            info = self.scontrol_job()
            nodes = sb.run(["sinfo", "-N", "-h", "-o", "%N %T %E"], capture_output=True, text=True).stdout
            raise TimeoutError(f"{exc}: JobState={info.get('JobState')} Reason={info.get('Reason')}; "
                               f"nodes: {' | '.join(nodes.splitlines())}") from None
        job = self.job()
        assert job is not None
        r.job_first_node = job.nodes[0] if job.nodes else ""
        self.say(f"job {r.job_id} runs on lent node {r.job_first_node}; letting it checkpoint")
        time.sleep(25)

        sb.load(HIGH_RPS)
        rise = time.monotonic()
        self.say(f"load rises to {HIGH_RPS} req/s: queues build, every lent node must come back")
        lent = set(r.lent_nodes_at_low_load)

        def all_back() -> bool:
            phases = self.phases()
            now = time.monotonic() - rise
            for node in lent:
                if phases[node] is Phase.SERVING and node not in r.reclaim_to_serving_s:
                    r.reclaim_to_serving_s[node] = round(now, 1)
            return all(phases[n] is Phase.SERVING for n in lent)

        r.timings_s["reclaim"] = self.until("lent nodes serving again", all_back, 300)
        engine = self.agent.engine_for(self.config.models[0].name)
        replicas = [self.config.replica(n) for n in lent]
        r.reclaimed_all_serving = all(
            replica is not None and engine.health(replica).serving for replica in replicas)
        info = self.scontrol_job()
        r.job_state_after_reclaim = info.get("JobState", "")
        r.job_restarts = int(info.get("Restarts", "0") or 0)
        self.say(f"all lent nodes serving again in {r.timings_s['reclaim']:.0f}s "
                 f"(per node: {r.reclaim_to_serving_s}); job {r.job_id} is {r.job_state_after_reclaim} "
                 f"with Restarts={r.job_restarts}")

        sb.load(LOW_RPS)
        self.say(f"load falls to {LOW_RPS} req/s: nodes are lent again and the job resumes")
        r.timings_s["resume_and_finish"] = self.until("the demo job finished", self._job_done, 600)
        r.job_final_state = self.scontrol_job().get("JobState", "") or "COMPLETED"
        self._read_output()
        r.admin_reason_after = next(v.node.reason for v in self.agent.observe().nodes if v.name == r.admin_node)
        self.say(f"job {r.job_id} {r.job_final_state}: resumed_from={r.resumed_from}, "
                 f"work lost to the preemption: {r.lost_gpu_s} GPU-seconds")
        self.say(f"{r.admin_node} still drained by the admin: reason {r.admin_reason_after!r}")
        sb.traffic_stop()
        r.client_traffic = sb.traffic_stats()
        r.timings_s["whole"] = time.monotonic() - self.t0
        self.say(f"clients through the router, whole story: {self.client_line()}")
        return r

    def _job_done(self) -> bool:
        info = self.scontrol_job()
        state = info.get("JobState", "")
        if state in {"FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"}:
            raise RuntimeError(f"demo: job {self.report.job_id} ended {state}")
        return state == "COMPLETED" or (not info and self.job() is None)

    def _read_output(self) -> None:
        info = self.scontrol_job()
        path = info.get("StdOut")
        lines = Path(path).read_text().splitlines() if path and Path(path).exists() else []
        self.report.job_output_tail = lines[-15:]
        resumed = [int(m.group(1)) for line in lines if (m := re.search(r"resumed_from=(\d+)", line))]
        self.report.resumed_from = resumed[-1] if resumed else None
        from slurm_idle.jobs import load_job_spec

        spec = load_job_spec(DEMO_SPEC)
        step_s = self.step_s or (float(spec.params.get("step_s", 1)) if spec.params else 1.0)
        self.report.lost_gpu_s = lost_gpu_seconds(lines, gpus=spec.gpus, step_s=step_s)


def reset_cluster(sb: Any, journal: str | None = None) -> None:
    """No jobs, no GPU held outside Slurm, every node undrained without a comment, every
    emulator up, load 0, no journal (nor the engine notes beside it)."""
    sb.run(["scancel", "--full", "--user", pwd.getpwuid(os.getuid()).pw_name], capture_output=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        out = sb.run(["squeue", "-h", "-t", "RUNNING,COMPLETING,CONFIGURING"], capture_output=True, text=True)
        if not out.stdout.strip():
            break
        time.sleep(0.5)
    sb.gpu_release()  # before engine_start: an emulator does not start on a held GPU
    for node in getattr(sb, "all_nodes", sb.nodes):  # the 8-GPU nodes too (issue 13)
        sb.run(["scontrol", "update", f"nodename={node}", "comment="], capture_output=True)
        sb.run(["scontrol", "update", f"nodename={node}", "state=RESUME"], capture_output=True)
        sb.engine_start(node)
    for model in dict.fromkeys(r.model for r in getattr(sb, "replicas", ())):
        sb.load(0.0, model)
    sb.load(0.0)
    sb.traffic_stop()  # client traffic of an earlier run (issue 14)
    wake_all(sb)  # after the loads are 0: no new simulated request queues behind it
    sb.router_ready_all()  # every replica back in HAProxy, as on a fresh sandbox
    if journal and Path(journal).exists():
        Path(journal).unlink()
    if journal:  # what the agent remembered of the engines (failed wakes, residues, refusals)
        notes_path(journal).unlink(missing_ok=True)
        # The journal's side files: the idle run being counted, the day of the phases record.
        from slurm_idle.journal import Journal
        from slurm_idle.journal_snapshots import day_path

        Journal(Path(journal)).pending_path.unlink(missing_ok=True)
        day_path(Journal(Path(journal))).unlink(missing_ok=True)


def wake_all(sb: Any) -> None:
    """Every running emulator awake with nothing queued or running. Woken: `engine_start`
    launches a stopped one but leaves a running one as it is, and one a module lent under the
    http-sleep engine sleeps on; a sleeping replica is no capacity, so the next tick would
    reclaim lent nodes at load 0. Emptied (vLLM's own /sleep?mode=abort, then /wake_up): the
    simulated requests an earlier surge queued outlive its load going to 0 by up to the
    model's client timeout, and a test's first lend would wait out its drain window for them
    (10 s a node), a clock of the last test rather than of this one."""
    for name, emu in sb.status().get("emulators", {}).items():
        if emu.get("healthy"):  # one not running has nothing queued; engine_start is the caller's
            poll(functools.partial(_empty_and_awake, sb, name, emu["url"]), 30,
                 f"{name}'s emulator empty and awake")


def _empty_and_awake(sb: Any, name: str, url: str) -> bool:
    """One try: abort what the emulator at `url` holds and wake it. An emulator an earlier test
    stopped may still be exiting (it answers /health until its server closes): such a one is
    started again (engine_start leaves a running one as it is) and tried again."""
    import http.client
    import urllib.request

    try:
        with urllib.request.urlopen(f"{url}/is_sleeping", timeout=5) as resp:
            sleeping = bool(json.loads(resp.read())["is_sleeping"])
        for call in ([] if sleeping else ["/sleep?level=1&mode=abort"]) + ["/wake_up"]:
            request = urllib.request.Request(f"{url}{call}", data=b"", method="POST")
            with urllib.request.urlopen(request, timeout=10):
                pass
    except (OSError, http.client.HTTPException, ValueError, KeyError):
        from slurm_idle.testing.sandboxconf import REPLICAS

        head = next((r.node for r in REPLICAS if r.name == name), None)
        if head is None:
            return not sb.status()["emulators"].get(name, {}).get("healthy")  # gone: nothing held
        sb.engine_start(head)  # starts its node's replicas that are not running, this one too
        return False
    return True


def lost_gpu_seconds(lines: list[str], gpus: int = 1, step_s: float = 1.0) -> float | None:
    """Work redone after each restart: the steps counted before a restart beyond the step the
    job resumed from, times the step's GPU-seconds (None if the job never restarted)."""
    last_step: int | None = None
    lost: float | None = None
    for line in lines:
        if (m := re.search(r"resumed_from=(\d+)", line)) and last_step is not None:
            lost = (lost or 0.0) + max(last_step - int(m.group(1)), 0) * step_s * gpus
            last_step = None
        elif m := re.match(r"step=(\d+)$", line.strip()):
            last_step = int(m.group(1))
    return lost


def failures_by_kind(st: dict[str, Any]) -> dict[str, dict[str, int]]:
    """The service's failures of a `load-stats` summary, by what caused them (loadgen's
    failure_kind): `drain`, `overload`, `other`."""
    kinds: dict[str, dict[str, int]] = {"drain": {}, "overload": {}, "other": {}}
    for why, n in st.get("failures", {}).items():
        kinds[failure_kind(why)][why] = n
    return kinds


def _listed(counts: dict[str, int]) -> str:
    return f" ({', '.join(f'{k} {v}' for k, v in counts.items())})" if counts else ""


def client_summary(st: dict[str, Any], p99: str) -> str:
    """One line of `load-stats`: what a lend or a reclaim did to clients (failed by a drain)
    apart from requests queued past their timeout under overload, any other failure, and the
    generator's own limit (not sent: client_overload)."""
    kinds = failures_by_kind(st)
    parts = [f"requests {st['requests']}",
             f"failed by a drain {sum(kinds['drain'].values())}{_listed(kinds['drain'])}"]
    if kinds["overload"]:
        parts.append(f"timed out under overload {sum(kinds['overload'].values())}"
                     f"{_listed(kinds['overload'])}")
    if kinds["other"]:
        parts.append(f"failed otherwise {sum(kinds['other'].values())}{_listed(kinds['other'])}")
    if st.get(CLIENT_OVERLOAD):
        parts.append(f"not sent (client_overload) {st[CLIENT_OVERLOAD]}")
    return ", ".join(parts) + f", p99 {p99}"


def verdict(report: DemoReport) -> tuple[bool, list[str]]:
    """`demo: OK` only if the story held: the job was preempted and resumed from a checkpoint,
    and no client request failed because a replica was stopped or put to sleep under it
    (aborted, reset, 502/503), nor for a reason nobody explained. Requests that waited out
    their timeout in an overloaded queue are the load's, not the lend's or the reclaim's:
    they are explained, not held against the story (the demo's load levels avoid them)."""
    lines: list[str] = []
    kinds = failures_by_kind(report.client_traffic)
    if kinds["overload"]:
        lines.append(f"demo: {sum(kinds['overload'].values())} client requests waited out their "
                     f"timeout in a queue under overload{_listed(kinds['overload'])}: the load's "
                     "doing, not a drain's")
    problems: list[str] = []
    if report.job_restarts < 1 or not report.resumed_from:
        problems.append("demo: the story did not complete as expected")
    if kinds["drain"]:
        problems.append(f"demo: {sum(kinds['drain'].values())} client requests failed because a "
                        f"replica was stopped or put to sleep under them{_listed(kinds['drain'])}")
    if kinds["other"]:
        problems.append(f"demo: {sum(kinds['other'].values())} client requests failed for "
                        f"another reason{_listed(kinds['other'])}")
    return not problems, lines + (problems or ["demo: OK"])


def build_images() -> None:
    """The demo's images, through the sandbox's dockerd; its own error message on failure."""
    r = subprocess.run([sys.executable, "-m", "slurm_idle.testing.images"], env=os.environ.copy(),
                       capture_output=True, text=True, check=False)
    if r.returncode != 0:
        lines = (r.stderr or r.stdout).strip().splitlines() or [f"exit {r.returncode}"]
        raise RuntimeError(f"demo: building the demo image failed: {lines[-1]}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", default="/tmp/slurm-idle-sandbox", help="sandbox directory")
    parser.add_argument("--keep", action="store_true", help="leave the sandbox running afterwards")
    parser.add_argument("--json", action="store_true", help="print the measurements as JSON at the end")
    args = parser.parse_args(argv)
    from slurm_idle.testing.sandbox import DEFAULT_BASE_PORT, DEFAULT_ROOT

    root = Path(args.root)
    # Same ports as `scripts/sandbox` for the default root, so `--keep` leaves a sandbox that
    # `scripts/sandbox status|env|down` find.
    base = DEFAULT_BASE_PORT if root == DEFAULT_ROOT and not (root / "sandbox.json").exists() else None
    try:
        report = _run(root, base, args.keep)
    except KeyboardInterrupt:
        print("demo: interrupted; everything it started is stopped", file=sys.stderr, flush=True)
        return 130
    except (RuntimeError, TimeoutError, OSError, subprocess.SubprocessError) as exc:
        # One line with the underlying error (a daemon's last log lines, dockerd's message);
        # the sandbox is down already unless --keep asked otherwise.
        msg = " ".join(str(exc).split())
        print(msg if msg.startswith(("demo:", "sandbox:")) else f"demo: {msg}",
              file=sys.stderr, flush=True)
        return 1
    if args.json:
        print(json.dumps(asdict(report), indent=2))
    ok, lines = verdict(report)
    for line in lines:
        print(line, flush=True)
    return 0 if ok else 1


def _run(root: Path, base: int | None, keep: bool) -> DemoReport:
    """Bring the sandbox up (a failed start stops what it started), run the story, and
    bring it down again unless `keep`."""
    from slurm_idle.testing.sandbox import Sandbox

    sb = Sandbox(root, base)
    started = time.monotonic()
    print(f"bringing the sandbox up under {root} ...", flush=True)
    try:
        # One line per part as it is ready (stderr: the story's output stays as it was).
        sb.up(progress=lambda line: print(f"sandbox: {line}", file=sys.stderr, flush=True))
        print(f"sandbox up in {time.monotonic() - started:.1f}s", flush=True)
        return Story(sb, out=lambda s: print(s, flush=True)).run()
    finally:
        if not keep:
            sb.down()
        else:
            print(f"sandbox left running: eval \"$(scripts/sandbox --root {root} env)\"; "
                  f"scripts/sandbox --root {root} down", flush=True)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
