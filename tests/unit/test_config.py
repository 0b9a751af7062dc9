"""Config validation: the shipped example validates and bad input fails with one clear line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from slurm_idle.config import load_config, parse_config
from slurm_idle.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "etc" / "slurm-idle.yaml"

MINIMAL = """
engine: {kind: command, start_command: "start {node}", stop_command: "stop {node}"}
models:
  - name: m
    nodes: gpu[1-2]
    url: "http://{node}:8000"
"""


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "slurm_idle.cli", *args], capture_output=True, text=True, timeout=60, check=False
    )


def test_example_config_validates() -> None:
    """etc/slurm-idle.yaml is complete and valid."""
    cfg = load_config(EXAMPLE)
    assert len(cfg.pool_nodes) == 10
    assert cfg.model_of_node("gpu03") is not None
    assert cfg.engine_for("Qwen/Qwen2.5-7B-Instruct").kind == "http-sleep"


def test_example_config_documents_the_lead_and_queue_knobs() -> None:
    """The example sets the expected cold start and the queue's sustain time; a sleep-mode model
    expects a 30 s wake, so its forecast lead is grace + 30 s + a tick."""
    from slurm_idle.policy import default_forecast_lead_s

    cfg = load_config(EXAMPLE)
    assert cfg.policy.queue_sustain_s == 60
    assert cfg.engine_for("meta-llama/Llama-3.1-70B-Instruct").expected_start_s == 300.0
    assert cfg.engine_for("Qwen/Qwen2.5-7B-Instruct").expected_start_s == 30.0
    assert default_forecast_lead_s(cfg, "Qwen/Qwen2.5-7B-Instruct") == 30.0 + 30.0 + 60.0


def test_expected_start_defaults_by_engine_kind() -> None:
    """engine.expected_start_s: 300 s for a cold start, 30 s for an http-sleep wake, unless set."""
    cold = parse_config(MINIMAL)
    assert cold.engine_for("m").expected_start_s == 300.0
    command = 'kind: command, start_command: "start {node}", stop_command: "stop {node}"'
    wake = parse_config(MINIMAL.replace(command, "kind: http-sleep"))
    assert wake.engine_for("m").expected_start_s == 30.0
    slow = parse_config(MINIMAL.replace("kind: command,", "kind: command, expected_start_s: 900,"))
    assert slow.engine_for("m").expected_start_s == 900.0
    with pytest.raises(ConfigError, match="expected_start_s"):
        parse_config(MINIMAL.replace("kind: command,", "kind: command, expected_start_s: -1,"))
    with pytest.raises(ConfigError, match="queue_sustain_s"):
        parse_config(MINIMAL + "policy: {queue_sustain_s: -5}\n")


def test_nodes_shorthand_expands_to_replicas() -> None:
    """`nodes: gpu[1-2]` with a url template becomes one replica per node."""
    cfg = parse_config(MINIMAL)
    assert [(r.node, r.url) for r in cfg.models[0].replicas] == [
        ("gpu1", "http://gpu1:8000"),
        ("gpu2", "http://gpu2:8000"),
    ]


def test_yaml_syntax_error_names_line() -> None:
    """A YAML syntax error names the source and the line."""
    with pytest.raises(ConfigError, match=r"bad.yaml: YAML syntax error at line 2"):
        parse_config("models:\n  - name: m: x\n", source="bad.yaml")


def test_empty_file_says_empty() -> None:
    """An empty file is reported as empty."""
    with pytest.raises(ConfigError, match="is empty"):
        parse_config("   \n# nothing\n", source="e.yaml")


def test_unknown_key_is_named() -> None:
    """An unknown key is named with its dotted path."""
    with pytest.raises(ConfigError, match=r"unknown key 'policy.max_lend_fraction'"):
        parse_config(MINIMAL + "policy: {max_lend_fraction: 0.5}\n")


def test_wrong_type_names_dotted_path() -> None:
    """A value of the wrong type names the field's dotted path."""
    with pytest.raises(ConfigError, match=r"models\.0\.gpus_per_replica"):
        parse_config(MINIMAL.replace("name: m", "name: m\n    gpus_per_replica: four"))


def test_duplicate_node_rejected() -> None:
    """A node cannot serve two models."""
    text = MINIMAL + "  - name: m2\n    nodes: gpu2\n"
    with pytest.raises(ConfigError, match="gpu2"):
        parse_config(text)


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        ("models: [\n", "line 2"),
        ("", "is empty"),
        (MINIMAL + "bogus: 1\n", "unknown key 'bogus'"),
        (MINIMAL + "timeouts: {start_s: soon}\n", "timeouts.start_s"),
        (MINIMAL.replace(":8000", ":{port}"), "models.0: url template 'http://{node}:{port}' uses {port}: give `ports: [8000, 8001]`"),
        (MINIMAL.replace(":8000", ":{gpu}"), "models.0: url template 'http://{node}:{gpu}': unknown placeholder {gpu}"),
        (MINIMAL.replace('"http://{node}:8000"', "8000"), "models.0: url must be a text template"),
        (MINIMAL.replace("nodes: gpu[1-2]", "nodes:"), "models.0: nodes must be a Slurm hostlist"),
        (MINIMAL.replace("nodes: gpu[1-2]", 'nodes: ""'), "models.0: nodes must be a Slurm hostlist"),
        (MINIMAL.replace(":8000", ":{0}"), "models.0: url template"),
        (MINIMAL + "timeouts: {start_s: 1e400}\n", "timeouts.start_s: Input should be a finite number"),
        (MINIMAL.replace("name: m", "name: m\n    min_serving_replicas: 0"),
         "models.0.min_serving_replicas: must be at least 1"),
        (MINIMAL + "  - name: m\n    nodes: gpu3\n", "models: model 'm' is listed twice"),
        ("engine: {kind: http-sleep, sleep_level: 2}\nmodels: [{name: m, nodes: gpu1}]\n",
         "engine.sleep_level: sleep_level must be 1"),
        # the grace is waited within one tick (issue 12): it must fit the tick's budget
        (MINIMAL + "slurm: {requeue_grace_s: 60}\ntimeouts: {tick_budget_s: 50}\n",
         "slurm.requeue_grace_s (60) must be shorter than timeouts.tick_budget_s (50)"),
        (MINIMAL + "slurm: {default_job_signal: 'USR2; rm'}\n", "slurm.default_job_signal"),
    ],
)
def test_cli_config_check_bad_input_exits_2(tmp_path: Path, content: str, expected: str) -> None:
    """`config check` prints one line naming the problem and exits 2, never a traceback."""
    path = tmp_path / "c.yaml"
    path.write_text(content)
    proc = run_cli("config", "check", str(path))
    assert proc.returncode == 2, proc.stderr
    assert expected in proc.stderr
    assert "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_cli_config_check_example_exits_0() -> None:
    """`config check etc/slurm-idle.yaml` exits 0."""
    proc = run_cli("config", "check", str(EXAMPLE))
    assert proc.returncode == 0, proc.stderr
    assert "OK" in proc.stdout


def test_cli_missing_config_is_clear(tmp_path: Path) -> None:
    """A missing config file says how to point at one."""
    proc = run_cli("--config", str(tmp_path / "nope.yaml"), "config", "check")
    assert proc.returncode == 2
    assert "not found" in proc.stderr and "--config" in proc.stderr


def test_cli_help_lists_every_command() -> None:
    """`--help` lists every command the product promises."""
    proc = run_cli("--help")
    assert proc.returncode == 0
    for name in ["tick", "status", "explain", "pin", "unpin", "lend", "reclaim", "submit",
                 "pipeline", "jobs", "simulate", "report", "metrics", "config"]:
        assert f"  {name} " in proc.stdout, name


def test_bad_lending_window_and_zone_fail_at_check_time() -> None:
    """A malformed lending window or time zone is a config error, not a crash of every tick."""
    with pytest.raises(ConfigError, match=r"policy\.lending_windows"):
        parse_config(MINIMAL + "policy: {lending_windows: ['25:99-xx']}\n")
    with pytest.raises(ConfigError, match=r"policy\.timezone.*Mars/Olympus"):
        parse_config(MINIMAL + "policy: {timezone: Mars/Olympus}\n")


def test_non_utf8_config_is_one_line(tmp_path: Path) -> None:
    """A binary file given as config is reported in one line with exit 2."""
    path = tmp_path / "c.yaml"
    path.write_bytes(b"\xff\xfe\x00bad")
    proc = run_cli("config", "check", str(path))
    assert proc.returncode == 2 and "UTF-8" in proc.stderr and "Traceback" not in proc.stderr


def test_unknown_key_in_a_model_is_one_error_not_two() -> None:
    """An unknown key under models.N is the only error reported (not also `models` too short)."""
    with pytest.raises(ConfigError) as err:
        parse_config(MINIMAL + "    bogus: 1\n")
    assert str(err.value) == "<config>:7:5: unknown key 'models.0.bogus'"


def test_non_finite_numbers_are_refused_everywhere() -> None:
    """`.inf`/`.nan` in any number field is a config error (e.g. a timeout that never fires)."""
    for extra in ("timeouts: {reclaim_s: .inf}", "policy: {target_utilisation: .nan}",
                  "slurm: {requeue_grace_s: .inf}", "report: {price_per_gpu_hour: .inf}"):
        with pytest.raises(ConfigError, match="finite number"):
            parse_config(MINIMAL + extra + "\n")


def test_a_serving_floor_of_zero_is_only_for_the_simulator() -> None:
    """A config file needs min_serving_replicas >= 1 (zero replicas give no metrics to bring the
    model back); the simulator builds models in code and may still plan with a floor of 0."""
    from slurm_idle.config import ModelConfig

    with pytest.raises(ConfigError, match="no metrics"):
        parse_config(MINIMAL.replace("name: m", "name: m\n    min_serving_replicas: 0"))
    assert ModelConfig(name="m", min_serving_replicas=0).min_serving_replicas == 0


def test_example_config_mentions_every_key() -> None:
    """etc/slurm-idle.yaml names every config key, set or commented out with its default."""
    import re

    from slurm_idle import config as c

    text = EXAMPLE.read_text()
    sections = (c.SlurmConfig, c.MetricsConfig, c.GpuConfig, c.EngineConfig, c.ModelConfig, c.PolicyConfig,
                c.TimeoutsConfig, c.PathsConfig, c.ReportConfig, c.RouterConfig)
    missing = [f"{cls.__name__}.{name}" for cls in sections for name in cls.model_fields
               if not re.search(rf"^[ #-]*\{{?{name}:", text, re.MULTILINE)]
    assert not missing


def test_gpu_section_defaults_are_dcgm_exporters_names() -> None:
    """Without a `gpu:` section: dcgm-exporter's metrics (MiB) and labels, the tolerances, and
    the two limits later steps read (gpu_free_s, wake_attempts)."""
    cfg = parse_config(MINIMAL)
    gpu = cfg.gpu
    assert (gpu.used_metric, gpu.free_metric, gpu.total_metric, gpu.unit) == (
        "DCGM_FI_DEV_FB_USED", "DCGM_FI_DEV_FB_FREE", None, "mib")
    assert (gpu.node_label, gpu.index_label, gpu.holder_label) == ("Hostname", "gpu", "hpc_job")
    assert (gpu.free_tolerance_mib, gpu.max_residue_mib) == (1024, 4096)
    assert cfg.timeouts.gpu_free_s == 300 and cfg.engine is not None and cfg.engine.wake_attempts == 3


@pytest.mark.parametrize(("section", "error"), [
    ("gpu: {used_metric: 'up} or vector(1'}", "gpu.used_metric: used_metric 'up} or vector(1' is not a Prometheus metric name"),
    ("gpu: {total_metric: 'a-b'}", "gpu.total_metric: total_metric 'a-b' is not a Prometheus metric name"),
    ("gpu: {node_label: 'host name'}", "gpu.node_label: node_label 'host name' is not a Prometheus label name"),
    ("gpu: {holder_label: '1job'}", "gpu.holder_label: holder_label '1job' is not a Prometheus label name"),
    ("gpu: {unit: gib}", "gpu.unit"),
    ("gpu: {free_tolerance_mib: -1}", "gpu.free_tolerance_mib"),
    ("engine: {kind: command, start_command: a, stop_command: b, wake_attempts: 0}", "engine.wake_attempts"),
])
def test_gpu_names_go_into_promql_only_when_they_are_names(section: str, error: str) -> None:
    """Metric and label names of the `gpu` section are checked like `metrics`' (they are put
    into PromQL as they are); the unit is mib or bytes; counts are not negative."""
    text = MINIMAL.replace('engine: {kind: command, start_command: "start {node}", stop_command: "stop {node}"}\n', "")
    if not section.startswith("engine"):
        text = MINIMAL + section + "\n"
    else:
        text = text + section + "\n"
    with pytest.raises(ConfigError) as info:
        parse_config(text)
    assert error in str(info.value)


def test_gpu_section_for_an_exporter_in_bytes() -> None:
    """Another exporter's names, in bytes, without a free metric or a holder label."""
    cfg = parse_config(MINIMAL + "gpu: {used_metric: nvidia_gpu_memory_used_bytes, free_metric: null,"
                       " total_metric: nvidia_gpu_memory_total_bytes, unit: bytes, node_label: instance,"
                       " holder_label: null}\n")
    assert cfg.gpu.unit == "bytes" and cfg.gpu.holder_label is None and cfg.gpu.free_metric is None
