"""vLLM metric names and labels, in one place, so a rename in vLLM is a one-line change here.

Names are those of the v1 engine (`vllm/v1/metrics/loggers.py`; labels `model_name` and
`engine`, one `engine` value per data-parallel engine core). Where vLLM renamed a metric, the
older name is listed as a fallback so servers of older releases still read correctly.
"""

from __future__ import annotations

from typing import Final

MODEL_LABEL: Final = "model_name"
ENGINE_LABEL: Final = "engine"
SLEEP_STATE_LABEL: Final = "sleep_state"

RUNNING: Final = "vllm:num_requests_running"
WAITING: Final = "vllm:num_requests_waiting"
KV_CACHE_USAGE: Final = "vllm:kv_cache_usage_perc"
#: Before vLLM 0.9 the KV-cache gauge was called this (deprecated, hidden from 0.11).
KV_CACHE_USAGE_LEGACY: Final = "vllm:gpu_cache_usage_perc"
#: Gauge with label `sleep_state`; the active state has value 1 (vLLM >= 0.10 with sleep mode).
SLEEP_STATE: Final = "vllm:engine_sleep_state"
SLEEP_AWAKE: Final = "awake"
SLEEP_STATES: Final = ("awake", "weights_offloaded", "discard_all")

#: Counters, as sample names (the family is the name without `_total`).
PROMPT_TOKENS: Final = "vllm:prompt_tokens_total"
GENERATION_TOKENS: Final = "vllm:generation_tokens_total"

#: Histograms (family names; samples are `<name>_bucket`, `_count`, `_sum`).
TTFT: Final = "vllm:time_to_first_token_seconds"
QUEUE_TIME: Final = "vllm:request_queue_time_seconds"

#: Every gauge we read, and the sample names of the counters and histogram buckets.
GAUGES: Final = (RUNNING, WAITING, KV_CACHE_USAGE, KV_CACHE_USAGE_LEGACY, SLEEP_STATE)
COUNTERS: Final = (PROMPT_TOKENS, GENERATION_TOKENS)
HISTOGRAMS: Final = (TTFT, QUEUE_TIME)
