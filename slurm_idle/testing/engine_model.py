"""The capacity model of one emulated vLLM replica, and its metrics in vLLM's v1 names.

Pure and clock-free: `EngineModel.step(dt, arrivals)` advances the simulation by `dt`
seconds, so tests drive it deterministically while the HTTP emulator drives it from a
timer thread. Capacity: at most `max_num_seqs` sequences run at once, each decodes at
`seq_tokens_per_s`, all together at most `tokens_per_s`; excess requests wait in a queue.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from enum import Enum

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# vLLM's own bucket boundaries (vllm/v1/metrics/loggers.py).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
               5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                   50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
FINISHED_REASONS = ("stop", "length", "abort")
SLEEP_STATES = ("awake", "weights_offloaded", "discard_all")


class SleepState(Enum):
    AWAKE = "awake"
    WEIGHTS_OFFLOADED = "weights_offloaded"  # sleep level 1
    DISCARD_ALL = "discard_all"  # sleep level 2


@dataclass(frozen=True)
class Capacity:
    """What one replica can do; defaults make 0.2 req/s need 1 replica and 500 req/s drown 4."""

    max_num_seqs: int = 16
    tokens_per_s: float = 500.0  # generation tokens/s of the whole replica
    seq_tokens_per_s: float = 50.0  # decode speed of one sequence (inter-token latency 20 ms)
    prefill_tokens_per_s: float = 10000.0
    prompt_tokens: int = 200  # of a simulated (load) request
    output_tokens: int = 100

    @property
    def requests_per_s(self) -> float:
        """Sustained completions/s of simulated requests at full load."""
        return self.tokens_per_s / self.output_tokens

    def weighted_tokens_per_s(self, prompt_token_weight: float = 0.1) -> float:
        """Capacity in the planner's unit: generation + weight * prompt tokens per second."""
        return self.requests_per_s * (self.output_tokens + prompt_token_weight * self.prompt_tokens)


@dataclass
class Request:
    prompt_tokens: int
    max_tokens: int
    arrived: float
    started: float | None = None
    first_token: float | None = None
    generated: float = 0.0
    finished_reason: str | None = None
    done: object = None  # an event the emulator sets when the request finished
    # A simulated request's client is the model's own (it gives up after client_timeout_s);
    # an HTTP request's is real: it times out on its own and the emulator cancels it then.
    simulated: bool = False


@dataclass
class EngineModel:
    """One replica's queue, running batch, counters and histograms."""

    model_name: str
    capacity: Capacity = field(default_factory=Capacity)
    now: float = 0.0
    sleep: SleepState = SleepState.AWAKE
    waiting: deque[Request] = field(default_factory=deque)
    running: list[Request] = field(default_factory=list)
    # Clients give up on a request queued longer than this (HTTP timeouts), so a queue built
    # under overload drains within this time once the load falls, as it does in production.
    client_timeout_s: float = 30.0
    _carry: float = 0.0

    def __post_init__(self) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name", "engine"]
        r = self.registry
        self.g_running = Gauge("vllm:num_requests_running", "Number of requests in model execution batches.", labels, registry=r)
        self.g_waiting = Gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", labels, registry=r)
        self.g_kv = Gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", labels, registry=r)
        self.g_sleep = Gauge("vllm:engine_sleep_state", "Engine sleep state; awake = 0 means engine is sleeping; awake = 1 means engine is awake; weights_offloaded = 1 means sleep level 1; discard_all = 1 means sleep level 2.", labels + ["sleep_state"], registry=r)
        self.c_prompt = Counter("vllm:prompt_tokens", "Number of prefill tokens processed.", labels, registry=r)
        self.c_gen = Counter("vllm:generation_tokens", "Number of generation tokens processed.", labels, registry=r)
        self.c_preempt = Counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.", labels, registry=r)
        self.c_success = Counter("vllm:request_success", "Count of successfully processed requests.", labels + ["finished_reason"], registry=r)
        self.h_ttft = Histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", labels, buckets=TTFT_BUCKETS, registry=r)
        self.h_itl = Histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", labels, buckets=ITL_BUCKETS, registry=r)
        self.h_e2e = Histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", labels, buckets=REQUEST_BUCKETS, registry=r)
        self.h_queue = Histogram("vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.", labels, buckets=REQUEST_BUCKETS, registry=r)
        self._labels = {"model_name": self.model_name, "engine": "0"}
        for metric in (self.g_running, self.g_waiting, self.g_kv, self.c_prompt, self.c_gen,
                       self.c_preempt, self.h_ttft, self.h_itl, self.h_e2e, self.h_queue):
            metric.labels(**self._labels)  # series exist from the first scrape, like vLLM's
        for reason in FINISHED_REASONS:
            self.c_success.labels(finished_reason=reason, **self._labels)
        self._update_gauges()

    # --- simulation -------------------------------------------------------------------

    @property
    def awake(self) -> bool:
        return self.sleep is SleepState.AWAKE

    def submit(self, prompt_tokens: int | None = None, max_tokens: int | None = None,
               simulated: bool = False) -> Request:
        """Queue one request (arriving now)."""
        req = Request(
            prompt_tokens=self.capacity.prompt_tokens if prompt_tokens is None else prompt_tokens,
            max_tokens=self.capacity.output_tokens if max_tokens is None else max(1, max_tokens),
            arrived=self.now, simulated=simulated,
        )
        self.waiting.append(req)
        self._admit()
        return req

    def arrivals_for(self, rps: float, dt: float) -> int:
        """Deterministic arrivals: the fractional remainder carries over to the next step."""
        self._carry += max(0.0, rps) * dt
        n = math.floor(self._carry)
        self._carry -= n
        return n

    def step(self, dt: float, rps: float = 0.0) -> list[Request]:
        """Advance by dt seconds with `rps` simulated arrivals/s; return finished requests."""
        if self.awake:
            for _ in range(self.arrivals_for(rps, dt)):
                self.submit(simulated=True)
        self.now += dt
        finished: list[Request] = []
        real: list[Request] = []  # queued as long, but their clients decide when to give up
        while self.waiting and self.now - self.waiting[0].arrived > self.client_timeout_s:
            req = self.waiting.popleft()
            if req.simulated:
                self._finish(req, "abort")
                finished.append(req)
            else:
                real.append(req)
        self.waiting.extendleft(reversed(real))
        if self.awake and self.running:
            cap = self.capacity
            total = min(len(self.running) * cap.seq_tokens_per_s, cap.tokens_per_s) * dt
            per_seq = total / len(self.running)
            for req in list(self.running):
                before = req.generated
                req.generated = min(float(req.max_tokens), req.generated + per_seq)
                self.c_gen.labels(**self._labels).inc(req.generated - before)
                if req.generated >= req.max_tokens:
                    self._finish(req, "length")
                    finished.append(req)
            self._admit()
        self._update_gauges()
        return finished

    def abort_all(self) -> list[Request]:
        """Abort everything queued or running (vLLM's /sleep default mode=abort)."""
        aborted = self.running + list(self.waiting)
        for req in aborted:
            self._finish(req, "abort")
        self.running, self.waiting = [], deque()
        self._update_gauges()
        return aborted

    def cancel(self, req: Request) -> None:
        """The client of `req` went away: vLLM aborts such a request, freeing its place."""
        if req.finished_reason is not None:
            return
        if req in self.waiting:
            self.waiting.remove(req)
        self._finish(req, "abort")
        self._admit()
        self._update_gauges()

    def go_to_sleep(self, level: int) -> None:
        self.sleep = SleepState.WEIGHTS_OFFLOADED if level == 1 else SleepState.DISCARD_ALL
        self._update_gauges()

    def wake_up(self) -> None:
        self.sleep = SleepState.AWAKE
        self._admit()
        self._update_gauges()

    @property
    def kv_cache_usage(self) -> float:
        return len(self.running) / self.capacity.max_num_seqs

    def _admit(self) -> None:
        if not self.awake:
            return
        cap = self.capacity
        while self.waiting and len(self.running) < cap.max_num_seqs:
            req = self.waiting.popleft()
            req.started = self.now
            prefill = req.prompt_tokens / cap.prefill_tokens_per_s
            req.first_token = self.now + prefill
            self.c_prompt.labels(**self._labels).inc(req.prompt_tokens)
            self.h_queue.labels(**self._labels).observe(self.now - req.arrived)
            self.h_ttft.labels(**self._labels).observe(req.first_token - req.arrived)
            self.running.append(req)

    def _finish(self, req: Request, reason: str) -> None:
        req.finished_reason = reason
        if req in self.running:
            self.running.remove(req)
        self.c_success.labels(finished_reason=reason, **self._labels).inc()
        if reason != "abort" and req.started is not None and req.first_token is not None:
            self.h_e2e.labels(**self._labels).observe(self.now - req.arrived)
            decode_s = max(0.0, self.now - req.first_token)
            self.h_itl.labels(**self._labels).observe(decode_s / max(1.0, req.generated))

    def _update_gauges(self) -> None:
        self.g_running.labels(**self._labels).set(len(self.running))
        self.g_waiting.labels(**self._labels).set(len(self.waiting))
        self.g_kv.labels(**self._labels).set(self.kv_cache_usage)
        for state in SLEEP_STATES:
            self.g_sleep.labels(sleep_state=state, **self._labels).set(
                1 if self.sleep.value == state else 0
            )

    def render(self) -> bytes:
        """The /metrics page in Prometheus text format."""
        return generate_latest(self.registry)
