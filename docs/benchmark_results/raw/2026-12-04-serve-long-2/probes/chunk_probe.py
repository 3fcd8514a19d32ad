"""Issue 56 probe (H200): what a prefill-chunk step costs, by chunk width and context, and where.

A. Engine steps timed one by one (synchronised): 8 decode rows alone, then each step of a 16K prompt's
   chunked prefill beside them, at chunk widths 128 / 256 / 512.
B. A profiler trace of two chunk steps near the prompt's end (chunk 512): GPU time by kernel name.
C. serve_bench's long-request workload (K=1) at chunk 128, 256, 512 with the same target.
"""
import argparse
import glob
import gzip
import json
import os
import statistics
import sys
import time
from collections import defaultdict

import jax
import numpy as np

sys.path.insert(0, os.path.join(os.getcwd(), "benchmarks"))
import serve_bench  # noqa: E402
from harness import random_pair  # noqa: E402
from jaxspec.batching import BatchEngine  # noqa: E402
from jaxspec.kernels import DispatchConfig  # noqa: E402

OUT = os.environ.get("OUT", "/tmp/out")
LONG, SHORT, CLIENTS, BLOCK = int(os.environ.get("LONG", 16384)), 64, 8, 16
PRESET = os.environ.get("PRESET", "12b")
BUDGET = int(os.environ.get("BUDGET", 2048))
WIDTHS = [int(w) for w in os.environ.get("WIDTHS", "128,256,512").split(",")]
commit = os.environ.get("COMMIT", "unknown")


def log(*a):
    print(*a, flush=True)
    with open(os.path.join(OUT, "probe.log"), "a") as f:
        print(*a, file=f)


t0 = time.perf_counter()
matmul = DispatchConfig.from_env(backend="pallas" if jax.default_backend() == "gpu" else "xla")
target, _ = random_pair(PRESET, None, matmul=matmul, seed=0)
log(f"target built in {time.perf_counter() - t0:.1f} s")
rng = np.random.default_rng(0)
vocab = target.config.vocab_size
short = [rng.integers(2, vocab, SHORT).tolist() for _ in range(32)]
long_ids = rng.integers(2, vocab, LONG).tolist()
capacity = -(-(LONG + 64 + 32) // BLOCK) * BLOCK


def sync(engine):
    jax.block_until_ready(engine.state)


def timed_step(engine):
    t = time.perf_counter()
    engine.step()
    sync(engine)
    return (time.perf_counter() - t) * 1e3


def part_a(width, trace=False):
    kv_blocks = CLIENTS * (-(-(SHORT + BUDGET + 32) // BLOCK)) + capacity // BLOCK
    engine = BatchEngine(target, None, slots=CLIENTS + 1, max_new_tokens=BUDGET, capacity=capacity, block_size=1,
                         eos_token_ids=(), rounds_per_step=1, kv_blocks=kv_blocks, block_tokens=BLOCK,
                         prefill_chunk=width)
    t = time.perf_counter()
    for ids, n in ((long_ids, 4), (short[0], 4)):
        engine.admit(ids, n, seed=0)
        while engine.live:
            engine.step()
    log(f"[A] chunk {width}: warm-up {time.perf_counter() - t:.1f} s")
    for c in range(CLIENTS):
        engine.admit(short[c], BUDGET, seed=0)
    for _ in range(10):
        timed_step(engine)
    dec = [timed_step(engine) for _ in range(30)]
    ls = engine.admit(long_ids, 8, seed=0)
    steps = []
    while engine.prefilling:
        chunks = engine.chunks
        ms = timed_step(engine)
        steps.append((chunks, ms))
    while engine.owner[ls] is not None:
        engine.step()
    n = len(steps)
    ms_ = [ms for _, ms in steps]
    k = max(1, n // 10)
    row = dict(width=width, decode_ms=statistics.median(dec), chunk_steps=n,
               first_ms=statistics.median(ms_[:k]), mid_ms=statistics.median(ms_[n // 2 - k // 2:n // 2 + k // 2 + 1]),
               last_ms=statistics.median(ms_[-k:]), all_ms=[round(x, 2) for x in ms_], max_ms=max(ms for _, ms in steps),
               total_s=sum(ms for _, ms in steps) / 1e3)
    log(f"[A] {json.dumps(row)}")
    if trace:
        # a second long request: trace two steps near its end
        engine.admit(long_ids, 8, seed=0)
        while len(engine.prefilling) and (len(long_ids) - engine.prefilling[max(engine.prefilling)][1]) > 3 * width:
            timed_step(engine)
        d = os.path.join(OUT, "trace")
        jax.profiler.start_trace(d, create_perfetto_trace=True)
        for _ in range(2):
            timed_step(engine)
        jax.profiler.stop_trace()
        summarize(d)
    for s in range(engine.slots):
        if engine.owner[s] is not None:
            engine.cancel(s)
    while engine.pending is not None:
        engine.step()
    del engine
    return row


def summarize(d):
    files = glob.glob(os.path.join(d, "**", "*perfetto_trace.json.gz"), recursive=True)
    if not files:
        log(f"[B] no perfetto trace under {d}: {glob.glob(os.path.join(d, '**'), recursive=True)[:20]}")
        return
    with gzip.open(files[0]) as f:
        tr = json.load(f)
    ev = tr["traceEvents"] if isinstance(tr, dict) else tr
    pname = {e["pid"]: e["args"]["name"] for e in ev if e.get("ph") == "M" and e.get("name") == "process_name"}
    import shutil
    shutil.copy(files[0], os.path.join(OUT, "trace.json.gz"))
    agg = defaultdict(lambda: [0.0, 0])
    mods = defaultdict(float)
    for e in ev:
        if e.get("ph") == "X" and "dur" in e and "GPU" in pname.get(e["pid"], "").upper():
            a = e.get("args", {})
            mod = str(a.get("hlo_module", a.get("module", "?")))[:40]
            mods[mod] += e["dur"]
            k = mod[:24] + " | " + e["name"][:70]
            agg[k][0] += e["dur"]
            agg[k][1] += 1
    for m, us in sorted(mods.items(), key=lambda kv: -kv[1]):
        log(f"[B] module {us / 1e3:8.3f} ms  {m}")
    sample = next((e for e in ev if e.get("ph") == "X" and "GPU" in pname.get(e["pid"], "").upper()), None)
    log(f"[B] a GPU event: {json.dumps(sample)[:400]}")
    tot = sum(v[0] for v in agg.values())
    log(f"[B] GPU events total {tot / 1e3:.2f} ms over 2 steps, {sum(v[1] for v in agg.values())} events, "
        f"processes {sorted(set(pname.values()))[:8]}")
    for k, (us, n) in sorted(agg.items(), key=lambda kv: -kv[1][0])[:45]:
        log(f"[B] {us / 1e3:8.3f} ms {n:5d}x  {k}")


rows = []
for w in WIDTHS:
    rows.append(part_a(w, trace=(w == int(os.environ.get("TRACE_W", 512)))))
json.dump(rows, open(os.path.join(OUT, "part_a.json"), "w"), indent=1)

if os.environ.get("PART_C", "1") == "1":
    for w in [int(x) for x in os.environ.get("C_WIDTHS", "128,256,512").split(",")]:
        args = argparse.Namespace(target=PRESET, assistant=None, layers=0, clients=[CLIENTS], k_values=[1],
                                  rounds_per_step=1, max_tokens=64, prompt_len=SHORT, seed=0, commit=commit,
                                  long_prompt=LONG, long_tokens=64, baseline_s=10.0, prefill_chunk=w,
                                  block_tokens=BLOCK, out=os.path.join(OUT, f"serve-long-c{w}"), quiet=True)
        os.makedirs(args.out, exist_ok=True)
        argv = ["--target", PRESET, "--long-prompt", str(LONG), "--long-tokens", "64", "--clients", str(CLIENTS),
                "--prompt-len", str(SHORT), "--max-tokens", "64", "--rounds-per-step", "1", "--prefill-chunk", str(w),
                "--baseline-s", "10", "--k-values", "1", "--quiet", "--commit", commit, "--out", args.out]
        serve_bench.long_main(args, target, None, argv)
log(f"done in {time.perf_counter() - t0:.1f} s")
