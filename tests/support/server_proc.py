"""Shared by the tests (moved from tests/serve/test_server.py: no test module imports another)."""
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from support.cli_run import CACHE
from support.paths import REPO


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Running:
    def __init__(self, *args, api_key=None):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu")
        env.pop("JAX_COMPILATION_CACHE_DIR", None)
        env.pop("JAXSPEC_API_KEY", None)
        if api_key:
            env["JAXSPEC_API_KEY"] = api_key  # the environment, as the docs advise (not the process list)
        self.log = tempfile.NamedTemporaryFile("w+", suffix=".log")
        self.proc = subprocess.Popen([sys.executable, "-m", "jaxspec", "serve", "--port", str(self.port),
                                      "--compile-cache", CACHE, *args], cwd=REPO, env=env,
                                     stdout=self.log, stderr=subprocess.STDOUT, text=True)
        deadline = time.time() + 600  # its warm-up compiles: minutes on a loaded 2-core machine
        while True:
            assert self.proc.poll() is None, self.output()
            try:
                self.health()
                break
            except OSError:
                assert time.time() < deadline, "jaxspec serve was not ready in 600 s:\n" + self.output()[-3000:]
                time.sleep(0.3)
        import openai  # the official client (a dev dependency), as the server tests talk to it

        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key=api_key or "none", max_retries=0, timeout=300)

    def output(self) -> str:
        with open(self.log.name) as f:
            return f.read()

    def health(self) -> dict:
        with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
            return json.loads(r.read())

    def post(self, path: str, data: bytes) -> tuple[int, dict]:
        req = urllib.request.Request(self.url + path, data=data, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=300) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    def stop(self):
        self.proc.terminate()
        self.proc.wait(timeout=30)
        self.log.close()


def concurrently(server, calls) -> tuple[list, int]:
    """Run every call in a thread of its own, all at once: (their results, the most requests the
    server's /health saw active at one time meanwhile)."""
    got, busiest, running = [None] * len(calls), [0], [True]

    def one(i):
        got[i] = calls[i]()

    def watch():
        while running[0]:
            busiest[0] = max(busiest[0], server.health()["active"])
            time.sleep(0.01)
    watcher = threading.Thread(target=watch)
    watcher.start()
    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    running[0] = False
    watcher.join()
    return got, busiest[0]
