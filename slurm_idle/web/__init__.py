"""`slurm-idle web`: a read-only view of the pool, the jobs and the pipelines (extra `web`).

Flask + Jinja2: a small, long-maintained WSGI framework whose templates escape by default,
synchronous like the rest of slurm-idle (subprocess calls to Slurm, blocking HTTP to
Prometheus), with a test client that needs no server. Waitress serves it (pure Python,
production-grade, no C build). Plots are PNGs drawn here with matplotlib; the pages load
nothing from elsewhere (no CDN, no JavaScript framework).

Only GET routes exist: the view changes nothing. It has no login of its own: it binds
127.0.0.1 by default; a site exposes it behind its SSO / reverse proxy (docs/admin.md, "The web view, for a site").
"""

from __future__ import annotations

from typing import Any

from slurm_idle.errors import BadInput, SlurmIdleError


def create_app(data: Any, timezone: str = "UTC", user_header: str | None = None,
               local_user: str | None = None) -> Any:
    """The Flask app over a `PoolData` (slurm_idle.web.data); needs the `web` extra."""
    try:
        from slurm_idle.web.app import make_app
    except ImportError:
        raise SlurmIdleError(
            "`slurm-idle web` needs the web extra: pip install 'slurm-idle[web]'"
        ) from None
    return make_app(data, timezone, user_header=user_header, local_user=local_user)


def check_bindable(host: str, port: int) -> None:
    """BadInput (exit 2) naming the port when HOST:PORT cannot be listened on (in use, or an
    address this machine does not have): said before anything claims to be serving."""
    import socket

    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as exc:
        raise BadInput(f"--host {host}: cannot resolve it ({exc.strerror})") from None
    with socket.socket(family, kind, proto) as sock:
        # As the server will: a port left in TIME_WAIT is free, a listening one is not.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(address)
        except OSError as exc:
            raise BadInput(f"cannot listen on {host}:{port}: {exc.strerror} (is another "
                           "`slurm-idle web` running? choose another --port)") from None


def serve(app: Any, host: str, port: int, threads: int = 4) -> None:
    """Serve with waitress until interrupted."""
    try:
        import waitress
    except ImportError:
        raise SlurmIdleError(
            "`slurm-idle web` needs the web extra: pip install 'slurm-idle[web]'"
        ) from None
    waitress.serve(app, host=host, port=port, threads=threads, ident="slurm-idle")
