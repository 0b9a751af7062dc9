"""The vLLM emulator's HTTP API (emulator.py holds the engine's state and the process).

The replies are plain functions of the emulator's state; `AsyncServer` serves them on one
asyncio loop (asynchttp.py), as vLLM's uvicorn does: a connection, or a completion waiting in
the engine's queue, costs a coroutine, not a thread. Only the calls that block
(`/sleep?mode=wait`, the shutdown) take one of a few pool threads. A completion whose client
went away is aborted in the engine, as vLLM aborts a disconnected request.
"""

from __future__ import annotations

import asyncio
import json
import signal
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, NamedTuple
from urllib.parse import parse_qs, urlparse

from prometheus_client import CONTENT_TYPE_LATEST

from slurm_idle.engine_version import SLEEP_MODE_WAIT, supports
from slurm_idle.testing import asynchttp
from slurm_idle.testing.asynchttp import HttpRequest, Reply

if TYPE_CHECKING:
    from slurm_idle.testing.emulator import Emulator
    from slurm_idle.testing.engine_model import Request


class LoopEvent:
    """An asyncio.Event that the simulation thread can set (the event loop owns the Event)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.event = asyncio.Event()

    def set(self) -> None:
        try:
            self.loop.call_soon_threadsafe(self.event.set)
        except RuntimeError:
            pass  # the loop is closed: the emulator is stopping and nobody waits


JSON = "application/json"


def _json(code: int, obj: Any) -> Reply:
    return code, json.dumps(obj).encode(), JSON


def models_reply(emu: Emulator) -> dict[str, Any]:
    """GET /v1/models as vLLM answers it: a model card per served name, each rooted at the
    model (the first name)."""
    root = emu.model.model_name
    return {"object": "list", "data": [{
        "id": name, "object": "model", "created": int(time.time()), "owned_by": "vllm",
        "root": root, "parent": None, "max_model_len": 8192} for name in emu.served_names]}


def serves(emu: Emulator, name: object) -> bool:
    """Whether a completion naming `name` is this server's: any of its served names."""
    return name in emu.served_names


def get_reply(emu: Emulator, path: str) -> Reply:
    if path == "/metrics":
        with emu.lock:
            body = emu.model.render()
        return 200, body, CONTENT_TYPE_LATEST
    if path == "/health":
        return 200, b"", "text/plain"
    if path == "/is_sleeping":
        with emu.lock:
            return _json(200, {"is_sleeping": not emu.model.awake})
    if path == "/v1/models":
        return _json(200, models_reply(emu))
    if path == "/version":
        return _json(200, {"version": emu.vllm_version})
    return _json(404, {"detail": "Not Found"})


def lifecycle_reply(emu: Emulator, path: str, query: dict[str, str]) -> Reply:
    """POST /sleep and /wake_up (blocks: /sleep?mode=wait waits for the engine to drain)."""
    if path == "/sleep":
        try:
            level = int(query.get("level", "1"))
        except ValueError:
            level = 0
        mode = query.get("mode", "abort")
        if not supports(emu.vllm_version, SLEEP_MODE_WAIT):
            mode = "abort"  # an old server never looks at `mode`
        if level not in (1, 2) or mode not in ("abort", "wait", "keep"):
            return _json(400, {"detail": "level must be 1|2, mode abort|wait|keep"})
        emu.sleep(level, mode)
        return 200, b"", "text/plain"
    if path == "/wake_up":
        error = emu.wake_up()
        if error is not None:  # vLLM's exception handler: ErrorResponse (since 0.10.1)
            return _json(500, {"error": {"message": error, "type": "InternalServerError",
                                         "param": None, "code": 500}})
        return 200, b"", "text/plain"
    return _json(404, {"detail": "Not Found"})


class Ask(NamedTuple):
    prompt_tokens: int
    max_tokens: int


def parse_completion(emu: Emulator, raw: bytes) -> Reply | Ask:
    """What a completion request asks for, or the error reply."""
    try:
        body = json.loads(raw or b"{}")
    except ValueError:
        return _json(400, {"error": {"message": "invalid JSON", "type": "BadRequestError", "code": 400}})
    if not isinstance(body, dict):
        return _json(400, {"error": {"message": "expected a JSON object", "type": "BadRequestError",
                                     "code": 400}})
    if not serves(emu, body.get("model", emu.model.model_name)):
        return _json(404, {"error": {"message": f"The model `{body.get('model')}` does not exist.",
                                     "type": "NotFoundError", "code": 404}})
    prompt = body.get("prompt", "")
    text = prompt if isinstance(prompt, str) else " ".join(map(str, prompt))
    try:
        max_tokens = int(body.get("max_tokens") or 16)
    except (TypeError, ValueError):
        return _json(400, {"error": {"message": "max_tokens must be an integer",
                                     "type": "BadRequestError", "code": 400}})
    return Ask(max(1, len(text.split())), max_tokens)


def completion_reply(emu: Emulator, req: Request | None, prompt_tokens: int) -> Reply:
    if req is None:
        why = "server is shutting down" if emu.shutting_down else "engine is sleeping"
        return _json(503, {"error": {"message": why, "type": "ServiceUnavailable", "code": 503}})
    generated = int(req.generated)
    return _json(200, {
        "id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion",
        "created": int(time.time()), "model": emu.model.model_name,
        "choices": [{"index": 0, "text": " tok" * generated, "logprobs": None,
                     "finish_reason": req.finished_reason or "abort"}],
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": generated,
                  "total_tokens": prompt_tokens + generated},
    })


class AsyncServer:
    """The emulator's HTTP server on one asyncio loop (see the module docstring)."""

    BLOCKING_WORKERS = 4
    GONE_CHECK_S = 0.5

    def __init__(self, emu: Emulator) -> None:
        self.emu = emu
        self.pool = ThreadPoolExecutor(self.BLOCKING_WORKERS, thread_name_prefix="blocking")
        self.queued: dict[int, tuple[Request, HttpRequest]] = {}  # id(req): waiting completions
        self._sweeper: asyncio.Task[None] | None = None

    async def handle(self, request: HttpRequest) -> Reply | None:
        url = urlparse(request.target)
        if request.method == "GET":
            return get_reply(self.emu, url.path)
        if request.method != "POST":
            return _json(405, {"detail": "Method Not Allowed"})
        loop = asyncio.get_running_loop()
        if url.path != "/v1/completions":
            query = {k: v[-1] for k, v in parse_qs(url.query).items()}
            return await loop.run_in_executor(self.pool, lifecycle_reply, self.emu, url.path, query)
        ask = parse_completion(self.emu, request.body)
        if not isinstance(ask, Ask):
            return ask
        done = LoopEvent(loop)
        req = self.emu.admit(ask.prompt_tokens, ask.max_tokens, done)
        if req is not None:
            self.queued[id(req)] = (req, request)
            try:
                await done.event.wait()
            finally:
                self.queued.pop(id(req), None)
            if request.gone():
                return None
        return completion_reply(self.emu, req, ask.prompt_tokens)

    async def _sweep(self) -> None:
        """Abort the requests whose clients went away (one pass for all, not a timer each)."""
        while True:
            await asyncio.sleep(self.GONE_CHECK_S)
            for req, request in list(self.queued.values()):
                if request.gone():
                    self.emu.cancel(req)

    async def start(self, host: str, port: int) -> asyncio.Server:
        server = await asynchttp.start(self.handle, host, port)
        self._sweeper = asyncio.get_running_loop().create_task(self._sweep())
        return server

    def close(self, server: asyncio.Server) -> None:
        server.close()
        if self._sweeper is not None:
            self._sweeper.cancel()
        self.pool.shutdown(wait=False, cancel_futures=True)

    async def serve(self, host: str, port: int, shutdown_timeout_s: float,
                    on_listening: Callable[[int], None]) -> None:
        """Serve until SIGTERM/SIGINT, then stop like vLLM (see the module docstring)."""
        loop = asyncio.get_running_loop()
        server = await self.start(host, port)
        on_listening(server.sockets[0].getsockname()[1])
        stopped = asyncio.Event()
        stopping: list[asyncio.Task[None]] = []  # holds the task (the loop keeps a weak one)

        async def graceful() -> None:
            await loop.run_in_executor(self.pool, self.emu.shutdown, shutdown_timeout_s)
            await asyncio.sleep(0.2)  # the aborted requests' answers leave before the sockets close
            stopped.set()

        def on_signal() -> None:
            if not self.emu.shutting_down:
                self.emu.shutting_down = True
                stopping.append(loop.create_task(graceful()))

        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, on_signal)
        try:
            await stopped.wait()
        finally:
            self.close(server)


def serve_in_thread(emu: Emulator, host: str = "127.0.0.1") -> tuple[int, Callable[[], None]]:
    """The same server on a loop in a thread of its own (tests): its port, and a stop."""
    loop = asyncio.new_event_loop()
    srv = AsyncServer(emu)
    server = loop.run_until_complete(srv.start(host, 0))
    thread = threading.Thread(target=loop.run_forever, name="emulator-http", daemon=True)
    thread.start()

    def stop() -> None:
        loop.call_soon_threadsafe(srv.close, server)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)

    return server.sockets[0].getsockname()[1], stop
