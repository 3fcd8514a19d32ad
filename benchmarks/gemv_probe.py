"""Where a GEMV launch's time goes (run on the GPU): the two GEMV kernels next to Pallas kernels that
only read the same bytes with the same grid and blocks (no dequantizing, no arithmetic), and an
XLA reduction over the packed words; each timed with the kernel benchmark's harness.

    python benchmarks/gemv_probe.py --out DIR [--shape 15360x3840] [--rows 1,8]
    XLA_PYTHON_CLIENT_PREALLOCATE=false ncu --clock-control none python benchmarks/gemv_probe.py --once ...
        # hardware counters (kernel replay saves and restores device memory: no preallocation)

If the stream kernels run at the GEMV's speed, the load structure (grid, block, bytes in flight)
is the bound, not the dequantizing; if they run near the XLA reduction, the arithmetic is.
`--once` calls each variant once on one weight set (for ncu, which replays every launch).
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import sys

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

from harness import environment, hbm_bandwidth, no_command_buffers, sync  # noqa: E402
from kernel_bench import GROUP, Timer, activations, n_sets_for, qbytes, weight_sets  # noqa: E402
from pallas_kernels import DispatchConfig, quantized_matmul, with_sb_layout, with_w_layout  # noqa: E402
from pallas_kernels.codes import load_sb_tiles  # noqa: E402
from pallas_kernels.dispatch import launcher  # noqa: E402
from pallas_kernels.gemv import GemvTiling  # noqa: E402
from pallas_kernels.kernel import MMA_ROWS, Tiling, split_groups  # noqa: E402
from pallas_kernels.mosaic_qmm import mosaic_qmm  # noqa: E402
from pallas_kernels.quant import word_tiles  # noqa: E402
from pallas_kernels.tiling import fma_gemv_tiling, gemv_tiling, mosaic_tiling, qmm_tiling, split_for  # noqa: E402


def _stream_kernel(w_ref, s_ref, b_ref, o_ref, *, n, block_n, gps, n_groups, groups_per_split, with_sb, sb_kn,
                   tiles):
    pid_n, pid_s = pl.program_id(0), pl.program_id(1)
    n0 = pid_n * block_n
    col_ok = (n0 + jnp.arange(block_n)) < n
    g_start = pid_s * groups_per_split
    g_end = jnp.minimum(g_start + groups_per_split, n_groups)
    wpg = w_ref.shape[-1]

    def step(i, acc):
        g = g_start + i * gps
        g_ok = (g + jnp.arange(gps)) < g_end
        if tiles:  # [N/block_n, groups, block_n, words]: the step's tiles are one contiguous run
            mask = jnp.broadcast_to(g_ok[:, None, None], (gps, block_n, wpg))
            w = pltriton.load(w_ref.at[pid_n, pl.ds(g, gps), :, :], mask=mask, other=0)
            acc = acc + jnp.sum(w, axis=(0, 2))
        else:
            mask = jnp.broadcast_to(col_ok[:, None, None] & g_ok[None, :, None], (block_n, gps, wpg))
            w = pltriton.load(w_ref.at[pl.ds(n0, block_n), pl.ds(g, gps), :], mask=mask, other=0)
            acc = acc + jnp.sum(w, axis=(1, 2))
        if with_sb:  # the scale and bias bytes the GEMV also reads, folded in as bits
            for v in load_sb_tiles(s_ref, b_ref, n0, block_n, g, gps, col_ok, g_ok, sb_kn):
                acc = acc + jnp.sum(jax.lax.bitcast_convert_type(v, jnp.uint16).astype(jnp.uint32), axis=1)
        return acc

    steps = pl.cdiv(g_end - g_start, gps)
    acc = jax.lax.fori_loop(0, steps, step, jnp.zeros((block_n,), jnp.uint32))
    pltriton.store(o_ref.at[pid_s, pl.ds(n0, block_n)], acc, mask=col_ok)


def stream(qw, *, block_n, gps, split_k, num_warps=4, num_stages=1, with_sb=True, tiles=False, interpret=None):
    """Read qw's words (and scales and biases) with a GEMV's grid and blocks; return a checksum. With
    `tiles`, from a tile-major copy (quant.word_tiles, made inside the op: time it with ncu or a trace,
    whose 'stream' filter leaves the copy out)."""
    n, k = qw.shape
    interpret = jax.default_backend() != "gpu" if interpret is None else interpret
    n_groups = k // qw.group_size
    split, per_split = split_groups(n_groups, split_k)
    words = qw.words()  # MLX's rows (a copy inside the op for "tiles" weights; ncu's filter skips it)
    w3 = word_tiles(words, block_n, words.shape[1] // n_groups) if tiles else words.reshape(n, n_groups, -1)
    kern = functools.partial(_stream_kernel, n=n, block_n=block_n, gps=gps, n_groups=n_groups,
                             groups_per_split=per_split, with_sb=with_sb, sb_kn=qw.sb_layout == "kn", tiles=tiles)
    return pl.pallas_call(
        kern, out_shape=jax.ShapeDtypeStruct((split, n), jnp.uint32), grid=(pl.cdiv(n, block_n), split),
        interpret=interpret, compiler_params=None if interpret else pltriton.CompilerParams(
            num_warps=num_warps, num_stages=num_stages),
        name=f"stream_{'tiles_' if tiles else ''}n{block_n}_g{gps}_s{split}",
    )(w3, qw.scales, qw.biases)


def launched(tiling):
    """op(x, qw) running one tiling's kernel directly (the dispatch would pick its own tiling)."""
    return lambda x, w: launcher(tiling)(x, w, tiling, interpret=False)


def mosaic_variants(shape, rows):
    """The Mosaic GPU kernel (pallas_kernels/mosaic_qmm.py) at the dispatch's tiling, with 4 groups per
    step, with two weight blocks per program (the sweep: benchmarks/mosaic_sweep.py), and reading a
    tile-major copy of the words (made inside the op: compare kernel times, ncu or --trace)."""
    v = {}
    for name, choices in (("", {}), (" G4", {"groups_per_step": 4}), (" n2", {"n_sub": 2}),
                          (" tiles", {"w_tiles": True}), (" G4 tiles", {"groups_per_step": 4, "w_tiles": True})):
        t = mosaic_tiling(rows, shape, GROUP, **choices)
        v[f"mosaic m{t.tile_m}{name}"] = lambda x, w, t=t: mosaic_qmm(x, w, t)
    return v


def k_groups(shape):
    return shape[1] // GROUP


def variants(shape, rows):
    """name -> op(x, qw). The GEMVs as the dispatch launches them, and stream kernels with their grids."""
    mma_t = gemv_tiling(shape, GROUP, DispatchConfig(gemv_kernel="mma"))
    fma_t = fma_gemv_tiling(shape, GROUP, DispatchConfig(gemv_kernel="fma"))
    mma_cfg, fma_cfg = DispatchConfig(gemv_kernel="mma"), DispatchConfig(gemv_kernel="fma")
    if rows > MMA_ROWS:  # the tiled GEMM, both bodies, next to a bf16 dense matmul of the same shape
        qmm = {d: qmm_tiling(rows, shape, GROUP, DispatchConfig(dequant=d)) for d in ("codes", "weights")}
        v = {f"qmm {d}": launched(t) for d, t in qmm.items()}
        v["qmm default"] = lambda x, w: quantized_matmul(x, w)
        for g, bm, nw in ((1, 64, 4), (4, 64, 4), (2, 128, 8)):  # the dequantize-first body, other dots
            t = dataclasses.replace(qmm["weights"], groups_per_step=g, block_m=bm, num_warps=nw)
            v[f"qmm weights g{g} m{bm} w{nw}"] = launched(t)
        # session 10: the GEMV's codes body (weight on the left of the dot, exact codes, kpairs) at tall
        # tiles: it unpacks each weight once per block_m rows and scales the small product per group
        # (2 FMAs per output and group: 1/32 of the MACs), where the dequantize-first body makes a
        # shared-memory bf16 tile per step
        for bm, bn, nw, xs, target in ((64, 64, 4, "reduce", 1920), (64, 64, 4, "input", 1920),
                                       (128, 64, 4, "input", 1920), (128, 64, 4, "input", 960),
                                       (128, 128, 8, "input", 960), (256, 64, 8, "input", 960)):
            programs = -(-shape[0] // bn) * -(-rows // bm)
            t = Tiling(block_m=bm, block_n=bn, groups_per_step=1, w_left=True, unpack="kpairs", dequant="codes",
                       num_warps=nw, num_stages=3, xsum=xs, split_k=split_for(programs, k_groups(shape), target))
            v[f"qmm wl m{bm} n{bn} w{nw} {xs} p{target}"] = launched(t)
        v.update(mosaic_variants(shape, rows))
        v.update(qmm_sweep13(shape, rows))
        dense = jax.random.normal(jax.random.PRNGKey(7), shape, jnp.bfloat16)  # a captured constant operand
        v["bf16 dot"] = lambda x, w: x @ dense.T
        return v, {k: str(t) for k, t in qmm.items()}
    path = "qmv" if rows == 1 else "multirow"
    v = {
        "gemv mma": lambda x, w: quantized_matmul(x, w, path=path, config=mma_cfg),
        "gemv fma": lambda x, w: quantized_matmul(x, w, path=path, config=fma_cfg),
        "xla sum(words)": lambda x, w: jnp.sum(w.weight, dtype=jnp.uint32),
    }
    for name, t in (("mma", mma_t), ("fma", fma_t)):
        for stages in (1, 3):
            v[f"stream {name}-grid st{stages}"] = functools.partial(
                lambda x, w, t, st: stream(w, block_n=t.block_n, gps=t.groups_per_step, split_k=t.split_k,
                                           num_stages=st), t=t, st=stages)
    # session 11: the same grids reading a tile-major copy of the words (each step's [block_n, group]
    # tiles contiguous), to tell the grid's pure read from the GEMV's per-group chain (docs/kernels.md,
    # entry 12: every GEMV launch measured takes 20-22 us)
    for block_n, gps, split in ((mma_t.block_n, mma_t.groups_per_step, mma_t.split_k), (64, 1, 4), (64, 4, 4),
                                (128, 1, 4), (64, 8, 1)):
        v[f"stream tiles n{block_n} g{gps} s{split}"] = functools.partial(
            lambda x, w, b, g, s: stream(w, block_n=b, gps=g, split_k=s, tiles=True), b=block_n, g=gps, s=split)
    for block_n, gps, split in ((64, 8, 1), (32, 16, 1), (16, 32, 1), (128, 4, 4), (256, 2, 4), (64, 16, 2)):
        for warps in (4, 8):
            v[f"stream n{block_n} g{gps} s{split} w{warps}"] = functools.partial(
                lambda x, w, b, g, s, nw: stream(w, block_n=b, gps=g, split_k=s, num_warps=nw),
                b=block_n, g=gps, s=split, nw=warps)
    # the GEMVs at the launch shapes whose stream kernels read fastest (more bytes per row per step)
    for b, g, sp, nw in ((64, 8, 4, 4), (64, 8, 4, 8), (32, 16, 4, 4), (64, 16, 2, 8), (16, 32, 2, 4)):
        t = GemvTiling(block_n=b, groups_per_step=g, split_k=sp, num_warps=nw)
        v[f"gemv fma n{b} g{g} s{sp} w{nw}"] = launched(t)
    # the CUDA-core GEMV's launch shapes at the dispatch's own split (registers per row against x
    # reuse: a thread holds block_n * groups_per_step * 8 / (32 * warps) words, several n rows of them
    # sharing one loaded input), with and without word-quad chains (the no-prefetch and 8-warp
    # launches lost at 8 rows in session 5's first sweep and were dropped)
    for b, g in ((128, 1), (256, 1), (64, 2), (128, 2), (64, 4), (32, 8)):
        for chains in (False, True):
            base = fma_gemv_tiling(shape, GROUP, DispatchConfig(gemv_kernel="fma", gemv_block_n=b))
            t = GemvTiling(block_n=b, groups_per_step=g, split_k=base.split_k, chains=chains)
            v[f"fma sweep n{b} g{g} c{int(chains)}"] = launched(t)
    # (128 x 1 at split 4 and 8: one group per step keeps 127 registers, so 4 programs fit an SM and
    # 480 programs run in one wave with half the groups each; docs/kernels.md, "Next steps")
    for b, g, sp in ((128, 4, 4), (64, 8, 2), (64, 16, 2), (128, 2, 4), (128, 1, 4), (128, 1, 8), (64, 1, 8)):
        t = Tiling(block_m=MMA_ROWS, block_n=b, groups_per_step=g, split_k=sp, w_left=True)
        v[f"gemv mma n{b} g{g} s{sp}"] = launched(t)
    # the code unpacking: the dispatch's launch with the pre-session-6 broadcast unpack (a shared-
    # memory load and store per weight) against the join unpack at other grids (log entry 7)
    v["gemv mma bcast"] = launched(dataclasses.replace(mma_t, unpack="broadcast"))
    for b, g, sp, nw in ((128, 1, 4, 4), (128, 1, 8, 4), (64, 1, 4, 4), (64, 1, 8, 4), (256, 1, 2, 4),
                         (256, 1, 4, 8), (128, 2, 2, 4), (128, 1, 2, 8)):
        t = Tiling(block_m=MMA_ROWS, block_n=b, groups_per_step=g, split_k=sp, w_left=True, num_warps=nw)
        v[f"mma join n{b} g{g} s{sp} w{nw}"] = launched(t)
    # the paired unpack (two codes per shift + LOP3) at four grids (the scale/bias prefetch measured
    # beside it in session 6 lost and was removed)
    for b, sp in ((128, 2), (64, 8), (64, 4), (128, 4)):
        t = Tiling(block_m=MMA_ROWS, block_n=b, groups_per_step=1, split_k=sp, w_left=True, unpack="pairs")
        v[f"mma pairs n{b} s{sp}"] = launched(t)
    # the kpairs unpack (the pairs read as the MMA operand, no shared-memory round trip in pip
    # Triton's build; log entry 7) at the default grid and two others, at 2 pipeline stages (the
    # default in log entry 9) and 3 (the default again since entry 10)
    for b, sp in ((64, 8), (64, 4), (128, 4)):
        for stages in (2, 3):
            t = Tiling(block_m=MMA_ROWS, block_n=b, groups_per_step=1, split_k=sp, w_left=True, unpack="kpairs",
                       num_stages=stages)
            v[f"mma kpairs n{b} s{sp} st{stages}"] = launched(t)
    # session 9: the dispatch's launch on MLX-layout weights (scales and biases [N, K/g]: a group's
    # block_n values 2*K/g bytes apart; the weight sets are "kn" like the models': 29.2 against 20.7
    # us under ncu, log entry 10) at 2 and 3 stages. The conversion is a separate XLA kernel here
    # (ncu's q4 filter skips it; the harness times include it).
    for stages in (2, 3):
        t = dataclasses.replace(mma_t, num_stages=stages)
        v[f"mma nk st{stages}"] = lambda x, w, t=t: launcher(t)(x, with_sb_layout(w, "nk"), t, interpret=False)
    v.update(mosaic_variants(shape, rows))
    # session 10: on "kn" weights, around the default launch: where each group's sum(x) comes from
    # (kernel.Tiling.xsum; ncu: 21.2 -> 18.8 us at n128 s16 input, no gain in the whole model) and wider tiles (fewer instructions per weight in pip Triton's SASS:
    # 4.69 at n64, 3.31 at n128, 3.05 at n128 with the wrapper's sums)
    for b, sp, nw, gps in ((64, 8, 4, 1), (128, 16, 4, 1), (128, 8, 4, 1), (256, 16, 8, 1), (32, 4, 4, 1),
                           (64, 4, 4, 2)):
        for xs in ("reduce", "input"):  # ("mma", a ones-tile dot: never the best, removed)
            t = dataclasses.replace(mma_t, block_n=b, split_k=min(sp, k_groups(shape) // 4), num_warps=nw,
                                    groups_per_step=gps, xsum=xs)
            v[f"kn n{b} s{sp} w{nw} g{gps} {xs}"] = launched(t)
    # dequantize-first (s*q + b per weight, one accumulating dot per step of g groups; dq_kernel.py)
    for b, g, sp, nw in ((128, 1, 2, 4), (128, 2, 2, 4), (128, 4, 2, 4), (128, 2, 4, 4), (64, 2, 4, 4),
                         (64, 4, 4, 4), (64, 2, 8, 4), (256, 2, 2, 8)):
        t = Tiling(block_m=MMA_ROWS, block_n=b, groups_per_step=g, split_k=sp, w_left=True, num_warps=nw,
                   dequant="weights")
        v[f"mma dq n{b} g{g} s{sp} w{nw}"] = launched(t)
    v.update(layout_variants(mma_t, fma_t))
    v.update(gemv_sweep13(shape, mma_t, fma_t))
    return v, {"mma": str(mma_t), "fma": str(fma_t)}


def layout_variants(mma_t, fma_t):
    """Session 12: the tensor-core GEMV on MLX's row-major words and on 64-row tiles per group
    (QuantizedWeight.w_layout). Tile-major pure streams took 11.2 us against 21.0 row-major at the
    GEMV's grid (docs/kernels.md, log entry 13). Call 2 ran 1-3 pipeline stages, two groups per step
    and a loaded-ahead next group (29-39 us, removed); this set: wider blocks (more bytes per load),
    with the wrapper's group sums; and the CUDA-core GEMV. The weight sets come in the models' layout
    (tiles unless $JAXSPEC_W_LAYOUT=rows), so the other layout's variants convert inside the op (a
    separate XLA kernel): compare with ncu (its q4 filter skips the copy) or set the env."""
    v = {}
    for layout in ("rows", "tiles"):
        for b, sp, nw, st, xs in ((64, mma_t.split_k, 4, 3, "reduce"), (64, mma_t.split_k, 4, 1, "reduce"),
                                  (64, mma_t.split_k, 4, 3, "input"), (128, 8, 4, 3, "reduce"), (128, 16, 4, 3, "input"),
                                  (128, 8, 8, 3, "reduce"), (256, 8, 8, 3, "reduce"), (256, 16, 8, 2, "input")):
            t = dataclasses.replace(mma_t, block_n=b, split_k=sp, num_warps=nw, num_stages=st, xsum=xs)
            name = f"s12 {layout} n{b} s{sp} w{nw} st{st} {xs}"
            v[name] = lambda x, w, t=t, lay=layout: launcher(t)(x, with_w_layout(w, lay), t, interpret=False)
        # the CUDA-core GEMV (no MMA, no barrier, loads a step ahead) at its default and one group per step
        for t in (fma_t, dataclasses.replace(fma_t, groups_per_step=1)):
            v[f"s12 {layout} fma n{t.block_n} g{t.groups_per_step} s{t.split_k}"] = (
                lambda x, w, t=t, lay=layout: launcher(t)(x, with_w_layout(w, lay), t, interpret=False))
    return v


def qmm_sweep13(shape, rows):
    """Session 13: the dequantize-first qmm on tiles with smaller and more programs (several per SM, so
    one program's dequantizing can overlap another's MMA), around the default (64 x 128, 2 groups,
    split to ~132 programs), at 64-256 rows (session 13, call 2: none beat it)."""
    base = qmm_tiling(rows, shape, GROUP, DispatchConfig(qmm_dense_rows=0))
    v = {}
    for bm, bn, gps, nw, st, target in ((64, 64, 2, 4, 3, 132), (64, 64, 2, 4, 3, 528), (64, 64, 1, 4, 3, 528),
                                        (128, 64, 2, 4, 3, 264), (128, 64, 2, 8, 3, 264), (128, 128, 2, 8, 2, 264),
                                        (64, 128, 2, 4, 4, 264), (32, 128, 2, 4, 3, 264), (128, 32, 2, 4, 3, 528)):
        programs = -(-shape[0] // bn) * -(-rows // bm)
        t = dataclasses.replace(base, block_m=bm, block_n=bn, groups_per_step=gps, num_warps=nw, num_stages=st,
                                split_k=split_for(programs, k_groups(shape), target))
        v[f"s13 qmm m{bm} n{bn} g{gps} w{nw} st{st} p{target}"] = launched(t)
    v["s13 qmm tiled default"] = launched(base)
    return v


def gemv_sweep13(shape, mma_t, fma_t):
    """Session 13: the tensor-core GEMV's K split and block width for the tall tied head (262144x3840:
    before session 13 the default ran it unsplit, n64 s1: 4096 programs of 60 groups; n128 s4 with
    the wrapper's sums is its default since), and the CUDA-core GEMV."""
    v = {}
    for b, sp, xs in ((64, 1, "reduce"), (64, 2, "reduce"), (64, 4, "reduce"), (64, 8, "reduce"), (128, 1, "reduce"),
                      (128, 2, "reduce"), (128, 4, "input"), (64, 4, "input")):
        t = dataclasses.replace(mma_t, block_n=b, split_k=sp, xsum=xs)
        v[f"s13 gemv n{b} s{sp} {xs}"] = launched(t)
    v["s13 fma default"] = launched(fma_t)
    return v


def device_times(T, log_dir):
    """Trace the last timed call once: per op, the device's summed kernel time, our kernels' share,
    and first-kernel-start to last-kernel-end (what the harness's wall time adds is host cost)."""
    from profile_forward import kernel_events, read_trace
    f, xs, ws = T.last
    with jax.profiler.trace(log_dir, create_perfetto_trace=True):
        sync(f(xs, ws))
    events, _ = kernel_events(read_trace(log_dir))
    ops = len(xs)
    ours = [e for e in events if any(t in e["name"] for t in ("q4", "stream"))]
    start = min(float(e["ts"]) for e in events)
    end = max(float(e["ts"]) + float(e.get("dur", 0.0)) for e in events)
    return {"device_us": sum(float(e.get("dur", 0.0)) for e in events) / ops,
            "kernel_us": sum(float(e.get("dur", 0.0)) for e in ours) / ops,
            "span_us": (end - start) / ops, "kernels_per_op": len(events) / ops}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="out")
    p.add_argument("--shape", default="15360x3840")
    p.add_argument("--rows", default="1,8")
    p.add_argument("--only", default="", help="comma-separated substrings of variant names (=NAME: exactly)")
    p.add_argument("--once", action="store_true", help="one call per variant, for ncu")
    p.add_argument("--trace", default="", help="comma-separated substrings: trace these variants once "
                   "(device kernel time per op next to the harness's)")
    a = p.parse_args(argv)
    if a.trace:
        no_command_buffers()  # traced kernels must be launched one by one (all variants, for a fair table)
    n, k = (int(s) for s in a.shape.split("x"))
    os.makedirs(a.out, exist_ok=True)
    key = jax.random.PRNGKey(0)
    count = 1 if a.once else n_sets_for(qbytes(n, k))
    ws = weight_sets(key, n, k, count)
    env = environment()
    T = None if a.once else Timer(os.path.join(a.out, "probe.jsonl"), hbm_bandwidth())
    table = []
    for rows in (int(r) for r in a.rows.split(",")):
        xs = activations(key, 1000 * rows, (rows, k), count)
        ops, tilings = variants((n, k), rows)
        for name, op in ops.items():
            if a.only and not any(name == s[1:] if s.startswith("=") else s in name for s in a.only.split(",")):
                continue
            if rows > 1 and name.startswith(("stream", "xla")):
                continue  # the stream kernels do not depend on rows
            if a.once:
                sync(jax.jit(op)(xs[0], ws[0]))
                print("ran", name, rows, flush=True)
                continue
            row = dict(phase="probe", n=n, k=k, rows=rows, variant=name, tilings=tilings, **env)
            if a.trace and any(t in name for t in a.trace.split(",")):
                try:
                    T.time_ops(op, xs, ws)
                    row.update(device_times(T, os.path.join("/tmp/gemv_probe_trace", f"{len(table)}")))
                except Exception as e:  # a failed trace must not stop the probe
                    row["trace_error"] = repr(e)[:300]
            row = T.measure(row, op, xs, ws, nbytes=qbytes(n, k))
            table.append(row)
            print(json.dumps({kk: row.get(kk) for kk in ("variant", "rows", "us", "tbps", "kernel_us", "span_us",
                                                         "error")}), flush=True)
    if table:
        print(f"\n{n}x{k}, floor {qbytes(n, k) / T.bw * 1e6:.1f} us at {T.bw / 1e12:.2f} TB/s (copy probe)")
        print("us: harness wall per op; kernel/span: traced device time per op (our kernels; first start"
              " to last end)")
        print(f"{'variant':34s} {'rows':>4s} {'us':>8s} {'old':>6s} {'TB/s':>6s} {'kernel':>7s} {'span':>7s}")
        for r in table:
            us = f"{r['us']:8.1f} {r['us_old_harness']:6.1f}" if "us" in r else "   error       "
            tb = f"{r['tbps']:6.2f}" if "tbps" in r else "      "
            tr = f"{r['kernel_us']:7.1f} {r['span_us']:7.1f}" if "kernel_us" in r else ""
            print(f"{r['variant']:34s} {r['rows']:4d} {us} {tb} {tr}")


if __name__ == "__main__":
    main()
