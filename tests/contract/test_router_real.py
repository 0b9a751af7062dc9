"""The router adapters against the real routers Debian ships (issue 14): HAProxy 2.6's runtime
API and nginx 1.22 reloading an upstream include written by the `file` router.

Each test starts its own HAProxy or nginx on loopback (own config, socket, pid file and free
ports under tmp_path, stopped by pid) in front of two tiny HTTP backends that answer their own
name, so "taken out" is checked by where requests really go, not only by what the router says.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import threading
import urllib.request
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from slurm_idle.config import RouterConfig
from slurm_idle.errors import RouterError
from slurm_idle.router import IN, MISSING, OUT, RouterTarget, make_router
from slurm_idle.testing.waiting import poll


def free_port() -> int:
    """A port for this test's own server, leased (ports.free_port): an ephemeral port found
    free could be taken by an outgoing connection before the server binds it."""
    from slurm_idle.testing import ports

    return ports.free_port()


@pytest.fixture
def backends() -> Iterator[dict[str, int]]:
    """Two HTTP servers answering their own name: {name: port}."""
    servers = {}
    for name in ("gpu1", "gpu2"):
        class Handler(BaseHTTPRequestHandler):
            me = name.encode()

            def do_GET(self) -> None:
                self.send_response(200)
                self.send_header("Content-Length", str(len(self.me)))
                self.end_headers()
                self.wfile.write(self.me)

            def log_message(self, *args: Any) -> None:
                pass

        srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        servers[name] = srv
    yield {n: int(s.server_address[1]) for n, s in servers.items()}
    for s in servers.values():
        s.shutdown()
        s.server_close()


def target(name: str, port: int) -> RouterTarget:
    return RouterTarget(name, "m", f"http://127.0.0.1:{port}", name, port)


def who(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=5) as r:
        return str(r.read().decode())


def answers(port: int, n: int = 8) -> set[str]:
    return {who(port) for _ in range(n)}


def stop(proc: subprocess.Popen[bytes]) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)


# --- HAProxy -------------------------------------------------------------------------------


@pytest.fixture
def haproxy(tmp_path: Path, backends: dict[str, int]) -> Iterator[tuple[Any, int]]:
    if shutil.which("haproxy") is None:
        pytest.skip("haproxy is not installed (scripts/lib/install.sh installs it)")
    sock, port = tmp_path / "admin.sock", free_port()
    servers = "\n".join(f"    server {n} 127.0.0.1:{p}" for n, p in backends.items())
    cfg = tmp_path / "haproxy.cfg"
    cfg.write_text(f"""global
    stats socket {sock} mode 600 level admin
defaults
    mode http
    timeout connect 2s
    timeout client 10s
    timeout server 10s
    option http-server-close
frontend fe
    bind 127.0.0.1:{port}
    default_backend vllm
backend vllm
    balance roundrobin
{servers}
""")
    proc = subprocess.Popen(["haproxy", "-db", "-f", str(cfg)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        poll(lambda: sock.exists(), 20, "haproxy admin socket")
        router = make_router(RouterConfig(kind="haproxy", admin_socket=str(sock)))
        yield router, port
    finally:
        stop(proc)


def test_haproxy_drain_takes_a_server_out_and_ready_puts_it_back(
        haproxy: tuple[Any, int], backends: dict[str, int]) -> None:
    """remove(gpu1): HAProxy reports it out and sends every request to gpu2; add: both again."""
    router, port = haproxy
    t1, t2 = target("gpu1", backends["gpu1"]), target("gpu2", backends["gpu2"])
    assert router.state([t1, t2]) == {"gpu1": IN, "gpu2": IN}
    assert answers(port) == {"gpu1", "gpu2"}
    router.remove(t1)
    router.remove(t1)  # idempotent
    assert router.state([t1, t2]) == {"gpu1": OUT, "gpu2": IN}
    assert answers(port) == {"gpu2"}
    router.add(t1)
    assert router.state([t1, t2]) == {"gpu1": IN, "gpu2": IN}
    assert answers(port) == {"gpu1", "gpu2"}


def test_haproxy_unknown_server_fails_and_reads_missing(haproxy: tuple[Any, int]) -> None:
    """A server name haproxy.cfg does not have: the call fails loudly, its state is missing."""
    router, _ = haproxy
    ghost = target("gpu9", 1)
    with pytest.raises(RouterError, match="gpu9"):
        router.remove(ghost)
    assert router.state([ghost]) == {"gpu9": MISSING}


def test_haproxy_points_a_replica_jobs_slot_at_the_job(
        haproxy: tuple[Any, int], backends: dict[str, int], tmp_path: Path) -> None:
    """A replica job (target.moves) runs where Slurm put it: add() sets its server slot's
    address first (`set server B/S addr`), so requests reach the job, not the slot's old one."""
    _, port = haproxy
    router = make_router(RouterConfig(kind="haproxy", admin_socket=str(tmp_path / "admin.sock"),
                                      server="gpu{index}"))
    job = RouterTarget("m#1", "m", f"http://localhost:{backends['gpu2']}", "localhost",
                       backends["gpu2"], index=1, moves=True)
    router.remove(job)
    router.add(job)  # slot gpu1 now points at the job (the gpu2 server here)
    assert router.state([job]) == {"m#1": IN}
    assert answers(port) == {"gpu2"}


# --- nginx ---------------------------------------------------------------------------------


@pytest.fixture
def nginx(tmp_path: Path) -> Iterator[tuple[Path, int, str]]:
    """nginx with its own prefix, pid file and port, including `upstream.inc` from the router.
    Yields (include path, port, reload command)."""
    if shutil.which("nginx") is None and not Path("/usr/sbin/nginx").exists():
        pytest.skip("nginx is not installed (scripts/lib/install.sh installs nginx-light)")
    nginx_bin = shutil.which("nginx") or "/usr/sbin/nginx"
    prefix, port = tmp_path / "nginx", free_port()
    (prefix / "logs").mkdir(parents=True)
    include = prefix / "upstream.inc"
    conf = prefix / "nginx.conf"
    conf.write_text(f"""daemon off;
master_process on;
worker_processes 1;
pid {prefix}/nginx.pid;
error_log {prefix}/logs/error.log;
user root;
events {{ worker_connections 64; }}
http {{
    access_log off;
    client_body_temp_path {prefix}/body;
    proxy_temp_path {prefix}/proxy;
    fastcgi_temp_path {prefix}/fastcgi;
    uwsgi_temp_path {prefix}/uwsgi;
    scgi_temp_path {prefix}/scgi;
    include {include};
    server {{
        listen 127.0.0.1:{port};
        location / {{ proxy_pass http://vllm; }}
    }}
}}
""")
    reload = f"{nginx_bin} -p {prefix} -c {conf} -s reload"
    yield include, port, reload
    pid_file = prefix / "nginx.pid"
    if pid_file.exists():
        pid = int(pid_file.read_text().strip())
        os.kill(pid, signal.SIGQUIT)
        poll(lambda: not Path(f"/proc/{pid}").exists()
             or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2], 15, "nginx exit")


def test_nginx_reloads_the_generated_upstream_include(
        nginx: tuple[Path, int, str], backends: dict[str, int]) -> None:
    """The file router writes an nginx upstream include and reloads nginx: a removed replica
    gets no more requests, an added one gets them again."""
    include, port, reload = nginx
    nginx_bin = reload.split()[0]
    cfg = RouterConfig(kind="file", path=str(include), format="template",
                       header="upstream vllm {\n", line="    server {host}:{port};\n",
                       footer="}\n", reload_command=reload)
    router = make_router(cfg)
    t1, t2 = target("gpu1", backends["gpu1"]), target("gpu2", backends["gpu2"])
    # nginx needs the include to start: write the first set without a reload.
    router_no_reload = make_router(cfg.model_copy(update={"reload_command": None}))
    router_no_reload.add(t1)
    router_no_reload.add(t2)
    conf = include.parent / "nginx.conf"
    proc = subprocess.Popen([nginx_bin, "-p", str(include.parent), "-c", str(conf)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        poll(lambda: _answers_or_none(port) == {"gpu1", "gpu2"}, 20, "nginx serving both")
        assert router.state([t1, t2]) == {"gpu1": IN, "gpu2": IN}
        router.remove(t1)
        poll(lambda: _answers_or_none(port) == {"gpu2"}, 20, "gpu1 out of nginx after reload")
        assert router.state([t1, t2]) == {"gpu1": OUT, "gpu2": IN}
        router.add(t1)
        poll(lambda: _answers_or_none(port) == {"gpu1", "gpu2"}, 20, "gpu1 back in nginx")
    finally:
        stop(proc)


def _answers_or_none(port: int) -> set[str] | None:
    try:
        return answers(port)
    except OSError:
        return None


def test_a_broken_reload_keeps_the_old_include(nginx: tuple[Path, int, str], tmp_path: Path) -> None:
    """A reload command that fails leaves the previous include in place and raises."""
    include, _, _ = nginx
    cfg = RouterConfig(kind="file", path=str(include), format="template",
                       header="upstream vllm {\n", line="    server {host}:{port};\n",
                       footer="}\n", reload_command="exit 1")
    ok = make_router(cfg.model_copy(update={"reload_command": None}))
    ok.add(target("gpu1", 1))
    before = include.read_text()
    with pytest.raises(RouterError):
        make_router(cfg).add(target("gpu2", 2))
    assert include.read_text() == before
