"""The shipped etc/ files: alert rules, Grafana dashboard, cron.d entry, systemd units (structure)."""

from __future__ import annotations

import configparser
import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from slurm_idle.agent_metrics import METRICS

ETC = Path(__file__).resolve().parents[2] / "etc"
METRIC_RE = re.compile(r"\bslurm_idle_[a-z_]+\b")


def metric_names(expr: str) -> set[str]:
    return set(METRIC_RE.findall(expr))


def alert_rules() -> list[dict[str, Any]]:
    doc = yaml.safe_load((ETC / "prometheus" / "slurm-idle-alerts.yml").read_text())
    return [rule for group in doc["groups"] for rule in group["rules"]]


def test_alert_rules_cover_the_issue_and_use_only_our_metrics() -> None:
    """Tick stale, reclaim too slow, serving below floor and tick errors exist, on real metrics."""
    rules = {rule["alert"]: rule for rule in alert_rules()}
    for name in ("SlurmIdleTickStale", "SlurmIdleReclaimTooSlow", "SlurmIdleServingBelowFloor",
                 "SlurmIdleTickErrors"):
        assert name in rules
    for rule in rules.values():
        used = metric_names(rule["expr"])
        assert used, rule["alert"]
        assert used <= set(METRICS), f"{rule['alert']} uses unknown metrics {used - set(METRICS)}"
        assert rule["labels"]["severity"] in {"warning", "critical"}
        assert rule["annotations"]["summary"]


def test_grafana_dashboard_loads_and_queries_our_metrics() -> None:
    """The dashboard is JSON whose panels query slurm_idle_* metrics the agent writes."""
    dash = json.loads((ETC / "grafana" / "slurm-idle-dashboard.json").read_text())
    assert dash["title"] and dash["panels"]
    used: set[str] = set()
    for panel in dash["panels"]:
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            names = metric_names(target["expr"])
            assert names, f"panel {panel['title']!r} queries none of our metrics"
            used |= names
    assert used <= set(METRICS)
    for name in ("slurm_idle_nodes", "slurm_idle_transitions_total", "slurm_idle_needed_replicas",
                 "slurm_idle_serving_replicas", "slurm_idle_last_tick_timestamp_seconds",
                 "slurm_idle_tick_errors_total", "slurm_idle_tick_duration_seconds"):
        assert name in used
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))


def test_cron_entry_runs_tick_every_minute_as_a_user() -> None:
    """cron.d lines have five time fields, a user and the tick command; env lines are KEY=value."""
    jobs = []
    for line in (ETC / "cron.d" / "slurm-idle").read_text().splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        if re.match(r"^[A-Z_]+=", line):
            continue
        fields = line.split(None, 6)
        assert len(fields) == 7, line
        for f in fields[:5]:
            assert re.fullmatch(r"[\d*/,\-]+", f), line
        jobs.append(fields)
    assert len(jobs) == 1
    minute, hour, dom, month, dow, user, command = jobs[0]
    assert (minute, hour, dom, month, dow) == ("*", "*", "*", "*", "*")
    assert user == "root"
    assert "slurm-idle" in command and " tick" in command


def unit(name: str) -> configparser.ConfigParser:
    parser = configparser.ConfigParser(strict=True, interpolation=None)
    parser.optionxform = str  # type: ignore[assignment,method-assign]
    parser.read_string((ETC / "systemd" / name).read_text())
    return parser


def test_systemd_service_is_a_oneshot_tick() -> None:
    """The service runs `slurm-idle tick` once, by absolute path, with a hard time limit."""
    svc = unit("slurm-idle-tick.service")
    assert set(svc.sections()) == {"Unit", "Service"}
    service = svc["Service"]
    assert service["Type"] == "oneshot"
    exec_start = service["ExecStart"].split()
    assert exec_start[0].startswith("/") and exec_start[0].endswith("/slurm-idle")
    assert exec_start[-1] == "tick"
    assert int(service["TimeoutStartSec"]) > 50  # longer than timeouts.tick_budget_s


def test_systemd_timer_fires_every_minute_and_names_the_service() -> None:
    """The timer starts the tick service every minute and is enabled from timers.target."""
    timer = unit("slurm-idle-tick.timer")
    assert timer["Timer"]["OnCalendar"] == "*-*-* *:*:00"
    assert timer["Timer"]["Unit"] == "slurm-idle-tick.service"
    assert timer["Install"]["WantedBy"] == "timers.target"


def conf_lines(text: str) -> list[str]:
    return [ln.split("#", 1)[0].strip() for ln in text.splitlines() if ln.split("#", 1)[0].strip()]


#: Settings the sandbox needs for fast tests, shipped commented out: cluster-wide values a site
#: must not paste (SchedulerParameters replaces the whole list; KillWait binds every job).
SANDBOX_ONLY = ("SchedulerParameters", "KillWait")
#: Partition attributes a site chooses: node lists, the grace time, and the default partition
#: (the sandbox makes `idle` the default so that a job submitted without -p is tested too).
SITE_ATTRS = ("Nodes=", "GraceTime=", "Default=")


def sandbox_conf(tmp_path: Path, version: str = "22.05.8") -> tuple[dict[str, str], dict[str, set[str]]]:
    from slurm_idle.testing.sandboxconf import Layout, slurm_conf

    lay = Layout(root=tmp_path, base_port=20000, slurm_version=version, hostname="h",
                 python="python3", job_submit_lua=tmp_path / "job_submit.lua")
    sandbox = conf_lines(slurm_conf(lay))
    settings = {ln.split("=", 1)[0]: ln.split("=", 1)[1] for ln in sandbox if not ln.startswith("PartitionName")}
    partitions = {ln.split()[0]: set(ln.split()[1:]) for ln in sandbox if ln.startswith("PartitionName")}
    return settings, partitions


@pytest.mark.parametrize("version", ["22.05.8", "24.11.5"])
def test_slurm_conf_snippet_is_what_the_sandbox_runs(tmp_path: Path, version: str) -> None:
    """Every setting the snippet tells a site to add is in the sandbox's generated slurm.conf
    (the one all contract and e2e tests run on), except the site-specific values: node lists,
    the sandbox's shorter GraceTime, the default partition, AuthInfo's other options, and its
    shorter cred_expire (said so in the snippet); 22.05 spells send_user_signal its own way
    (said so in the snippet)."""
    settings, partitions = sandbox_conf(tmp_path, version)
    snippet = conf_lines((ETC / "slurm.conf.snippet").read_text())
    assert "AccountingStorageType=accounting_storage/slurmdbd" in snippet  # report needs sacct
    for line in snippet:
        key, value = line.split("=", 1)
        assert key not in SANDBOX_ONLY, f"{line}: sandbox-only, must stay commented out"
        if key == "PartitionName":
            name, *attrs = line.split()
            assert {a for a in attrs if not a.startswith(SITE_ATTRS)} == {
                a for a in partitions[name] if not a.startswith(SITE_ATTRS)}, name
        elif key == "AuthInfo":
            ours = dict(o.split("=", 1) for o in settings["AuthInfo"].split(",") if "=" in o)
            k, v = value.split("=", 1)
            if k == "cred_expire":  # the sandbox runs Slurm's minimum to shorten its tests
                assert 5 <= int(ours[k]) <= int(v), f"{line} vs sandbox cred_expire={ours[k]}"
                assert f"the sandbox runs {ours[k]}" in " ".join(
                    (ETC / "slurm.conf.snippet").read_text().replace("#", " ").split()), ours[k]
            else:
                assert ours.get(k) == v, line
        elif key == "PreemptParameters" and version.startswith("22."):
            assert settings["SlurmctldParameters"] == "preempt_send_user_signal"
            assert "SlurmctldParameters=preempt_send_user_signal" in (
                ETC / "slurm.conf.snippet").read_text()
        else:
            assert settings.get(key) == value, f"{line} vs sandbox {key}={settings.get(key)}"


def test_slurm_conf_snippet_shows_the_sandbox_only_values_commented_out(tmp_path: Path) -> None:
    """The sandbox's timing values appear in the snippet, commented out under a SANDBOX ONLY
    warning, with the values the sandbox really runs."""
    settings, _ = sandbox_conf(tmp_path)
    text = (ETC / "slurm.conf.snippet").read_text()
    for key in SANDBOX_ONLY:
        match = re.search(rf"^#{key}=(\S+)$", text, re.MULTILINE)
        assert match, key
        assert match.group(1) == settings[key], key
        before = text[: match.start()].rsplit("\n\n", 1)[-1]
        assert "SANDBOX ONLY" in before, key


def test_slurm_conf_snippet_does_not_make_idle_the_default_partition() -> None:
    """A site pasting the snippet keeps its own default partition: `idle` has Default=NO, so
    jobs submitted without -p never become preemptible (the sandbox may differ: SITE_ATTRS)."""
    snippet = conf_lines((ETC / "slurm.conf.snippet").read_text())
    idle = next(ln for ln in snippet if ln.startswith("PartitionName=idle "))
    assert "Default=NO" in idle.split()


def test_systemd_agent_service_runs_the_loop_and_outlasts_a_pass_on_stop() -> None:
    """The agent unit runs `slurm-idle agent` by absolute path, restarts on failure, stops it
    with SIGTERM and waits longer than a pass (timeouts.tick_budget_s) before SIGKILL."""
    service = unit("slurm-idle-agent.service")["Service"]
    assert service["Type"] == "simple"
    exec_start = service["ExecStart"].split()
    assert exec_start[0].startswith("/") and exec_start[-1] == "agent"
    assert service["KillSignal"] == "SIGTERM" and int(service["TimeoutStopSec"]) > 50
    assert service["Restart"] == "on-failure"


def test_router_examples_are_valid_router_sections() -> None:
    """Every etc/router/*.yaml is a `router:` section the config accepts, and the nginx example
    renders a complete upstream block."""
    from slurm_idle.config import RouterConfig
    from slurm_idle.router import RouterTarget
    from slurm_idle.router.file import render

    kinds = set()
    for path in sorted((ETC / "router").glob("*.yaml")):
        cfg = RouterConfig.model_validate(yaml.safe_load(path.read_text())["router"])
        kinds.add(cfg.kind)
        if path.name == "nginx.yaml":
            entry = RouterTarget("gpu1", "m", "http://gpu1:8000", "gpu1", 8000).fields()
            text = render(cfg, [entry])
            assert text.startswith("upstream vllm {") and "server gpu1:8000;" in text
            assert text.rstrip().endswith("}")
    assert kinds == {"haproxy", "file", "command"}


def logrotate_blocks(text: str) -> list[tuple[list[str], list[str]]]:
    """The rules of a logrotate file: (the paths or globs it names, its directive lines)."""
    body = " \n".join(ln.split("#", 1)[0] for ln in text.splitlines())
    return [(head.split(), [d.strip() for d in inner.splitlines() if d.strip()])
            for head, inner in re.findall(r"([^{}]*)\{([^{}]*)\}", body)]


def test_logrotate_rule_rotates_only_the_default_journal_by_creating_a_new_file() -> None:
    """etc/logrotate.d/slurm-idle names paths.journal's default exactly (the example config's
    too), no glob that would also take the `.idle-run` side file; `create` makes the new file
    as the agent would (0644, root, like the cron line and the agent unit), and there is no
    copytruncate (records appended between its copy and truncate would be lost) nor a signal."""
    import fnmatch

    from slurm_idle.config.sections import PathsConfig
    from slurm_idle.journal import Journal

    default = PathsConfig().journal
    example = yaml.safe_load((ETC / "slurm-idle.yaml").read_text())["paths"]["journal"]
    assert example == default
    [(paths, directives)] = logrotate_blocks((ETC / "logrotate.d" / "slurm-idle").read_text())
    assert paths == [default]
    side_file = str(Journal(Path(default)).pending_path)
    assert not any(fnmatch.fnmatch(side_file, p) for p in paths)
    words = {d.split()[0]: d.split()[1:] for d in directives}
    assert words["create"] == ["0644", "root", "root"]
    assert "copytruncate" not in words and "nocreate" not in words
    assert not {"postrotate", "prerotate", "firstaction", "lastaction"} & set(words)
    assert {"compress", "delaycompress", "missingok", "notifempty"} <= set(words)
