"""Engine kind `http-sleep`: vLLM sleep mode (`POST /sleep?level=N&mode=wait`, `POST /wake_up`);
the server keeps running, its weights leave the GPUs while lent.
"""

from __future__ import annotations

import time

from slurm_idle.config import EngineConfig, ReplicaConfig
from slurm_idle.engine.probe import (
    EngineDeadline,
    HttpDisconnected,
    HttpProbe,
    HttpTimeout,
    UrllibClient,
    _endpoint,
    _HttpHealth,
    _limit,
)
from slurm_idle.errors import EngineError
from slurm_idle.httpdeadline import HttpClient

#: Pause before asking a /wake_up whose connection was dropped once more.
WAKE_RETRY_PAUSE_S = 0.5


class HttpSleepEngine(_HttpHealth):
    """vLLM sleep mode: the server keeps running, its weights leave the GPUs while lent."""

    may_sleep = True  # a server whose sleep state is unknown may be asleep: not serving

    def __init__(self, config: EngineConfig, http: HttpClient | None = None, model: str = "") -> None:
        self.config = config
        self.model = model
        self.http = http or UrllibClient()
        self.probe = HttpProbe(self.http, config.http_timeout_s)

    def _post(self, replica: ReplicaConfig, path: str, own_s: float, given_s: float | None) -> None:
        limit, cut = _limit(own_s, given_s)
        try:
            resp = self.http.request("POST", _endpoint(replica, path), limit)
        except HttpTimeout:
            if cut:
                # vLLM carries on with a request whose client went away: the next tick finds
                # the server asleep (or awake) and has nothing more to ask, or asks again.
                raise EngineDeadline(
                    f"{replica.node}: POST {path.split('?')[0]} not answered within the tick's "
                    f"time left ({limit:g} s); the next tick checks and asks again"
                ) from None
            raise
        if resp.status != 200:
            detail = resp.body.decode(errors="replace").strip()[:200]
            hint = " (is the server run with VLLM_SERVER_DEV_MODE=1 --enable-sleep-mode?)" \
                if resp.status == 404 else ""
            raise EngineError(f"{replica.node}: POST {path} answered {resp.status} {detail}{hint}")

    def cold_restart(self, replica: ReplicaConfig, timeout_s: float | None = None) -> bool:
        """After wakes that keep failing (vLLM leaks what a failed wake had mapped, so later
        wakes can fail after the holder is gone): the site's stop_command, then its
        start_command, which starts a fresh server, awake. False when they are not both
        configured."""
        if not (self.config.start_command and self.config.stop_command):
            return False
        from slurm_idle.engine.command import CommandEngine

        cold = CommandEngine(self.config.model_copy(update={"kind": "command"}), self.model)
        cold.stop(replica, timeout_s)
        cold.start(replica, timeout_s)
        return True

    def start(self, replica: ReplicaConfig, timeout_s: float | None = None) -> None:
        health = self.health(replica)
        if health.serving:
            return
        if not health.up:
            raise EngineError(
                f"{replica.node}: vLLM at {replica.url} is not running; the http-sleep engine "
                "only wakes a running server (start it, or use engine kind command/docker)"
            )
        began = time.monotonic()
        try:
            self._post(replica, "/wake_up", self.config.start_timeout_s, timeout_s)
        except HttpDisconnected:
            # /wake_up is idempotent (vLLM's executor returns at once when it is not asleep,
            # vllm/v1/executor/abstract.py `wake_up`) and this one got no answer at all: asked
            # once more, within what is left of the caller's time, so one dropped connection
            # does not leave a reclaim waiting for the next tick.
            time.sleep(WAKE_RETRY_PAUSE_S)
            left = None if timeout_s is None else timeout_s - (time.monotonic() - began)
            if left is not None and left <= 0:
                raise
            self._post(replica, "/wake_up", self.config.start_timeout_s, left)

    def stop(self, replica: ReplicaConfig, timeout_s: float | None = None) -> None:
        health = self.health(replica)
        if health.up and health.awake is False:
            return  # already asleep: the weights have left the GPUs
        if not health.up:
            # A server that does not answer may be hung with the GPUs still full: lending on
            # that guess could hand jobs occupied GPUs. Stay LENDING; the next tick retries,
            # and a lend stuck past its timeout is reported for an admin to look at.
            raise EngineError(
                f"{replica.node}: vLLM at {replica.url} does not answer ({health.error or 'no /health'}); "
                "cannot confirm it released the GPUs, not lending"
            )
        # mode=wait lets in-flight requests finish (vLLM's default, abort, would drop them);
        # a server older than 0.17 ignores it: the driver drains it by in-flight count first.
        timeout = self.config.drain_timeout_s + self.config.stop_timeout_s
        self._post(replica, f"/sleep?level={self.config.sleep_level}&mode=wait", timeout, timeout_s)

    def released(self, replica: ReplicaConfig) -> bool:
        """The server says it is asleep: its weights have left the GPUs."""
        return self.probe.is_sleeping(replica) is True
