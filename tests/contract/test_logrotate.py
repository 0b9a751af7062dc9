"""The shipped logrotate rule (etc/logrotate.d/slurm-idle) run by the real logrotate in the
middle of an agent's run: the agent goes on writing to the file `create` made, with no signal,
and explain and report read one history across the rotated siblings, compressed ones too.

The agent is the in-process one on fakes (the journal and its side file are real files, every
tick writes real records); the rule is the shipped file with only its path (and, run by
another user than root, its owner) replaced, so the test checks the directives a site installs.
"""

from __future__ import annotations

import grp
import gzip
import json
import os
import pwd
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from slurm_idle.agent import Agent, TickResult
from slurm_idle.cli import main
from slurm_idle.cli.common import Context
from slurm_idle.config import Config, parse_config
from slurm_idle.journal import Journal, TickRecord, TransitionRecord, typed_records
from slurm_idle.journal_files import history
from slurm_idle.lifecycle import format_reason
from slurm_idle.model import ModelLoad, Phase, ReplicaLoad, SlurmNode
from slurm_idle.policy import assess, plan
from slurm_idle.report_io import make_report
from slurm_idle.testing.fakes import FakeEngine, FakeMetrics, FakeSlurm

# T0 is on the hour: the scenario's idle runs stay within one UTC hour
from tests.unit.test_agent import T0, Clock

RULE = Path(__file__).resolve().parents[2] / "etc" / "logrotate.d" / "slurm-idle"
DEFAULT_JOURNAL = "/var/lib/slurm-idle/journal.jsonl"
NODES = ("gpu1", "gpu2", "gpu3")
CONFIG = """
engine: {{kind: command, start_command: "true {{node}}", stop_command: "true {{node}}", drain_timeout_s: 5}}
models:
  - name: m
    nodes: gpu[1-3]
    url: "http://127.0.0.1:1/{{node}}"
    tokens_per_s_per_replica: 100
policy: {{scale_down_window_s: 60, forecast: false}}
paths:
  journal: {journal}
  lock: {root}/tick.lock
timeouts: {{tick_budget_s: 10}}
"""


def logrotate_binary() -> str:
    """The logrotate binary; missing, a skip with the reason, or a failure in CI (CI=true),
    where scripts/lib/install.sh must have installed it."""
    found = shutil.which("logrotate") or (
        "/usr/sbin/logrotate" if Path("/usr/sbin/logrotate").exists() else None)
    if found is None:
        why = "logrotate is not installed (Debian package `logrotate`; scripts/lib/install.sh installs it)"
        if os.environ.get("CI"):
            pytest.fail(why)
        pytest.skip(why)
    return found


class Pool:
    """gpu[1-3] serving model m (100 tok/s per replica), an agent with the real planner over
    fake Slurm, engines and metrics, ticking once a minute; `demand` moves it."""

    def __init__(self, root: Path) -> None:
        # The agent's directory exists, as systemd's StateDirectory= makes it (the agent's
        # parallel steps would otherwise race to create it).
        (root / "lib").mkdir(mode=0o755)
        self.journal_path = root / "lib" / "journal.jsonl"
        self.config: Config = parse_config(CONFIG.format(journal=self.journal_path, root=root))
        self.slurm = FakeSlurm.with_nodes(list(NODES))
        for n in NODES:
            self.slurm.node_map[n] = SlurmNode(
                name=n, state="idle", flags=frozenset({"DRAIN"}),
                reason=format_reason("slurm-idle", Phase.SERVING, T0 - 600))
        self.engine = FakeEngine(up=dict.fromkeys(NODES, True))
        self.metrics = FakeMetrics()
        self.clock = Clock()
        self.agent = Agent(config=self.config, slurm=self.slurm, metrics=self.metrics,
                           engine_for=lambda model: self.engine, planner=plan, assessor=assess,
                           clock=self.clock, sleep=self.clock.sleep)
        self.results: list[TickResult] = []

    def phases(self) -> dict[str, Phase]:
        return {v.name: v.phase for v in self.agent.observe().nodes}

    def tick(self, demand: float, times: int) -> None:
        """`times` ticks a minute apart, the model's demand `demand` tok/s over its serving
        replicas."""
        for _ in range(times):
            serving = [n for n, p in self.phases().items() if p is Phase.SERVING]
            self.metrics.replicas = {
                n: ReplicaLoad("m", n, url=f"http://127.0.0.1:1/{n}",
                               generation_tokens_per_s=demand / len(serving)) for n in serving}
            self.metrics.models = {"m": ModelLoad("m", generation_tokens_per_s=demand,
                                                  demand_tokens_per_s_max_window=demand,
                                                  waiting_max_window=0)}
            result = self.agent.tick()
            assert result.error is None and result.locked_out is None
            self.results.append(result)
            self.clock.t += 60


def render_rule(journal: Path) -> str:
    """The shipped rule for `journal`: its path replaced, and its owner when not run as root
    (logrotate cannot chown to root then, and the agent's user owns the journal)."""
    text = RULE.read_text()
    assert text.count(DEFAULT_JOURNAL) == 1
    text = text.replace(DEFAULT_JOURNAL, str(journal))
    if os.geteuid() != 0:
        user, group = pwd.getpwuid(os.geteuid()).pw_name, grp.getgrgid(os.getegid()).gr_name
        text = text.replace("create 0644 root root", f"create 0644 {user} {group}")
    return text


def rotate(binary: str, conf: Path, state: Path) -> None:
    """One forced rotation (`-f`: what `weekly`/`maxsize` would decide in a week), with the
    test's own state file. logrotate says nothing on success: any output is a problem."""
    proc = subprocess.run([binary, "-f", "-s", str(state), str(conf)], capture_output=True,
                          text=True, timeout=60, check=False)
    assert proc.returncode == 0 and not proc.stderr and not proc.stdout, proc


def lines(path: Path) -> list[dict[str, Any]]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as fh:
        return [json.loads(ln) for ln in fh if ln.strip()]


def test_rotation_mid_run_loses_and_duplicates_no_record(tmp_path: Path) -> None:
    """Two rotations by the shipped rule between lends and reclaims: the agent writes to the
    new live file with no signal, the idle run's side file stays where it is, every tick and
    transition is in the history exactly once, and explain and report see both sides."""
    binary = logrotate_binary()
    pool = Pool(tmp_path)
    journal = Journal(pool.journal_path)
    conf, state = tmp_path / "logrotate.conf", tmp_path / "logrotate.state"
    conf.write_text(render_rule(pool.journal_path))
    live, first, second = (pool.journal_path, pool.journal_path.with_name("journal.jsonl.1"),
                           pool.journal_path.with_name("journal.jsonl.2.gz"))

    # Low load: gpu1 and gpu2 are lent, then idle ticks pile up in the side file.
    pool.tick(demand=10.0, times=4)
    assert pool.phases() == {"gpu1": Phase.LENT, "gpu2": Phase.LENT, "gpu3": Phase.SERVING}
    before_first, idle_run = lines(live), journal.pending_path.read_text()
    rotate(binary, conf, state)
    assert lines(first) == before_first and live.stat().st_size == 0
    assert journal.pending_path.read_text() == idle_run  # the side file is not rotated
    st = live.stat()
    assert (st.st_mode & 0o777, st.st_uid) == (0o644, os.geteuid())  # what the agent checks

    # High load: both come back; the idle run begun before the rotation ends up in the new file.
    pool.tick(demand=250.0, times=4)
    assert set(pool.phases().values()) == {Phase.SERVING}
    assert any(r.get("count", 1) == 3 for r in lines(live)), "the pre-rotation idle run"
    before_second = lines(live)
    rotate(binary, conf, state)
    # delaycompress: the newest sibling stays plain, the one before it is compressed now.
    assert lines(first) == before_second and lines(second) == before_first
    assert not first.with_name("journal.jsonl.1.gz").exists()

    # Low load again: lent again, into the file the second rotation made.
    pool.tick(demand=10.0, times=4)
    assert pool.phases() == {"gpu1": Phase.LENT, "gpu2": Phase.LENT, "gpu3": Phase.SERVING}
    after = lines(live)
    assert any(r["event"] == "transition" for r in after)
    assert history(live) == [second, first, live]
    assert sorted(p.name for p in live.parent.iterdir() if p.name.startswith("journal.jsonl")) == [
        "journal.jsonl", "journal.jsonl.1", "journal.jsonl.2.gz", "journal.jsonl.idle-run",
        "journal.jsonl.phases-day"]  # the side files beside it, never rotated

    # Nothing lost, nothing doubled: each tick is covered by exactly one tick record (a run
    # covers `count` ticks from ts to until), each step is one transition record.
    records = list(journal.records())
    assert len({json.dumps(r, sort_keys=True) for r in records}) == len(records)
    typed = list(typed_records(records))
    ticks = [r for r in typed if isinstance(r, TickRecord)]
    assert sum(t.count for t in ticks) == len(pool.results) == 12
    for result in pool.results:
        covering = [t for t in ticks if t.ts <= result.started <= t.last_ts]
        assert len(covering) == 1, result.started
    transitions = [r for r in typed if isinstance(r, TransitionRecord)]
    steps = [s for r in pool.results for s in r.steps]
    assert len(transitions) == len(steps) == 18  # 2 lends of 3 steps, twice; 2 reclaims of 3
    assert sorted((t.node, t.from_phase, t.to_phase) for t in transitions) == sorted(
        (s.node, s.from_phase.value, s.to_phase.value) for s in steps)

    # explain --json reads from the end through the plain and the compressed siblings.
    out = CliRunner().invoke(
        main, ["--config", str(write_config(tmp_path, pool)), "explain", "-n", "100", "--json"],
        obj=Context(agent_factory=lambda config, read_only=False: pool.agent))  # type: ignore[arg-type]
    assert out.exit_code == 0, out.output
    doc = json.loads(out.stdout)
    shown = [(t["ts"], t["node"], t["from"], t["to"]) for t in doc["transitions"]]
    assert sorted(shown) == sorted((t.ts, t.node, t.from_phase, t.to_phase) for t in transitions)
    assert doc["last_tick"]["count"] == 3  # the idle run being counted, newest of all
    assert doc["journal_predates"] == []
    in_oldest = {(r["ts"], r["node"]) for r in before_first if r["event"] == "transition"}
    in_live = {(r["ts"], r["node"]) for r in after if r["event"] == "transition"}
    assert in_oldest and in_live and in_oldest | in_live <= {(s[0], s[1]) for s in shown}

    # report over the whole run: the lends in .2.gz and the live file, the reclaims in .1.
    now = pool.clock()
    report = make_report(pool.config, since=T0 - 60, until=now, now=now, runs=[])
    assert (report.lends, report.reclaims, report.ticks) == (4, 2, 12)
    assert report.reclaim_latencies == 2 and report.journal == str(live)
    # ... and from the second rotation on: only the last lends and ticks.
    cut = pool.results[8].started
    report = make_report(pool.config, since=cut, until=now, now=now, runs=[])
    assert (report.lends, report.reclaims, report.ticks) == (2, 0, 4)


def write_config(root: Path, pool: Pool) -> Path:
    path = root / "slurm-idle.yaml"
    path.write_text(CONFIG.format(journal=pool.journal_path, root=root))
    return path
