"""Where does a decode-program call's fixed cost go? 12B classic, one slot (see serve results)."""
import json, os, statistics, sys, time
sys.path.insert(0, "benchmarks")
import jax, jax.numpy as jnp, numpy as np
from harness import random_pair
from jaxspec import loop
from jaxspec.batching import BatchEngine
from pallas_kernels import DispatchConfig

OUT = os.environ.get("OUT", "/tmp/out")
res = {}
t, _ = random_pair(os.environ.get("TARGET", "12b"), None, matmul=DispatchConfig.from_env(backend=os.environ.get("BACKEND", "pallas")))
eng = BatchEngine(t, None, slots=int(os.environ.get("SLOTS", "1")), max_new_tokens=1024, capacity=2048, block_size=1,
                  eos_token_ids=())
rng = np.random.default_rng(0)
prompt = rng.integers(2, min(1000, t.config.vocab_size), 64).tolist()

def fresh():
    for s in range(eng.slots):
        eng.cancel(s)
    for s in range(eng.slots):
        eng.admit(prompt, 1024, seed=0)
    jax.block_until_ready(eng.state)

def timed(n, reps):
    fresh()
    eng.state = eng.decode(eng.state, n); jax.block_until_ready(eng.state)
    calls, total = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        eng.state = eng.decode(eng.state, n)
        t1 = time.perf_counter()
        jax.block_until_ready(eng.state)
        t2 = time.perf_counter()
        calls.append(t1 - t0); total.append(t2 - t0)
    return statistics.median(calls) * 1e3, statistics.median(total) * 1e3

for n, reps in ((0, 20), (1, 30), (2, 20), (4, 20), (8, 10), (32, 5)):
    c, tot = timed(n, reps)
    res[f"decode_{n}"] = dict(return_ms=c, total_ms=tot)
    print(f"decode({n}): call returns after {c:.3f} ms, done after {tot:.3f} ms", flush=True)

# one round without the while loop
spec = eng.gen.spec
one_round = jax.jit(lambda t, s: loop.decode_round(spec, t, None, s), donate_argnums=1)
fresh()
st = one_round(t, eng.state); jax.block_until_ready(st)
ts = []
for _ in range(30):
    t0 = time.perf_counter(); st = one_round(t, st); jax.block_until_ready(st); ts.append(time.perf_counter() - t0)
res["one_round_no_while_ms"] = statistics.median(ts) * 1e3
print("one round, no while loop:", res["one_round_no_while_ms"], flush=True)
eng.state = st

# an empty program over the same arguments
for donate in (False, True):
    f = jax.jit(lambda t, s: s.replace(rounds=s.rounds + 1), donate_argnums=(1,) if donate else (), keep_unused=True)
    st = f(t, eng.state); jax.block_until_ready(st)
    ts = []
    for _ in range(50):
        t0 = time.perf_counter(); st = f(t, st); jax.block_until_ready(st); ts.append(time.perf_counter() - t0)
    res[f"empty_program_donate_{donate}_ms"] = statistics.median(ts) * 1e3
    print(f"empty program over (target, state), donate={donate}:", res[f"empty_program_donate_{donate}_ms"], flush=True)
    eng.state = st
print("leaves: target", len(jax.tree.leaves(t)), "state", len(jax.tree.leaves(eng.state)))

# the engine's own step, one round per step
fresh()
eng.pending = None
for _ in range(3): eng.step()
ts = []
for _ in range(30):
    t0 = time.perf_counter(); eng.step(); ts.append(time.perf_counter() - t0)
res["engine_step_ms"] = statistics.median(ts) * 1e3
print("engine.step (1 round):", res["engine_step_ms"], flush=True)

# a trace: 4 calls of one round, then one call of 4 rounds
fresh()
eng.state = eng.decode(eng.state, 1); jax.block_until_ready(eng.state)
jax.profiler.start_trace(os.path.join(OUT, "trace"))
for _ in range(4):
    eng.state = eng.decode(eng.state, 1); jax.block_until_ready(eng.state)
time.sleep(0.01)
eng.state = eng.decode(eng.state, 4); jax.block_until_ready(eng.state)
jax.profiler.stop_trace()
json.dump(res, open(os.path.join(OUT, "overhead.json"), "w"), indent=1)

# what the compiled decode runs outside its while loop (loop-invariant work XLA hoisted: paid per call)
import re
txt = eng.gen.compiled_decode_text(t, None, eng.state)
entry = re.search(r"\nENTRY .*?\n}\n", txt, re.S).group(0)
keep = [l for l in entry.splitlines() if "parameter(" not in l and "get-tuple-element" not in l]
open(os.path.join(OUT, "entry.txt"), "w").write("\n".join(keep))
print(len(keep), "ENTRY instructions besides parameters")
