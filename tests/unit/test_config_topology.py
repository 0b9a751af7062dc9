"""Replica forms of the config (several per node, spanning nodes, GPU subsets) and lend groups."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from slurm_idle.config import parse_config
from slurm_idle.errors import ConfigError
from slurm_idle.topology import lend_groups

HEAD = 'engine: {kind: command, start_command: "start {node}", stop_command: "stop {node}"}\nmodels:\n'

PER_NODE = HEAD + """
  - name: m
    nodes: gpu[01-08]
    gpus_per_replica: 4
    gpus_per_node: 8
    replicas_per_node: 2
    url: "http://{node}:{port}"
    ports: [8000, 8001]
"""

EXPLICIT = HEAD + """
  - name: big
    gpus_per_replica: 16
    replicas:
      - {nodes: "gpu[11-12]", url: "http://gpu11:8000"}
  - name: small
    replicas:
      - {node: gpu09, gpus: "0-3", url: "http://gpu09:8000"}
      - {node: gpu09, gpus: "4-7", url: "http://gpu09:8001"}
"""


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "slurm_idle.cli", *args], capture_output=True,
                          text=True, timeout=60, check=False)


def test_replicas_per_node_makes_two_replicas_per_node_one_group_each() -> None:
    """8 nodes x 2 replicas: 16 replicas with their own port and GPUs, 8 groups of one node."""
    cfg = parse_config(PER_NODE)
    replicas = cfg.models[0].replicas
    assert len(replicas) == 16
    assert [(r.name, r.url, r.gpus, r.index) for r in replicas[:2]] == [
        ("gpu01:8000", "http://gpu01:8000", (0, 1, 2, 3), 0),
        ("gpu01:8001", "http://gpu01:8001", (4, 5, 6, 7), 1),
    ]
    groups = lend_groups(cfg)
    assert [g.nodes for g in groups] == [(f"gpu0{i}",) for i in range(1, 9)]
    assert all(len(g.replicas) == 2 for g in groups)
    assert len(cfg.pool_nodes) == 8


def test_index_placeholder_instead_of_ports() -> None:
    """`{index}` in the url tells the replicas of a node apart without a port list."""
    cfg = parse_config(PER_NODE.replace('"http://{node}:{port}"', '"http://{node}:800{index}"')
                       .replace("    ports: [8000, 8001]\n", ""))
    assert [r.url for r in cfg.models[0].replicas[:2]] == ["http://gpu01:8000", "http://gpu01:8001"]


def test_explicit_multi_node_and_gpu_subsets() -> None:
    """A replica spanning two nodes makes one group of both; two subsets of gpu09 one group."""
    cfg = parse_config(EXPLICIT)
    groups = {g.nodes: [r.name for r in g.replicas] for g in lend_groups(cfg)}
    assert groups == {("gpu11", "gpu12"): ["gpu11"], ("gpu09",): ["gpu09:8000", "gpu09:8001"]}
    assert cfg.model("big").replicas[0].node == "gpu11"


def test_a_node_with_replicas_of_two_models_is_one_group() -> None:
    """Two models on one node: one group, both replicas in it."""
    cfg = parse_config(HEAD + """
  - name: a
    replicas: [{node: gpu1, gpus: "0-3", url: "http://gpu1:8000"}]
  - name: b
    replicas: [{node: gpu1, gpus: "4-7", url: "http://gpu1:8001"}]
""")
    (group,) = lend_groups(cfg)
    assert group.models() == ("a", "b")


def test_one_replica_per_node_configs_are_unchanged() -> None:
    """Today's `nodes:` form: one whole-node replica named after its node, a group per node."""
    cfg = parse_config(HEAD + "  - name: m\n    nodes: gpu[1-3]\n")
    assert [(g.nodes, [r.name for r in g.replicas]) for g in lend_groups(cfg)] == [
        (("gpu1",), ["gpu1"]), (("gpu2",), ["gpu2"]), (("gpu3",), ["gpu3"])]
    assert cfg.replica("gpu2") is not None and cfg.replica("gpu2").gpus is None


BAD = [
    (HEAD + """
  - name: m
    replicas:
      - {node: gpu09, gpus: "0-3", url: "http://gpu09:8000"}
      - {node: gpu09, gpus: "3-7", url: "http://gpu09:8001"}
""", "models.0.replicas.1.gpus: GPU 3 of gpu09 is also in models.0.replicas.0"),
    (HEAD + """
  - name: m
    gpus_per_node: 8
    replicas:
      - {node: gpu09, gpus: "4-11", url: "http://gpu09:8000"}
""", "models.0: replicas.0.gpus: GPU 11 of gpu09 is beyond gpus_per_node 8"),
    (PER_NODE.replace("gpus_per_replica: 4", "gpus_per_replica: 6"),
     "models.0: replicas.1.gpus: GPU 11 of gpu01 is beyond gpus_per_node 8"),
    (HEAD + """
  - name: a
    gpus_per_replica: 16
    replicas: [{nodes: "gpu[1-2]", url: "http://gpu1:8000"}]
  - name: b
    gpus_per_replica: 16
    replicas: [{nodes: "gpu[2-3]", gpus: "4-7", url: "http://gpu2:8001"}]
""", "models.1.replicas.0.gpus: node gpu2 is wholly given to models.0.replicas.0"),
    (HEAD + """
  - name: a
    replicas: [{nodes: "gpu[1-2]", gpus: "0-3", url: "http://gpu1:8000"}]
  - name: b
    replicas: [{nodes: "gpu[2-3]", gpus: "4-7", url: "http://gpu2:8001"}]
""", "models.1.replicas.0.nodes: gpu2 carries multi-node replicas of both 'a'"),
    (HEAD + "  - name: a\n    nodes: gpu1\n  - name: b\n    nodes: gpu1\n",
     "node 'gpu1' is listed under both 'a' and 'b'"),
    (PER_NODE.replace("    ports: [8000, 8001]\n", "").replace("{port}", "8000"),
     "models.0: url 'http://{node}:8000' is the same for the 2 replicas of a node"),
    (PER_NODE.replace("[8000, 8001]", "[8000]"), "models.0: ports has 1 port(s) for replicas_per_node 2"),
    (PER_NODE.replace('"0-3"', '"x"').replace("replicas_per_node: 2", "replicas_per_node: 0"),
     "models.0: replicas_per_node must be a whole number >= 1"),
    (HEAD + '  - name: m\n    replicas: [{node: gpu1, gpus: "a-b", url: "http://gpu1:1"}]\n',
     "models.0.replicas.0: gpus must be GPU indexes"),
    (PER_NODE.replace("kind: command", "kind: docker").replace(', start_command: "start {node}", '
                                                                'stop_command: "stop {node}"', ""),
     "engine.container 'vllm-{node}' names one container per node, but gpu01 runs several"),
]


@pytest.mark.parametrize(("content", "expected"), BAD)
def test_bad_topologies_exit_2_naming_the_field(tmp_path: Path, content: str, expected: str) -> None:
    """`config check` refuses an impossible fleet with one line naming the field, exit 2."""
    path = tmp_path / "c.yaml"
    path.write_text(content)
    proc = run_cli("config", "check", str(path))
    assert proc.returncode == 2, proc.stderr
    assert expected in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("content", [PER_NODE, EXPLICIT])
def test_config_check_accepts_the_forms(tmp_path: Path, content: str) -> None:
    """`config check` accepts replicas_per_node, multi-node and GPU-subset replicas."""
    path = tmp_path / "c.yaml"
    path.write_text(content)
    proc = run_cli("config", "check", str(path))
    assert proc.returncode == 0, proc.stderr
    assert "replica(s)" in proc.stdout and "lend group(s)" in proc.stdout


def test_parse_rejects_in_process_too() -> None:
    """The same refusal is a ConfigError for library callers."""
    with pytest.raises(ConfigError, match="a GPU in two replicas"):
        parse_config(BAD[0][0])
