"""Chain of 8 dependent GEMVs (alternating 3840->15360 and 15360->3840, distinct weights) vs the
same 8 GEMVs independent; per-op us. Run under different XLA_FLAGS by the shell wrapper."""
import json, os, sys, time, statistics
import jax, jax.numpy as jnp
sys.path.insert(0, os.getcwd()); sys.path.insert(0, os.path.join(os.getcwd(), "benchmarks"))
from kernel_bench import random_qweight
from harness import empty_call_with_seconds, median_time
from pallas_kernels import quantized_matmul

tag = sys.argv[1]
out = os.environ["OUT"]
res = []
key = jax.random.PRNGKey(0)
SETS = int(os.environ.get("SETS", "4"))  # x 8 weights x ~30 MB per timed call (>> L2)
ws = []
for s in range(SETS):
    row = []
    for i in range(8):
        n, k = (15360, 3840) if i % 2 == 0 else (3840, 15360)
        key, sk = jax.random.split(key)
        row.append(random_qweight(sk, n, k))
    ws.append(row)

def chain(x, sets):
    outs = []
    for row in sets:
        h = x
        for w in row:
            h = quantized_matmul(h, w)
            h = (h * 0.01).astype(jnp.bfloat16)
        outs.append(h)
    return outs

def indep(xs, sets):
    outs = []
    for xr, row in zip(xs, sets):
        outs.append([quantized_matmul(xi, w) for xi, w in zip(xr, row)])
    return outs

for rows in (1, 8, 16):
    x = jax.random.normal(jax.random.PRNGKey(rows), (rows, 3840), jnp.bfloat16)
    xs = [[jax.random.normal(jax.random.PRNGKey(100 + 8 * s + i), (rows, 3840 if i % 2 == 0 else 15360), jnp.bfloat16)
           for i in range(8)] for s in range(SETS)]
    fc, fi = jax.jit(chain), jax.jit(indep)
    e1 = empty_call_with_seconds(x, ws)
    e2 = empty_call_with_seconds(xs, ws)
    tc = median_time(fc, x, ws, warmup=3, repeats=31)
    ti = median_time(fi, xs, ws, warmup=3, repeats=31)
    r = dict(tag=tag, rows=rows, chain_us_per_op=(tc - e1) / (8 * SETS) * 1e6, indep_us_per_op=(ti - e2) / (8 * SETS) * 1e6,
             chain_call_ms=tc * 1e3, empty_ms=e1 * 1e3)
    print(json.dumps(r), flush=True)
    res.append(r)
with open(os.path.join(out, f"chain-{tag}.jsonl"), "w") as f:
    for r in res:
        f.write(json.dumps(r) + "\n")
