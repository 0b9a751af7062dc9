"""Client traffic through the sandbox's router, counted on the client side.

`scripts/sandbox load RPS` runs this as a sandbox process: an open-loop generator sending
`RPS` completions a second to the router (HAProxy) and appending one JSON line per finished
request to `--out`: `{"t": start, "d": seconds, "ok": bool, "why": ...}`. A request fails on a
connection error, a 5xx, a truncated answer or one the engine aborted (finish_reason `abort`),
which is what a client of a replica stopped under it sees. `summarize` turns the lines into
`{"requests", "ok", "failed", "p50_s", "p99_s"}` (optionally for a time window).

Run: python -m slurm_idle.testing.loadgen --url http://127.0.0.1:P --rps R --out FILE
"""

from __future__ import annotations

import argparse
import http.client
import json
import math
import signal
import sys
import threading
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

PROMPT_WORDS = 200  # the emulator's simulated request shape (engine_model.Capacity)
MAX_TOKENS = 100


def one_request(host: str, port: int, model: str, max_tokens: int, timeout_s: float) -> tuple[bool, str]:
    """One completion through the router: (ok, why-not)."""
    body = json.dumps({"model": model, "prompt": "word " * PROMPT_WORDS,
                       "max_tokens": max_tokens}).encode()
    conn = http.client.HTTPConnection(host, port, timeout=timeout_s)
    try:
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        data = resp.read()
    except (OSError, http.client.HTTPException) as exc:
        return False, f"connection: {type(exc).__name__}"
    finally:
        conn.close()
    if resp.status != 200:
        return False, f"http {resp.status}"
    try:
        choice = json.loads(data)["choices"][0]
    except (ValueError, KeyError, IndexError, TypeError):
        return False, "truncated"
    if choice.get("finish_reason") == "abort":
        return False, "aborted"
    return True, ""


def run(url: str, rps: float, out: Path, model: str, max_tokens: int, timeout_s: float,
        stop: threading.Event) -> None:
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    lock = threading.Lock()

    def fire(started: float) -> None:
        t0 = time.monotonic()
        ok, why = one_request(host, port, model, max_tokens, timeout_s)
        line = json.dumps({"t": round(started, 3), "d": round(time.monotonic() - t0, 4),
                           "ok": ok, "why": why})
        with lock, out.open("a") as fh:
            fh.write(line + "\n")

    interval = 1.0 / rps
    with ThreadPoolExecutor(max_workers=max(4, math.ceil(rps * (timeout_s + 1)))) as pool:
        next_at = time.monotonic()
        while not stop.is_set():
            pool.submit(fire, time.time())
            next_at += interval
            stop.wait(max(0.0, next_at - time.monotonic()))


def read_results(path: Path) -> list[dict[str, Any]]:
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        return []
    out = []
    for line in lines:
        try:
            out.append(json.loads(line))
        except ValueError:
            continue  # a line being written
    return out


def _quantile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return round(values[min(len(values) - 1, max(0, math.ceil(q * len(values)) - 1))], 4)


def summarize(results: Iterable[dict[str, Any]], since: float | None = None,
              until: float | None = None) -> dict[str, Any]:
    """Counts and latency quantiles of the requests started in [since, until)."""
    rows = [r for r in results if (since is None or r["t"] >= since)
            and (until is None or r["t"] < until)]
    ok = [r for r in rows if r["ok"]]
    why: dict[str, int] = {}
    for r in rows:
        if not r["ok"]:
            why[r["why"]] = why.get(r["why"], 0) + 1
    return {"requests": len(rows), "ok": len(ok), "failed": len(rows) - len(ok),
            "p50_s": _quantile([r["d"] for r in ok], 0.5),
            "p99_s": _quantile([r["d"] for r in ok], 0.99), "failures": why}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m slurm_idle.testing.loadgen",
                                description=__doc__.splitlines()[0])
    p.add_argument("--url", required=True, help="the router's address, e.g. http://127.0.0.1:8080")
    p.add_argument("--rps", type=float, required=True)
    p.add_argument("--out", type=Path, required=True, help="results, one JSON line per request")
    p.add_argument("--model", default="sandbox-model")
    p.add_argument("--max-tokens", type=int, default=MAX_TOKENS)
    p.add_argument("--timeout-s", type=float, default=30.0)
    args = p.parse_args(argv)
    if args.rps <= 0:
        return 0
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda s, f: stop.set())
    signal.signal(signal.SIGINT, lambda s, f: stop.set())
    run(args.url, args.rps, args.out, args.model, args.max_tokens, args.timeout_s, stop)
    return 0


if __name__ == "__main__":
    sys.exit(main())
