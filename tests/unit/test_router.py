"""The router adapters on their own (issue 14): HAProxy's runtime API answers parsed from
captured output, the file writer's atomic replace and failed reloads, command quoting."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import pytest

from slurm_idle.commands import CompletedResult
from slurm_idle.config import RouterConfig
from slurm_idle.errors import CommandError, RouterError
from slurm_idle.router import IN, MISSING, OUT, UNKNOWN, RouterTarget, make_router
from slurm_idle.router.command import CommandRouter, format_router_command
from slurm_idle.router.file import FileRouter, render
from slurm_idle.router.haproxy import HaproxyRouter, parse_servers_state

#: `show servers state vllm` of HAProxy 2.6.12 (Debian 12): gpu2 drained, gpu3 in maintenance.
SERVERS_STATE = """1
# be_id be_name srv_id srv_name srv_addr srv_op_state srv_admin_state srv_uweight srv_iweight srv_time_since_last_change srv_check_status srv_check_result srv_check_health srv_check_state srv_agent_state bk_f_forced_id srv_f_forced_id srv_fqdn srv_port srvrecord srv_use_ssl srv_check_port srv_check_addr srv_agent_addr srv_agent_port
3 vllm 1 gpu1 127.0.0.1 2 0 1 1 21 15 3 3 6 0 0 0 - 50324 - 0 0 - - 0
3 vllm 2 gpu2 127.0.0.1 2 8 1 1 21 15 3 3 6 0 0 0 - 50325 - 0 0 - - 0
3 vllm 3 gpu3 127.0.0.1 0 1 1 1 21 15 3 3 6 0 0 0 - 50326 - 0 0 - - 0
"""


def target(name: str = "gpu1", port: int = 8000) -> RouterTarget:
    return RouterTarget(name, "org/model 7b", f"http://{name}:{port}", name, port)


def haproxy(answers: dict[str, str]) -> tuple[HaproxyRouter, list[str]]:
    sent: list[str] = []

    def send(command: str) -> str:
        sent.append(command)
        return answers.get(command, "")

    cfg = RouterConfig(kind="haproxy", admin_socket="/nonexistent.sock")
    return HaproxyRouter(cfg, send=send), sent


def test_servers_state_is_parsed_by_its_header() -> None:
    """Every server line becomes (op_state, admin_state), keyed by backend and server."""
    parsed = parse_servers_state(SERVERS_STATE)
    assert parsed[("vllm", "gpu1")] == (2, 0)
    assert parsed[("vllm", "gpu2")] == (2, 8)
    assert parsed[("vllm", "gpu3")] == (0, 1)


def test_a_garbled_answer_is_a_router_error() -> None:
    """An answer that is not format 1 (an old HAProxy, a wrong socket) raises, never guesses."""
    with pytest.raises(RouterError, match="unexpected"):
        parse_servers_state("Unknown command.\n")


def test_haproxy_remove_drains_and_add_makes_ready() -> None:
    """remove = `state drain` (open requests finish), add = `state ready`, on the named server."""
    router, sent = haproxy({})
    router.remove(target())
    router.add(target())
    assert sent == ["set server vllm/gpu1 state drain", "set server vllm/gpu1 state ready"]


def test_haproxy_gives_a_replica_jobs_slot_its_address_before_ready() -> None:
    """A replica job's target (moves) gets `set server ... addr IP port P` before `state ready`
    (the job runs wherever Slurm put it); an error answer to it fails the add."""
    job = RouterTarget("jm#1", "jm", "http://gpu8:9101", "gpu8", 9101, index=1, moves=True)
    cfg = RouterConfig(kind="haproxy", admin_socket="/x", server="{model}-{index}")
    sent: list[str] = []

    def send(command: str) -> str:
        sent.append(command)
        return "IP changed from '127.0.0.1' to '10.0.0.8' by 'stats socket command'" if "addr" in command else ""

    HaproxyRouter(cfg, send=send, resolve={"gpu8": "10.0.0.8"}.__getitem__).add(job)
    assert sent == ["set server vllm/jm-1 addr 10.0.0.8 port 9101", "set server vllm/jm-1 state ready"]
    refused = HaproxyRouter(cfg, send=lambda c: "No such server.", resolve=lambda h: "10.0.0.8")
    with pytest.raises(RouterError, match="No such server"):
        refused.add(job)
    # A node's replica (fixed address in haproxy.cfg) is only made ready.
    router, sent = haproxy({})
    router.add(target())
    assert sent == ["set server vllm/gpu1 state ready"]


def test_haproxy_error_text_is_a_failed_call() -> None:
    """HAProxy answers errors as text (rc is always 0): any answer to `set server` fails."""
    router, _ = haproxy({"set server vllm/gpu1 state drain": "No such server.\n"})
    with pytest.raises(RouterError, match="No such server"):
        router.remove(target())


def test_haproxy_state_reads_admin_bits() -> None:
    """Admin state 0 is in; drain or maintenance bits are out; an unknown server is missing."""
    router, sent = haproxy({"show servers state vllm": SERVERS_STATE})
    states = router.state([target("gpu1"), target("gpu2"), target("gpu3"), target("gpu9")])
    assert states == {"gpu1": IN, "gpu2": OUT, "gpu3": OUT, "gpu9": MISSING}
    assert sent == ["show servers state vllm"]  # one read per backend


def test_haproxy_names_come_from_templates() -> None:
    """Backend and server names are templates over the target's fields."""
    cfg = RouterConfig(kind="haproxy", admin_socket="/x", backend="be_{port}", server="{node}-vllm")
    sent: list[str] = []

    def send(command: str) -> str:
        sent.append(command)
        return ""

    HaproxyRouter(cfg, send=send).add(target(port=8001))
    assert sent == ["set server be_8001/gpu1-vllm state ready"]


def test_haproxy_unreachable_socket_says_what_to_check(tmp_path: Path) -> None:
    """No socket: a RouterError naming the socket and the `stats socket ... level admin` line."""
    router = make_router(RouterConfig(kind="haproxy", admin_socket=str(tmp_path / "none.sock")))
    with pytest.raises(RouterError, match="level admin"):
        router.add(target())


# --- file ----------------------------------------------------------------------------------


class Runner:
    def __init__(self, fail: bool = False, seen: Path | None = None) -> None:
        self.argv: list[list[str]] = []
        self.fail, self.seen = fail, seen
        self.contents: list[str] = []

    def run(self, argv: Sequence[str], input: str | None = None,
            timeout: float | None = None) -> CompletedResult:
        self.argv.append(list(argv))
        if self.seen is not None:
            self.contents.append(self.seen.read_text())
        if self.fail:
            raise CommandError(argv, 1, "nginx: [emerg] invalid")
        return CompletedResult(tuple(argv), 0, "", "")


def nginx_config(path: Path, reload: str | None = "nginx -s reload") -> RouterConfig:
    return RouterConfig(kind="file", path=str(path), format="template",
                        header="upstream vllm {\n", line="    server {host}:{port};\n",
                        footer="}\n", reload_command=reload)


def test_template_renders_an_nginx_upstream() -> None:
    """The serving set as an nginx upstream block, sorted so equal sets give equal bytes."""
    cfg = nginx_config(Path("/x"))
    entries = [target("gpu2").fields(), target("gpu1").fields()]
    assert render(cfg, entries) == (
        "upstream vllm {\n    server gpu1:8000;\n    server gpu2:8000;\n}\n")


def test_file_router_adds_removes_and_reloads(tmp_path: Path) -> None:
    """add/remove rewrite the whole set and reload; the state is read back from the record."""
    path = tmp_path / "upstream.inc"
    runner = Runner(seen=path)
    router = FileRouter(nginx_config(path), runner=runner)
    router.add(target("gpu1"))
    router.add(target("gpu2"))
    router.remove(target("gpu1"))
    assert path.read_text() == "upstream vllm {\n    server gpu2:8000;\n}\n"
    assert runner.argv[-1] == ["sh", "-c", "nginx -s reload"]
    assert router.state([target("gpu1"), target("gpu2")]) == {"gpu1": OUT, "gpu2": IN}
    # The reload saw the complete new file each time (written before the command ran).
    assert runner.contents[-1] == path.read_text()


def test_file_router_write_is_atomic(tmp_path: Path) -> None:
    """The file is replaced by a rename of a complete temp file in the same directory: at the
    moment of the rename the old file is still whole, and the temp file holds the whole new."""
    path = tmp_path / "replicas.json"
    cfg = RouterConfig(kind="file", path=str(path), format="json")
    FileRouter(cfg).add(target("gpu1"))
    seen: list[tuple[str, str, str]] = []

    def before_replace(tmp: str) -> None:
        seen.append((Path(tmp).parent.as_posix(), Path(tmp).read_text(), path.read_text()))

    FileRouter(cfg, before_replace=before_replace).add(target("gpu2"))
    tmp_dir, new, old = seen[0]
    assert tmp_dir == tmp_path.as_posix()
    assert [r["name"] for r in json.loads(old)["replicas"]] == ["gpu1"]
    assert [r["name"] for r in json.loads(new)["replicas"]] == ["gpu1", "gpu2"]
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_a_failed_reload_restores_the_file_and_keeps_the_state(tmp_path: Path) -> None:
    """Reload fails: the previous file is put back, the recorded state is unchanged, and the
    call raises, so the replica stays where it was and the next tick tries again."""
    path = tmp_path / "upstream.inc"
    FileRouter(nginx_config(path), runner=Runner()).add(target("gpu1"))
    before = path.read_text()
    failing = FileRouter(nginx_config(path), runner=Runner(fail=True))
    with pytest.raises(RouterError, match="reload"):
        failing.add(target("gpu2"))
    assert path.read_text() == before
    assert failing.state([target("gpu2")]) == {"gpu2": OUT}


def test_file_router_without_a_file_reports_missing(tmp_path: Path) -> None:
    """Nothing written yet: every replica is missing (the reconcile then adds the serving)."""
    cfg = RouterConfig(kind="file", path=str(tmp_path / "r.yaml"), format="yaml")
    assert FileRouter(cfg).state([target()]) == {"gpu1": MISSING}


# --- command -------------------------------------------------------------------------------


def test_command_placeholders_are_shell_quoted() -> None:
    """A model name with a space and a slash reaches the command as one word."""
    cmd = format_router_command("gw rm --model {model} {url} {port} {x}", target())
    assert cmd == "gw rm --model 'org/model 7b' http://gpu1:8000 8000 {x}"


def test_command_router_runs_and_fails_loudly() -> None:
    """remove/add run their command; a failing command is a RouterError."""
    runner = Runner()
    cfg = RouterConfig(kind="command", remove_command="rm {node}", add_command="add {node}")
    router = CommandRouter(cfg, runner=runner)
    router.remove(target())
    router.add(target())
    assert [a[2] for a in runner.argv] == ["rm gpu1", "add gpu1"]
    assert router.state([target()]) == {"gpu1": UNKNOWN}  # no state_command: cannot tell
    with pytest.raises(RouterError):
        CommandRouter(cfg, runner=Runner(fail=True)).add(target())


def test_router_config_requires_what_each_kind_needs() -> None:
    """Each kind names the key it misses."""
    from pydantic import ValidationError

    for kind, key in (("haproxy", "admin_socket"), ("file", "path"), ("command", "remove_command")):
        with pytest.raises(ValidationError, match=key):
            RouterConfig.model_validate({"kind": kind})
