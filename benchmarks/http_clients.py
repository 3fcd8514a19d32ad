"""Closed-loop HTTP clients for serve_bench, in a process of their own (standard library only).

    echo '{"url": ..., "requests": [[body, ...], ...]}' | python benchmarks/http_clients.py

Each client (a thread) sends its request bodies to POST /v1/completions one after another, streamed,
and times them: TTFT is the first chunk that carries text, the token count the final chunk's usage.
Prints one JSON object: {"done": [{"ttft", "tokens", "stream_tps"}, ...], "wall_s", "errors"}.
Real clients are other processes; threads in the server's own process would take its interpreter
lock from the worker thread and the event loop, and the measurement would charge that to the server.
"""
from __future__ import annotations

import http.client
import json
import sys
import threading
import time
from urllib.parse import urlparse


def run(url: str, requests: list[list[dict]]) -> dict:
    host = urlparse(url)
    done, errors = [], []

    def client(bodies):
        conn = http.client.HTTPConnection(host.hostname, host.port, timeout=600)
        for body in bodies:
            t0 = time.perf_counter()
            conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
            resp = conn.getresponse()
            if resp.status != 200:
                errors.append(f"HTTP {resp.status}: {resp.read()[:200]!r}")
                return
            first, n = None, 0
            for line in resp:
                line = line.strip()
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                d = json.loads(line[6:])
                if "error" in d:
                    errors.append(str(d["error"]))
                    return
                if first is None and d["choices"][0]["text"]:
                    first = time.perf_counter()
                if d.get("usage"):
                    n = d["usage"]["completion_tokens"]
            now = time.perf_counter()
            first = first or now
            done.append(dict(ttft=first - t0, tokens=n, stream_tps=(n - 1) / (now - first) if now > first else 0.0))
        conn.close()

    threads = [threading.Thread(target=client, args=(bodies,)) for bodies in requests]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return dict(done=done, wall_s=time.perf_counter() - t0, errors=errors)


if __name__ == "__main__":
    spec = json.load(sys.stdin)
    json.dump(run(spec["url"], spec["requests"]), sys.stdout)
