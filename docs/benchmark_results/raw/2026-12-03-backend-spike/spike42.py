"""Issue 42 spike: the GEMV on three backends, one launch and chains of 8 dependent launches.

Backends: today's Pallas-Triton kernel (quantized_matmul), the Mosaic GPU GEMV (.probe/mosaic_gemv.py)
without and with PDL, and the same Triton GEMV through jax-triton (.probe/jt_gemv.py) if it imports.
Shapes 15360x3840 (up) and 3840x15360 (down), alternating in chains as in a layer; SETS distinct
weight sets per timed call (each set 8 x 33 MB: the call reads several times the 50 MB L2).
usage: OUT=dir python .probe/spike42.py TAG [--quick]
"""
import json
import os
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.getcwd())
sys.path.insert(0, os.path.join(os.getcwd(), "benchmarks"))
sys.path.insert(0, os.path.join(os.getcwd(), ".probe"))
from harness import empty_call_with_seconds, median_time  # noqa: E402
from kernel_bench import random_qweight  # noqa: E402
from pallas_kernels import quantized_matmul  # noqa: E402
from pallas_kernels.quant import dequantize  # noqa: E402
import mosaic_gemv as mg  # noqa: E402

TAG = sys.argv[1]
QUICK = "--quick" in sys.argv
OUT = os.environ["OUT"]
SETS = int(os.environ.get("SETS", "4"))
SHAPES = [(256, 128), (128, 256)] if os.environ.get("SMOKE") else [(15360, 3840), (3840, 15360)]
log = open(os.path.join(OUT, f"spike-{TAG}.jsonl"), "a")


def emit(**r):
    r["tag"] = TAG
    print(json.dumps(r), flush=True)
    log.write(json.dumps(r) + "\n")
    log.flush()


try:
    import jt_gemv
    HAVE_JT = True
except Exception as e:  # noqa: BLE001
    HAVE_JT = False
    emit(event="jax-triton import failed", error=f"{type(e).__name__}: {str(e)[:300]}")

key = jax.random.PRNGKey(0)
ws = []
for s in range(SETS):
    row = []
    for i in range(8):
        key, sk = jax.random.split(key)
        row.append(random_qweight(sk, *SHAPES[i % 2]))
    ws.append(row)
codes = [[(mg.codes_of(w), w.scales, w.biases) for w in row] for row in ws]
jax.block_until_ready(codes)


def triton_op(h, w):
    return quantized_matmul(h, w)


def mosaic_op(pdl, n_sub):
    def op(h, c):
        cw, s, b = c
        shape = (cw.shape[0] * 64, cw.shape[1] * 64)
        return mg.mosaic_gemv(h, cw, s, b, split=mg.default_split(shape), n_sub=n_sub, pdl=pdl)
    return op


VARIANTS = {"triton": (triton_op, ws), "mosaic": (mosaic_op(False, 1), codes),
            "mosaic_pdl": (mosaic_op(True, 1), codes), "mosaic_pdl_n2": (mosaic_op(True, 2), codes)}
if HAVE_JT:
    VARIANTS["jax_triton"] = (lambda h, w: jt_gemv.jt_gemv(h, w), ws)

# ---- correctness: against float32 dequantize @ x, and row invariance (16 rows vs each row alone)
for name, (op, wts) in VARIANTS.items():
    for si, shape in enumerate(SHAPES):
        try:
            w, wv = ws[0][si], wts[0][si]
            x = jax.random.normal(jax.random.PRNGKey(7 + si), (16, shape[1]), jnp.bfloat16)
            f = jax.jit(op)
            y16 = np.asarray(f(x, wv), np.float32)
            ref = np.asarray(x, np.float32) @ np.asarray(dequantize(w, jnp.float32), np.float32).T
            err = float(np.max(np.abs(y16 - ref)) / np.max(np.abs(ref)))
            same = all(np.array_equal(np.asarray(f(x[i:i + 1], wv), np.float32), y16[i:i + 1]) for i in (0, 5, 15))
            emit(event="check", variant=name, shape=shape, rel_err=err, rows_bitwise=same)
        except Exception as e:  # noqa: BLE001
            emit(event="check", variant=name, shape=shape, error=f"{type(e).__name__}: {str(e)[:800]}")
            traceback.print_exc()


def chain(op):
    def f(x, sets):
        outs = []
        for row in sets:
            h = x
            for w in row:
                h = (op(h, w) * 0.01).astype(jnp.bfloat16)
            outs.append(h)
        return outs
    return jax.jit(f)


def indep(op):
    def f(xs, sets):
        return [[op(xi, w) for xi, w in zip(xr, row)] for xr, row in zip(xs, sets)]
    return jax.jit(f)


rows_list = (1, 16) if QUICK else (1, 4, 8, 16)
names = [n for n in VARIANTS if not QUICK or n in ("triton", "mosaic_pdl", "jax_triton")]
for rows in rows_list:
    x = jax.random.normal(jax.random.PRNGKey(rows), (rows, SHAPES[0][1]), jnp.bfloat16)
    xs = [[jax.random.normal(jax.random.PRNGKey(100 + 8 * s + i), (rows, SHAPES[i % 2][1]), jnp.bfloat16)
           for i in range(8)] for s in range(SETS)]
    for name in names:
        op, wts = VARIANTS[name]
        try:
            t0 = time.time()
            fc, fi = chain(op), indep(op)
            e1, e2 = empty_call_with_seconds(x, wts), empty_call_with_seconds(xs, wts)
            tc = median_time(fc, x, wts, warmup=3, repeats=25)
            ti = median_time(fi, xs, wts, warmup=3, repeats=25) if rows in (1, 16) else float("nan")
            emit(event="time", variant=name, rows=rows, chain_us_per_op=(tc - e1) / (8 * SETS) * 1e6,
                 indep_us_per_op=(ti - e2) / (8 * SETS) * 1e6, call_ms=tc * 1e3, empty_ms=e1 * 1e3,
                 wall_s=time.time() - t0)
        except Exception as e:  # noqa: BLE001
            emit(event="time", variant=name, rows=rows, error=f"{type(e).__name__}: {str(e)[:800]}")
            traceback.print_exc()
