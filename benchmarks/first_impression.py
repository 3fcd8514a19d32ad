"""first_impression: the real model as a user meets it on a CPU, through the commands a user runs.

    python benchmarks/first_impression.py --out docs/benchmark_results/first-impression-cpu-DATE.md
    python benchmarks/first_impression.py --rounds 3 --serve-args "--max-batch 4" --out ...

Each round, alternating so that other processes' load falls on both:
- the CLI: `jaxspec generate PROMPT --model M --max-tokens N --json` (greedy): its decode tok/s and
  tokens, and the command's wall time;
- the server: `jaxspec serve --model M` started anew (the compile cache warm after the first start):
  seconds from the command to /health answering ready, then one streamed greedy completion of the
  same prompt through the official `openai` client: its decode tok/s (tokens after the first over
  the time from the first chunk to the last), and whether its text is the CLI's.
`--demo`: `make demo` (warm) wall time too. The first round is a warm-up (it fills the program
cache and the weights cache) and is reported apart. Writes a markdown table (--out) and prints it.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import socket
import subprocess
import sys
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.dirname(sys.executable)
PROMPT = "The capital of France is"


def _args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="gemma-3-270m")
    p.add_argument("--prompt", default=PROMPT)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=2, help="timed rounds after the warm-up round")
    p.add_argument("--serve-args", default="", help="more `jaxspec serve` flags (one string)")
    p.add_argument("--demo", action="store_true", help="also time a warm `make demo`")
    p.add_argument("--ready-timeout", type=float, default=900.0)
    p.add_argument("--out")
    return p.parse_args(argv)


def _load() -> str:
    return f"{os.getloadavg()[0]:.1f}"


def cli_run(a) -> dict:
    cmd = [os.path.join(BIN, "jaxspec"), "generate", a.prompt, "--model", a.model, "--max-tokens", str(a.max_tokens),
           "--json"]
    t0 = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=ROOT).stdout
    wall = time.perf_counter() - t0
    got = json.loads(out)
    return dict(wall=wall, text=got["text"], tok_s=got["stats"]["decode_tokens_per_s"], load=_load())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=5) as r:
            return r.status == 200
    except OSError:
        return False


def serve_run(a) -> dict:
    import openai

    port = _free_port()
    cmd = [os.path.join(BIN, "jaxspec"), "serve", "--model", a.model, "--port", str(port), *shlex.split(a.serve_args)]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        while not _ready(url):
            if proc.poll() is not None:
                raise RuntimeError(f"jaxspec serve exited {proc.returncode}: {proc.stderr.read()[-2000:]}")
            if time.perf_counter() - t0 > a.ready_timeout:
                raise RuntimeError("jaxspec serve was not ready in time")
            time.sleep(0.5)
        ready = time.perf_counter() - t0
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
        model = client.models.list().data[0].id
        stamps, text = [], ""
        for chunk in client.completions.create(model=model, prompt=a.prompt, max_tokens=a.max_tokens,
                                               temperature=0, stream=True):
            piece = chunk.choices[0].text if chunk.choices else ""
            if piece:
                stamps.append(time.perf_counter())
                text += piece
        # tokens: the server's usage is not streamed; count them with the CLI's stats instead (same text)
        return dict(ready=ready, text=text, stamps=stamps, load=_load())
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def demo_run() -> dict:
    t0 = time.perf_counter()
    subprocess.run(["make", "demo"], cwd=ROOT, check=True, capture_output=True)
    return dict(wall=time.perf_counter() - t0, load=_load())


def main(argv=None) -> int:
    a = _args(argv)
    rows = []
    for r in range(a.rounds + 1):
        c = cli_run(a)
        s = serve_run(a)
        # the stream's chunks are tokens' text pieces; the decode rate counts the CLI's tokens (the
        # same text) after the first over the time from the first chunk to the last
        n = a.max_tokens
        span = s["stamps"][-1] - s["stamps"][0] if len(s["stamps"]) > 1 else float("nan")
        row = dict(round="warm-up" if r == 0 else str(r), cli_wall=c["wall"], cli_tok_s=c["tok_s"], ready=s["ready"],
                   serve_tok_s=(n - 1) / span, same_text=s["text"] == c["text"], load=f"{c['load']} / {s['load']}",
                   cli_text=c["text"], serve_text=s["text"])
        if a.demo and r > 0:
            row["demo_wall"] = demo_run()["wall"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    head = ("| round | CLI decode tok/s | server decode tok/s | server / CLI | server ready s | CLI wall s | "
            "same text | load (CLI / server) |" + (" make demo s |" if a.demo else ""))
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        lines.append(f"| {r['round']} | {r['cli_tok_s']:.2f} | {r['serve_tok_s']:.2f} | "
                     f"{r['serve_tok_s'] / r['cli_tok_s']:.2f} | {r['ready']:.1f} | {r['cli_wall']:.1f} | "
                     f"{'yes' if r['same_text'] else 'no'} | {r['load']} |" +
                     (f" {r.get('demo_wall', float('nan')):.1f} |" if a.demo else ""))
    texts = [f"CLI text: {rows[-1]['cli_text']!r}", f"server text: {rows[-1]['serve_text']!r}"]
    report = "\n".join([f"`{' '.join(sys.argv)}` ({a.model}, {a.max_tokens} tokens, greedy, "
                        f"serve flags: {a.serve_args or 'none'})", "", *lines, "", *texts, ""])
    print(report)
    if a.out:
        with open(a.out, "a") as f:
            f.write(report + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
