"""How fast can a Mosaic GPU (wgmma + TMA) GEMM be on the H200 at the qmm's shapes?

A ceiling for docs/kernels.md's qmm question: jax ships Hopper Mosaic GPU matmuls as examples
(`jax.experimental.pallas.ops.gpu.hopper_matmul_mgpu`, bf16 x bf16, and
`hopper_mixed_type_matmul_mgpu`, int8 x bf16 with the int8 operand converted in registers). This
times them, next to XLA's bf16 dot, at rows x N x K with several weight sets in one call (harness
pitfalls: docs/kernels.md). Prints one line per variant; writes JSON lines to --out.
Usage: python3 benchmarks/mgpu_ceiling.py --rows 64,512 --shapes 15360x3840 --out DIR
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(__file__))
from harness import empty_call_with_seconds, environment, median_time  # noqa: E402

SETS = 6


def timed(fn, xs, ws):
    """Per-op microseconds of fn over SETS (x, w) pairs in one jitted call."""
    f = jax.jit(lambda xs, ws: [fn(x, w) for x, w in zip(xs, ws)])
    t = median_time(f, xs, ws, warmup=2, repeats=7) - empty_call_with_seconds(xs, ws)
    return t / len(xs) * 1e6


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="64,512")
    ap.add_argument("--shapes", default="15360x3840,3840x15360")
    ap.add_argument("--out", default="out_mgpu")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    from jax.experimental.pallas.ops.gpu import hopper_matmul_mgpu as hm
    from jax.experimental.pallas.ops.gpu import hopper_mixed_type_matmul_mgpu as hx
    env = environment()
    print(env)
    rec = open(os.path.join(a.out, "mgpu_ceiling.jsonl"), "w")
    key = jax.random.key(0)
    for shape in a.shapes.split(","):
        n, k = map(int, shape.split("x"))
        for m in map(int, a.rows.split(",")):
            ks = jax.random.split(key, 2 * SETS)
            xs = [jax.random.normal(ks[i], (m, k), jnp.bfloat16) for i in range(SETS)]
            wb = [jax.random.normal(ks[SETS + i], (k, n), jnp.bfloat16) for i in range(SETS)]
            wi = [jax.random.randint(ks[SETS + i], (n, k), -8, 8, jnp.int8) for i in range(SETS)]
            ref = jnp.dot(xs[0], wb[0], preferred_element_type=jnp.float32)
            rows = [("xla bf16 dot", lambda x, w: jnp.dot(x, w), wb, None)]
            for tm, tn, tk, st in [(128, 128, 64, 4), (128, 256, 64, 4), (64, 128, 64, 4)]:
                if m % (2 * tm) and m % tm:
                    continue
                cfg = hm.TuningConfig(tile_m=tm, tile_n=tn, tile_k=tk, max_concurrent_steps=st,
                                      wg_dimension=hm.MatmulDimension.N)
                rows.append((f"mgpu bf16 {tm}x{tn}x{tk} s{st}",
                             lambda x, w, c=cfg: hm.matmul(x, w, None, c), wb, ref))
            # int8 weight on the left, converted in registers: out^T = W @ x^T (the wgmma A operand)
            for tm, tn, tk in [(64, 64, 64), (64, 128, 64), (128, 64, 64), (64, 128, 128)]:
                cfg = hx.TuningConfig(tile_m=tm, tile_n=tn, tile_k=tk, max_concurrent_steps=4,
                                      wg_dimension=hx.MatmulDimension.N)
                rows.append((f"mgpu int8xbf16 W.xT {tm}x{tn}x{tk}",
                             lambda x, w, c=cfg: hx.mixed_matmul_kernel(w, x.T, out_dtype=jnp.bfloat16,
                                                                          config=c), wi, None))
            for name, fn, ws, r in rows:
                try:
                    if r is not None:
                        err = float(jnp.max(jnp.abs(fn(xs[0], ws[0]).astype(jnp.float32) - r)))
                    else:
                        err = None
                    us = timed(fn, xs, ws)
                    line = {"shape": shape, "rows": m, "variant": name, "us": us, "max_err": err, **env}
                    print(f"{shape:>11} rows={m:<4} {name:<32} {us:8.1f} us  err={err}")
                except Exception as e:  # a config the kernel refuses (smem, divisibility)
                    line = {"shape": shape, "rows": m, "variant": name, "error": repr(e)[:300]}
                    print(f"{shape:>11} rows={m:<4} {name:<32} ERROR {repr(e)[:200]}")
                rec.write(json.dumps(line) + "\n")
                rec.flush()


if __name__ == "__main__":
    main()
