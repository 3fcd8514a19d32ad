"""serve_abuse: `jaxspec serve` under hostile clients, on loopback (issue 51's load cases).

    python benchmarks/serve_abuse.py                                   # the embedded default pair
    python benchmarks/serve_abuse.py --model DIR --assistant DIR --idle 1100 --big 64 --out FILE.json

Starts `python -m jaxspec serve` on a free loopback port with its open-file limit set to --fd-limit
(soft and hard, in the server's process only; this process raises its own soft limit to hold the
idle sockets), waits for /health, then runs two phases:

1. idle: --idle TCP connections that never send a byte, held --hold seconds (more than the
   server's descriptors allow when --idle > --fd-limit);
2. big: --big clients at once, each POSTing a --big-bytes text prompt (random words).

During each phase /health is polled on a fresh connection every --poll seconds; a poll that gets no
200 within 5 s is a failure (counted at 5 s). Per phase it reports /health's worst and median
latency and failures, the server's open descriptors at most (/proc, Linux), the server log's new
lines and tracebacks, and what the clients got (for the idle phase: how many of the held sockets
the server had closed by the end). Prints one JSON object (also written to --out) and a summary.
Bounded: every loop has a count or a deadline; nothing leaves loopback.
"""
from __future__ import annotations

import argparse
import collections
import http.client
import json
import os
import random
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HEALTH_TIMEOUT_S = 5.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`jaxspec serve` in a subprocess with RLIMIT_NOFILE = fd_limit; its log in a temporary file."""

    def __init__(self, argv: list[str], fd_limit: int, start_timeout: float):
        self.port = free_port()
        self.log = tempfile.NamedTemporaryFile("w+", suffix=".log")
        env = dict(os.environ, PYTHONPATH=REPO)
        env.setdefault("JAX_PLATFORMS", "cpu")

        def limit():
            resource.setrlimit(resource.RLIMIT_NOFILE, (fd_limit, fd_limit))
        self.proc = subprocess.Popen([sys.executable, "-m", "jaxspec", "serve", "--host", "127.0.0.1", "--port",
                                      str(self.port), *argv], cwd=REPO, env=env, stdout=self.log,
                                     stderr=subprocess.STDOUT, preexec_fn=limit)
        deadline = time.monotonic() + start_timeout
        while True:
            if self.proc.poll() is not None:
                raise SystemExit(f"the server exited ({self.proc.returncode}):\n{self.output()}")
            if health(self.port)[0] == 200:
                break
            if time.monotonic() > deadline:
                self.stop()
                raise SystemExit(f"the server did not answer /health within {start_timeout} s:\n{self.output()}")
            time.sleep(0.5)

    def output(self) -> str:
        with open(self.log.name, errors="replace") as f:
            return f.read()

    def lines(self) -> int:
        return len(self.output().splitlines())

    def fds(self) -> int | None:
        try:
            return len(os.listdir(f"/proc/{self.proc.pid}/fd"))
        except OSError:
            return None

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=30)


def health(port: int) -> tuple[int | None, float]:
    """(status or None, seconds) of one GET /health on a fresh connection."""
    t0 = time.monotonic()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=HEALTH_TIMEOUT_S)
    try:
        conn.request("GET", "/health")
        r = conn.getresponse()
        r.read()
        return r.status, time.monotonic() - t0
    except (OSError, http.client.HTTPException):
        return None, max(time.monotonic() - t0, HEALTH_TIMEOUT_S)
    finally:
        conn.close()


class Watch:
    """Polls /health and the server's descriptor count in a thread until stopped."""

    def __init__(self, server: Server, every: float):
        self.server, self.every = server, every
        self.latencies, self.failures, self.fds = [], 0, []
        self.running = True
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        while self.running:
            status, seconds = health(self.server.port)
            self.latencies.append(seconds)
            self.failures += status != 200
            n = self.server.fds()
            if n is not None:
                self.fds.append(n)
            time.sleep(self.every)

    def stop(self) -> dict:
        self.running = False
        self.thread.join(HEALTH_TIMEOUT_S + 5)
        lat = self.latencies or [float("nan")]
        return {"health_polls": len(self.latencies), "health_failures": self.failures,
                "health_worst_s": round(max(lat), 4), "health_median_s": round(statistics.median(lat), 4),
                "server_fds_max": max(self.fds) if self.fds else None}


def phase(server: Server, every: float, work) -> dict:
    """Run `work()` (returns a dict) with /health watched; adds the log's new lines and tracebacks."""
    before = server.output().splitlines()
    watch = Watch(server, every)
    try:
        got = work()
    finally:
        stats = watch.stop()
    new = server.output().splitlines()[len(before):]
    return {**got, **stats, "log_lines": len(new), "log_tracebacks": sum("Traceback" in line for line in new),
            "log_sample": new[:3]}


def idle_phase(port: int, n: int, hold: float) -> dict:
    socks, failed = [], 0
    for _ in range(n):
        try:
            socks.append(socket.create_connection(("127.0.0.1", port), timeout=5))
        except OSError:
            failed += 1
    time.sleep(hold)
    closed = 0
    for s in socks:  # closed by the server: readable with nothing to read (or reset)
        s.setblocking(False)
        try:
            closed += s.recv(1) == b""
        except BlockingIOError:
            pass
        except OSError:
            closed += 1
        s.close()
    return {"idle_opened": len(socks), "idle_connect_failures": failed, "idle_closed_by_server": closed}


def big_phase(port: int, n: int, size: int, seed: int) -> dict:
    rng = random.Random(seed)
    words = ["def", "return", "class", "import", "self", "value", "data", "for", "in", "x", "print"]
    text = []
    length = 0
    while length < size:  # one text, random words, shared by every client (their bodies are what count)
        w = rng.choice(words)
        text.append(w)
        length += len(w) + 1
    body = json.dumps({"prompt": " ".join(text)[:size], "max_tokens": 4}).encode()
    statuses = collections.Counter()
    seconds = []

    def client():
        t0 = time.monotonic()
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
        try:
            conn.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
            r = conn.getresponse()
            r.read()
            statuses[r.status] += 1
        except (OSError, http.client.HTTPException) as e:
            statuses[type(e).__name__] += 1
        finally:
            conn.close()
            seconds.append(time.monotonic() - t0)
    threads = [threading.Thread(target=client) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(330)
    return {"big_clients": n, "big_body_bytes": len(body), "big_statuses": dict(statuses),
            "big_slowest_s": round(max(seconds), 3) if seconds else None}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", metavar="DIR")
    p.add_argument("--assistant", metavar="DIR")
    p.add_argument("--fd-limit", type=int, default=1024, help="the server's RLIMIT_NOFILE (default 1024)")
    p.add_argument("--idle", type=int, default=1100, help="idle connections held at once (default 1100)")
    p.add_argument("--hold", type=float, default=10.0, help="seconds the idle connections are held (default 10)")
    p.add_argument("--big", type=int, default=64, help="concurrent large text prompts (default 64)")
    p.add_argument("--big-bytes", type=int, default=1_000_000, help="characters per large prompt (default 1e6)")
    p.add_argument("--poll", type=float, default=0.1, help="seconds between /health polls (default 0.1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--start-timeout", type=float, default=900.0)
    p.add_argument("--out", metavar="FILE", help="also write the JSON here")
    p.add_argument("--log", metavar="FILE", help="also keep the server's log here")
    p.add_argument("serve_args", nargs="*", help="more `jaxspec serve` flags (after --)")
    args = p.parse_args(argv)

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = args.idle + args.big + 256
    if soft != resource.RLIM_INFINITY and soft < need:  # this side holds every idle socket
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(need, hard), hard))
    model = (["--model", args.model] + (["--assistant", args.assistant] if args.assistant else [])
             if args.model else [])
    t0 = time.monotonic()
    server = Server(model + args.serve_args, args.fd_limit, args.start_timeout)
    try:
        result = {"fd_limit": args.fd_limit, "startup_s": round(time.monotonic() - t0, 1),
                  "model": args.model or "embedded default pair", "serve_args": args.serve_args}
        result["idle"] = phase(server, args.poll, lambda: idle_phase(server.port, args.idle, args.hold))
        result["big"] = phase(server, args.poll, lambda: big_phase(server.port, args.big, args.big_bytes, args.seed))
        status, _ = health(server.port)
        result["health_after"] = status
        result["server_alive"] = server.proc.poll() is None
    finally:
        server.stop()
        if args.log:
            with open(args.log, "w") as f:
                f.write(server.output())
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    for name in ("idle", "big"):
        r = result[name]
        print(f"{name}: /health worst {r['health_worst_s']} s (median {r['health_median_s']} s, "
              f"{r['health_failures']}/{r['health_polls']} failed), server fds <= {r['server_fds_max']}, "
              f"log +{r['log_lines']} lines ({r['log_tracebacks']} tracebacks)", file=sys.stderr)
    return 0 if result["server_alive"] and result["health_after"] == 200 else 1


if __name__ == "__main__":
    sys.exit(main())
