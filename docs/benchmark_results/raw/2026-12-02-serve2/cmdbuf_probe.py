"""Per-call cost of the decode program and the engine step under the XLA_FLAGS in effect; tokens saved for exactness."""
import json, os, statistics, sys, time
sys.path.insert(0, "benchmarks")
import jax, numpy as np
from harness import random_pair
from jaxspec.batching import BatchEngine
from pallas_kernels import DispatchConfig

OUT, TAG = os.environ["OUT"], sys.argv[1]
res = {"flags": os.environ.get("XLA_FLAGS", "")}
t, a = random_pair(os.environ.get("TARGET", "12b"), None, matmul=DispatchConfig.from_env(backend=os.environ.get("BACKEND", "pallas")))
rng = np.random.default_rng(0)
prompt = rng.integers(2, min(1000, t.config.vocab_size), 64).tolist()
for slots in (1, 8):
    eng = BatchEngine(t, None, slots=slots, max_new_tokens=512, capacity=1024, block_size=1, eos_token_ids=())
    def fresh():
        for s in range(slots): eng.cancel(s)
        for s in range(slots): eng.admit(prompt, 512, seed=0)
        jax.block_until_ready(eng.state); eng.pending = None
    r = {}
    for n, reps in ((0, 10), (1, 20), (4, 10), (32, 3)):
        fresh(); eng.state = eng.decode(eng.state, n); jax.block_until_ready(eng.state)
        calls, total = [], []
        for _ in range(reps):
            t0 = time.perf_counter(); eng.state = eng.decode(eng.state, n); t1 = time.perf_counter()
            jax.block_until_ready(eng.state); t2 = time.perf_counter()
            calls.append(t1 - t0); total.append(t2 - t0)
        r[f"decode_{n}"] = (statistics.median(calls) * 1e3, statistics.median(total) * 1e3)
    for rps in (1, 4):
        eng.rounds_per_step = rps
        fresh()
        for _ in range(3): eng.step()
        ts = []
        for _ in range(12):
            t0 = time.perf_counter(); eng.step(); ts.append(time.perf_counter() - t0)
        r[f"step_{rps}_rounds"] = statistics.median(ts) * 1e3
    fresh(); eng.state = eng.decode(eng.state, 100)
    r["tokens"] = np.asarray(eng.state.out[0, :101]).tolist()
    res[f"slots_{slots}"] = r
    print(TAG, slots, {k: v for k, v in r.items() if k != "tokens"}, flush=True)
json.dump(res, open(os.path.join(OUT, f"cmdbuf_{TAG}.json"), "w"))
