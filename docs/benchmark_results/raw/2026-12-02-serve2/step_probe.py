"""The engine's step with the fixed-round program: does the call return before its rounds finish, and what does a step cost?"""
import json, os, statistics, sys, time
sys.path.insert(0, "benchmarks")
import jax, numpy as np
from harness import random_pair
from jaxspec.batching import BatchEngine
from pallas_kernels import DispatchConfig

OUT = os.environ["OUT"]
res = {}
t, _ = random_pair(os.environ.get("TARGET", "12b"), None, matmul=DispatchConfig.from_env(backend=os.environ.get("BACKEND", "pallas")))
rng = np.random.default_rng(0)
prompt = rng.integers(2, min(1000, t.config.vocab_size), 64).tolist()
for slots in (1, 8):
    for rps in (1, 4):
        eng = BatchEngine(t, None, slots=slots, max_new_tokens=512, capacity=1024, block_size=1, eos_token_ids=(),
                          rounds_per_step=rps)
        for s in range(slots): eng.admit(prompt, 512, seed=0)
        jax.block_until_ready(eng.state)
        calls, total = [], []
        for _ in range(6):
            t0 = time.perf_counter(); eng.state = eng.decode(eng.state); t1 = time.perf_counter()
            jax.block_until_ready(eng.state); t2 = time.perf_counter()
            calls.append(t1 - t0); total.append(t2 - t0)
        for _ in range(3): eng.step()
        ts = []
        for _ in range(12):
            t0 = time.perf_counter(); eng.step(); ts.append(time.perf_counter() - t0)
        r = dict(call_returns_ms=statistics.median(calls) * 1e3, call_done_ms=statistics.median(total) * 1e3,
                 step_ms=statistics.median(ts) * 1e3)
        res[f"slots{slots}_rounds{rps}"] = r
        print(slots, rps, r, flush=True)
json.dump(res, open(os.path.join(OUT, "step_probe.json"), "w"), indent=1)
