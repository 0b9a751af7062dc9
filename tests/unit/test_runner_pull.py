"""job_policy.pull: `never` asks no registry and fails a job whose image is not on the node
before anything starts, in one line naming the image, the node and how to load it there;
`missing` pulls only what is absent; `always` pulls each run. One rule for both engines the
runner drives through the docker SDK: each engine's real answer for an absent image (a 404
body captured from docker 20.10 and podman 4.3) goes through the SDK's own error mapping."""

from __future__ import annotations

import io
import json
import os
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import docker.errors
import pytest
import requests

from slurm_idle.config import JobPolicyConfig
from slurm_idle.runner import cli as runner
from slurm_idle.runner.container import ImageMissing, ensure_image, slurm_context
from slurm_idle.runner.run import EXIT_START_FAILED, run_container
from slurm_idle.runner.supervise import Reporter, RunSettings, Signals
from tests.unit.test_runner import CTX, FakeClient, spec

#: GET /images/{name}/json of an absent image, as each engine answers it (captured here).
ABSENT_BODIES: dict[str, Callable[[str], dict[str, Any]]] = {
    "docker": lambda tag: {"message": f"No such image: {tag}"},
    "podman": lambda tag: {
        "cause": f"failed to find image {tag}: docker.io/{tag}: No such image",
        "message": f"failed to find image {tag}: docker.io/{tag}: No such image",
        "response": 404},
}


def absent(engine: str) -> Callable[[str], Exception]:
    """The exception the docker SDK raises for `engine`'s 404 answer (its own mapping)."""
    def make(tag: str) -> Exception:
        response = requests.Response()
        response.status_code = 404
        response._content = json.dumps(ABSENT_BODIES[engine](tag)).encode()
        try:
            docker.errors.create_api_error_from_http_exception(
                requests.HTTPError(response=response))
        except docker.errors.APIError as exc:
            return exc
        raise AssertionError("the SDK raised nothing")
    return make


ENGINES: dict[str, Callable[[str], Exception]] = {e: absent(e) for e in ABSENT_BODIES}


class Images:
    def __init__(self, present: set[str], absent: Callable[[str], Exception]) -> None:
        self.present = present
        self.absent = absent
        self.pulled: list[str] = []

    def get(self, tag: str) -> object:
        if tag not in self.present:
            raise self.absent(tag)
        return object()

    def pull(self, tag: str) -> object:
        self.pulled.append(tag)
        self.present.add(tag)
        return object()


class Client:
    def __init__(self, present: set[str], engine: str = "docker") -> None:
        self.images = Images(present, ENGINES[engine])


class Said:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def say(self, message: str) -> None:
        self.lines.append(message)


@pytest.mark.parametrize("engine", sorted(ENGINES))
@pytest.mark.parametrize(("pull", "present", "pulled"), [
    ("missing", set(), ["img:1"]),
    ("missing", {"img:1"}, []),
    ("always", {"img:1"}, ["img:1"]),
    ("never", {"img:1"}, []),
])
def test_pull_policy_decides_when_the_registry_is_asked(
        engine: Any, pull: Any, present: set[str], pulled: list[str]) -> None:
    """missing pulls only an absent image, always pulls, never only looks; on either engine."""
    client = Client(set(present), engine)
    ensure_image(client, "img:1", Said(), pull, "gpu1", engine)
    assert client.images.pulled == pulled


@pytest.mark.parametrize("engine", sorted(ENGINES))
def test_never_with_a_missing_image_says_what_to_load_where(engine: Any) -> None:
    """Each engine's way of saying "absent" is refused the same way: one line naming the
    image, the node and that engine's load command; nothing is pulled."""
    client = Client(set(), engine)
    with pytest.raises(ImageMissing) as err:
        ensure_image(client, "slurm-idle/demo:latest", Said(), "never", "gpu3", engine)
    msg = str(err.value)
    assert "\n" not in msg
    assert "image slurm-idle/demo:latest is not on node gpu3" in msg
    assert "job_policy.pull is never" in msg
    assert f"{engine} load -i IMAGE.tar" in msg
    assert client.images.pulled == []


def test_a_node_is_named_even_outside_slurm() -> None:
    """Run by hand (no SLURMD_NODENAME): the host's name stands for the node."""
    with pytest.raises(ImageMissing, match=f"is not on node {os.uname().nodename} "):
        ensure_image(Client(set()), "img:1", Said(), "never", "")


def test_the_node_comes_from_slurmd_nodename() -> None:
    """The job step's SLURMD_NODENAME is the node an admin loads the image on."""
    assert slurm_context({"SLURMD_NODENAME": "gpu7"}).node == "gpu7"


@pytest.mark.parametrize("engine", sorted(ENGINES))
def test_a_missing_image_fails_the_job_before_a_container_is_created(
        tmp_path: Path, engine: Any) -> None:
    """Through the runner: exit 70 (could not start), no container created, no pull, and the
    job log's line names the image and the node."""
    client = FakeClient(on_start=lambda c: c.exit(0))
    images = Images(set(), ENGINES[engine])
    client.images = images  # type: ignore[assignment]
    out = io.BytesIO()
    settings = RunSettings(uid=1000, gid=1000, poll_s=0.01, pull="never", engine=engine)
    code = run_container(client, spec(tmp_path), replace(CTX, node="gpu3"), settings, Signals(),
                         Reporter(out, clock=lambda: 0.0))
    text = out.getvalue().decode()
    assert code == EXIT_START_FAILED
    assert client.containers.created == [] and images.pulled == []
    assert "could not run the container: image img:1 is not on node gpu3" in text
    assert "pulling" not in text


def test_the_config_key_defaults_to_missing_and_refuses_other_values() -> None:
    """job_policy.pull: missing unless set; only never|missing|always."""
    from pydantic import ValidationError

    assert JobPolicyConfig().pull == "missing"
    assert JobPolicyConfig(pull="never").pull == "never"
    with pytest.raises(ValidationError):
        JobPolicyConfig(pull="sometimes")  # type: ignore[arg-type]


def _capture_settings(monkeypatch: pytest.MonkeyPatch) -> list[RunSettings]:
    seen: list[RunSettings] = []

    def fake_run(*args: Any, **kwargs: Any) -> int:
        seen.append(args[3])
        return 0

    monkeypatch.setattr(runner, "_client", lambda *a, **k: object())
    monkeypatch.setattr(runner, "run_container", fake_run)
    return seen


@pytest.mark.skipif(os.geteuid() != 0, reason="a root-owned config needs root")
def test_the_sites_pull_reaches_the_runner_like_every_job_policy_key(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The key travels the way the rest of job_policy does: read by the runner from the trusted
    config (here root's own job naming a root-owned one), never from the batch script."""
    cfg = tmp_path / "site.yaml"
    cfg.write_text("engine: {kind: command, start_command: s, stop_command: t}\n"
                   "models: [{name: m, nodes: gpu1}]\n"
                   "job_policy: {mount_prefixes: [/tmp], allow_root: true, runtime: docker, "
                   "pull: never}\n")
    cfg.chmod(0o644)
    tmp_path.chmod(0o755)
    monkeypatch.setenv("SLURM_IDLE_CONFIG", str(cfg))
    seen = _capture_settings(monkeypatch)
    job = tmp_path / "job.yaml"
    job.write_text("name: j\nimage: img:1\n")
    assert runner._main(["--spec", str(job)], Signals()) == 0
    assert [(s.pull, s.engine) for s in seen] == [("never", "docker")]


class FakePodmanService:
    """Stands in for the per-job podman API service (its own tests: test_podman.py)."""

    def __init__(self) -> None:
        self.pid = None

    @classmethod
    def for_job(cls, *args: Any, **kwargs: Any) -> FakePodmanService:
        return cls()

    def start(self) -> str:
        return "unix:///nowhere/podman.sock"

    def running(self) -> bool:
        return True

    def stop(self) -> None:
        pass


def test_a_podman_job_gets_the_pull_policy_and_podmans_load_hint(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """runtime podman: the same pull setting, and the load hint is podman's (the job's user's
    own store), not docker's."""
    monkeypatch.setattr(runner, "site_policy", lambda env: JobPolicyConfig(
        allow_root=True, mount_prefixes=("/tmp",), runtime="podman", pull="never"))
    monkeypatch.setattr(runner, "PodmanService", FakePodmanService)
    seen = _capture_settings(monkeypatch)
    job = tmp_path / "job.yaml"
    job.write_text("name: j\nimage: img:1\n")
    assert runner._main(["--spec", str(job)], Signals()) == 0
    assert [(s.pull, s.engine) for s in seen] == [("never", "podman")]
