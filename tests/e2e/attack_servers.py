"""What an unprivileged user runs against the service in tests/e2e/test_attacks.py (stdlib only,
so any user's python3 runs it: `python3 attack_servers.py KIND PORT`).

- `nan`: a fake vLLM /metrics page on a lent node's freed port: every load gauge and counter
  NaN (or negative), under the served model's name, so Prometheus sums it into the model.
- `squat`: something else answering /health 200 on a reclaimed node's port (and /metrics with
  a quiet engine), but it is not vLLM: /v1/models lists no such model.
- `trickle`: a metrics page sent one byte every 2 s (a per-read timeout never fires).
- `model`: a squatter that looks like the engine by name: /health 200, /v1/models lists the
  served model, completions answered (and counted: GET /squatter-count says how many reached it).
"""

from __future__ import annotations

import json
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

MODEL = "sandbox-model"


def nan_page() -> str:
    labels = f'model_name="{MODEL}",engine="0"'
    lines = []
    for name, kind in (("vllm:num_requests_running", "gauge"), ("vllm:num_requests_waiting", "gauge"),
                       ("vllm:kv_cache_usage_perc", "gauge"),
                       ("vllm:prompt_tokens_total", "counter"),
                       ("vllm:generation_tokens_total", "counter")):
        lines += [f"# TYPE {name} {kind}", f"{name}{{{labels}}} NaN"]
    lines += [f"vllm:engine_sleep_state{{{labels},sleep_state=\"awake\"}} 1"]
    return "\n".join(lines) + "\n"


def quiet_page() -> str:
    labels = f'model_name="{MODEL}",engine="0"'
    return "\n".join([
        f"vllm:num_requests_running{{{labels}}} 0", f"vllm:num_requests_waiting{{{labels}}} 0",
        f"vllm:kv_cache_usage_perc{{{labels}}} 0",
        f"vllm:engine_sleep_state{{{labels},sleep_state=\"awake\"}} 1",
    ]) + "\n"


class Handler(BaseHTTPRequestHandler):
    kind = "nan"
    completions = 0  # POSTs answered (the `model` squatter's prompts from the router)

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        Handler.completions += 1
        self._send(200, json.dumps({"object": "text_completion", "model": MODEL, "choices": [
            {"index": 0, "text": " stolen", "finish_reason": "length"}]}), "application/json")

    def log_message(self, *args: object) -> None:
        pass

    def _send(self, status: int, body: str, ctype: str = "text/plain") -> None:
        data = body.encode()
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        if self.kind == "trickle":
            page = quiet_page().encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(page)))
            self.end_headers()
            for byte in page:
                self.wfile.write(bytes([byte]))
                self.wfile.flush()
                time.sleep(2)
            return
        if self.path.startswith("/metrics"):
            self._send(200, nan_page() if self.kind == "nan" else quiet_page())
        elif self.path.startswith("/squatter-count"):
            self._send(200, str(Handler.completions))
        elif self.path.startswith("/v1/models"):
            listed = MODEL if self.kind == "model" else "not-the-model"
            self._send(200, json.dumps({"object": "list", "data": [{"id": listed}]}),
                       "application/json")
        else:
            self._send(200, "ok")  # /health, /is_sleeping ...: whatever the agent asks


def main() -> None:
    kind, port = sys.argv[1], int(sys.argv[2])
    Handler.kind = kind
    ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()


if __name__ == "__main__":
    main()
