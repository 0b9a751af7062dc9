"""Engine identity beyond the model name: a replica's engine lists a secret served name only
the agent knows (`{identity}`), so a process that took the port and lists the right model is
never taken for the engine nor put in the router; and a SERVING replica whose engine is gone
or not ours is repaired (out of the router, restarted) instead of blocking all lending."""

from __future__ import annotations

import json
import re
import stat
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import pytest

from slurm_idle import policy
from slurm_idle.agent import Agent
from slurm_idle.commands import CompletedResult
from slurm_idle.config import Config, EngineConfig, ReplicaConfig, parse_config
from slurm_idle.engine import CommandEngine, HttpTimeout, IdentityStore, identity_dir
from slurm_idle.engine.identity import PREFIX
from slurm_idle.engine.probe import HttpRefused
from slurm_idle.errors import EngineError
from slurm_idle.httpdeadline import HttpResponse
from slurm_idle.model import ModelLoad, Phase, ReplicaLoad
from slurm_idle.router import IN, OUT
from slurm_idle.router.sync import RouterSet
from slurm_idle.testing.fake_router import FakeRouter
from slurm_idle.testing.fakes import FakeEngine, FakeMetrics, FakeSlurm
from tests.unit.test_agent import Clock, continue_all, phases
from tests.unit.test_router_lifecycle import Post, first, set_phase

MODEL = "m"
REPLICA = ReplicaConfig(node="gpu1", url="http://127.0.0.1:1/gpu1", name="gpu1")


def _models(*names: str) -> HttpResponse:
    return HttpResponse(200, json.dumps({"object": "list", "data": [{"id": n} for n in names]}).encode())


@dataclass
class Port:
    """What answers on a replica's port: nothing, a squatter listing the model, or the engine
    (listing the model and the served names it was started with)."""

    names: tuple[str, ...] | None = None  # None: nothing listens
    timeout: bool = False
    error: str | None = None  # any other transport failure (no route, DNS, reset...)
    models_status: int = 200  # what /v1/models answers (a 503 of a busy server, a 401...)
    calls: list[str] = field(default_factory=list)

    def request(self, method: str, url: str, timeout: float) -> HttpResponse:
        self.calls.append(url)
        if self.timeout:
            raise HttpTimeout(f"{method} {url}: no answer")
        if self.error is not None:
            raise EngineError(f"{method} {url}: {self.error}")
        if self.names is None:
            raise HttpRefused(f"{method} {url}: [Errno 111] Connection refused")
        if url.endswith("/v1/models") and self.models_status != 200:
            return HttpResponse(self.models_status, b"")
        if url.endswith("/v1/models"):
            return _models(*self.names)
        if url.endswith("/health"):
            return HttpResponse(200, b"")
        if url.endswith("/is_sleeping"):
            return HttpResponse(200, b'{"is_sleeping": false}')
        return HttpResponse(404, b"")


@dataclass
class Launcher:
    """The start/stop commands' runner: a start (`start NAME IDENTITY`) brings up an engine
    listing the model and the identity it was given, unless a squatter holds the port."""

    port: Port
    squatted: bool = False
    argvs: list[list[str]] = field(default_factory=list)

    def run(self, argv: Sequence[str], input: str | None = None,
            timeout: float | None = None) -> CompletedResult:
        self.argvs.append(list(argv))
        words = argv[-1].split()
        if words[0] == "start" and not self.squatted:
            self.port.names = (MODEL, *words[2:])
        elif words[0] == "stop" and not self.squatted:
            self.port.names = None
        return CompletedResult(tuple(argv), 0, "", "")


def engine_config(identity: bool = True) -> EngineConfig:
    start = "start {name} {identity}" if identity else "start {name}"
    return EngineConfig(kind="command", start_command=start, stop_command="stop {name}",
                        http_timeout_s=1)


def command_engine(tmp_path: Path, port: Port, identity: bool = True) -> tuple[CommandEngine, Launcher]:
    launcher = Launcher(port)
    engine = CommandEngine(engine_config(identity), MODEL, runner=launcher, http=port,
                           identities=IdentityStore(tmp_path / "ids"))
    return engine, launcher


# --- the identity check -----------------------------------------------------------------------


def test_a_squatter_listing_the_model_is_not_the_engine(tmp_path: Path) -> None:
    """Once the replica has an identity, an endpoint listing only the model is foreign: not
    serving, named as another process on the port."""
    port = Port(names=(MODEL,))
    engine, _ = command_engine(tmp_path, port)
    IdentityStore(tmp_path / "ids").issue("gpu1")
    health = engine.health(REPLICA)
    assert health.up and not health.serving
    assert health.foreign is not None and "identity" in health.foreign
    assert engine.identify(REPLICA).ours is False


def test_the_engine_started_with_its_identity_is_ours(tmp_path: Path) -> None:
    """start passes the identity to the start command; the engine listing it serves."""
    port = Port()
    engine, launcher = command_engine(tmp_path, port)
    engine.start(REPLICA)
    [argv] = launcher.argvs
    name = argv[-1].split()[2]
    assert name.startswith(PREFIX) and len(name) > len(PREFIX) + 16
    assert engine.health(REPLICA).serving and engine.identify(REPLICA).ours is True


def test_start_with_a_squatter_on_the_port_runs_the_start_command(tmp_path: Path) -> None:
    """A squatter answering /health 200 with the right model does not make start a no-op: our
    unit is stopped (in case it is ours without the name) and the start command runs. The
    replica was named when we stopped its engine (a lend): its port is a squatter's now."""
    port = Port(names=(MODEL,))
    engine, launcher = command_engine(tmp_path, port)
    assert engine.identities is not None
    engine.identities.rotate(REPLICA.name or REPLICA.node)
    launcher.squatted = True
    engine.start(REPLICA)
    assert [a[-1].split()[0] for a in launcher.argvs] == ["stop", "start"]
    assert not engine.health(REPLICA).serving


def test_an_engine_started_without_its_name_is_restarted_with_it(tmp_path: Path) -> None:
    """An engine serving the model that was never named by us (started before identities, met
    at the adoption of a running pool, maybe in the router) is taken as it is: no restart cuts
    its clients. Once the replica has a name (issued at a stop), an engine answering without it
    is stopped and started with it; one that does not answer in time is left alone (untold)."""
    port = Port(names=(MODEL,))
    engine, launcher = command_engine(tmp_path, port)
    engine.start(REPLICA)
    assert launcher.argvs == [] and engine.health(REPLICA).serving
    assert engine.identities is not None
    engine.identities.rotate(REPLICA.name or REPLICA.node)  # named, e.g. by an earlier stop
    engine.start(REPLICA)
    assert [a[-1].split()[0] for a in launcher.argvs] == ["stop", "start"]
    assert engine.health(REPLICA).serving
    port.timeout = True
    launcher.argvs.clear()
    try:
        engine.start(REPLICA)
    except EngineError:
        pass
    assert [a[-1].split()[0] for a in launcher.argvs] in ([], ["start"])


def test_a_stop_retires_the_identity(tmp_path: Path) -> None:
    """After a stop the old name is never valid again: a process listing it (read through the
    router's /v1/models while the engine served) is foreign."""
    port = Port()
    engine, launcher = command_engine(tmp_path, port)
    engine.start(REPLICA)
    old = port.names
    engine.stop(REPLICA)
    port.names = old  # a squatter replaying what it saw
    assert engine.identify(REPLICA).ours is False
    engine.start(REPLICA)  # the squatter stays: start runs again, with a new name
    new = launcher.argvs[-1][-1].split()[2]
    assert old is not None and new not in old


def test_without_the_placeholder_the_model_name_is_checked_as_before(tmp_path: Path) -> None:
    """A start command without `{identity}` cannot give the engine a name: the model name
    alone is checked (an existing site's config keeps working)."""
    port = Port(names=(MODEL,))
    engine, _ = command_engine(tmp_path, port, identity=False)
    IdentityStore(tmp_path / "ids").issue("gpu1")
    assert engine.identify(REPLICA).ours is True


def test_nothing_listening_is_proven_not_ours_a_timeout_is_untold(tmp_path: Path) -> None:
    """A refused connection proves the engine is not there; no answer in time tells nothing."""
    engine, _ = command_engine(tmp_path, Port(names=None))
    assert engine.identify(REPLICA).ours is False
    engine, _ = command_engine(tmp_path, Port(names=(MODEL,), timeout=True))
    assert engine.identify(REPLICA).ours is None


@pytest.mark.parametrize("port", [
    Port(names=(MODEL,), error="[Errno 113] No route to host"),
    Port(names=(MODEL,), error="[Errno -3] Temporary failure in name resolution"),
    Port(names=(MODEL,), models_status=503),
    Port(names=(MODEL,), models_status=401),
], ids=["no-route", "dns", "http-503", "http-401-api-key"])
def test_what_a_busy_or_unreachable_engine_answers_is_untold_not_foreign(
        tmp_path: Path, port: Port) -> None:
    """Only a refused connection or an answer that is not our engine's proves it is not ours
    (and so makes a SERVING replica restarted): a blip of the network, a busy server's 503, an
    --api-key server's 401 tell nothing."""
    engine, _ = command_engine(tmp_path, port)
    assert engine.identify(REPLICA).ours is None


def test_a_real_refused_connection_is_told_apart_from_other_failures() -> None:
    """The one HTTP client says Refused for a closed loopback port (nothing listens), the
    failure identify takes as proof; a deadline is DeadlineExceeded, not Refused."""
    import socket

    from slurm_idle import httpdeadline

    with socket.socket() as sock:  # a port just free: nothing listens on it
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with pytest.raises(httpdeadline.Refused):
        httpdeadline.DeadlineClient(1024).request("GET", f"http://127.0.0.1:{port}/v1/models", 5)
    with socket.socket() as listening:  # listens, never answers
        listening.bind(("127.0.0.1", 0))
        listening.listen(1)
        url = f"http://127.0.0.1:{listening.getsockname()[1]}/v1/models"
        with pytest.raises(OSError) as info:
            httpdeadline.DeadlineClient(1024).request("GET", url, 0.3)
        assert not isinstance(info.value, httpdeadline.Refused)


def test_identities_are_root_only_files(tmp_path: Path) -> None:
    """The directory is 0700 and each file 0600: a user on the host cannot read a name."""
    store = IdentityStore(tmp_path / "state" / "engine-identity")
    name = store.issue("gpu5:8001")
    assert store.issue("gpu5:8001") == name  # kept until rotated
    assert stat.S_IMODE((tmp_path / "state" / "engine-identity").stat().st_mode) == 0o700
    [f] = list((tmp_path / "state" / "engine-identity").iterdir())
    assert stat.S_IMODE(f.stat().st_mode) == 0o600
    assert identity_dir("/var/lib/slurm-idle/journal.jsonl") == Path("/var/lib/slurm-idle/engine-identity")


# --- admission to the router and repair --------------------------------------------------------


def cluster_config(tmp_path: Path) -> Config:
    return parse_config(f"""
engine: {{kind: command, start_command: "start {{name}} {{identity}}", stop_command: "stop {{name}}",
          drain_timeout_s: 5, http_timeout_s: 1}}
router:
  kind: haproxy
  admin_socket: /nonexistent.sock
  warmup_prompt: "hi"
models:
  - name: {MODEL}
    nodes: gpu[1-3]
    url: "http://127.0.0.1:1/{{node}}"
paths:
  journal: {tmp_path}/journal.jsonl
  lock: {tmp_path}/tick.lock
timeouts:
  tick_budget_s: 3
""")


def agent_with(tmp_path: Path, engine: object, planner: object = continue_all,
               metrics: FakeMetrics | None = None) -> tuple[Agent, FakeSlurm, FakeRouter, Post]:
    cfg = cluster_config(tmp_path)
    slurm = FakeSlurm.with_nodes(["gpu1", "gpu2", "gpu3"])
    router = FakeRouter(log=slurm.log)
    post = Post()
    clock = Clock()
    agent = Agent(config=cfg, slurm=slurm,
                  metrics=metrics or FakeMetrics(models={MODEL: ModelLoad(model=MODEL)}),
                  engine_for=lambda model: engine,  # type: ignore[arg-type,return-value]
                  planner=planner, assessor=lambda obs, cfg, now: [],  # type: ignore[arg-type]
                  clock=clock, sleep=clock.sleep)
    assert agent.journal is not None
    agent.router = RouterSet(cfg, journal=agent.journal.append, make=lambda c: router,
                             clock=clock, post=post)
    return agent, slurm, router, post


class PortsByNode:
    """One Port per node, by the URL's path (`http://127.0.0.1:1/gpu1/...`)."""

    def __init__(self, ports: dict[str, Port]) -> None:
        self.ports = ports

    def request(self, method: str, url: str, timeout: float) -> HttpResponse:
        node = re.sub(r"^https?://[^/]+/([^/]+)/.*$", r"\1", url)
        return self.ports[node].request(method, url, timeout)


def test_a_squatter_on_a_starting_replica_never_joins_the_router(tmp_path: Path) -> None:
    """gpu1 comes back (RECLAIMING) with a squatter on its port (the right model, /health 200):
    the start command runs, no warm-up and no router add go to the squatter, it stays STARTING;
    once the port is the engine's (started with its identity), it joins."""
    port = Port(names=(MODEL,))
    ports = PortsByNode({"gpu1": port})
    launcher = Launcher(port, squatted=True)
    engine = CommandEngine(cluster_config(tmp_path).engine, MODEL, runner=launcher, http=ports,
                           identities=IdentityStore(identity_dir(str(tmp_path / "journal.jsonl"))))
    agent, slurm, router, post = agent_with(
        tmp_path, engine, planner=lambda obs, cfg, now: [a for a in continue_all(obs, cfg, now)
                                                         if a.node == "gpu1"])
    set_phase(slurm, "gpu1", Phase.RECLAIMING)
    router.members["gpu1"] = OUT
    assert engine.identities is not None
    engine.identities.rotate("gpu1")  # named when the lend stopped its engine
    agent.tick()
    assert [a[-1].split()[0] for a in launcher.argvs] == ["stop", "start"]
    assert post.urls == [] and ("router_add", "gpu1") not in slurm.log
    assert router.members["gpu1"] == OUT and phases(agent)["gpu1"] is Phase.STARTING
    launcher.squatted = False  # the squatter left: the next start brings up the engine
    port.names = None
    agent.tick()
    assert phases(agent)["gpu1"] is Phase.SERVING and router.members["gpu1"] == IN
    assert post.urls == ["http://127.0.0.1:1/gpu1/v1/completions"]


def test_adopting_a_running_pool_restarts_no_engine(tmp_path: Path) -> None:
    """The first tick over a running pool: gpu1 (no Comment of ours: UNKNOWN) is in the router
    and its engine, started before identities, answers the model without a name of ours. The
    adoption takes it as it is: no stop cuts its clients' requests (the CI router e2e saw HTTP
    503 when the agent restarted such engines under traffic)."""
    port = Port(names=(MODEL,))
    ports = PortsByNode({"gpu1": port})
    launcher = Launcher(port)
    engine = CommandEngine(cluster_config(tmp_path).engine, MODEL, runner=launcher, http=ports,
                           identities=IdentityStore(identity_dir(str(tmp_path / "journal.jsonl"))))
    agent, _slurm, router, _ = agent_with(
        tmp_path, engine, planner=lambda obs, cfg, now: [a for a in continue_all(obs, cfg, now)
                                                         if a.node == "gpu1"])
    router.members["gpu1"] = IN
    agent.tick()
    assert launcher.argvs == []
    assert router.members["gpu1"] == IN


def test_a_serving_replica_whose_engine_vanished_is_restarted(tmp_path: Path) -> None:
    """The planner's tick: gpu2 SERVING with nothing on its port is taken out of the router
    first, then restarted (stop, start) and admitted back once serving; the other replicas
    are left alone and nothing is lent meanwhile."""
    engine = FakeEngine(up={"gpu1": True, "gpu2": False, "gpu3": True})
    loads = {n: ReplicaLoad(model=MODEL, node=n) for n in ("gpu1", "gpu3")}
    metrics = FakeMetrics(replicas=loads, models={MODEL: ModelLoad(model=MODEL)})
    agent, slurm, router, _ = agent_with(tmp_path, engine, planner=policy.plan, metrics=metrics)
    for n in ("gpu1", "gpu2", "gpu3"):
        set_phase(slurm, n, Phase.SERVING)
        router.members[n] = IN
    result = agent.tick()
    assert any(s.node == "gpu2" and s.action == "repair" for s in result.steps)
    removed = first(slurm.log, lambda e: e == ("router_remove", "gpu2"))
    starting = first(slurm.log, lambda e: e[0] == "drain" and e[1] == "gpu2" and ":starting" in e[2])
    assert removed < starting
    assert engine.log == [("stop", "gpu2"), ("start", "gpu2")]
    assert phases(agent)["gpu2"] is Phase.SERVING and router.members["gpu2"] == IN
    assert not any(s.action == "lend" for s in result.steps)


def test_a_repair_restarts_nothing_when_the_engine_answers_as_ours_at_action_time(
        tmp_path: Path) -> None:
    """The tick saw gpu2's engine gone, but by the time the repair runs it answers as ours
    (a blip): the repair is skipped, gpu2 stays SERVING and in the router, nothing is stopped
    (its clients' requests are not cut)."""
    engine = FakeEngine(up={"gpu1": True, "gpu2": False, "gpu3": True})
    loads = {n: ReplicaLoad(model=MODEL, node=n) for n in ("gpu1", "gpu3")}
    metrics = FakeMetrics(replicas=loads, models={MODEL: ModelLoad(model=MODEL)})

    def plan_then_recover(obs, cfg, now):  # type: ignore[no-untyped-def]
        actions = policy.plan(obs, cfg, now)
        engine.up["gpu2"] = True  # back before the action runs
        return actions

    agent, slurm, router, _ = agent_with(tmp_path, engine, planner=plan_then_recover,
                                         metrics=metrics)
    for n in ("gpu1", "gpu2", "gpu3"):
        set_phase(slurm, n, Phase.SERVING)
        router.members[n] = IN
    result = agent.tick()
    repair = [s for s in result.steps if s.node == "gpu2" and s.action == "repair"]
    assert repair and repair[0].outcome.value == "skipped", result.steps
    assert engine.log == [] and ("router_remove", "gpu2") not in slurm.log
    assert phases(agent)["gpu2"] is Phase.SERVING and router.members["gpu2"] == IN


def test_the_planner_repairs_a_foreign_serving_replica_and_lends_nothing(tmp_path: Path) -> None:
    """A SERVING replica proven not ours gets a REPAIR (-> STARTING), not a lend, and the
    model's metrics stay unknown for lending meanwhile (service first)."""
    engine = FakeEngine(up={"gpu1": True, "gpu2": False, "gpu3": True})
    agent, slurm, *_ = agent_with(tmp_path, engine, planner=policy.plan)
    for n in ("gpu1", "gpu2", "gpu3"):
        set_phase(slurm, n, Phase.SERVING)
    obs = agent.observe()
    actions = policy.plan(obs, agent.config, obs.now)
    assert [(a.kind.value, a.node, a.to_phase) for a in actions] == [("repair", "gpu2", Phase.STARTING)]
    obs = replace(obs, nodes=tuple(v for v in obs.nodes if v.name != "gpu2"))
    assert not any(a.kind.value == "repair" for a in policy.plan(obs, agent.config, obs.now))


def test_the_emulator_lists_every_served_name_as_vllm_does() -> None:
    """`--served-model-name MODEL IDENTITY`: /v1/models lists both (vLLM makes a model card
    per served name), a completion may name either, the metrics keep the first."""
    from slurm_idle.testing.emulator import Emulator, parse_args
    from slurm_idle.testing.emulator_http import models_reply, serves
    from slurm_idle.testing.engine_model import EngineModel

    args = parse_args(["--port", "1", "--served-model-name", MODEL, "slurm-idle-abc"])
    emu = Emulator(EngineModel(args.served_model_name[0]), "gpu1", None, None)
    emu.served_names = tuple(args.served_model_name)
    assert [d["id"] for d in models_reply(emu)["data"]] == [MODEL, "slurm-idle-abc"]
    assert serves(emu, MODEL) and serves(emu, "slurm-idle-abc") and not serves(emu, "other")
    assert 'model_name="m"' in emu.model.render().decode()


def test_an_identity_this_user_cannot_read_is_untold_and_status_does_not_blame_the_engine(
    tmp_path: Path,
) -> None:
    """An admin's `status` runs as a user who cannot read the agent's identity store (0700):
    the engine is not admitted on that (health not serving, `foreign` says why) but nothing is
    proven, so status does not call it another server; a squatter proven foreign still is."""
    from slurm_idle.replica_health import unhealthy

    port = Port(names=(MODEL,))
    engine, _ = command_engine(tmp_path, port)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.write_text(PREFIX + "0" * 32 + "\n")
    # A symlink at the replica's file: read without following it fails as an unreadable file
    # does (a permission error needs a non-root user; the suite runs as root).
    IdentityStore(tmp_path / "ids").issue("gpu1")
    [issued] = list((tmp_path / "ids").iterdir())
    issued.unlink()
    issued.symlink_to(elsewhere)
    health = engine.health(REPLICA)
    assert health.up and not health.serving and health.foreign is not None
    assert not health.foreign_proven and "cannot read the engine identity" in health.foreign
    assert unhealthy("http://x", health, ReplicaLoad(model=MODEL, node="gpu1")) is None
    issued.unlink()
    IdentityStore(tmp_path / "ids").issue("gpu1")  # readable again; the port lacks the name
    health = engine.health(REPLICA)
    assert health.foreign_proven
    problem = unhealthy("http://x", health, ReplicaLoad(model=MODEL, node="gpu1"))
    assert problem is not None and problem.summary == "endpoint is not the expected engine"
