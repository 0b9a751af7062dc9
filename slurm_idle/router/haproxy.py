"""`router: haproxy`: HAProxy's runtime API on its admin socket.

`set server BACKEND/SERVER state drain` takes a replica out of load balancing (connections
already open finish; health checks go on), `state ready` puts it back, and `show servers
state BACKEND` is read back each tick. The server name comes from a template (`{node}` by
default), the backend from `router.backend`. The socket needs `level admin` in haproxy.cfg.

A replica job (placement jobs) runs wherever Slurm put it: each has its own server slot,
declared once in haproxy.cfg (`server-template` or one `server NAME 127.0.0.1:1 disabled` per
replica index, named by `router.server`, e.g. "{model}-{index}"), and before `state ready`
the slot gets the job's address (`set server B/S addr IP port PORT`); at retire it is drained
like a node's, before the job is cancelled.
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Sequence

from slurm_idle.config import RouterConfig
from slurm_idle.errors import RouterError
from slurm_idle.router import IN, MISSING, OUT, RouterTarget, fill

#: srv_admin_state bits that hold a server out of load balancing (HAProxy's SRV_ADMF_*:
#: forced/inherited/config/resolution/health maintenance, forced/inherited drain).
OUT_BITS = 0x01 | 0x02 | 0x04 | 0x08 | 0x10 | 0x20 | 0x40

Send = Callable[[str], str]


def unix_send(path: str, timeout_s: float) -> Send:
    """One runtime API command per connection (non-interactive mode: HAProxy answers and
    closes), the answer as text."""

    def send(command: str) -> str:
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.settimeout(timeout_s)
                s.connect(path)
                s.sendall(command.encode() + b"\n")
                chunks = []
                while chunk := s.recv(65536):
                    chunks.append(chunk)
        except OSError as exc:
            raise RouterError(f"haproxy admin socket {path}: {exc.strerror or exc}; is HAProxy "
                              "running with `stats socket PATH level admin`?") from None
        return b"".join(chunks).decode(errors="replace")

    return send


def parse_servers_state(text: str) -> dict[tuple[str, str], tuple[int, int]]:
    """`show servers state` -> {(backend, server): (op_state, admin_state)} (pure).

    Format 1: a version line, a `#` header naming the columns, then one line per server.
    """
    lines = [line for line in text.splitlines() if line.strip()]
    if not lines or lines[0].strip() != "1":
        raise RouterError(f"haproxy: unexpected `show servers state` answer: {text.strip()[:200]!r}")
    columns: list[str] = []
    out: dict[tuple[str, str], tuple[int, int]] = {}
    for line in lines[1:]:
        if line.startswith("#"):
            columns = line.lstrip("# ").split()
            continue
        fields = line.split()
        try:
            row = dict(zip(columns, fields, strict=False))
            out[(row["be_name"], row["srv_name"])] = (int(row["srv_op_state"]),
                                                      int(row["srv_admin_state"]))
        except (KeyError, ValueError):
            raise RouterError(f"haproxy: cannot read server line {line!r}") from None
    return out


class HaproxyRouter:
    kind = "haproxy"

    def __init__(self, config: RouterConfig, send: Send | None = None,
                 resolve: Callable[[str], str] = socket.gethostbyname) -> None:
        assert config.admin_socket is not None  # the config validator requires it
        self.config = config
        self.send = send or unix_send(config.admin_socket, config.timeout_s)
        self.resolve = resolve  # HAProxy's `addr` takes an IP address

    def names(self, target: RouterTarget) -> tuple[str, str]:
        return fill(self.config.backend, target), fill(self.config.server, target)

    def _set(self, target: RouterTarget, state: str) -> None:
        backend, server = self.names(target)
        answer = self.send(f"set server {backend}/{server} state {state}").strip()
        if answer:  # success is an empty answer; anything else is HAProxy's error text
            raise RouterError(f"haproxy: set server {backend}/{server} state {state}: {answer}")

    def remove(self, target: RouterTarget) -> None:
        self._set(target, "drain")

    def add(self, target: RouterTarget) -> None:
        if target.moves:
            self._set_address(target)
        self._set(target, "ready")

    def _set_address(self, target: RouterTarget) -> None:
        """Point a replica job's server slot at where the job runs now."""
        backend, server = self.names(target)
        try:
            ip = self.resolve(target.host)
        except OSError as exc:
            raise RouterError(f"haproxy: cannot resolve {target.host} for {backend}/{server}: "
                              f"{exc}") from None
        command = f"set server {backend}/{server} addr {ip} port {target.port}"
        answer = self.send(command).strip()
        # HAProxy says what changed ("IP changed from ...", "no need to change ..."), or why not.
        if answer and "change" not in answer.lower():
            raise RouterError(f"haproxy: {command}: {answer}")

    def state(self, targets: Sequence[RouterTarget]) -> dict[str, str]:
        servers: dict[tuple[str, str], tuple[int, int]] = {}
        for backend in sorted({self.names(t)[0] for t in targets}):
            servers.update(parse_servers_state(self.send(f"show servers state {backend}")))
        out = {}
        for t in targets:
            found = servers.get(self.names(t))
            out[t.name] = MISSING if found is None else (OUT if found[1] & OUT_BITS else IN)
        return out
