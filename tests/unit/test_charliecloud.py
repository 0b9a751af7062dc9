"""Charliecloud behind the runner's container protocol: image directories, the ch-run command
line, the environment the workload gets, and the supervisor's rules over a ch-run child (a fake
ch-run here that runs the command without a user namespace; the real one: tests/contract)."""

from __future__ import annotations

import io
import os
import time
from pathlib import Path
from typing import Any

import pytest

import slurm_idle.runner.cli as runner
from slurm_idle.charliecloud import (
    PREPARE,
    CharliecloudClient,
    ChContainer,
    ChRunError,
    ImageConfig,
    child_env,
    chrun_argv,
    command_of,
    exit_code,
    image_name,
    read_image_config,
)
from slurm_idle.config import JobPolicyConfig
from slurm_idle.jobs import parse_job_spec
from slurm_idle.runner import (
    EXIT_PREEMPTED,
    EXIT_START_FAILED,
    Reporter,
    RunSettings,
    Signals,
    SlurmContext,
    run_container,
)
from tests.unit.test_runner_stop import later

#: Runs what follows `--` as ch-run would (exec in place), without any namespace.
FAKE_CH_RUN = '#!/bin/sh\nwhile [ "$1" != "--" ]; do shift; done\nshift\nexec "$@"\n'
IMAGE = "slurm-idle/demo:latest"
CTX = SlurmContext(job_id="42", restart_count=1, gpus=("2", "3"), cuda_visible_devices="2,3",
                   node="gpu7")


@pytest.fixture
def images(tmp_path: Path) -> Path:
    """An images root with one image directory holding the usual bind targets."""
    root = tmp_path / "images"
    img = root / "slurm-idle%demo+latest"
    for d in ("ck", "in", "run/slurm-idle", "bin"):
        (img / d).mkdir(parents=True)
    (img / "run/slurm-idle/params.json").touch()
    return root


@pytest.fixture
def client(images: Path, tmp_path: Path) -> CharliecloudClient:
    fake = tmp_path / "ch-run"
    fake.write_text(FAKE_CH_RUN)
    fake.chmod(0o755)
    return CharliecloudClient(str(images), "someone", ch_run=str(fake), namespaces=False)


def spec(tmp_path: Path, script: str, **over: Any) -> Any:
    return parse_job_spec({"name": "t", "image": IMAGE, "command": ["/bin/sh", "-c", script],
                           "mounts": {"checkpoint": {"source": str(tmp_path / "ck"),
                                                     "target": "/ck"}}, **over})


def run(client: CharliecloudClient, sp: Any, signals: Signals | None = None,
        grace_s: float = 5.0) -> tuple[int, str]:
    out = io.BytesIO()
    code = run_container(client, sp, CTX, RunSettings(grace_s=grace_s, poll_s=0.01,
                                                      engine="charliecloud", pull="never"),
                         signals or Signals(), Reporter(out, clock=lambda: 0.0))
    return code, out.getvalue().decode()


# ---------------------------------------------------------------- pure parts


@pytest.mark.parametrize("image, name", [
    ("slurm-idle/demo:latest", "slurm-idle%demo+latest"),
    ("busybox", "busybox+latest"),
    ("localhost:5000/a/b", "localhost+5000%a%b+latest"),
    ("a/b@sha256:ab12", "a%b@sha256+ab12"),
])
def test_an_image_is_a_directory_named_as_ch_image_names_its_storage(image: str, name: str) -> None:
    """`/` -> `%`, `:` -> `+`; no tag means :latest, as for docker."""
    assert image_name(image) == name


def test_namespaces_keep_the_network_out_inputs_read_only_and_tmp_private(tmp_path: Path) -> None:
    """ch-run shares the host network and /tmp and binds read-write: network none adds a
    network namespace, each read-only mount's source is made read-only before ch-run binds it,
    and /tmp is always the container's own (the host's /tmp is outside every mount prefix)."""
    (tmp_path / "ck").mkdir()
    (tmp_path / "in").mkdir()
    kw = {"network_mode": "none", "entrypoint": ["sh"], "command": ["-c", "true"],
          "user": "1000:100", "mounts": [{"Source": "/data/x", "Target": "/ck"},
                                         {"Source": "/data/i", "Target": "/in", "ReadOnly": True}]}
    argv = chrun_argv(kw, tmp_path, ImageConfig(), "ch-run")
    cut = argv.index("ch-run")
    assert argv[:cut] == ["unshare", "--user", "--map-root-user", "--mount", "--net", "--",
                          "/bin/sh", "-c", PREPARE, "sh", "none", "/data/i", "--"]
    assert "remount,bind,ro" in PREPARE and "ip link set lo up" in PREPARE
    # ch-run starts as the namespace's root there: the caller's ids are passed on.
    assert argv[cut:] == ["ch-run", "--private-tmp", "-u", "1000", "-g", "100", "-b",
                          "/data/x:/ck", "-b", "/data/i:/in", str(tmp_path), "--", "sh", "-c", "true"]
    host = chrun_argv({**kw, "network_mode": "host"}, tmp_path, ImageConfig(), "ch-run")
    assert "--net" not in host[:host.index("ch-run")] and "--mount" in host
    assert "--private-tmp" in host


def test_a_bind_target_missing_from_the_image_is_refused_by_name(tmp_path: Path) -> None:
    """ch-run cannot create a mount point in a read-only image: say which one, and how."""
    with pytest.raises(ChRunError, match="mount target /out is not in the image .*mkdir -p"):
        chrun_argv({"mounts": [{"Source": "/data/o", "Target": "/out"}], "entrypoint": ["x"]},
                   tmp_path, ImageConfig())


def test_a_bind_target_that_climbs_out_of_the_image_is_refused(tmp_path: Path) -> None:
    """ch-run joins the target to the image path: `..` would name a place outside the image
    (which exists, so the check above would pass it)."""
    (tmp_path / "img").mkdir()
    with pytest.raises(ChRunError, match="climbs out"):
        chrun_argv({"mounts": [{"Source": "/data/o", "Target": "/../img"}], "entrypoint": ["x"]},
                   tmp_path / "img", ImageConfig())


def test_the_command_follows_dockers_rules_over_the_images_config() -> None:
    """An entrypoint given drops the image's CMD; args alone keep the image's entrypoint;
    nothing anywhere is an error that says what to write."""
    img = ImageConfig(entrypoint=("/bin/sh", "/demo.sh"), cmd=("--fast",), workdir="/w")
    assert command_of({}, img) == ["/bin/sh", "/demo.sh", "--fast"]
    assert command_of({"command": ["--slow"]}, img) == ["/bin/sh", "/demo.sh", "--slow"]
    assert command_of({"entrypoint": ["python"]}, img) == ["python"]
    with pytest.raises(ChRunError, match="give `command:`"):
        command_of({}, ImageConfig())
    argv = chrun_argv({}, Path("/"), img, unshare=None)
    assert argv[argv.index("-c") + 1] == "/w"


def test_the_image_config_is_read_where_ch_image_keeps_it(tmp_path: Path) -> None:
    """ch/config.pulled.json (the docker image config) first, ch/metadata.json (env, cwd) else."""
    (tmp_path / "ch").mkdir()
    (tmp_path / "ch/metadata.json").write_text('{"env": {"A": "1"}, "cwd": "/m"}')
    assert read_image_config(tmp_path) == ImageConfig(env=(("A", "1"),), workdir="/m")
    (tmp_path / "ch/config.pulled.json").write_text(
        '{"config": {"Entrypoint": ["/bin/sh"], "Cmd": null, "Env": ["PATH=/bin", "B=x=y"]}}')
    assert read_image_config(tmp_path) == ImageConfig(
        entrypoint=("/bin/sh",), env=(("PATH", "/bin"), ("B", "x=y")))
    assert read_image_config(tmp_path / "nothing") == ImageConfig()


def test_the_child_gets_the_container_environment_over_the_images_and_user() -> None:
    env = child_env({"environment": {"A": "spec", "CUDA_VISIBLE_DEVICES": "2,3"}},
                    ImageConfig(env=(("A", "image"), ("B", "image"))), "alice")
    assert env["A"] == "spec" and env["B"] == "image" and env["USER"] == "alice"
    assert env["PATH"].startswith("/usr/local/sbin") and env["CUDA_VISIBLE_DEVICES"] == "2,3"


def test_a_signal_death_reads_as_an_engine_reports_it() -> None:
    assert exit_code(-15) == 143 and exit_code(-9) == 137 and exit_code(3) == 3


# ---------------------------------------------------------------- the runner over ch-run


def test_the_workload_runs_with_its_exit_code_gpus_and_params(
        client: CharliecloudClient, tmp_path: Path) -> None:
    """Its code comes back as the runner's; the GPUs Slurm gave are in its environment (as
    the env gpu mode passes them) and the params file is bound where the spec says."""
    code, log = run(client, spec(tmp_path, "echo cuda=$CUDA_VISIBLE_DEVICES nv=$NVIDIA_VISIBLE_DEVICES"
                                           " params=$SLURM_IDLE_PARAMS_FILE; exit 7",
                                 params={"lr": 0.5}))
    assert code == 7, log
    assert "cuda=2,3 nv=2,3 params=/run/slurm-idle/params.json" in log
    (argv,) = [c.argv for c in client.containers.created.values()]
    assert any(a.endswith(":/run/slurm-idle/params.json") for a in argv)


def test_the_runners_own_environment_never_reaches_the_workload(
        client: CharliecloudClient, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """ch-run passes its environment through: the child is given only the container's (no
    engine socket, no config path, no step variables of the runner's)."""
    monkeypatch.setenv("DOCKER_HOST", "unix:///run/docker.sock")
    monkeypatch.setenv("SLURM_IDLE_CONFIG", "/tmp/permissive.yaml")
    code, log = run(client, spec(tmp_path, "env; exit 0"))
    assert code == 0, log
    assert "DOCKER_HOST" not in log and "SLURM_IDLE_CONFIG" not in log and "USER=someone" in log


def test_sigterm_reaches_the_workloads_trap_and_the_run_ends_143(
        client: CharliecloudClient, tmp_path: Path) -> None:
    """The supervisor's SIGTERM goes to the ch-run child, which is the workload: its trap
    checkpoints at once (not at the end of the grace)."""
    signals = Signals()
    sp = spec(tmp_path, "trap 'echo checkpointed; exit 143' TERM; echo ready; "
                        "while true; do sleep 0.05; done")
    later(signals.on_term, gap_s=0.5)(None)  # type: ignore[arg-type]
    t0 = time.monotonic()
    code, log = run(client, sp, signals, grace_s=30)
    assert code == EXIT_PREEMPTED, log
    assert "checkpointed" in log and "container stopped with code 143" in log
    assert time.monotonic() - t0 < 10


def test_a_workload_ignoring_sigterm_is_killed_at_the_end_of_the_grace(
        client: CharliecloudClient, tmp_path: Path) -> None:
    signals = Signals()
    later(signals.on_term, gap_s=0.3)(None)  # type: ignore[arg-type]
    code, log = run(client, spec(tmp_path, "trap '' TERM; while true; do sleep 0.05; done"),
                    signals, grace_s=0.5)
    assert code == EXIT_PREEMPTED and "killing it" in log and "code 137" in log, log


def test_what_the_workload_leaves_running_ends_with_it(
        client: CharliecloudClient, tmp_path: Path) -> None:
    """A background child holding the log pipe open neither outlives the container nor holds
    the runner (as an engine ends a container's processes with its main one)."""
    marker = f"sleep {4242 + os.getpid() % 1000}"
    t0 = time.monotonic()
    code, log = run(client, spec(tmp_path, f"{marker} & echo left; exit 0"))
    assert code == 0 and "left" in log, log
    assert time.monotonic() - t0 < 3
    time.sleep(0.1)
    left = [p for p in os.listdir("/proc") if p.isdigit() and _cmdline(p) == marker]
    assert left == []


def _cmdline(pid: str) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
    except OSError:
        return ""


def test_an_ended_container_refuses_a_signal_as_dockerd_does(
        client: CharliecloudClient, tmp_path: Path) -> None:
    """supervise reads that refusal as "it ended as the stop came" (its exit 0 is its own)."""
    c = ChContainer("c", ["/bin/sh", "-c", "exit 0"], {"PATH": "/usr/bin:/bin"})
    c.start()
    assert c.wait() == {"StatusCode": 0}
    with pytest.raises(ChRunError, match="not running"):
        c.kill(signal="SIGTERM")
    c.reload()
    assert c.status == "exited"
    c.remove(force=True)


def test_a_missing_image_directory_fails_70_naming_the_image_node_and_how(
        client: CharliecloudClient, tmp_path: Path, images: Path) -> None:
    """One line before anything starts: the image, the node, the directory, how to make it."""
    code, log = run(client, spec(tmp_path, "true", image="nope/absent:1"))
    assert code == EXIT_START_FAILED and client.containers.created == {}
    line = next(ln for ln in log.splitlines() if "could not run" in ln)
    assert "image nope/absent:1 is not on node gpu7" in line
    assert str(images / "nope%absent+1") in line and "ch-convert" in line


def _main_with(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, policy: JobPolicyConfig,
               *argv: str, job: str = "name: j\nimage: img:1\n") -> tuple[int, list[Any]]:
    seen: list[Any] = []
    monkeypatch.setattr(runner, "site_policy", lambda env: policy)
    monkeypatch.setattr(runner, "run_container",
                        lambda *a, **k: seen.append((a[0], a[3])) or 0)  # type: ignore[func-returns-value]
    path = tmp_path / "job.yaml"
    path.write_text(job)
    return runner._main([*argv, "--spec", str(path)] if "--cleanup" not in argv else list(argv),
                        Signals()), seen


def test_runtime_charliecloud_runs_ch_run_never_pulls_and_passes_gpus_by_env(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The site's runtime picks the ch-run client over the site's image directory; pull is
    never whatever the config says (there is no registry to ask); nvidia device requests
    have no engine to serve them, so the GPUs go by environment."""
    policy = JobPolicyConfig(allow_root=True, mount_prefixes=("/tmp",), runtime="charliecloud",
                             pull="always", charliecloud_images="/srv/images")
    code, seen = _main_with(monkeypatch, tmp_path, policy, "--gpu-mode", "nvidia")
    assert code == 0
    ((client, settings),) = seen
    assert isinstance(client, CharliecloudClient) and client.images.root == "/srv/images"
    assert (settings.engine, settings.pull, settings.gpu_mode) == ("charliecloud", "never", "env")
    assert settings.uid == os.getuid()


def test_the_node_policy_refuses_a_charliecloud_job_before_anything_starts(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same check_spec as for podman and docker: a mount outside the prefixes is exit 70."""
    policy = JobPolicyConfig(allow_root=True, mount_prefixes=("/scratch",), runtime="charliecloud")
    code, seen = _main_with(monkeypatch, tmp_path, policy, job=(
        "name: j\nimage: img:1\nmounts: {outputs: [{source: /etc, target: /out}]}\n"))
    assert code == EXIT_START_FAILED and seen == []


def test_cleanup_under_charliecloud_has_nothing_to_remove(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An Epilog's `--cleanup JOBID` reaches no engine: ch-run children end with the step."""
    monkeypatch.setattr(runner, "_client", lambda *a, **k: pytest.fail("no engine to reach"))
    policy = JobPolicyConfig(runtime="charliecloud")
    code, seen = _main_with(monkeypatch, tmp_path, policy, "--cleanup", "42")
    assert code == 0 and seen == []


def test_the_runtime_key_accepts_charliecloud_and_an_absolute_image_dir() -> None:
    from pydantic import ValidationError

    assert JobPolicyConfig(runtime="charliecloud").charliecloud_images == "/var/lib/slurm-idle/images"
    with pytest.raises(ValidationError):
        JobPolicyConfig(charliecloud_images="images")


def test_a_node_without_ch_run_fails_70_saying_what_to_install(
        images: Path, tmp_path: Path) -> None:
    client = CharliecloudClient(str(images), "someone", ch_run=str(tmp_path / "no-ch-run"))
    code, log = run(client, spec(tmp_path, "true"))
    assert code == EXIT_START_FAILED and "not found on this node" in log
    assert "apt-get install charliecloud" in log


class _FakeExport:
    """An engine's container of a tiny image: `export()` is its flattened tree as tar chunks."""

    def __init__(self) -> None:
        import tarfile

        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            for name, data in (("bin/hello", b"#!/bin/sh\necho hi\n"), ("etc/passwd", b"root:x:0:0::/:/bin/sh\n")):
                info = tarfile.TarInfo(name)
                info.size, info.mode = len(data), 0o755
                tar.addfile(info, io.BytesIO(data))
        self.data = buf.getvalue()
        self.removed = False

    def export(self) -> Any:
        yield from (self.data[i:i + 1000] for i in range(0, len(self.data), 1000))

    def remove(self, force: bool = False) -> None:
        self.removed = True


def test_an_exported_image_is_a_ready_directory_with_its_config(tmp_path: Path) -> None:
    """The project's export: the tree, ch-run's mount points, the params-file stand-in and the
    image config where ch-image keeps it, renamed into place; the container removed."""
    from types import SimpleNamespace

    from slurm_idle.testing.images import export_image_dir

    made = _FakeExport()
    attrs = {"Architecture": "amd64", "Config": {"Entrypoint": ["/bin/hello"], "Env": ["A=1"]}}
    client = SimpleNamespace(containers=SimpleNamespace(create=lambda *a, **k: made),
                             images=SimpleNamespace(get=lambda tag: SimpleNamespace(attrs=attrs)))
    path = export_image_dir(client, IMAGE, tmp_path / "images")
    assert path == tmp_path / "images" / "slurm-idle%demo+latest" and made.removed
    assert (path / "bin/hello").read_bytes().startswith(b"#!/bin/sh")
    for d in ("dev", "proc", "sys", "home", "checkpoint", "run/slurm-idle"):
        assert (path / d).is_dir(), d
    assert (path / "run/slurm-idle/params.json").is_file()
    assert read_image_config(path) == ImageConfig(entrypoint=("/bin/hello",), env=(("A", "1"),))
    assert [p.name for p in (tmp_path / "images").iterdir()] == [path.name]  # no half-made one
