"""Quantized-matmul kernel benchmark at Gemma-4-12B shapes (run on the GPU).

    python benchmarks/kernel_bench.py --out DIR [--phase check,table,sweep,tiles] [--quick]
                                      [--shapes 15360x3840,3840x15360] [--deadline SECONDS]

Phases:
  check  correctness at real shapes: every path against a float32 reference, multirow bitwise equal
         to each row alone, a qmm row independent of the other rows of its launch.
  table  the default paths through `quantized_matmul` with `DispatchConfig()`: qmv (1 row), multirow
         (2..8), qmm (tiled, and from 256 rows the dense fallback), next to one GEMV per row
         (multirow off), qmm forced at 4/8 rows, the tiled kernel where the dense fallback runs,
         the xla backend, and the bf16 dot of the dense weight (the reference qmm is set against).
  sweep  the GEMV launch (`launch.gemv`) with explicit `Tiling`s around `launch.gemv_tiling`.
  tiles  the tiled GEMM (`launch.qmm`) with explicit `Tiling`s around `launch.qmm_tiling`, and the
         bf16 dot.
Writes DIR/kernels.jsonl (one JSON object per measurement) and prints a short table last;
`benchmarks/kernel_report.py` turns the JSON into a markdown report and a PNG.
Per-op time = (median call time - the time of an empty call taking the same arrays) / ops per call;
each op in a call has its own weight set (together several times the L2) and its own activations.
"""
from __future__ import annotations

import argparse
import dataclasses
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
from jaxspec.kernels import DispatchConfig, QuantizedWeight, dequantize, quantized_matmul, select_path  # noqa: E402
from jaxspec.kernels.launch import Tiling, gemv, gemv_tiling, qmm, qmm_dense, qmm_tiling  # noqa: E402
from jaxspec.progress import bar  # noqa: E402

SHAPES = [(15360, 3840), (3840, 15360), (262144, 3840), (4096, 3840), (2048, 3840)]  # priority order
EXTRA_SHAPES = [(256, 512)]  # a small shape for a quick run anywhere (CPU: Pallas interpret mode)
# Gemma 3 270M: q, k/v, o, gate/up, down, the tied head (K = width 640)
SHAPES_270M = [(1024, 640), (256, 640), (640, 1024), (2048, 640), (640, 2048), (262144, 640)]
ROWS = [1, 2, 3, 4, 5, 8, 16, 32, 64, 128, 256, 512]

@dataclasses.dataclass(frozen=True)
class Format:
    """The weights' quantization: bits, group size, and the scales' dtype (None: the activations'; the
    exact GGUF mappings keep float32 scales, e.g. Gemma 3 270M's Q8_0/Q5_0 as 8-bit g32)."""
    bits: int = 4
    group: int = 64
    scale_dtype: str | None = None

    @classmethod
    def parse(cls, text: str) -> "Format":
        """BITS/GROUP or BITS/GROUP/f32, e.g. 4/64, 8/32/f32."""
        parts = text.split("/")
        if (len(parts) not in (2, 3) or not all(p.isascii() and p.isdigit() for p in parts[:2])
                or (len(parts) == 3 and parts[2] != "f32")):
            raise ValueError(f"--format {text!r}: expected BITS/GROUP or BITS/GROUP/f32, e.g. 4/64 or 8/32/f32")
        return cls(int(parts[0]), int(parts[1]), "float32" if len(parts) == 3 else None)

    def __str__(self):
        return f"{self.bits}/{self.group}" + ("/f32" if self.scale_dtype else "")


FMT = Format()  # main() sets it from --format
START = time.time()
SET_BYTES = 4 << 30  # weight bytes per timed call, spread over distinct sets (>> 60 MB L2)
DEFAULT = DispatchConfig()
INTERPRET = jax.default_backend() != "gpu"  # explicit launches: Pallas interpret mode without a GPU


def random_qweight(key, n, k, dtype=jnp.bfloat16):
    """Random codes in FMT with scales and biases of a trained layer's size, from MLX's layout."""
    k1, k2, k3 = jax.random.split(key, 3)
    words = jax.random.bits(k1, (n, k * FMT.bits // 32), jnp.uint32)
    dtype = FMT.scale_dtype or dtype
    scales = (jax.random.uniform(k2, (n, k // FMT.group), jnp.float32, 0.5, 1.5) * 0.01).astype(dtype)
    biases = (jax.random.normal(k3, (n, k // FMT.group), jnp.float32) * 0.05).astype(dtype)
    return QuantizedWeight.from_mlx(words, scales, biases, FMT.bits, FMT.group)


def weight_sets(key, n, k, count):
    """`count` distinct random 4-bit weights, one per op in a timed call (together several times the L2)."""
    return [random_qweight(jax.random.fold_in(key, i), n, k) for i in range(count)]


def bf16_dot(x, w):
    """The dense reference the qmm targets are set against: x @ w.T, float32 accumulation, x's dtype."""
    return jnp.dot(x, w.T, preferred_element_type=jnp.float32).astype(x.dtype)


def activations(key, seed, shape, count):
    """`count` distinct bf16 arrays of `shape` (seed offsets keep each phase's inputs its own)."""
    return [jax.random.normal(jax.random.fold_in(key, seed + i), shape, jnp.bfloat16) for i in range(count)]


def qbytes(n, k):
    """Bytes a quantized matmul reads: the codes plus a scale and a bias per group."""
    scale_bytes = 4 if FMT.scale_dtype else 2
    return n * k * FMT.bits // 8 + 2 * scale_bytes * n * (k // FMT.group)


def n_sets_for(bytes_per_set, cap=32):
    return int(max(4, min(cap, SET_BYTES // max(bytes_per_set, 1))))


def tiling_dict(t: Tiling) -> dict:
    return dataclasses.asdict(t)


class Timer:
    def __init__(self, out_path, bw, quiet=False):
        self.out = open(out_path, "a")
        self.bw, self.quiet = bw, quiet
        self.bar = bar(enabled=False)  # a phase's shapes (sweep)
        self.empty = empty_call_seconds()
        self.deadline = None

    def time_ops(self, op, xs, ws):
        """Per-op seconds of `op(x_i, w_i)` over distinct pairs in one jitted call, less the cost of
        an empty call that takes the same arguments (passing each array costs host time)."""
        f = jax.jit(lambda xs, ws: [op(x, w) for x, w in zip(xs, ws)])
        t = median_time(f, xs, ws, warmup=2, repeats=7)
        return max(t - empty_call_with_seconds(xs, ws), 1e-9) / len(xs)

    def past_deadline(self):
        return self.deadline is not None and time.time() > self.deadline

    def measure(self, row, op, xs, ws, nbytes=None):
        """Time op over the pairs and record it (or the error: a failed variant must not stop a sweep);
        with nbytes, also the achieved TB/s."""
        try:
            t = self.time_ops(op, xs, ws)
            row["us"] = t * 1e6
            if nbytes is not None:
                row["tbps"] = nbytes / t / 1e12
        except Exception as e:
            row["error"] = repr(e)[:300]
        return self.record(**row)

    def sweep(self, shapes, phase):
        """The shapes of a phase under a progress bar on stderr (a terminal's, not --quiet), each
        measurement shown as it is recorded."""
        self.bar = bar(shapes, desc=f"{phase} shapes", unit="shape", enabled=False if self.quiet else None)
        return self.bar

    def record(self, **row):
        self.bar.set_postfix_str(" ".join(f"{k}={row[k]}" for k in ("n", "k", "rows", "path", "variant") if k in row))
        row["time"] = time.time()
        self.out.write(json.dumps(row) + "\n")
        self.out.flush()
        return row


def _rel(y, ref):
    return float(jnp.linalg.norm(y.astype(jnp.float32) - ref) / jnp.linalg.norm(ref))


def check_phase(T, key, shapes):
    """Correctness on the GPU at real shapes: every path vs a float32 reference, multirow == each row
    alone bitwise, a qmm row independent of the launch's other rows."""
    for n, k in T.sweep(shapes, "check"):
        qw = random_qweight(key, n, k)
        wd = dequantize(qw, jnp.float32)
        for rows in (1, 4, 8, 16, 64, 256):
            x = jax.random.normal(jax.random.fold_in(key, rows), (rows, k), jnp.bfloat16)
            ref = jnp.dot(x.astype(jnp.float32), wd.T, precision=jax.lax.Precision.HIGHEST)
            y = quantized_matmul(x, qw, config=DEFAULT)
            path = select_path(rows, DEFAULT) + (" (dense)" if qmm_dense(rows, (n, k), DEFAULT) else "")
            T.record(phase="check", n=n, k=k, rows=rows, path=path, rel_err=_rel(y, ref),
                     finite=bool(jnp.all(jnp.isfinite(y))))
        x = jax.random.normal(jax.random.fold_in(key, 99), (8, k), jnp.bfloat16)
        multi = quantized_matmul(x, qw, path="multirow", config=DEFAULT)
        alone = jnp.concatenate([quantized_matmul(x[i:i + 1], qw, path="qmv", config=DEFAULT) for i in range(8)])
        ref8 = jnp.dot(x.astype(jnp.float32), wd.T, precision=jax.lax.Precision.HIGHEST)
        T.record(phase="check", n=n, k=k, rows=8, what="multirow_vs_qmv_bitwise",
                 equal=bool(jnp.array_equal(multi, alone)), rel_err=_rel(multi, ref8))
        x32 = jax.random.normal(jax.random.fold_in(key, 7), (32, k), jnp.bfloat16)
        tiled = DispatchConfig(qmm_dense_rows=0)
        a = quantized_matmul(x32, qw, path="qmm", config=tiled)
        b = quantized_matmul(x32[:16], qw, path="qmm", config=tiled)
        T.record(phase="check", n=n, k=k, rows=32, what="qmm_row_independent_of_other_rows",
                 equal=bool(jnp.array_equal(a[:16], b)))


def table_phase(T, key, quick, only=None, rows_only=None):
    shapes = only or (SHAPES[:2] if quick else SHAPES)
    for n, k in T.sweep(shapes, "table"):
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
            dense = qmm_dense(rows, (n, k), DEFAULT)
            variants = [("pallas", select_path(rows, DEFAULT) + (" (dense)" if dense else ""),
                         lambda x, w: quantized_matmul(x, w, config=DEFAULT))]
            if rows in (2, 4, 8):  # multirow rows
                off = DispatchConfig(multirow=False)
                variants.append(("pallas", "qmv-per-row", lambda x, w, c=off: quantized_matmul(x, w, config=c)))
            if rows in (4, 8):
                variants.append(("pallas", "qmm-forced", lambda x, w: quantized_matmul(x, w, path="qmm", config=DEFAULT)))
            if dense:  # the tiled kernel where the dense fallback takes the default
                tiled = DispatchConfig(qmm_dense_rows=0)
                variants.append(("pallas", "qmm-tiled", lambda x, w, c=tiled: quantized_matmul(x, w, config=c)))
            if rows in (1, 8) or rows >= 64:
                xla = DispatchConfig(backend="xla")
                variants.append(("xla", "dequant+dot", lambda x, w, c=xla: quantized_matmul(x, w, config=c)))
            for backend, path, op in variants:
                T.measure(dict(phase="table", n=n, k=k, rows=rows, backend=backend, path=path, floor_us=floor_us),
                          op, xs, qws, nbytes=qb)
        del qws


# GEMV launches around the default (changes to gemv_tiling's Tiling; split_mult scales its split).
GEMV_VARIANTS = {"default": {}, "split x2": dict(split_mult=2), "split x4": dict(split_mult=4),
                 "split /2": dict(split_mult=0.5), "block_n 128": dict(block_n=128),
                 "2 groups/step": dict(groups_per_step=2), "warps 2": dict(num_warps=2), "warps 8": dict(num_warps=8),
                 "stages 2": dict(num_stages=2), "stages 4": dict(num_stages=4), "xsum input": dict(xsum="input"),
                 "block_n 128, xsum input": dict(block_n=128, xsum="input")}


def gemv_sweep(T, key, quick, only=None, names=None):
    """`launch.gemv` with explicit tilings around `gemv_tiling` at 1 and 8 rows (1 row off the MLP shapes)."""
    variants = {nm: v for nm, v in GEMV_VARIANTS.items() if not names or nm in names}
    if quick:
        variants = dict(list(variants.items())[:3])
    for n, k in T.sweep(only or SHAPES, "sweep"):
        if T.past_deadline():
            return
        nsets = n_sets_for(qbytes(n, k))
        ws = weight_sets(key, n, k, nsets)
        default = gemv_tiling((n, k), FMT.group)
        for rows in ((1, 8) if (n, k) in SHAPES[:2] else (1,)):
            xs = activations(key, 1000, (rows, k), nsets)
            for name, v in variants.items():
                if T.past_deadline():
                    return
                v = dict(v)
                mult = v.pop("split_mult", 1)
                tiling = dataclasses.replace(default, **v,
                                             split_k=max(1, min(int(default.split_k * mult), k // FMT.group)))
                T.measure(dict(phase="sweep", n=n, k=k, rows=rows, variant=name, tiling=tiling_dict(tiling),
                               floor_us=qbytes(n, k) / T.bw * 1e6),
                          lambda x, w, tl=tiling: gemv(x, (w,), tl, interpret=INTERPRET)[0], xs, ws)
        del ws


# qmm launches around the default (changes to qmm_tiling's Tiling at the measured row count).
QMM_VARIANTS = {"default": {}, "split 1": dict(split_k=1), "warps 8": dict(num_warps=8),
                "block_n 64": dict(block_n=64), "tile_m 128, warps 8": dict(block_m=128, num_warps=8),
                "tile_m 128, n 256, warps 8": dict(block_m=128, block_n=256, num_warps=8),
                # 256 x 128 with 3 stages asks 240 KiB of shared memory (the H200 has 227): 2 stages
                "tile_m 256, warps 8, stages 2": dict(block_m=256, num_warps=8, num_stages=2),
                "4 groups/step": dict(groups_per_step=4)}


def tiles_phase(T, key, quick, rows_list=None, names=None, shapes=None):
    """`launch.qmm` with explicit tilings around `qmm_tiling`, next to the bf16 dot of the same shape and rows."""
    for n, k in T.sweep(shapes or [(15360, 3840), (3840, 15360)], "tiles"):
        nq = n_sets_for(qbytes(n, k))
        qws = weight_sets(key, n, k, nq)
        row_counts = rows_list or ((64, 512) if quick else (16, 64, 128, 512))
        for rows in row_counts:
            xs = activations(key, 3000, (rows, k), nq)
            base = qmm_tiling(rows, (n, k), FMT.group, DEFAULT)
            for name, v in QMM_VARIANTS.items():
                if names and name not in names:
                    continue
                if T.past_deadline():
                    return
                tiling = dataclasses.replace(base, **v)
                T.measure(dict(phase="tiles", n=n, k=k, rows=rows, variant=name, tile_m=tiling.block_m,
                               split_k=tiling.split_k, tiling=tiling_dict(tiling), floor_us=qbytes(n, k) / T.bw * 1e6),
                          lambda x, w, tl=tiling: qmm(x, (w,), tl, interpret=INTERPRET)[0], xs, qws)
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


def summary(path):
    rows = [json.loads(l) for l in open(path)]
    print("\n== check ==")
    for r in rows:
        if r["phase"] == "check":
            print({k: v for k, v in r.items() if k not in ("phase", "time")})
    print("\n== gemv sweep: us (% floor), variant: block_n split warps stages groups/step xsum ==")
    for r in rows:
        if r["phase"] == "sweep" and "us" in r:
            t = r["tiling"]
            print(f"{r['n']:>6}x{r['k']:<6} r={r['rows']} {r['us']:7.1f} ({100 * r['floor_us'] / r['us']:4.1f}%) "
                  f"{r['variant']:<24} {t['block_n']:>3} {t['split_k']:>3} {t['num_warps']} {t['num_stages']} "
                  f"{t['groups_per_step']} {t['xsum']}")
    print("\n== qmm tiles: us ==")
    for r in rows:
        if r["phase"] == "tiles" and "us" in r:
            print(f"{r['n']:>6}x{r['k']:<6} rows={r['rows']:<4} tile_m={r['tile_m']:<3} split={r['split_k']:<2} "
                  f"{r.get('variant', ''):<30} {r['us']:8.1f} us")
    errs = [r for r in rows if "error" in r]
    print(f"\nerrors: {len(errs)}", *(e.get("error", "")[:160] for e in errs[:3]), sep="\n")
    print("\n== table: us ==")
    for r in rows:
        if r["phase"] == "table" and "us" in r:
            print(f"{r['n']:>6}x{r['k']:<6} rows={r['rows']:<4} {r['backend']:<10} {r['path']:<14} "
                  f"{r['us']:8.1f} us  {100 * r['floor_us'] / r['us']:5.1f}% floor")


def _ints(s):
    return s and [int(v) for v in s.split(",")]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="out/kernels")
    ap.add_argument("--phase", default="check,table", help="comma-separated: check, table, sweep, tiles")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--shapes", default=None,
                    help="table, sweep and tiles phases: NxK,NxK of SHAPES or EXTRA_SHAPES (default: table and "
                         "sweep all of SHAPES, the table the two MLP shapes with --quick; tiles the two MLP shapes)")
    ap.add_argument("--check-shapes", default="15360x3840,3840x15360,2048x3840", help="check phase: NxK,NxK")
    ap.add_argument("--table-rows", default=None, help="table phase only: row counts, e.g. 1,8,64,256")
    ap.add_argument("--tile-rows", default=None, help="tiles phase only: row counts, e.g. 512")
    ap.add_argument("--variants", default=None,
                    help="sweep / tiles phases: GEMV_VARIANTS / QMM_VARIANTS names (and 'bf16 dot'), ';'-separated")
    ap.add_argument("--deadline", type=float, default=None,
                    help="seconds after start past which no new measurement starts (then the summary)")
    ap.add_argument("--commit", default=None, help="the commit to name in the results (default: git rev-parse)")
    ap.add_argument("--quiet", action="store_true", help="no progress bars (shown on stderr only when it is a terminal)")
    ap.add_argument("--format", default="4/64", help="the weights: BITS/GROUP[/f32] (f32: float32 scales and "
                                                     "biases, as the exact GGUF loads keep them), e.g. 8/32/f32")
    args = ap.parse_args(argv)
    global FMT
    try:
        FMT = Format.parse(args.format)
    except ValueError as e:
        ap.error(str(e))
    def shapes(flag, text):
        out = [tuple(int(v) for v in s.split("x")) for s in text.split(",")]
        known = SHAPES + EXTRA_SHAPES + SHAPES_270M
        unknown = [s for s in out if s not in known]
        if unknown:
            ap.error(f"{flag} {unknown}: not among the benchmark shapes {known}")
        return out

    only = shapes("--shapes", args.shapes) if args.shapes else None
    check_shapes = shapes("--check-shapes", args.check_shapes)
    phases = args.phase.split(",")
    bad = [p for p in phases if p not in ("check", "table", "sweep", "tiles")]
    if bad:
        ap.error(f"--phase {bad}: expected check, table, sweep or tiles")
    names = args.variants and args.variants.split(";")
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "kernels.jsonl")
    env = environment(args.commit)
    bw = hbm_bandwidth()
    T = Timer(path, bw, quiet=args.quiet)
    if args.deadline:
        T.deadline = START + args.deadline
    T.record(phase="env", **env, format=str(FMT), hbm_tbps=bw / 1e12, empty_call_us=T.empty * 1e6, argv=sys.argv)
    print(env, f"HBM {bw / 1e12:.2f} TB/s, empty call {T.empty * 1e6:.0f} us", flush=True)
    key = jax.random.key(0)
    run = {"check": lambda: check_phase(T, key, check_shapes),
           "table": lambda: table_phase(T, key, args.quick, only, _ints(args.table_rows)),
           "sweep": lambda: gemv_sweep(T, key, args.quick, only, names),
           "tiles": lambda: tiles_phase(T, key, args.quick, _ints(args.tile_rows), names, only)}
    for phase in phases:
        t0 = time.time()
        try:
            run[phase]()
        except Exception:
            traceback.print_exc()
        T.bar.close()  # a phase cut by the deadline leaves its bar open
        print(f"phase {phase} took {time.time() - t0:.0f}s", flush=True)
    summary(path)


if __name__ == "__main__":
    main()
