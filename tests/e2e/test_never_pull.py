"""The demo job right after `scripts/sandbox up`, and a sandbox that never reaches a registry.

`slurm-idle submit etc/examples/demo-job.yaml` runs on the image `up` built. With the image
removed, the job fails within seconds, its log naming the image and the node (the sandbox's
job_policy.pull is never), for docker and for podman alike. Nothing leaves loopback: a packet
socket watches every interface for DNS queries (its positive control: a query sent to a closed
loopback port is seen, on `lo`), and dockerd's proxy is a loopback port of the sandbox (the
registry trap), so even a pull made on purpose arrives there, the registry's name unresolved.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from slurm_idle.testing.demo import reset_cluster
from slurm_idle.testing.dnswatch import DnsWatch, dns_query_packet
from slurm_idle.testing.images import DEMO_IMAGE, build_demo_image
from slurm_idle.testing.waiting import poll

pytestmark = pytest.mark.sandbox

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "etc" / "examples" / "demo-job.yaml"
ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED"}
#: A query naming any of these is a registry lookup (docker.io's registry, auth and index).
REGISTRY_WORDS = ("docker", "registry")


class RegistryTrap:
    """A loopback listener on the sandbox's registry trap port: records the first line of each
    connection (a proxy request: `CONNECT host:443 ...`) and refuses it with 403."""

    def __init__(self, port: int) -> None:
        self.requests: list[str] = []
        self._sock = socket.create_server(("127.0.0.1", port))
        self._sock.settimeout(0.2)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            with conn:
                conn.settimeout(2)
                try:
                    data = conn.recv(4096)
                except OSError:
                    data = b""
                # recorded before the answer: dockerd fails the pull as soon as it reads the 403
                self.requests.append(data.decode(errors="replace").split("\r\n")[0])
                try:
                    conn.sendall(b"HTTP/1.1 403 Forbidden\r\nContent-Length: 0\r\n"
                                 b"Connection: close\r\n\r\n")
                except OSError:
                    pass

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._sock.close()


@pytest.fixture(scope="module")
def trap(sandbox: Any) -> Iterator[RegistryTrap]:
    t = RegistryTrap(sandbox.layout.registry_trap_port)
    yield t
    t.close()


@pytest.fixture(scope="module")
def dns() -> Iterator[DnsWatch]:
    """Every DNS query the machine sends, with its interface; proven able to see one first."""
    try:
        watch = DnsWatch().start()
    except PermissionError as exc:
        pytest.skip(f"no packet socket to watch DNS with ({exc}): needs CAP_NET_RAW")
    try:
        t0 = time.time()
        probe = f"probe-{os.getpid()}.slurm-idle.invalid"
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            # the positive control: a resolver at a closed loopback port (the trap is TCP only)
            s.sendto(dns_query_packet(probe), ("127.0.0.1", 53))
        poll(lambda: any(q.name == probe and q.interface == "lo" for q in watch.queries(t0)), 5,
             "the DNS watch seeing a query to a closed loopback port")
        yield watch
    finally:
        watch.stop()


def registry_lookups(watch: DnsWatch, since: float) -> list[str]:
    """DNS queries off loopback since `since` that name a registry."""
    return [f"{q.interface}:{q.name}" for q in watch.off_loopback(since)
            if any(w in q.name for w in REGISTRY_WORDS)]


@pytest.fixture(scope="module")
def docker_client(sandbox: Any) -> Iterator[Any]:
    import docker

    client = docker.DockerClient(base_url=sandbox.docker_host, timeout=120)
    yield client
    client.close()


@pytest.fixture(scope="module")
def demo_spec(sandbox: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """etc/examples/demo-job.yaml as the README submits it, its log and checkpoint dir moved
    under this test's own dir (job ids restart at 1 in every sandbox)."""
    reset_cluster(sandbox)
    run_dir = tmp_path_factory.mktemp("never-pull")
    run_dir.chmod(0o755)
    spec = yaml.safe_load(EXAMPLE.read_text())
    spec["mounts"]["checkpoint"]["source"] = str(run_dir / "checkpoint-{job_id}")
    spec["log"] = str(run_dir / "demo-%j.out")
    path = run_dir / "demo-job.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def submit(sb: Any, spec: Path, env: dict[str, str] | None = None) -> int:
    proc = sb.run([sys.executable, "-m", "slurm_idle.cli", "submit", str(spec), "--json"],
                  env=env or {})
    assert proc.returncode == 0, proc.stderr
    return int(json.loads(proc.stdout)["job_id"])


def job_state(sb: Any, job_id: int) -> str:
    out = sb.run(["scontrol", "show", "job", str(job_id)]).stdout
    state = next((t.split("=", 1)[1] for t in out.split() if t.startswith("JobState=")), "")
    if state:
        return str(state)
    acct = sb.run(["sacct", "-X", "-n", "-P", "-j", str(job_id), "--format=State"]).stdout.split()
    return acct[0] if acct else ""


def output_of(spec: Path, job_id: int) -> str:
    path = Path(yaml.safe_load(spec.read_text())["log"].replace("%j", str(job_id)))
    return path.read_text(errors="replace") if path.exists() else ""


def wait_for(sb: Any, job_id: int, states: set[str], timeout_s: float) -> str:
    """The job's state once it is one of `states` or has ended (whichever comes first)."""
    state: str = poll(lambda: (s := job_state(sb, job_id)) in states | ENDED and s, timeout_s,
                      f"job {job_id} in {sorted(states | ENDED)}", interval_s=0.2)
    return state


def test_demo_job_runs_right_after_up(sandbox: Any, demo_spec: Path, docker_client: Any) -> None:
    """The image `up` built is there (nothing here builds it): the demo job's container
    starts (then the job is cancelled: it ran)."""
    docker_client.images.get(DEMO_IMAGE)
    t0 = time.monotonic()
    job_id = submit(sandbox, demo_spec)
    try:
        state = wait_for(sandbox, job_id, {"RUNNING"}, 120)
        assert state in {"RUNNING", "COMPLETED"}, output_of(demo_spec, job_id)
        poll(lambda: "started container" in output_of(demo_spec, job_id), 60,
             f"job {job_id}'s runner starting its container")
        print(f"MEASURE demo_job_container_started_s={time.monotonic() - t0:.1f}")
        assert "pulling" not in output_of(demo_spec, job_id)
    finally:
        sandbox.run(["scancel", str(job_id)])
    wait_for(sandbox, job_id, set(), 60)


def test_missing_image_fails_in_seconds_naming_it_and_no_dns_query_leaves(
        sandbox: Any, demo_spec: Path, docker_client: Any, trap: RegistryTrap,
        dns: DnsWatch) -> None:
    """docker: no image, job_policy.pull never: FAILED within 30 s, the runner's line names the
    image and the node; nothing reaches the registry trap and no DNS query leaves loopback."""
    before = list(trap.requests)
    docker_client.images.remove(DEMO_IMAGE, force=True)
    try:
        since = time.time()
        t0 = time.monotonic()
        job_id = submit(sandbox, demo_spec)
        state = wait_for(sandbox, job_id, set(), 30)
        elapsed = time.monotonic() - t0
        out = output_of(demo_spec, job_id)
        assert state == "FAILED", out
        assert re.search(rf"image {re.escape(DEMO_IMAGE)} is not on node gpu\d and "
                         r"job_policy.pull is never .*docker load -i", out), out
        assert "pulling" not in out, out
        time.sleep(1)  # a late connection or query would still be seen
        off_lo = [f"{q.interface}:{q.name}" for q in dns.off_loopback(since)]
        print(f"MEASURE missing_image_failed_s={elapsed:.1f} dns_queries_off_loopback="
              f"{len(off_lo)} registry_lookups={len(registry_lookups(dns, since))} "
              f"trap_requests={len(trap.requests) - len(before)}")
        assert registry_lookups(dns, since) == [], off_lo
        assert trap.requests == before
    finally:
        build_demo_image(docker_client)
    docker_client.images.get(DEMO_IMAGE)  # later tests on this sandbox still have it


def test_a_pull_made_on_purpose_goes_to_the_loopback_trap_unresolved(
        docker_client: Any, trap: RegistryTrap, dns: DnsWatch) -> None:
    """dockerd's own configuration: a pull (not the runner's: it never pulls here) reaches the
    trap with the registry's name unresolved, fails at once, and asks no DNS server."""
    import docker.errors

    since = time.time()
    t0 = time.monotonic()
    with pytest.raises(docker.errors.APIError):
        docker_client.images.pull("busybox", tag="latest")
    assert time.monotonic() - t0 < 10
    poll(lambda: "CONNECT registry-1.docker.io:443 HTTP/1.1" in trap.requests, 5,
         f"the pull's CONNECT at the trap (seen: {trap.requests})")
    time.sleep(1)
    assert registry_lookups(dns, since) == [], dns.off_loopback(since)


@pytest.fixture(scope="module")
def podman_site(sandbox: Any, trap: RegistryTrap) -> Iterator[dict[str, str]]:
    """A root job's config with `runtime: podman` (root's own jobs may name theirs): the
    sandbox's, so pull never, with a podman store of this test's own (root's podman would
    otherwise use the machine's /var/lib/containers). The podman service gets the sandbox's
    registry trap as its proxy, like dockerd."""
    if shutil.which("podman") is None:
        pytest.skip("podman is not installed")
    work = Path(tempfile.mkdtemp(prefix="never-pull-podman-"))
    work.chmod(0o755)
    (work / "storage.conf").write_text(
        f'[storage]\ndriver = "vfs"\ngraphroot = "{work}/graph"\nrunroot = "{work}/run"\n')
    # the shipped settings, with root's podman state (/run/libpod otherwise) in here too; the
    # file's last table is [engine]
    shipped = (ROOT / "etc" / "podman" / "containers.conf").read_text()
    assert re.findall(r"^\[(\w+)\]", shipped, re.MULTILINE)[-1] == "engine"
    (work / "containers.conf").write_text(shipped + f'tmp_dir = "{work}/tmp"\n')
    cfg = yaml.safe_load(sandbox.config_path.read_text())
    cfg["job_policy"]["runtime"] = "podman"
    assert cfg["job_policy"]["pull"] == "never"
    (work / "slurm-idle.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    (work / "slurm-idle.yaml").chmod(0o644)
    trap_url = f"http://127.0.0.1:{sandbox.layout.registry_trap_port}"
    env = {"SLURM_IDLE_CONFIG": str(work / "slurm-idle.yaml"),
           "CONTAINERS_CONF": str(work / "containers.conf"),
           "CONTAINERS_STORAGE_CONF": str(work / "storage.conf"),
           "HTTP_PROXY": trap_url, "HTTPS_PROXY": trap_url, "NO_PROXY": ""}
    info = subprocess.run(["podman", "info", "--format", "{{.Store.GraphRoot}}"],
                          env={**os.environ, **env}, capture_output=True, text=True, timeout=120,
                          check=False)
    if info.returncode != 0:
        shutil.rmtree(work, ignore_errors=True)
        pytest.skip(f"podman does not run here: {' '.join(info.stderr.split())[-300:]}")
    yield env
    shutil.rmtree(work, ignore_errors=True)  # vfs, no container ever made: nothing mounted


def test_podman_missing_image_fails_in_seconds_naming_it_and_no_dns_query_leaves(
        sandbox: Any, demo_spec: Path, podman_site: dict[str, str], trap: RegistryTrap,
        dns: DnsWatch) -> None:
    """podman (the runner's own API service): the same rule. Podman's API says "image not
    known" rather than docker's "No such image"; the job still fails at once with the one
    line, podman's load hint in it, and nothing is pulled or looked up."""
    before = list(trap.requests)
    since = time.time()
    t0 = time.monotonic()
    job_id = submit(sandbox, demo_spec, env=podman_site)
    state = wait_for(sandbox, job_id, set(), 60)
    elapsed = time.monotonic() - t0
    out = output_of(demo_spec, job_id)
    assert state == "FAILED", out
    assert "podman service at unix://" in out, out
    assert re.search(rf"image {re.escape(DEMO_IMAGE)} is not on node gpu\d and "
                     r"job_policy.pull is never .*podman load -i", out), out
    assert "pulling" not in out, out
    time.sleep(1)
    print(f"MEASURE podman_missing_image_failed_s={elapsed:.1f} "
          f"registry_lookups={len(registry_lookups(dns, since))} "
          f"trap_requests={len(trap.requests) - len(before)}")
    assert registry_lookups(dns, since) == [], dns.off_loopback(since)
    assert trap.requests == before
