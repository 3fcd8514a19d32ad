"""serve_bench: continuous batching under concurrent clients, the way `jaxspec serve` runs it.

    python benchmarks/serve_bench.py --target 12b --assistant 12b --clients 1,4,8,16 --k-values 1,4 --out DIR
    python benchmarks/serve_bench.py --target default --clients 1,4,8 --k-values 1,4 [--http] --out DIR
    python benchmarks/serve_bench.py --target 12b --http --clients 32 --k-values 1 --sampling uniform,mixed --out DIR

Each of N closed-loop clients sends its requests one after another (the next when the previous has
finished), all starting at once; the server's scheduling core (`jaxspec.engine.batching.BatchEngine` with
min(N, --max-slots) slots, admitting between steps in arrival order, --rounds-per-step rounds per
step as the server's worker does per chunk) serves them. HTTP and JSON are not in the timed path
(unless --http): this measures what the GPU and the engine do. Per configuration: aggregate
tokens/s (all tokens over the wall time), time to first token (arrival to the step that reports
it: the prefill and the next step's dispatch, plus any wait for a slot), per-stream tokens/s (a
request's tokens after its first over the time since its first), the engine's K (after the
exactness probe) and the speculative speedup against K = 1 at the same N.
Compilation is excluded (a warm-up request per configuration). Prompts: random ids, fresh for every
request (presets: no two share a prefix) or the default pair's held-out prompts, cycled; every request
decodes --max-tokens tokens (no stop ids).
`--http` adds, per configuration, the same clients through the HTTP server (`jaxspec.serve.app` behind
its guard on a local port, streamed completions read with http.client by client threads in a process
of their own, `http_clients.py`, as real clients would be): the engine row then uses
the server's own engine (its cache size, budget and the tokenizer's stop ids), so the two rows
differ only by HTTP, JSON and the server's worker thread. A preset has no tokenizer: its text is
the ids written out (`IdTokenizer`, no stop ids).
`--sampling`: greedy (T = 0), uniform (every request T = 0.8, top_p 0.95), mixed (request i gets
one of 16 distinct (temperature, top_p) settings and its own seed): mixed against uniform is what
sharing one batch across settings costs; penalized (greedy, every other request with presence 0.5,
frequency 0.3 and repetition 1.2 penalties): against greedy, what the penalties cost a batch.
`--step-tokens A,B,...` sweeps the engine's token budget a step (issue 66: decode rounds first, then
chunks of the waiting prompts; default: the engine's), each budget a configuration of its own, in the
sweep and in the long workload (the budget is a row's `step_tokens`, its prefill lanes `lanes`):
    python benchmarks/serve_bench.py --target 12b --k-values 1 --max-slots 32 --rounds-per-step 4 \
        --prompt-len 64 --max-tokens 64 --clients 32 --step-tokens 512,2048,8192 --http --out DIR
`--repeats N` runs each configuration N times and reports the median run (benchmarks/serve_guard.py
uses 3). `--no-prefix-cache` turns prefix reuse off (benchmarks/prefix_bench.py measures what it buys;
the sweep run with and without it is what it costs). Writes DIR/serve.json and DIR/serve.md.

`--long-prompt N` runs the long-request workload instead (issue 56): --clients[0] closed-loop clients
of exactly --prompt-len-token prompts stream (--max-tokens each, one after another; client i starts
after i x max-tokens / clients engine steps, so the streams' requests end in different steps, as
independent clients' would) for --baseline-s seconds, then one N-token request (--long-tokens new
tokens) arrives and is prefilled in chunks of --prefill-chunk tokens between their steps. Every token
is stamped when the step that reports it returns; a stream's gaps are the times between its
consecutive tokens within a request. Reported per K: the streams' p50 / p99 gap before the long
request arrived and while it ran (arrival to its last token), their ratio, the long request's time
to first token and to completion, and the stream requests' time to first token (p50, max) for those
arriving before it and while it ran. The JSON rows also hold the 20 largest gaps while it ran
(`top_gaps_during`: seconds since its arrival, gap ms, client; `long_chunk` / `chunks`: a chunk of
the long prompt / how many chunks were queued in the step whose rounds made the token, the device
time the gap mostly is; `long_chunk_reporting`: one was queued in the step that reported it, whose
first-token reads wait for its chunks). The engine's KV pool holds every stream's blocks and the
long request's. Writes DIR/serve_long.json and DIR/serve_long.md.

    python benchmarks/serve_bench.py --target 12b --long-prompt 16384 --clients 8 --prompt-len 64 \
        --max-tokens 64 --rounds-per-step 1 --k-values 1,4 --out DIR
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from harness import environment, environment_line, random_pair, write_report  # noqa: E402

from jaxspec import models  # noqa: E402
from jaxspec import default_pair as dp  # noqa: E402
from jaxspec.engine import sampling  # noqa: E402
from jaxspec.engine.batching import BatchEngine  # noqa: E402
from jaxspec.engine.loop_config import PREFILL_CHUNK  # noqa: E402
from jaxspec.serve.guard import Guard  # noqa: E402
from jaxspec.text import load_tokenizer  # noqa: E402
from jaxspec.kernels import DispatchConfig  # noqa: E402
from jaxspec.kernels.config import BACKEND_CHOICES  # noqa: E402
from jaxspec.progress import bar  # noqa: E402


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x]


def _budget(step_tokens: int | None) -> dict:
    """The engine's (or Server's) keyword for a swept budget; none for the default."""
    return {} if step_tokens is None else {"step_tokens": step_tokens}


def load(args, matmul):
    """(target, assistant or None, prompts as id lists, description)."""
    rng = np.random.default_rng(args.seed)
    if args.target == "default":
        path = dp.default_pair_path()
        if not dp.default_pair_available(path):
            raise SystemExit(f"--target default: the default pair is not installed at {path}")
        dtype = jnp.dtype(args.dtype)
        t = models.load_target(os.path.join(path, "target"), dtype=dtype, matmul=matmul)
        a = models.load_assistant(os.path.join(path, "assistant"), dtype=dtype, matmul=matmul)
        return t, a, Cycled(p["ids"] for p in dp.heldout_prompts(path)), "the default pair, its held-out prompts"
    t, a = random_pair(args.target, args.assistant, layers=args.layers, matmul=matmul, seed=args.seed)
    prompts = Prompts(rng, t.config.vocab_size, args.prompt_len // 2, args.prompt_len)
    return t, a, prompts, (f"preset {args.target}, random 4-bit weights, {args.prompt_len // 2}-{args.prompt_len}-token "
                           "prompts, a fresh one for every request")


class Prompts:
    """A preset sweep's prompts: fresh random ids for every request `take` hands out, so no two
    requests share a first block and the prefix cache never hits (issue 70's bar compares the sweep
    with reuse on and off on requests that share nothing; the 32 prompts cycled before made a repeated
    prompt's blocks hit). `widths()`: one prompt per prefill width, for the compile warm-up."""

    def __init__(self, rng, vocab: int, lo: int, hi: int):
        self.rng, self.vocab, self.lo, self.hi = rng, vocab, lo, hi

    def _ids(self, n: int) -> list[int]:
        return self.rng.integers(2, self.vocab, int(n)).tolist()

    def take(self, count: int) -> list[list[int]]:
        return [self._ids(n) for n in self.rng.integers(self.lo, self.hi + 1, count)]

    def widths(self) -> list[list[int]]:
        return [self._ids(max(self.lo, min(self.hi, 16 * w))) for w in range(-(-self.lo // 16), -(-self.hi // 16) + 1)]


class Cycled(list):
    """The default pair's held-out prompts, cycled in the same order by every run."""

    def take(self, count: int) -> list[list[int]]:
        return [self[i % len(self)] for i in range(count)]

    def widths(self) -> list[list[int]]:
        return list({-(-len(p) // 16): p for p in self}.values())


class IdTokenizer:
    """A stand-in tokenizer for presets (random weights have no vocabulary): text is the ids
    written out, no stop ids. What `jaxspec.serve.app` needs of one."""

    eos_token_ids = ()

    def decode(self, ids, skip_special_tokens=True):
        return "".join(f" {int(i)}" for i in ids)

    def encode(self, text, add_special_tokens=True):
        return [int(t) for t in text.split()]


MIXED = [(round(0.5 + 0.05 * i, 2), (None, 0.9, 0.95, 0.8)[i % 4]) for i in range(16)]


PENALTIES = dict(presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.2)


def setting(kind: str, i: int) -> dict:
    """Request i's sampling fields for --sampling `kind`."""
    if kind == "greedy":
        return dict(temperature=0.0)
    if kind == "penalized":  # issue 68's sweep: greedy, every other request with all three penalties
        return dict(temperature=0.0, **(PENALTIES if i % 2 else {}))
    t, p = (0.8, 0.95) if kind == "uniform" else MIXED[i % len(MIXED)]
    return dict(temperature=t, top_p=p, seed=1000 + i)


def serve(engine: BatchEngine, prompts, clients: int, per_client: int, max_tokens: int, kind: str = "greedy") -> dict:
    """Closed-loop clients against the engine; the timings of every request."""
    todo = {c: [prompts[(c * per_client + i) % len(prompts)] for i in range(per_client)] for c in range(clients)}
    queue = [(c, time.perf_counter()) for c in range(clients)]  # (client, arrival)
    owner, first, tokens, done = {}, {}, {}, []
    t0 = time.perf_counter()
    sent = 0
    while queue or engine.live:
        while queue and engine.free:
            c, arrived = queue.pop(0)
            kw = setting(kind, sent)
            sent += 1
            params = sampling.SamplingParams(**{k: v for k, v in kw.items() if k != "seed"})
            slot = engine.admit(todo[c].pop(0), max_tokens, seed=kw.get("seed", 0), params=params)
            owner[slot] = (c, arrived)
            tokens[slot] = 0
        for ev in engine.step():
            now = time.perf_counter()
            c, arrived = owner[ev.slot]
            if tokens[ev.slot] == 0 and ev.tokens:
                first[ev.slot] = now
            tokens[ev.slot] += len(ev.tokens)
            if ev.done:
                n, t1 = tokens[ev.slot], first[ev.slot]
                done.append(dict(ttft=t1 - arrived, tokens=n, stream_tps=(n - 1) / (now - t1) if now > t1 else 0.0))
                if todo[c]:
                    queue.append((c, now))
    return _summary(done, time.perf_counter() - t0)


def serve_http(url: str, prompts, clients: int, per_client: int, max_tokens: int, kind: str = "greedy") -> dict:
    """The same closed loop through the HTTP server: each client a thread streaming
    /v1/completions (token-id prompts), all in one other process (`http_clients.py`: real clients
    do not share the server's interpreter)."""
    import json
    import subprocess

    requests = [[dict(prompt=prompts[(c * per_client + i) % len(prompts)], max_tokens=max_tokens, stream=True,
                      **setting(kind, c * per_client + i)) for i in range(per_client)] for c in range(clients)]
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "http_clients.py")
    proc = subprocess.run([sys.executable, script], input=json.dumps(dict(url=url, requests=requests)),
                          capture_output=True, text=True, check=True)
    got = json.loads(proc.stdout)
    if got["errors"]:
        raise RuntimeError(f"the server answered an error: {got['errors'][0]}")
    return _summary(got["done"], got["wall_s"])


def _summary(done: list[dict], wall: float) -> dict:
    total = sum(d["tokens"] for d in done)
    ttft = sorted(d["ttft"] for d in done)
    return dict(requests=len(done), tokens=total, wall_s=wall, tokens_per_s=total / wall,
                ttft_median_s=statistics.median(ttft), ttft_p90_s=ttft[-(-9 * len(ttft) // 10) - 1],  # nearest rank
                stream_tokens_per_s=statistics.median(d["stream_tps"] for d in done))


def _http_run(server, warm_prompts, prompts, clients: int, args, kind: str) -> dict:
    """serve_http against `server` on a local port (one request per prefill width first: the
    engine compiled them already, this warms the HTTP path)."""
    http = _Http(server)
    try:
        serve_http(http.url, list(warm_prompts), 1, len(warm_prompts), 2, kind)
        return serve_http(http.url, prompts, clients, args.requests_per_client, args.max_tokens, kind)
    finally:
        http.close()


class _Http:
    """`jaxspec serve`'s app for a Server, on a free local port in a thread (uvicorn), until closed."""

    def __init__(self, server):
        import socket
        import threading

        import uvicorn

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        app = Guard(server.app(), api_key=None, max_body_bytes=1 << 20, bound_host="127.0.0.1")  # as `serve`
        self.srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
        self.thread = threading.Thread(target=self.srv.run, daemon=True)
        self.thread.start()
        while not self.srv.started:
            time.sleep(0.02)

    def close(self):
        self.srv.should_exit = True
        self.thread.join()


def _pct(xs: list[float], q: float) -> float:
    """Nearest-rank percentile (0 for no data)."""
    if not xs:
        return 0.0
    xs = sorted(xs)
    return xs[max(0, -(-int(q * len(xs)) // 100) - 1)] if q < 100 else xs[-1]


def long_request(engine: BatchEngine, clients: int, short_prompts, max_tokens: int, long_ids, long_tokens: int,
                 baseline_s: float) -> dict:
    """The long-request workload (see the module docstring): per-token timestamps of the streams,
    their gaps and their requests' times to first token before and while the long request runs, and
    the largest gaps while it runs."""
    LONG = "long"
    owner, gaps = {}, []  # slot -> (client, token stamps, request); gaps: (stamp, gap, client, step info)
    requests = []  # the short requests: {"arrived", "first"} (first: None until its first token)
    # Client c's first request waits c * max_tokens / clients engine steps. Started together, equal
    # requests end in the same step and every stream re-admits at once: a step with all the streams'
    # prefills swings the p99 before, and a long request arriving then meets no stream mid-request.
    starts = {c: c * max_tokens // clients for c in range(clients)}
    t0 = time.perf_counter()
    queue = []  # (client or LONG, arrival)
    arrive = t0 + baseline_s
    long_at = long_first = long_done = None
    long_slot, long_n, steps = None, 0, 0
    queued = dict(long_chunk=False, chunks=0)  # what the previous step queued (its rounds' tokens come now)
    while long_done is None or any(r["first"] is None and r["arrived"] <= long_done for r in requests):
        now = time.perf_counter()
        if long_done is None:  # afterwards: only the requests that arrived while it ran get their first token
            for c in [c for c, at in starts.items() if at <= steps]:
                del starts[c]
                queue.append((c, now))
            if long_at is None and now >= arrive:
                long_at = now
                queue.insert(0, (LONG, now))  # admitted next: ahead of the streams' next requests (it arrived first)
            while queue and engine.can_admit(len(long_ids) if queue[0][0] == LONG else short_prompts.hi,
                                             long_tokens if queue[0][0] == LONG else max_tokens):
                c, arrived = queue.pop(0)
                if c == LONG:
                    slot = long_slot = engine.admit(long_ids, long_tokens, seed=0)
                    req = None
                else:
                    slot = engine.admit(short_prompts.take(1)[0], max_tokens, seed=0)
                    req = dict(arrived=arrived, first=None)
                    requests.append(req)
                owner[slot] = (c, [], req)
        was = engine.prefilling[long_slot].done if long_slot in engine.prefilling else None
        chunks = engine.chunks
        events = engine.step()
        steps += 1
        now_at = engine.prefilling[long_slot].done if long_slot in engine.prefilling else len(long_ids)
        this = dict(long_chunk=was is not None and now_at > was,
                    chunks=engine.chunks - chunks)
        for ev in events:
            now = time.perf_counter()
            c, mine, req = owner[ev.slot]
            if c == LONG:
                long_n += len(ev.tokens)
                if long_first is None and ev.tokens:
                    long_first = now
                if ev.done:
                    long_done = now
                continue
            if req["first"] is None and ev.tokens:
                req["first"] = now
            for _ in ev.tokens:
                if mine:
                    gaps.append((now, now - mine[-1], c, queued, this))
                mine.append(now)
            if ev.done:
                queue.append((c, now))
        queued = this
    for slot in range(engine.slots):  # the streams still running: stopped here
        if engine.owner[slot] is not None:
            engine.cancel(slot)
    while engine.pending is not None:
        engine.step()
    warm = t0 + min(1.0, baseline_s / 4)  # the first requests' prefills are not the steady state
    before = [g for t, g, *_ in gaps if warm <= t < long_at]
    during = [g for t, g, *_ in gaps if long_at <= t <= long_done]
    ttft_before = [r["first"] - r["arrived"] for r in requests if warm <= r["arrived"] < long_at]
    ttft_during = [r["first"] - r["arrived"] for r in requests if long_at <= r["arrived"] <= long_done]
    top = sorted((x for x in gaps if long_at <= x[0] <= long_done), key=lambda x: -x[1])[:20]
    p99b, p99d = _pct(before, 99), _pct(during, 99)
    return dict(gaps_before=len(before), gaps_during=len(during), gap_p50_before_ms=_pct(before, 50) * 1e3,
                gap_p99_before_ms=p99b * 1e3, gap_p50_during_ms=_pct(during, 50) * 1e3,
                gap_p99_during_ms=p99d * 1e3, p99_ratio=p99d / p99b if p99b else float("inf"),
                gap_max_during_ms=max(during, default=0.0) * 1e3,
                long_ttft_s=long_first - long_at, long_total_s=long_done - long_at, long_tokens=long_n,
                short_requests_before=len(ttft_before), short_ttft_p50_before_ms=_pct(ttft_before, 50) * 1e3,
                short_ttft_max_before_ms=max(ttft_before, default=0.0) * 1e3,
                short_requests_during=len(ttft_during), short_ttft_p50_during_ms=_pct(ttft_during, 50) * 1e3,
                short_ttft_max_during_ms=max(ttft_during, default=0.0) * 1e3,
                top_gaps_during=[dict(t_s=t - long_at, gap_ms=g * 1e3, client=c, long_chunk=m["long_chunk"],
                                      chunks=m["chunks"], long_chunk_reporting=r["long_chunk"])
                                 for t, g, c, m, r in top])


def long_main(args, target, assistant, argv) -> None:
    """--long-prompt: the long-request workload for each K of --k-values (DIR/serve_long.*)."""
    rng = np.random.default_rng(args.seed)
    vocab = target.config.vocab_size
    clients = args.clients[0]
    short = Prompts(rng, vocab, args.prompt_len, args.prompt_len)  # a fresh prompt a request: none hits a prefix
    long_ids = rng.integers(2, vocab, args.long_prompt).tolist()
    block = args.block_tokens
    capacity = -(-(args.long_prompt + args.long_tokens + 2 * 16) // block) * block
    per_short = -(-(args.prompt_len + args.max_tokens + 2 * 16) // block)
    kv_blocks = clients * per_short + capacity // block
    rows = []
    for k, budget in ((k, b) for k in args.k_values for b in args.step_tokens or [None]):
        engine = BatchEngine(target, assistant if k > 1 else None, slots=clients + 1,
                             max_new_tokens=max(args.max_tokens, args.long_tokens), capacity=capacity, block_size=k,
                             eos_token_ids=(), rounds_per_step=args.rounds_per_step, kv_blocks=kv_blocks,
                             block_tokens=block, prefill_chunk=args.prefill_chunk,
                             prefix_cache=not args.no_prefix_cache, **_budget(budget))
        t = time.perf_counter()
        for ids, n in ((long_ids, args.long_tokens), (short.take(1)[0], args.max_tokens)):  # compile: chunks, steps
            engine.admit(ids, n, seed=0)
            while engine.live:
                engine.step()
        compile_s = time.perf_counter() - t
        r = long_request(engine, clients, short, args.max_tokens, long_ids, args.long_tokens, args.baseline_s)
        rows.append(dict(k_asked=k, k=engine.block_size, clients=clients, prefill_chunk=args.prefill_chunk,
                         step_tokens=engine.step_tokens, lanes=engine.lanes, warm_up_s=compile_s,
                         chunks=engine.chunks, **r))
        print(f"K={engine.block_size} clients={clients} chunk={args.prefill_chunk} budget={engine.step_tokens}: "
              f"p99 gap {r['gap_p99_before_ms']:.1f} "
              f"-> {r['gap_p99_during_ms']:.1f} ms ({r['p99_ratio']:.2f}x), long request TTFT "
              f"{r['long_ttft_s']:.2f} s, done in {r['long_total_s']:.2f} s; short TTFT p50 "
              f"{r['short_ttft_p50_before_ms']:.1f} -> {r['short_ttft_p50_during_ms']:.1f} ms, max "
              f"{r['short_ttft_max_before_ms']:.1f} -> {r['short_ttft_max_during_ms']:.1f} ms", flush=True)
    lines = [f"# serve_bench long request — preset {args.target}, random 4-bit weights", "",
             environment_line(args.commit), "",
             f"Command: `python benchmarks/serve_bench.py {' '.join(argv if argv is not None else sys.argv[1:])}`", "",
             f"{clients} streams of {args.prompt_len}-token prompts, {args.max_tokens} tokens each, one after another; "
             f"after {args.baseline_s} s one {args.long_prompt}-token request ({args.long_tokens} new tokens) arrives. "
             f"Prefill chunk {args.prefill_chunk} tokens, {args.rounds_per_step} round(s) per step, KV pool "
             f"{kv_blocks} blocks of {block}, {capacity} positions per request at most. Gaps: between a stream's "
             "consecutive tokens (stamped when their step returns), before the long request and while it runs. "
             f"Stream i starts after i x {args.max_tokens} / {clients} steps. Short TTFT: a stream request's arrival "
             "(its previous request's end) to its first token, for requests arriving before the long one / while it "
             "runs. The 20 largest gaps while it runs are in serve_long.json (top_gaps_during).", "",
             "| K asked | K run | step tokens (lanes) | streams | gaps before / during | p50 gap before ms | p99 gap before ms | "
             "p50 gap during ms | p99 gap during ms | p99 ratio | max gap during ms | long TTFT s | long total s | "
             "short requests before / during | short TTFT before p50 / max ms | short TTFT during p50 / max ms |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['k_asked']} | {r['k']} | {r['step_tokens']} ({r['lanes']}) | {r['clients']} | {r['gaps_before']} / {r['gaps_during']} | "
                     f"{r['gap_p50_before_ms']:.1f} | {r['gap_p99_before_ms']:.1f} | {r['gap_p50_during_ms']:.1f} | "
                     f"{r['gap_p99_during_ms']:.1f} | {r['p99_ratio']:.2f} | {r['gap_max_during_ms']:.1f} | "
                     f"{r['long_ttft_s']:.2f} | {r['long_total_s']:.2f} | "
                     f"{r['short_requests_before']} / {r['short_requests_during']} | "
                     f"{r['short_ttft_p50_before_ms']:.1f} / {r['short_ttft_max_before_ms']:.1f} | "
                     f"{r['short_ttft_p50_during_ms']:.1f} / {r['short_ttft_max_during_ms']:.1f} |")
    write_report(args.out, "serve_long", dict(environment(args.commit), args=vars(args)), rows, lines)
    print("\n".join(lines))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="12b", help="a preset name or 'default' (the shipped pair)")
    ap.add_argument("--assistant", default=None, help="preset of the assistant (default: the target's name)")
    ap.add_argument("--layers", type=int, default=0, help="keep the preset's first N layers (0: all)")
    ap.add_argument("--clients", type=_ints, default=[1, 4, 8, 16, 32])
    ap.add_argument("--k-values", type=_ints, default=[1, 4], help="block sizes (1: classic)")
    ap.add_argument("--max-slots", type=int, default=16, help="slots at most (more clients queue)")
    ap.add_argument("--requests-per-client", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=1,
                    help="runs of each configuration; its row is the median run's (all runs' tok/s kept in the JSON)")
    ap.add_argument("--rounds-per-step", type=int, default=1, help="rounds between two reads (the server's chunk)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=128, help="presets: prompts of half to all this many ids")
    ap.add_argument("--capacity", type=int, default=1024, help="cache positions per slot")
    ap.add_argument("--backend", choices=BACKEND_CHOICES, default="auto")
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--commit", default=None)
    ap.add_argument("--http", action="store_true",
                    help="each configuration also through `jaxspec serve`'s HTTP app (streamed completions), the "
                         "engine rows then with the server's engine and stop ids")
    ap.add_argument("--sampling", type=lambda s: s.split(","), default=["greedy"],
                    help="comma-separated: greedy, uniform (T 0.8, top_p 0.95), mixed (16 distinct settings), "
                         "penalized (greedy, penalties on every other request)")
    ap.add_argument("--long-prompt", type=int, default=0,
                    help="the long-request workload with a prompt of this many tokens (0: the sweep)")
    ap.add_argument("--long-tokens", type=int, default=64, help="--long-prompt: the long request's new tokens")
    ap.add_argument("--baseline-s", type=float, default=5.0, help="--long-prompt: streaming before it arrives")
    ap.add_argument("--prefill-chunk", type=int, default=PREFILL_CHUNK,
                    help=f"the chunk width prompts are cut into (default {PREFILL_CHUNK}, the engine's)")
    ap.add_argument("--block-tokens", type=int, default=16, help="positions per KV pool block")
    ap.add_argument("--step-tokens", type=_ints, default=[],
                    help="comma-separated token budgets a step to sweep, each a configuration (default: the engine's)")
    ap.add_argument("--no-prefix-cache", action="store_true",
                    help="prefill every prompt whole (issue 70's bar: the sweep with reuse within 3%% of it; a "
                         "preset's requests share no prefix, so the sweep measures what reuse costs)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--quiet", action="store_true", help="no progress bar (shown on stderr only when it is a terminal)")
    args = ap.parse_args(argv)
    bad = set(args.sampling) - {"greedy", "uniform", "mixed", "penalized"}
    if bad:
        raise SystemExit(f"--sampling: unknown {sorted(bad)} (greedy, uniform, mixed, penalized)")
    os.makedirs(args.out, exist_ok=True)
    matmul = DispatchConfig.from_env(backend=args.backend)  # "auto": resolve_backend
    if args.assistant is None and args.target != "default":
        args.assistant = args.target
    target, assistant, prompts, what = load(args, matmul)
    if args.long_prompt:
        return long_main(args, target, assistant, argv)
    tokenizer = (load_tokenizer(os.path.join(dp.default_pair_path(), "target")) if args.target == "default"
                 else IdTokenizer())
    if args.http:
        from jaxspec.serve.app import Server
        from jaxspec.serve.config import RANGES as SERVE_KNOBS
    rows = []
    configs = len(args.k_values) * len(args.clients) * len(args.sampling) * (2 if args.http else 1)
    sweep = bar(total=configs, desc="configurations", unit="run", enabled=False if args.quiet else None)
    for k, budget in ((k, b) for k in args.k_values for b in args.step_tokens or [None]):
        for n in args.clients:
            slots = min(n, args.max_slots)
            if args.http:  # the server's own engine (its capacity, budget and stop ids) for both rows
                server = Server(target, assistant if k > 1 else None, tokenizer, model_name="bench", block_size=k,
                                rounds_per_chunk=args.rounds_per_step, max_batch=slots,
                                max_queue=SERVE_KNOBS["max_queue"].hi,  # never a 429: every client waits its turn
                                prefix_cache=not args.no_prefix_cache, **_budget(budget))
                engine = server.engine
            else:
                engine = BatchEngine(target, assistant if k > 1 else None, slots=slots,
                                     max_new_tokens=args.max_tokens, capacity=args.capacity, block_size=k,
                                     eos_token_ids=(), rounds_per_step=args.rounds_per_step,
                                     prefill_chunk=args.prefill_chunk, block_tokens=args.block_tokens,
                                     prefix_cache=not args.no_prefix_cache,
                                     **_budget(budget))
            widths = prompts.widths()  # one prompt per prefill width
            if set(args.sampling) != {"greedy"}:
                engine.warm_up()  # every step program (greedy alone needs only the first)
            for p in widths:  # compile: each prompt width's prefill
                engine.admit(p, 2, seed=0)
                while engine.live:
                    engine.step()
            for kind in args.sampling:
                per_run = n * args.requests_per_client
                runs = [("engine", lambda: serve(engine, prompts.take(per_run), n, args.requests_per_client,
                                                 args.max_tokens, kind))]
                if args.http:
                    runs.append(("http", lambda: _http_run(server, widths, prompts.take(per_run), n, args, kind)))
                for mode, run in runs:
                    steps, hit = list(engine.steps), engine.pool.hit
                    tries = [run() for _ in range(args.repeats)]
                    r = sorted(tries, key=lambda x: x["tokens_per_s"])[len(tries) // 2]  # the median run
                    used = [(b - a) // args.repeats for a, b in zip(steps, engine.steps)]
                    rows.append(dict(mode=mode, sampling=kind, k_asked=k, k=engine.block_size, fallback=engine.fallback,
                                     clients=n, slots=slots, step_tokens=engine.step_tokens, lanes=engine.lanes,
                                     steps_per_program=used, prefix_hit_tokens=engine.pool.hit - hit,
                                     repeats_tokens_per_s=[x["tokens_per_s"] for x in tries], **r))
                    sweep.update(1)
                    with sweep.external_write_mode():  # the result line (stdout) between two redraws of the bar
                        print(f"{mode} {kind} K={engine.block_size} clients={n} slots={slots} budget={engine.step_tokens}: "
                              f"{r['tokens_per_s']:.1f} "
                              f"tok/s, TTFT {r['ttft_median_s'] * 1e3:.0f} ms, stream {r['stream_tokens_per_s']:.1f} "
                              f"tok/s, steps per program {used}", flush=True)
            if args.http:
                server.close()  # its worker thread holds it: else the next row's engine shares the device with it
            engine = server = runs = run = None  # noqa: F841  the next row's engine is built without this one
    sweep.close()
    base = {(r["mode"], r["sampling"], r["clients"], r["step_tokens"]): r["tokens_per_s"] for r in rows
            if r["k_asked"] == 1}
    one = {(r["mode"], r["sampling"], r["k_asked"], r["step_tokens"]): r["tokens_per_s"] for r in rows
           if r["clients"] == 1}
    uniform = {(r["mode"], r["k_asked"], r["clients"], r["step_tokens"]): r["tokens_per_s"] for r in rows
               if r["sampling"] == "uniform"}
    lines = [f"# serve_bench — {what}", "", environment_line(args.commit), "",
             f"Command: `python benchmarks/serve_bench.py {' '.join(argv if argv is not None else sys.argv[1:])}`", "",
             f"{args.requests_per_client} requests per client, {args.max_tokens} tokens each (the median of "
             f"{args.repeats} run(s) a row); slots = min(clients, "
             f"{args.max_slots}); {args.capacity} cache positions per slot; {args.rounds_per_step} round(s) per step.",
             "",
             "| path | sampling | K asked | K run | clients | slots | step tokens (lanes) | tok/s (all) | x one client | "
             "/ uniform (mixed), / greedy (penalized) | "
             "TTFT median ms | TTFT p90 ms | per-stream tok/s | speculative / classic | steps per program |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        b = base.get((r["mode"], r["sampling"], r["clients"], r["step_tokens"]))
        o = one.get((r["mode"], r["sampling"], r["k_asked"], r["step_tokens"]))
        u = uniform.get((r["mode"], r["k_asked"], r["clients"], r["step_tokens"]))
        spec = f"{r['tokens_per_s'] / b:.2f}" if r["k_asked"] > 1 and b else ""
        scale = f"{r['tokens_per_s'] / o:.2f}" if o else ""
        g = base.get((r["mode"], "greedy", r["clients"], r["step_tokens"]))
        ref = {"mixed": u, "penalized": g}.get(r["sampling"])
        vs = f"{r['tokens_per_s'] / ref:.2f}" if ref else ""
        lines.append(f"| {r['mode']} | {r['sampling']} | {r['k_asked']} | {r['k']} | {r['clients']} | {r['slots']} | "
                     f"{r['step_tokens']} ({r['lanes']}) | {r['tokens_per_s']:.1f} | {scale} | {vs} | {r['ttft_median_s'] * 1e3:.0f} | "
                     f"{r['ttft_p90_s'] * 1e3:.0f} | {r['stream_tokens_per_s']:.1f} | {spec} | "
                     f"{r['steps_per_program']} |")
    write_report(args.out, "serve", dict(environment(args.commit), what=what, args=vars(args)), rows, lines)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
