"""Quantized-matmul kernel benchmark at Gemma-4-12B shapes (run on the GPU).

    python benchmarks/kernel_bench.py --out DIR [--phase check,fma,sweep,table,tiles] [--quick]
                                      [--shapes 262144x3840,4096x3840] [--deadline SECONDS]

Writes DIR/kernels.jsonl (one JSON object per measurement) and prints a short table last.
`benchmarks/kernel_report.py` turns the JSON into docs/benchmark_results/kernels-*.md and a PNG.
Per-op time = (median call time - empty-call time) / ops per call; each op in a call has its own
weight set (together several times the L2) and its own activations.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

from harness import empty_call_seconds, empty_call_with_seconds, environment, hbm_bandwidth, median_time  # noqa: E402
from pallas_kernels import DispatchConfig, QuantizedWeight, dequantize, for_kernels, quantized_matmul, select_path  # noqa: E402
from pallas_kernels.gemv import GemvTiling, gemv_launch  # noqa: E402
from pallas_kernels.kernel import Tiling, launch  # noqa: E402
from pallas_kernels.tiling import fma_gemv_tiling, gemv_tiling, qmm_tiling, split_for  # noqa: E402

SHAPES = [(15360, 3840), (3840, 15360), (262144, 3840), (4096, 3840), (2048, 3840)]  # priority order
ROWS = [1, 2, 3, 4, 5, 8, 16, 32, 64, 128, 256, 512]
GROUP = 64
START = time.time()
SET_BYTES = 4 << 30  # weight bytes per timed call, spread over distinct sets (>> 60 MB L2)


def random_qweight(key, n, k, dtype=jnp.bfloat16):
    k1, k2, k3 = jax.random.split(key, 3)
    words = jax.random.bits(k1, (n, k // 8), jnp.uint32)
    scales = (jax.random.uniform(k2, (n, k // GROUP), jnp.float32, 0.5, 1.5) * 0.01).astype(dtype)
    biases = (jax.random.normal(k3, (n, k // GROUP), jnp.float32) * 0.05).astype(dtype)
    return QuantizedWeight(words, scales, biases, 4, GROUP)


def weight_sets(key, n, k, count):
    """`count` distinct random 4-bit weights, one per op in a timed call (together several times the L2),
    in the layouts models store (`for_kernels`: "kn" scales unless $JAXSPEC_SB_LAYOUT says "nk", words
    as $JAXSPEC_W_LAYOUT says)."""
    return [for_kernels(random_qweight(jax.random.fold_in(key, i), n, k)) for i in range(count)]


def bf16_dot(x, w):
    """The dense reference the qmm targets are set against: x @ w.T, float32 accumulation, x's dtype."""
    return jnp.dot(x, w.T, preferred_element_type=jnp.float32).astype(x.dtype)


def activations(key, seed, shape, count):
    """`count` distinct bf16 arrays of `shape` (seed offsets keep each phase's inputs its own)."""
    return [jax.random.normal(jax.random.fold_in(key, seed + i), shape, jnp.bfloat16) for i in range(count)]


def qbytes(n, k):
    return n * k // 2 + 2 * 2 * n * (k // GROUP)


def n_sets_for(bytes_per_set, cap=32):
    return int(max(4, min(cap, SET_BYTES // max(bytes_per_set, 1))))


class Timer:
    def __init__(self, out_path, bw):
        self.out = open(out_path, "a")
        self.bw = bw
        self.empty = empty_call_seconds()
        self.deadline = None

    def time_ops(self, op, xs, ws):
        """Per-op seconds of `op(x_i, w_i)` over distinct pairs in one jitted call, less the cost of
        an empty call that takes the same arguments (until 2026-11-30 the harness subtracted an
        empty call of one argument; on the H200 the Python side of passing the rest alone was
        2.2-2.9 us per op)."""
        f = jax.jit(lambda xs, ws: [op(x, w) for x, w in zip(xs, ws)])
        t = median_time(f, xs, ws, warmup=2, repeats=7)
        self.last = (f, xs, ws)  # the compiled call, for a profiler trace of the same work
        self.last_one_arg_us = max(t - self.empty, 1e-9) / len(xs) * 1e6  # the old figure, for comparison
        return max(t - empty_call_with_seconds(xs, ws), 1e-9) / len(xs)

    def past_deadline(self):
        return self.deadline is not None and time.time() > self.deadline

    def measure(self, row, op, xs, ws, nbytes=None):
        """Time op over the pairs and record it (or the error: a failed variant must not stop a sweep);
        with nbytes, also the achieved TB/s."""
        try:
            t = self.time_ops(op, xs, ws)
            row["us"] = t * 1e6
            row["us_old_harness"] = self.last_one_arg_us
            if nbytes is not None:
                row["tbps"] = nbytes / t / 1e12
        except Exception as e:
            row["error"] = repr(e)[:300]
        return self.record(**row)

    def record(self, **row):
        row["time"] = time.time()
        self.out.write(json.dumps(row) + "\n")
        self.out.flush()
        return row


def check_phase(T, key):
    """Correctness on the GPU at real shapes: every path vs an f32 reference, multirow == qmv bitwise."""
    for n, k in [(15360, 3840), (3840, 15360), (2048, 3840)]:
        qw = random_qweight(key, n, k)
        wd = dequantize(qw, jnp.float32)
        for rows in (1, 4, 8, 16, 64):
            x = jax.random.normal(jax.random.fold_in(key, rows), (rows, k), jnp.bfloat16)
            ref = jnp.dot(x.astype(jnp.float32), wd.T, precision=jax.lax.Precision.HIGHEST)
            y = quantized_matmul(x, qw).astype(jnp.float32)
            rel = float(jnp.linalg.norm(y - ref) / jnp.linalg.norm(ref))
            T.record(phase="check", n=n, k=k, rows=rows, path=select_path(rows), rel_err=rel,
                     finite=bool(jnp.all(jnp.isfinite(y))))
        x = jax.random.normal(jax.random.fold_in(key, 99), (8, k), jnp.bfloat16)
        for kernel in ("mma", "fma"):  # both GEMV kernels, whichever is the default
            cfg = DispatchConfig(gemv_kernel=kernel)
            multi = quantized_matmul(x, qw, path="multirow", config=cfg)
            alone = jnp.concatenate([quantized_matmul(x[i:i + 1], qw, path="qmv", config=cfg) for i in range(8)])
            ref8 = jnp.dot(x.astype(jnp.float32), wd.T, precision=jax.lax.Precision.HIGHEST)
            T.record(phase="check", n=n, k=k, rows=8, what=f"multirow_vs_qmv_bitwise ({kernel})",
                     equal=bool(jnp.array_equal(multi, alone)),
                     rel_err=float(jnp.linalg.norm(multi.astype(jnp.float32) - ref8) / jnp.linalg.norm(ref8)))
        x16 = jax.random.normal(jax.random.fold_in(key, 7), (32, k), jnp.bfloat16)
        a = quantized_matmul(x16, qw, path="qmm")
        b = quantized_matmul(x16[:16], qw, path="qmm")
        T.record(phase="check", n=n, k=k, rows=32, what="qmm_row_depends_on_M",
                 equal=bool(jnp.array_equal(a[:16], b)))


FMA_VARIANTS = {"default": {}, "split /2": dict(split_mult=0.5), "split x2": dict(split_mult=2),
                "split /4": dict(split_mult=0.25), "block_n 128": dict(block_n=128), "block_n 256": dict(block_n=256),
                "no prefetch": dict(prefetch=False), "2 groups/step": dict(groups_per_step=2),
                "warps 2": dict(num_warps=2), "warps 8": dict(num_warps=8), "stages 2": dict(num_stages=2)}


def fma_sweep(T, key, quick):
    """The CUDA-core GEMV (pallas_kernels/gemv.py) around its default tiling: every variant at 1 and 8
    rows on the MLP shapes, the default alone at 2 and 4 rows there and at 1 and 8 rows on the other
    shapes; with the tensor-core GEMV's default for comparison."""
    for n, k in SHAPES:
        if T.past_deadline():
            return
        nsets = n_sets_for(qbytes(n, k))
        ws = weight_sets(key, n, k, nsets)
        mlp = (n, k) in SHAPES[:2]
        for rows in ((1, 8, 2, 4) if mlp else (1, 8)):
            xs = activations(key, 1000, (rows, k), nsets)
            names = list(FMA_VARIANTS) if mlp and rows in (1, 8) and not quick else ["default"]
            for name in names + ["mma default"]:
                if T.past_deadline():
                    return
                if name == "mma default":
                    tiling = gemv_tiling((n, k), GROUP, DispatchConfig(gemv_kernel="mma"))
                    op = (lambda x, w, tl=tiling: launch(x, w, tl, interpret=False))
                else:
                    v = dict(FMA_VARIANTS[name])
                    mult = v.pop("split_mult", 1)
                    base = fma_gemv_tiling((n, k), GROUP, DispatchConfig(gemv_block_n=v.pop("block_n", None)))
                    split = int(min(max(1, base.split_k * mult), k // GROUP))
                    tiling = GemvTiling(**{**base.__dict__, **v, "split_k": split})
                    op = (lambda x, w, tl=tiling: gemv_launch(x, w, tl, interpret=False))
                T.measure(dict(phase="fma", n=n, k=k, rows=rows, variant=name, tiling=tiling.__dict__,
                               floor_us=qbytes(n, k) / T.bw * 1e6), op, xs, ws)
        del ws


LOCALITY_FMA = [(128, 1, 4), (128, 2, 4), (64, 4, 4), (32, 8, 4), (16, 16, 4), (32, 8, 2), (64, 8, 8)]
LOCALITY_MMA = [(128, 1, 4), (128, 2, 4), (64, 4, 4), (32, 4, 4), (32, 8, 4), (16, 8, 4), (16, 16, 4)]


def locality_sweep(T, key, quick):
    """Both GEMV kernels at 1 and 8 rows with the bytes each row contributes per loop step (block_n
    rows x groups_per_step x 32 bytes) raised from 32 to 512: tests whether short scattered runs per
    DRAM page, not instructions, hold both kernels at ~0.55 TB/s (docs/kernels.md, log entry 4).
    K is split as the dispatch would for that block_n."""
    from pallas_kernels.tiling import _FMA_TARGET_PROGRAMS, _TARGET_PROGRAMS, split_for
    for n, k in SHAPES[:2]:
        nsets = n_sets_for(qbytes(n, k))
        ws = weight_sets(key, n, k, nsets)
        for rows in (1, 8):
            xs = activations(key, 1000, (rows, k), nsets)
            for kernel, grid in (("fma", LOCALITY_FMA), ("mma", LOCALITY_MMA)):
                for bn, gps, warps in grid[:3] if quick else grid:
                    if T.past_deadline():
                        return
                    target = _FMA_TARGET_PROGRAMS if kernel == "fma" else _TARGET_PROGRAMS
                    split = split_for(-(-n // bn), k // GROUP, target)
                    if kernel == "fma":
                        tiling = GemvTiling(block_n=bn, groups_per_step=gps, split_k=split, num_warps=warps)
                        op = (lambda x, w, tl=tiling: gemv_launch(x, w, tl, interpret=False))
                    else:
                        tiling = Tiling(block_n=bn, groups_per_step=gps, split_k=split, num_warps=warps)
                        op = (lambda x, w, tl=tiling: launch(x, w, tl, interpret=False))
                    T.measure(dict(phase="locality", n=n, k=k, rows=rows, kernel=kernel, bytes_per_row_step=gps * 32,
                                   tiling=tiling.__dict__, floor_us=qbytes(n, k) / T.bw * 1e6), op, xs, ws)
        del ws


def gemv_sweep(T, key, quick, only=None):
    """The GEMV launch around its default: code conversion ("cvt" vs "bits"), then split-K, block_n,
    groups per step, warps and stages (re-swept in session 8 around the kpairs unpack; the weights
    are in the models' "kn" scale layout since session 9, where 3 stages became the default). Earlier
    sweeps (block_n 32..256, groups per step 1..4, split 1..16, warps 2..8, stages 2..4; the
    scale/bias prefetch and layout options, since removed) are in raw/."""
    variants = [dict(convert="cvt"), dict(), dict(split_mult=2), dict(split_mult=4), dict(split_mult=0.5),
                dict(block_n=32), dict(block_n=128), dict(groups_per_step=2), dict(num_warps=8),
                dict(num_warps=2), dict(num_stages=2), dict(num_stages=4)]
    if quick:
        variants = variants[:3]
    for n, k in only or SHAPES:
        if T.past_deadline():
            return
        nsets = n_sets_for(qbytes(n, k))
        ws = weight_sets(key, n, k, nsets)
        for rows in ((1, 8) if (n, k) in SHAPES[:2] else (1,)):
            xs = activations(key, 1000, (rows, k), nsets)
            for v in variants:
                v = dict(v)
                mult = v.pop("split_mult", 1)
                cfg = DispatchConfig(gemv_kernel="mma", gemv_block_n=v.pop("block_n", None))
                default = gemv_tiling((n, k), GROUP, cfg)
                tiling = Tiling(**{**default.__dict__, **v,
                                   "split_k": max(1, min(int(default.split_k * mult), k // GROUP))})
                T.measure(dict(phase="sweep", n=n, k=k, rows=rows, tiling=tiling.__dict__,
                               floor_us=qbytes(n, k) / T.bw * 1e6),
                          lambda x, w, tl=tiling: launch(x, w, tl, interpret=False), xs, ws)
        del ws


def table_phase(T, key, quick, only=None, rows_only=None):
    shapes = only or (SHAPES[:2] if quick else SHAPES)
    for n, k in shapes:
        qb, db = qbytes(n, k), n * k * 2
        nq, nd = n_sets_for(qb), n_sets_for(db, cap=16)
        # the bf16 dense dot first, so that a deadline never leaves the quantized rows without it
        if n * k * 2 * nd <= 20 << 30:
            dws = activations(key, 9000, (n, k), nd)
            for rows in [r for r in ((1, 64, 512) if quick else (1, 64, 128, 256, 512))
                         if not rows_only or r in rows_only]:
                xs = activations(key, 7000, (rows, k), nd)
                t = T.time_ops(bf16_dot, xs, dws)
                T.record(phase="table", n=n, k=k, rows=rows, backend="dense-bf16", path="jnp.dot", us=t * 1e6,
                         floor_us=db / T.bw * 1e6, tbps=db / t / 1e12)
            del dws
        qws = weight_sets(key, n, k, nq)
        floor_us = qb / T.bw * 1e6
        # Every row count on the two MLP shapes; a subset elsewhere (each variant is a compile).
        for rows in rows_only or (ROWS if (n, k) in SHAPES[:2] and not quick else [1, 4, 8, 16, 64, 512]):
            xs = activations(key, 5000, (rows, k), nq)
            if T.past_deadline():
                return
            variants = [("pallas", select_path(rows), lambda x, w: quantized_matmul(x, w))]
            if rows in (2, 4, 8):
                off = DispatchConfig(multirow=False)
                variants.append(("pallas", "qmv-per-row", lambda x, w, c=off: quantized_matmul(x, w, config=c)))
            if rows in (4, 8):
                variants.append(("pallas", "qmm-forced", lambda x, w: quantized_matmul(x, w, path="qmm")))
            if rows in (1, 8) or rows >= 64:  # (from 64 rows: where dequantize + dense dot wins)
                xla = DispatchConfig(backend="xla")
                variants.append(("xla", "dequant+dot", lambda x, w, c=xla: quantized_matmul(x, w, config=c)))
            for backend, path, op in variants:
                T.measure(dict(phase="table", n=n, k=k, rows=rows, backend=backend, path=path, floor_us=floor_us),
                          op, xs, qws, nbytes=qb)
        del qws


QMM_VARIANTS = {"default": {}, "split 1": dict(split_k=1), "warps 8": dict(num_warps=8),
                "block_n 64": dict(block_n=64), "tile_m 128, warps 8": dict(block_m=128, num_warps=8),
                # fewer dequantizations of each weight tile at 512 rows (one per 128 or 256 rows)
                "tile_m 128, n 256, warps 8": dict(block_m=128, block_n=256, num_warps=8),
                "tile_m 256, warps 8": dict(block_m=256, num_warps=8),
                # 256 x 128 with 3 stages asks 240 KiB of shared memory (the H200 has 227): 2 stages
                "tile_m 256, warps 8, stages 2": dict(block_m=256, num_warps=8, num_stages=2),
                "tile_m 128, n 256, warps 8, stages 2": dict(block_m=128, block_n=256, num_warps=8, num_stages=2),
                "tile_m 128, n 256, warps 4": dict(block_m=128, block_n=256),
                # session 8: the dequantized weight tile on the left of the dot (the operand Hopper's
                # wgmma can take from registers; x on the left needs the weight in shared memory)
                "w_left": dict(w_left=True),
                "w_left, tile_m 256, warps 8, stages 2": dict(w_left=True, block_m=256, num_warps=8, num_stages=2),
                "w_left, n 64, tile_m 256, warps 4, stages 2": dict(w_left=True, block_n=64, block_m=256, num_stages=2),
                # the GEMV's grid (64-column tiles, K split to ~1920 programs), both bodies (row tiles as
                # the dispatch's: 64, or 256 from QMM_TALL_ROWS rows)
                "gemv grid, codes": dict(block_n=64, dequant="codes", unpack="kpairs", w_left=True,
                                         groups_per_step=1, split_target=1920),
                "gemv grid, dq": dict(block_n=64, w_left=True, split_target=1920),
                "n 64, split 1920": dict(block_n=64, split_target=1920)}


def tiles_phase(T, key, quick, rows_list=None, names=None, shapes=None):
    """qmm around its default (tile_m 64, split-K to one wave): warps, block_n, the operand order and
    the GEMV's grid, next to the bf16 dot of the same shape and rows. The tile_m 16/32/64/128 x split
    sweep that chose the default: raw/2026-11-29-c15f057/."""
    for n, k in shapes or [(15360, 3840), (3840, 15360)]:
        nq = n_sets_for(qbytes(n, k))
        qws = weight_sets(key, n, k, nq)
        row_counts = rows_list or ((64, 512) if quick else (16, 64, 512))
        for rows in row_counts:
            xs = activations(key, 3000, (rows, k), nq)
            for name, v in QMM_VARIANTS.items():
                if names and name not in names:
                    continue
                if T.past_deadline():
                    return
                v = dict(v)
                target = v.pop("split_target", None)
                base = qmm_tiling(rows, (n, k), GROUP, DispatchConfig(qmm_tile_n=v.get("block_n", 128),
                                                               qmm_tile_m=v.get("block_m")))
                tiling = Tiling(**{**base.__dict__, **v})
                if target:
                    programs = -(-n // tiling.block_n) * -(-rows // tiling.block_m)
                    tiling = Tiling(**{**tiling.__dict__, "split_k": split_for(programs, k // GROUP, target)})
                T.measure(dict(phase="tiles", n=n, k=k, rows=rows, variant=name, tile_m=tiling.block_m,
                               split_k=tiling.split_k, tiling=tiling.__dict__, floor_us=qbytes(n, k) / T.bw * 1e6),
                          lambda x, w, tl=tiling: launch(x, w, tl, interpret=False), xs, qws)
        del qws
        if names and "bf16 dot" not in names:
            continue
        dense_sets = n_sets_for(n * k * 2, cap=16)
        dws = activations(key, 9000, (n, k), dense_sets)
        for rows in row_counts:
            if T.past_deadline():
                return
            xs = activations(key, 7000, (rows, k), dense_sets)
            T.measure(dict(phase="tiles", n=n, k=k, rows=rows, variant="bf16 dot", tile_m="-", split_k="-",
                           floor_us=n * k * 2 / T.bw * 1e6),
                      bf16_dot, xs, dws)
        del dws


def print_launches(rows, phase, title, detail):
    """One line per timed row of a launch-shape phase: shape, rows, us (% of floor), then
    `detail(row, tiling)`."""
    print(f"\n== {title} ==")
    for r in rows:
        if r["phase"] == phase and "us" in r:
            print(f"{r['n']:>6}x{r['k']:<6} r={r['rows']} {r['us']:7.1f} ({100 * r['floor_us'] / r['us']:4.1f}%) "
                  + detail(r, r["tiling"]))


def summary(path):
    rows = [json.loads(l) for l in open(path)]
    print("\n== check ==")
    for r in rows:
        if r["phase"] == "check":
            print({k: v for k, v in r.items() if k not in ("phase", "time")})
    print_launches(rows, "sweep", "gemv sweep: us (% floor)  convert bn split warps stages gps",
                   lambda r, t: f"{t['convert']:<4} {t['block_n']:>3} {t['split_k']:>3} {t['num_warps']} "
                                f"{t['num_stages']} {t['groups_per_step']}")
    print_launches(rows, "fma", "fma GEMV: us (% floor), variant, tiling",
                   lambda r, t: f"{r['variant']:<14} bn={t['block_n']} split={t['split_k']} w={t['num_warps']}")
    print_launches(rows, "locality",
                   "locality: us (% floor), kernel, block_n x groups/step (bytes per row per step), split, warps",
                   lambda r, t: f"{r['kernel']} {t['block_n']:>3}x{t['groups_per_step']:<2} "
                                f"({r['bytes_per_row_step']:>3} B) split={t['split_k']} w={t['num_warps']}")
    print("\n== qmm tiles: us ==")
    for r in rows:
        if r["phase"] == "tiles" and "us" in r:
            print(f"{r['n']:>6}x{r['k']:<6} rows={r['rows']:<4} tile_m={r['tile_m']:<3} split={r['split_k']:<2} "
                  f"{r.get('variant', ''):<20} {r['us']:8.1f} us")
    errs = [r for r in rows if "error" in r]
    print(f"\nerrors: {len(errs)}", *(e.get("error", "")[:160] for e in errs[:3]), sep="\n")
    print("\n== table: us (xla) ==")
    for r in rows:
        if r["phase"] == "table" and "us" in r:
            print(f"{r['n']:>6}x{r['k']:<6} rows={r['rows']:<4} {r['backend']:<10} {r['path']:<12} "
                  f"{r['us']:8.1f} us  {100 * r['floor_us'] / r['us']:5.1f}% floor")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    ap.add_argument("--phase", default="check,sweep,table,tiles")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--shapes", default=None,
                    help="sweep, table and tiles phases: NxK,NxK of SHAPES (default: sweep and table all, table "
                         "the two MLP shapes with --quick; tiles the two MLP shapes)")
    ap.add_argument("--tile-rows", default=None, help="tiles phase only: row counts, e.g. 512")
    ap.add_argument("--table-rows", default=None, help="table phase only: row counts, e.g. 16,64,128,256,512")
    ap.add_argument("--tile-variants", default=None,
                    help="tiles phase only: QMM_VARIANTS names and/or 'bf16 dot', ';'-separated")
    ap.add_argument("--deadline", type=float, default=None,
                    help="seconds after start past which no new measurement starts (then the summary)")
    args = ap.parse_args()
    only = None
    if args.shapes:
        only = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
        unknown = [s for s in only if s not in SHAPES]
        if unknown:
            ap.error(f"--shapes {unknown}: not among the benchmark shapes {SHAPES}")
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "kernels.jsonl")
    env = environment()
    bw = hbm_bandwidth()
    T = Timer(path, bw)
    if args.deadline:
        T.deadline = START + args.deadline
    T.record(phase="env", **env, hbm_tbps=bw / 1e12, empty_call_us=T.empty * 1e6, argv=sys.argv)
    print(env, f"HBM {bw / 1e12:.2f} TB/s, empty call {T.empty * 1e6:.0f} us", flush=True)
    key = jax.random.key(0)
    for phase in args.phase.split(","):
        t0 = time.time()
        try:
            {"check": lambda: check_phase(T, key), "sweep": lambda: gemv_sweep(T, key, args.quick, only),
             "fma": lambda: fma_sweep(T, key, args.quick),
             "locality": lambda: locality_sweep(T, key, args.quick),
             "table": lambda: table_phase(T, key, args.quick, only, args.table_rows and [
                 int(r) for r in args.table_rows.split(",")]), "tiles": lambda: tiles_phase(
                 T, key, args.quick, args.tile_rows and [int(r) for r in args.tile_rows.split(",")],
                 args.tile_variants and args.tile_variants.split(";"), only)}[phase]()
        except Exception:
            traceback.print_exc()
        print(f"phase {phase} took {time.time() - t0:.0f}s", flush=True)
    summary(path)


if __name__ == "__main__":
    main()
