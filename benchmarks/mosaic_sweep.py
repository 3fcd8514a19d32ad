"""Launch options of the Mosaic GPU kernel (pallas_kernels/mosaic_qmm.py) on the GPU, next to the
dispatch's default (Triton) launch and a bf16 dense dot of the same shape: each variant checked against
a float32 reference once, then timed with the kernel benchmark's harness.

    python benchmarks/mosaic_sweep.py --out DIR [--shapes 15360x3840,3840x15360] [--rows 1,8,64,...]

Options swept (MosaicTiling): groups per pipeline step (G), 64-row weight blocks per program (n2),
pipeline stages (st), the K split (s) and the x-row tile (m).
Progress goes to stderr, the table last to stdout. Each timed call runs `--sets` distinct weight sets (several times the L2); the op is jitted on its
own so that a call of many sets lowers the kernel once (a Mosaic GPU lowering costs about a second).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

from harness import environment, hbm_bandwidth  # noqa: E402
from kernel_bench import GROUP, Timer, activations, qbytes, weight_sets  # noqa: E402
from pallas_kernels import dequantize, quantized_matmul  # noqa: E402
from pallas_kernels.mosaic_qmm import mosaic_qmm  # noqa: E402
from pallas_kernels.tiling import mosaic_tiling  # noqa: E402

# per x-row tile: the option sets to try, most promising first (the deadline cuts the tail)
G, N2 = "groups_per_step", "n_sub"
CHOICES = {
    16: [{}, {G: 2}, {G: 4}, {G: 6}, {G: 3}, {G: 4, N2: 2}, {G: 2, N2: 2}, {G: 4, "stages": 3},
         {G: 4, "stages": 6}, {G: 2, "stages": 8}],
    64: [{}, {G: 2}, {G: 4}, {N2: 2}, {G: 2, N2: 2}, {"stages": 6}],
    128: [{}, {G: 2}, {N2: 2}, {G: 2, N2: 2, "stages": 3}, {"tile_m": 64, G: 2, N2: 2}],
    256: [{}, {G: 2, "stages": 2}, {"stages": 3}, {"tile_m": 128, N2: 2}, {"tile_m": 128, G: 2, N2: 2, "stages": 3}],
}


def choices_for(rows):
    tm = 16 if rows <= 16 else 64 if rows <= 64 else 128 if rows <= 128 else 256
    return CHOICES[tm] if rows != 8 else CHOICES[16][:3] + CHOICES[16][5:7]


def label(t):
    return (f"mosaic m{t.tile_m} G{t.groups_per_step} s{t.split_k} st{t.stages}"
            f"{' n2' if t.n_sub == 2 else ''}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="out")
    p.add_argument("--shapes", default="15360x3840,3840x15360")
    p.add_argument("--rows", default="1,8,64,128,256,512")
    p.add_argument("--sets", type=int, default=8)
    p.add_argument("--deadline", type=float, default=470.0, help="seconds: skip what is left after this")
    a = p.parse_args(argv)
    start = time.time()
    os.makedirs(a.out, exist_ok=True)
    env = environment()
    bw = hbm_bandwidth()
    T = Timer(os.path.join(a.out, "mosaic_sweep.jsonl"), bw)
    T.record(phase="env", hbm_tbps=bw / 1e12, **env)
    key = jax.random.PRNGKey(0)
    table = []
    shapes = [tuple(int(v) for v in s.split("x")) for s in a.shapes.split(",")]
    sets = {shape: weight_sets(key, *shape, a.sets) for shape in shapes}
    for rows in (int(r) for r in a.rows.split(",")):  # rows outer: the deadline cuts the largest counts
        for shape in shapes:
            n, k = shape
            ws = sets[shape]
            wd = dequantize(ws[0], jnp.float32)
            dense = jax.random.normal(jax.random.PRNGKey(7), shape, jnp.bfloat16)
            xs = activations(key, 1000 * rows, (rows, k), a.sets)
            ref = jnp.dot(xs[0].astype(jnp.float32), wd.T, precision=jax.lax.Precision.HIGHEST)
            floor_us = (qbytes(n, k) + 2 * rows * (k + n)) / bw * 1e6
            ops = {"bf16 dot": lambda x, w: x @ dense.T, "triton default": lambda x, w: quantized_matmul(x, w)}
            for c in choices_for(rows):
                t = mosaic_tiling(rows, shape, GROUP, **c)
                ops.setdefault(label(t), lambda x, w, t=t: mosaic_qmm(x, w, t))
            for name, op in ops.items():
                if time.time() - start > a.deadline:
                    print(f"deadline: skipped {shape} rows {rows} {name}", file=sys.stderr, flush=True)
                    continue
                row = dict(phase="time", shape=f"{n}x{k}", rows=rows, variant=name, floor_us=floor_us)
                op = jax.jit(op)
                if name.startswith("mosaic"):
                    try:
                        y = op(xs[0], ws[0]).astype(jnp.float32)
                        row["rel_err"] = float(jnp.linalg.norm(y - ref) / jnp.linalg.norm(ref))
                    except Exception as e:  # a launch that does not fit (shared memory): record, go on
                        row["error"] = repr(e)[:300]
                        T.record(**row)
                        print(f"{n}x{k} {rows:4d} {name:42s} error {row['error'][:150]}", file=sys.stderr, flush=True)
                        continue
                r = T.measure(row, op, xs, ws)
                table.append(r)
                print(f"{n}x{k} {rows:4d} {name:42s} {r.get('us', float('nan')):8.1f} us "
                      f"{floor_us / r['us'] * 100 if 'us' in r else 0:5.1f}% floor  err {r.get('rel_err', 0):.1e}"
                      f"{' ' + r['error'][:100] if 'error' in r else ''}", file=sys.stderr, flush=True)
    print("\nshape       rows variant                                          us  %floor  rel_err")
    for r in table:
        if "us" in r:
            print(f"{r['shape']:11s} {r['rows']:4d} {r['variant']:46s} {r['us']:8.1f} {r['floor_us'] / r['us'] * 100:6.1f}  {r.get('rel_err', float('nan')):.1e}")
    with open(os.path.join(a.out, "table.json"), "w") as f:
        json.dump(table, f, indent=1)


if __name__ == "__main__":
    main()
