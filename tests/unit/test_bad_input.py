"""Hostile or absurd input (issue 11, item 10) fails fast with one line and exit 2.

Each case here crashed, hung or passed silently before the bounds existed: alias bombs (minutes
and gigabytes in `submit --dry-run`), deep nesting (RecursionError), a hostlist of 10^8 nodes
(MemoryError), values that would make a Reason, a URL or a PromQL query mean something else.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from slurm_idle.agent import observe
from slurm_idle.config import parse_config
from slurm_idle.errors import ConfigError
from slurm_idle.hostlist import expand_hostlist
from slurm_idle.jobs import parse_job_spec
from slurm_idle.lifecycle import derive_phase, format_reason
from slurm_idle.model import ModelLoad, Phase, SlurmNode
from slurm_idle.testing.fakes import FakeMetrics, FakeSlurm
from slurm_idle.yamlfile import parse_yaml

from .test_config import run_cli

ENGINE = 'engine: {kind: command, start_command: "s {node}", stop_command: "t {node}"}\n'


def alias_bomb(levels: int = 9) -> str:
    """A 'billion laughs': each level lists the previous one 9 times (9^9 leaves, ~400 bytes)."""
    lines = ['a0: &a0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    for i in range(1, levels):
        refs = ",".join([f"*a{i - 1}"] * 9)
        lines.append(f"a{i}: &a{i} [{refs}]")
    return "\n".join(lines) + "\n"


def one_line_exit_2(proc) -> str:
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and len(lines[0]) < 400, proc.stderr[:2000]
    return lines[0]


def test_an_alias_bomb_is_refused_quickly() -> None:
    """A 400-byte document that expands to 9^9 values is refused while parsing, in well under
    a second (it took > 60 s and > 3 GB in `submit --dry-run`)."""
    text = alias_bomb()
    assert len(text) < 600
    started = time.process_time()
    with pytest.raises(ConfigError, match="aliases"):
        parse_yaml(text, "bomb.yaml")
    assert time.process_time() - started < 5  # generous: the point is "not minutes"


def test_aliases_used_sensibly_still_work() -> None:
    """Anchors and merges of ordinary size are fine."""
    data = parse_yaml("base: &b {x: 1, y: [1, 2]}\nother: {<<: *b, z: 3}\nthird: *b\n", "ok.yaml")
    assert data["other"] == {"x": 1, "y": [1, 2], "z": 3}


@pytest.mark.parametrize("text", [
    "a: " + "[" * 50_000 + "]" * 50_000,
    "a: " + "{x: " * 5_000 + "1" + "}" * 5_000,
])
def test_deep_nesting_is_a_config_error_not_a_recursion_error(text: str) -> None:
    with pytest.raises(ConfigError, match="nested"):
        parse_yaml(text, "deep.yaml")


def test_a_huge_file_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="larger than"):
        parse_yaml("a: " + "x" * (2 << 20), "big.yaml")


def test_submit_dry_run_of_an_alias_bomb_is_one_line_exit_2(tmp_path: Path) -> None:
    spec = tmp_path / "job.yaml"
    spec.write_text("name: j\nimage: busybox\n" + alias_bomb().replace("a0:", "env_x:", 0))
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text(alias_bomb() + "name: j\nimage: busybox\nargs: *a8\n")
    line = one_line_exit_2(run_cli("submit", "--dry-run", str(bomb)))
    assert "aliases" in line


def test_config_check_of_deep_nesting_is_one_line_exit_2(tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("models: " + "[" * 50_000 + "]" * 50_000 + "\n")
    assert "nested" in one_line_exit_2(run_cli("config", "check", str(cfg)))


def test_a_hostlist_of_a_hundred_million_nodes_is_one_line_exit_2(tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text(ENGINE + "models:\n  - name: m\n    nodes: gpu[1-100000000]\n")
    assert "more than" in one_line_exit_2(run_cli("config", "check", str(cfg)))


def test_hostlist_bound_is_checked_before_expanding() -> None:
    started = time.process_time()
    for expr in ("gpu[1-100000000]", "a[1-1000]b[1-1000]", "gpu[1-99999999999999999999]"):
        with pytest.raises(ValueError, match="more than"):
            expand_hostlist(expr, strict=True)
    assert time.process_time() - started < 1
    assert len(expand_hostlist("gpu[1-1000]", strict=True)) == 1000


def config_with(**sections: str) -> str:
    text = ENGINE + "models:\n  - name: m\n    nodes: gpu[1-2]\n    url: 'http://{node}:8000'\n"
    return text + "".join(f"{k}: {v}\n" for k, v in sections.items())


@pytest.mark.parametrize("text, words", [
    (config_with(slurm='{tag: ""}'), "tag"),
    (config_with(slurm="{tag: 'a b'}"), "tag"),
    (config_with(slurm="{lend_partition: inference}"), "both 'inference'"),
    (config_with(slurm="{lend_partition: 'idle\\nx'}"), "lend_partition"),
    (ENGINE + "models:\n  - name: m\n    replicas: [{node: '', url: 'http://a:1'}]\n", "node ''"),
    (ENGINE + "models:\n  - name: m\n    nodes: ['gpu1', ' ']\n", "node name"),
    (ENGINE + "models:\n  - name: m\n    nodes: gpu1\n    url: 'file:///etc/{node}'\n", "http"),
    (ENGINE + "models:\n  - name: m\n    replicas: [{node: a, url: 'ftp://a/'}]\n", "http"),
    (config_with(metrics="{prometheus_url: 'file:///etc/passwd'}"), "prometheus_url"),
    (config_with(metrics="{prometheus_url: 'localhost:9090'}"), "prometheus_url"),
    (config_with(metrics="""{job_label: 'vllm"} or vector(1) or {x="'}"""), "job_label"),
    (config_with(metrics="{instance_label: 'instance) or (x'}"), "instance_label"),
    (ENGINE + "models:\n  - name: m\n    nodes: gpu1\n    gpus_per_replica: 1e30\n", "gpus_per_replica"),
])
def test_config_values_that_would_change_meaning_are_refused(text: str, words: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_config(text, "c.yaml")
    assert words in str(err.value)
    assert "\n" not in str(err.value) and len(str(err.value)) < 400


@pytest.mark.parametrize("extra, words", [
    ("gpus: 1e30", "gpus"),
    ("mem: '" + "9" * 400 + "'", "mem"),
    ("cpus: 10000000000", "cpus"),
    ("time: '" + "9" * 400 + "'", "time"),
])
def test_absurd_resources_are_refused_in_one_short_line(extra: str, words: str) -> None:
    data = parse_yaml(f"name: j\nimage: busybox\n{extra}\n", "job.yaml")
    with pytest.raises(ConfigError) as err:
        parse_job_spec(data, "job.yaml")
    assert words in str(err.value) and len(str(err.value)) < 300


@pytest.mark.parametrize("reason", [
    "slurm-idle:serving since=garbage",
    "slurm-idle:serving",
    "slurm-idle:lent",
    "slurm-idle:lent since=2026-12-02T10:00:00Z",
    "slurm-idle:bogus since=2026-12-02T10:00:00Z",
    "slurm-idle:serving since=2026-12-02T10:00:00Z and more words",
    "slurm-idle:",
])
def test_a_drained_node_imitating_our_tag_is_the_admins(reason: str) -> None:
    node = SlurmNode(name="gpu1", state="idle", flags=frozenset({"DRAIN"}), reason=reason)
    assert derive_phase(node, "slurm-idle").phase is Phase.ADMIN


def test_our_own_reasons_still_read_back() -> None:
    for phase in (Phase.SERVING, Phase.RECLAIMING):
        for pinned in (False, True):
            reason = format_reason("slurm-idle", phase, 1796205600.0, pinned)
            node = SlurmNode(name="g", state="idle", flags=frozenset({"DRAIN"}), reason=reason)
            info = derive_phase(node, "slurm-idle")
            assert (info.phase, info.since, info.pinned) == (phase, 1796205600.0, pinned)


@pytest.mark.parametrize("comment", ["slurm-idle:lent since=garbage", "slurm-idle:lent", "slurm-idle:serving since=2026-12-02T10:00:00Z"])
def test_a_comment_imitating_our_lent_marker_is_the_admins(comment: str) -> None:
    node = SlurmNode(name="gpu1", state="idle", comment=comment)
    assert derive_phase(node, "slurm-idle").phase is Phase.ADMIN


def test_unknown_pool_nodes_neither_count_nor_flood_the_log() -> None:
    """10,000 configured nodes Slurm does not have: one observation line, and no view (so they
    add nothing to the pool's totals, e.g. max_lent_fraction's share)."""
    cfg = parse_config(ENGINE + "models:\n  - name: m\n    nodes: gpu[1-10002]\n"
                       "    url: 'http://{node}:8000'\n", "c.yaml")
    slurm = FakeSlurm.with_nodes(["gpu1", "gpu2"])
    obs = observe(cfg, slurm, FakeMetrics(models={"m": ModelLoad(model="m")}), 0.0)
    assert [v.name for v in obs.nodes] == ["gpu1", "gpu2"]
    assert len(obs.errors) == 1
    assert "10000 pool node(s) not known to Slurm" in obs.errors[0] and len(obs.errors[0]) < 200
