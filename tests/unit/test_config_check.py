"""`config check` lists every problem at its line with the key meant; `config show` says where
each effective value comes from; the YAML loader keeps key positions without losing its bounds."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from slurm_idle.cli import main
from slurm_idle.cli.common import run_guarded
from slurm_idle.config import ConfigInvalid, load_config_located, parse_config
from slurm_idle.config.provenance import format_settings, settings
from slurm_idle.errors import ConfigError
from slurm_idle.testing import sandboxconf
from slurm_idle.yamlfile import parse_yaml_located

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "etc" / "slurm-idle.yaml"

TWO_TYPOS = """\
slurm:
  lend_partiton: idle
  serve_partition: inference
engine: {kind: command, start_command: "start {node}", stop_command: "stop {node}"}
models:
  - name: m
    nodes: gpu[1-2]
    gpus_per_replca: 4
"""

MINIMAL = """\
engine: {kind: command, start_command: "start {node}", stop_command: "stop {node}"}
models:
  - name: m
    nodes: gpu[1-2]
"""


def cli(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """Run the CLI in-process the way the entry point does: (exit code, stdout, stderr)."""
    with pytest.raises(SystemExit) as exit_:
        run_guarded(main, args)
    out = capsys.readouterr()
    code = exit_.value.code
    return (code if isinstance(code, int) else 0), out.out, out.err


def problems(text: str) -> ConfigInvalid:
    with pytest.raises(ConfigInvalid) as err:
        parse_config(text, "c.yaml")
    return err.value


def test_check_names_both_typos_with_line_and_suggestion(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Two misspelt keys: exit 2, one stderr line each with file:line:column and the key meant."""
    bad = tmp_path / "c.yaml"
    bad.write_text(TWO_TYPOS)
    code, out, err = cli(["config", "check", str(bad)], capsys)
    assert code == 2 and out == ""
    assert err.splitlines() == [
        (f"slurm-idle: error: {bad}:2:3: unknown key 'slurm.lend_partiton' "
        "(did you mean 'lend_partition'?)"),
        (f"slurm-idle: error: {bad}:8:5: unknown key 'models.0.gpus_per_replca' "
        "(did you mean 'gpus_per_replica'?)"),
    ]


def test_every_kind_of_problem_is_listed_not_only_the_first() -> None:
    """A wrong type, an unknown section and a non-finite value are all reported, in file order."""
    text = MINIMAL + "    min_serving_replicas: many\npolcy: {target_utilisation: 0.5}\n" \
        "timeouts:\n  start_s: .inf\n"
    found = problems(text).problems
    assert [(p.path, p.line) for p in found] == [
        ("models.0.min_serving_replicas", 5), ("polcy", 6), ("timeouts.start_s", 8)]
    assert found[1].suggestion == "policy" and found[0].suggestion is None
    assert "(got 'many')" in found[0].message and "finite number" in found[2].message


@pytest.mark.parametrize(("extra", "path", "meant"), [
    ("engine: {kind: command, start_command: a, stop_command: b, drain_timeout: 5}\n",
     "engine.drain_timeout", "drain_timeout_s"),                  # `X | None` section
    ("policy: {target_utilization: 0.5}\n", "policy.target_utilization", "target_utilisation"),
    ("  - name: n\n    replicas: [{node: gpu9, ulr: 'http://gpu9:1'}]\n",
     "models.1.replicas.0.ulr", "url"),                           # item of a tuple of models
    ("  - name: n\n    node: gpu9\n", "models.1.node", "nodes"),  # a shorthand key is valid
    ("policy: {zzzzzz: 1}\n", "policy.zzzzzz", None),             # nothing close: no guess
])
def test_unknown_keys_are_answered_with_the_closest_valid_key_at_their_level(
        extra: str, path: str, meant: str | None) -> None:
    text = (MINIMAL.replace("engine:", "#") + extra) if extra.startswith("engine") else MINIMAL + extra
    found = problems(text).problems
    unknown = [p for p in found if p.path == path]
    assert unknown and unknown[0].suggestion == meant


def test_a_misspelled_required_key_is_one_problem_not_two() -> None:
    """`ulr:` for the required `url` is the unknown key with its suggestion, not that and a
    `missing required key ... url` besides; a required key missing with no look-alike still is."""
    text = MINIMAL + "  - name: n\n    replicas: [{node: gpu9, ulr: 'http://gpu9:1'}]\n"
    found = problems(text).problems
    assert [(p.path, p.suggestion) for p in found] == [("models.1.replicas.0.ulr", "url")], found
    found = problems(MINIMAL + "  - nodes: gpu7\n    nmae: n\n").problems
    assert [(p.path, p.suggestion) for p in found] == [("models.1.nmae", "name")], found
    found = problems(MINIMAL + "  - nodes: gpu7\n    zzzz: n\n").problems
    assert sorted(p.path for p in found) == ["models.1.name", "models.1.zzzz"]


def test_a_missing_key_points_at_the_mapping_that_lacks_it() -> None:
    """`models.1.name` is not in the file: the problem is located at the item that needs it."""
    found = problems(MINIMAL + "  - nodes: gpu7\n").problems
    assert [(p.path, p.line, p.column, p.message) for p in found] == [
        ("models.1.name", 5, 5, "missing required key 'models.1.name'")]


def test_check_json_lists_the_errors_of_an_invalid_file(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`check --json` of an invalid file: {"ok": false, "errors": [...]} on stdout, exit 2."""
    bad = tmp_path / "c.yaml"
    bad.write_text(TWO_TYPOS)
    code, out, err = cli(["config", "check", "--json", str(bad)], capsys)
    assert code == 2 and err == ""
    doc = json.loads(out)
    assert doc["ok"] is False and doc["file"] == str(bad)
    assert doc["errors"][0] == {"path": "slurm.lend_partiton", "line": 2, "column": 3,
                                "message": "unknown key 'slurm.lend_partiton'",
                                "suggestion": "lend_partition"}
    assert [e["suggestion"] for e in doc["errors"]] == ["lend_partition", "gpus_per_replica"]


def test_check_json_reports_a_yaml_syntax_error_and_the_grace_rule_too(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Errors that are not validation errors keep the same JSON form (and exit 2)."""
    broken = tmp_path / "b.yaml"
    broken.write_text("models: [\n")
    code, out, _ = cli(["config", "check", "--json", str(broken)], capsys)
    (error,) = json.loads(out)["errors"]
    assert code == 2 and "YAML syntax error" in error["message"] and error["path"] is None
    slow = tmp_path / "s.yaml"
    slow.write_text(MINIMAL + "slurm:\n  requeue_grace_s: 90\n")
    code, out, _ = cli(["config", "check", "--json", str(slow)], capsys)
    (error,) = json.loads(out)["errors"]
    assert code == 2 and (error["path"], error["line"]) == ("slurm.requeue_grace_s", 6)


def test_check_json_of_a_valid_file_is_still_the_validated_config(
        capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = cli(["config", "check", "--json", str(EXAMPLE)], capsys)
    assert code == 0 and json.loads(out)["slurm"]["lend_partition"] == "idle"


def test_any_command_loading_a_bad_config_prints_every_problem(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The loader is the one place: `tick` with a bad config shows the same lines, exit 2."""
    bad = tmp_path / "c.yaml"
    bad.write_text(TWO_TYPOS)
    code, _, err = cli(["--config", str(bad), "tick"], capsys)
    assert code == 2
    assert len(err.splitlines()) == 2 and err.count("did you mean") == 2


def test_show_on_the_shipped_example_gives_every_value_a_source() -> None:
    """Every leaf has `file:LINE` (the line that holds it) or `default` (the model's default)."""
    cfg, positions = load_config_located(EXAMPLE)
    rows = settings(cfg, positions)
    lines = EXAMPLE.read_text().splitlines()
    by_key = {r.key: r for r in rows}
    assert len(by_key) == len(rows) > 50
    for row in rows:
        assert row.source == "default" or row.source.startswith("file:"), row
    grace = by_key["slurm.lend_partition"]
    assert grace.value == "idle" and "lend_partition:" in lines[int(grace.source[5:]) - 1]
    assert by_key["metrics.scrape_interval_s"].source == "default"
    assert by_key["metrics.scrape_interval_s"].value == 1.0
    # A replica the `nodes:` shorthand made points at that line, not at the model's first.
    node = by_key["models.0.replicas.0.node"]
    assert node.value == "gpu01" and "nodes:" in lines[int(node.source[5:]) - 1]


def test_show_on_the_sandbox_config(tmp_path: Path) -> None:
    """The generated sandbox config: each key written in it is sourced at its own line."""
    lay = sandboxconf.Layout(root=tmp_path, base_port=30000, slurm_version="22.05.8",
                             hostname="vm", python="/usr/bin/python3")
    path = tmp_path / "slurm-idle.yaml"
    path.write_text(sandboxconf.slurm_idle_config(lay, 1000.0))
    cfg, positions = load_config_located(path)
    lines = path.read_text().splitlines()
    rows = settings(cfg, positions)
    written = [r for r in rows if tuple(_parts(r.key)) in positions]
    assert len(written) > 20
    for row in written:
        assert row.source.startswith("file:")
        assert row.key.rsplit(".", 1)[-1] + ":" in lines[int(row.source[5:]) - 1], row
    assert all(r.source == "default" for r in rows if r.key.startswith("report."))


def test_show_text_is_aligned_and_json_has_value_and_source(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good = tmp_path / "c.yaml"
    good.write_text(MINIMAL + "policy:\n  forecast: false\n")
    code, out, _ = cli(["config", "show", str(good)], capsys)
    assert code == 0
    lines = out.splitlines()
    assert len({line.index(" = ") for line in lines}) == 1
    assert "policy.forecast" in out and any(
        line.startswith("policy.forecast ") and line.endswith("(file:6)") for line in lines)
    code, out, _ = cli(["config", "show", "--json", str(good)], capsys)
    doc = json.loads(out)
    assert code == 0 and doc["file"] == str(good)
    assert doc["settings"]["policy.forecast"] == {"value": False, "source": "file:6"}
    assert doc["settings"]["policy.target_utilisation"] == {"value": 0.8, "source": "default"}
    assert doc["settings"]["models.0.replicas.1.node"] == {"value": "gpu2", "source": "file:4"}


def test_show_lists_the_keys_of_every_section_with_their_defaults(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Keys a file leaves out are shown at their default: the newest ones too (the foreign job
    action, the pipeline step cap, the web's user header and all-users switch)."""
    good = tmp_path / "c.yaml"
    good.write_text(MINIMAL + "web:\n  show_all_users: true\n")
    code, out, _ = cli(["config", "show", "--json", str(good)], capsys)
    doc = json.loads(out)["settings"]
    assert code == 0
    assert doc["slurm.foreign_job_action"] == {"value": "cancel", "source": "default"}
    assert doc["pipeline.max_steps"]["source"] == "default"
    assert doc["web.user_header"]["source"] == "default"
    assert doc["web.show_all_users"] == {"value": True, "source": "file:6"}
    assert doc["engine.kind"] == {"value": "command", "source": "file:1"}
    sections = {key.split(".")[0] for key in doc}
    assert sections == {"slurm", "metrics", "gpu", "engine", "models", "policy", "timeouts", "paths",
                        "report", "router", "job_policy", "pipeline", "web", "ha"}


def test_the_config_group_offers_what_its_help_promises(
        capsys: pytest.CaptureFixture[str]) -> None:
    """`config --help` promises checking and showing, and both commands exist."""
    code, out, _ = cli(["config", "--help"], capsys)
    assert code == 0 and "show" in out.split("Commands:")[0]
    commands = out.split("Commands:")[1].split()
    assert "check" in commands and "show" in commands


def test_show_of_an_invalid_file_fails_like_check(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "c.yaml"
    bad.write_text(TWO_TYPOS)
    code, out, err = cli(["config", "show", "--json", str(bad)], capsys)
    assert code == 2 and out == "" and err.count("did you mean") == 2


def test_format_settings_caps_the_value_column() -> None:
    """One long command does not push every other line's source far to the right."""
    from slurm_idle.config.provenance import Setting

    text = format_settings([Setting("a", "x" * 200, "default"), Setting("bb", 1, "file:2")])
    assert text[1] == "bb = " + "1".ljust(40) + "  (file:2)"
    assert format_settings([Setting("c", "{url}\n", "default")]) == ['c = "{url}\\n"  (default)']


def test_yaml_positions_cover_keys_items_flow_and_merge_keys() -> None:
    data, pos = parse_yaml_located("a: 1\nb:\n  c: [1, {d: 2}]\n  e: &x {f: 1}\ng: {<<: *x, h: 2}\n",
                                   "s.yaml")
    assert data["g"] == {"f": 1, "h": 2}
    assert pos[("a",)] == (1, 1) and pos[("b", "c")] == (3, 3)
    assert pos[("b", "c", 1)] == (3, 10) and pos[("b", "c", 1, "d")] == (3, 11)
    assert pos[("g", "h")] == (5, 13) and pos[("g", "f")] == (4, 10)  # merged: where written


def test_a_key_given_twice_is_located_where_its_value_in_force_is() -> None:
    """YAML keeps the last of a repeated key (and an explicit key over a merged one)."""
    _, pos = parse_yaml_located("a: 1\na: 2\nb: &x {c: 1}\nd: {<<: *x, c: 2}\n", "s.yaml")
    assert pos[("a",)] == (2, 1) and pos[("d", "c")] == (4, 13)


def test_yaml_positions_survive_a_self_referencing_alias() -> None:
    """`&a [*a]` is one node containing itself: the walk does not go round it forever."""
    _, pos = parse_yaml_located("i: &r [*r]\n", "s.yaml")
    assert pos == {("i",): (1, 1), ("i", 0): (1, 4)}


def test_the_located_loader_keeps_the_bounds() -> None:
    """The bomb and depth guards hold for the loader `config check` and `show` use too."""
    bomb = "a: &a [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"{c}: &{c} [*{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}]\n"
        for p, c in zip("abcdefgh", "bcdefghi", strict=True))
    with pytest.raises(ConfigError, match="more than 100000 values"):
        parse_yaml_located(bomb, "bomb.yaml")
    with pytest.raises(ConfigError, match="nested deeper"):
        parse_yaml_located("a: " + "[" * 100 + "]" * 100 + "\n", "deep.yaml")


def _parts(key: str) -> list[str | int]:
    return [int(p) if p.isdigit() else p for p in key.split(".")]
