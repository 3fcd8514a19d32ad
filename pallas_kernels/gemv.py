"""The GEMV kernel for 1..8 rows on CUDA cores ("fma"): no tensor cores, no shared memory, about
four instructions per weight.

A 4-bit decode reads 0.56 bytes per weight, so at HBM speed an H200 can issue only about four
instructions per weight. Here each code costs one shift and one LOP3, which put it at the top of a
float32 mantissa ORed with the exponent of 1.0, so it reads as `1 + q/2^bits` with no int->float
convert, and one FMA into its input. Per group of g inputs `sum_i x_i (1 + q_i/2^bits) = sum(x) +
(x.q)/2^bits`, so

    x . (s*q + b) = 2^bits * s * t + (b - 2^bits * s) * sum(x),    t = sum_i x_i (1 + q_i/2^bits)

and scales, biases and the row's group sums touch each group once. The packed words and the scales
and biases are read in either stored layout (`QuantizedWeight.w_layout`, `sb_layout`).
The wrapper hands the kernel a float32 copy of the (small) activation as `[rows, groups, code,
word]`, so code j of a thread's words meets one contiguous vector of inputs, and the group sums.

Rows are an unrolled static loop around the same per-row arithmetic, with the unpacked codes
shared: row i's result is bitwise the same whether it is computed alone or among up to 7 others
(the row invariance greedy speculative decoding relies on; a launch shape never depends on the row
count). Each extra row costs one more FMA per weight, so rows=8 costs more than rows=1 here, unlike
the tensor-core kernel in kernel.py. Measured on the H200 with Nsight Compute (docs/kernels.md, log
entries 5-6; 15360x3840, floor 7.7 us): 20 us at one row against 54 for that kernel, 79 us at its
best 8-row launch against 52; so it is an option (gemv_kernel="fma"), not the default.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from . import codes
from .kernel import fold_splits, pad_by, pad_to, split_groups
from .quant import QuantizedWeight

@dataclasses.dataclass(frozen=True)
class GemvTiling:
    """block_n: output columns per program; groups_per_step: quantization groups per loop iteration
    (bytes in flight per thread); split_k: programs along K (float32 partial sums added outside);
    chains: each thread folds its four contiguous words of a group into one FMA chain per row
    (one accumulator per row and word quad instead of one per word: 4x fewer registers at 8 rows);
    prefetch: load the next step's packed words before this step's arithmetic (software pipelining
    by hand: Triton's pipeliner only takes loads that feed a `dot`)."""

    block_n: int = 128
    groups_per_step: int = 1
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 1
    prefetch: bool = True
    chains: bool = False


def _kernel(x_ref, xs_ref, w_ref, s_ref, b_ref, o_ref, *, rows, n, bits, tiling, n_groups, groups_per_split,
            interpret, sb_kn, w_tiles):
    t = tiling
    epw = 32 // bits
    gps = t.groups_per_step
    pid_n, pid_s = pl.program_id(0), pl.program_id(1)
    n0 = pid_n * t.block_n
    col_ok = (n0 + jnp.arange(t.block_n)) < n
    g_start = pid_s * groups_per_split
    g_end = jnp.minimum(g_start + groups_per_split, n_groups)
    steps = pl.cdiv(g_end - g_start, gps)
    top = 23 - bits  # code bits land at mantissa bits [top, 23): the value is 1 + q / 2^bits
    code_as_float = functools.partial(codes.code_as_float, bits=bits, interpret=interpret)
    fma = functools.partial(codes.fma, interpret=interpret)

    def group_ok(g):
        return (g + jnp.arange(gps)) < g_end

    # [.., wpg] or, with chains, [.., wpg // 4, 4] ("tiles" refs have their 64-row axis before those)
    wshape = (t.block_n, gps) + tuple(w_ref.shape[3 if w_tiles else 2:])
    word_axes = (slice(None),) * (len(wshape) - 2)

    def load_w(g):  # packed words; groups past the split's end read as 0
        return codes.load_words(w_ref, n0, t.block_n, g, gps, col_ok, group_ok(g), w_tiles)

    def quads(a):  # the four words a thread holds contiguously (the last axis), as four tensors
        return [p.squeeze(-1) for p in jnp.split(a, 4, axis=-1)]

    def step(i, carry):
        acc, w = carry
        g = g_start + i * gps
        if t.prefetch:
            w_next = load_w(g + gps)
        else:
            w = load_w(g)
        gmask = group_ok(g)
        s, b = codes.load_sb_tiles(s_ref, b_ref, n0, t.block_n, g, gps, col_ok, gmask, sb_kn)
        s = s.astype(jnp.float32) * float(2**bits)  # exact: a power-of-two scaling
        b = b.astype(jnp.float32) - s
        x_mask = jnp.broadcast_to(gmask.reshape((gps,) + (1,) * len(word_axes)), wshape[1:])
        tsum = [None] * rows
        for j in range(epw):
            qj = code_as_float(w, top - bits * j)
            qs = quads(qj) if t.chains else [qj]
            for r in range(rows):
                # code j of each word meets its input: x[r, g, j, w] (the wrapper's transposed copy)
                xj = pltriton.load(x_ref.at[(jnp.int32(r), pl.ds(g, gps), jnp.int32(j)) + word_axes],
                                   mask=x_mask, other=0)
                for q, xq in zip(qs, quads(xj) if t.chains else [xj]):
                    xq = jnp.broadcast_to(xq[None], q.shape)
                    tsum[r] = q * xq if tsum[r] is None else fma(q, xq, tsum[r])
        new = []
        for r in range(rows):
            tg = jnp.sum(tsum[r], axis=2)              # [block_n, gps]
            xg = pltriton.load(xs_ref.at[jnp.int32(r), pl.ds(g, gps)], mask=gmask, other=0)
            new.append(acc[r] + jnp.sum(s * tg + b * xg[None, :], axis=1))
        return tuple(new), (w_next if t.prefetch else w)

    acc = tuple(jnp.zeros((t.block_n,), jnp.float32) for _ in range(rows))
    w0 = load_w(g_start) if t.prefetch else jnp.zeros(wshape, jnp.uint32)
    acc, _ = jax.lax.fori_loop(0, steps, step, (acc, w0))
    for r in range(rows):
        pltriton.store(o_ref.at[pid_s, jnp.int32(r), pl.ds(n0, t.block_n)], acc[r].astype(o_ref.dtype), mask=col_ok)


def group_sums(x3: jax.Array) -> jax.Array:
    """`[rows, groups, g] -> [rows, groups]` sums, each row's in the same order whatever the row count.
    (XLA's reduce picks its order by shape: on CPU `x.sum(-1)` of 8 rows differed in the last bit
    from the same rows summed alone, which broke the kernel's row invariance.) Elementwise adds of
    halves are exact per element and never reassociated."""
    while x3.shape[-1] > 1:
        half = x3.shape[-1] // 2
        x3 = x3[..., :half] + x3[..., half:]
    return x3[..., 0]


def gemv_launch(x2: jax.Array, qw: QuantizedWeight, tiling: GemvTiling, *, interpret: bool) -> jax.Array:
    """`x2 [rows, K] @ dequantize(qw).T` -> `[rows, N]` in x2's dtype (float32 accumulation)."""
    w_tiles = qw.w_layout == "tiles"
    if w_tiles:
        codes.check_tile_block(tiling.block_n)
    rows, k = x2.shape
    n = qw.shape[0]
    g = qw.group_size
    epw = 32 // qw.bits
    n_groups = k // g
    split, groups_per_split = split_groups(n_groups, tiling.split_k)
    # Activations as float32 [rows, groups, code, word]: code j of the words of a group meets a
    # contiguous run of inputs, loaded and used without conversion; and their group sums. One small
    # XLA op per call (in the kernel benchmark a launch of its own; whether XLA fuses it into x's
    # producer inside a model was not checked).
    wpg = g // epw
    if tiling.chains and wpg % 4:
        raise ValueError(f"GemvTiling.chains needs a multiple of 4 words per group, got {wpg}")
    word_shape = (wpg // 4, 4) if tiling.chains else (wpg,)
    x3 = x2.astype(jnp.float32).reshape(rows, n_groups, g)
    xs = group_sums(x3)
    x4 = x3.reshape(rows, n_groups, wpg, epw).swapaxes(2, 3).reshape((rows, n_groups, epw) + word_shape)
    # [N, groups, words...] or, as stored for "tiles", [N/64, groups, 64, words...]
    w3 = qw.weight.reshape((qw.weight.shape[:-1] if w_tiles else (n, n_groups)) + word_shape)
    scales, biases = qw.scales, qw.biases
    sb_kn = qw.sb_layout == "kn"
    n_axis, g_axis = qw.sb_axes
    if interpret:
        # Interpret mode clamps out-of-range slices instead of masking them: pad to whole tiles.
        # The last step (and the prefetch past it) may start up to 2 steps past the last group.
        # Poison, not zeros, so the CPU tests see it if a mask fails to hide the padding.
        extra = 2 * tiling.groups_per_step
        w3 = pad_by(pad_to(w3, 0, codes.tile_span(tiling.block_n) if w_tiles else tiling.block_n, 0xFFFFFFFF),
                    1, extra, 0xFFFFFFFF)
        scales, biases = (pad_by(pad_to(a, n_axis, tiling.block_n, 1.0), g_axis, extra, 1.0) for a in (scales, biases))
        x4, xs = pad_by(x4, 1, extra, 1.0), pad_by(xs, 1, extra, 1.0)
    out_n = scales.shape[n_axis]
    out_dtype = x2.dtype if split == 1 else jnp.float32
    kernel = functools.partial(_kernel, rows=rows, n=n, bits=qw.bits, tiling=tiling, n_groups=n_groups,
                               groups_per_split=groups_per_split, interpret=interpret, sb_kn=sb_kn, w_tiles=w_tiles)
    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((split, rows, out_n), out_dtype),
        grid=(pl.cdiv(n, tiling.block_n), split),
        interpret=interpret,
        compiler_params=None if interpret else pltriton.CompilerParams(
            num_warps=tiling.num_warps, num_stages=tiling.num_stages),
        name=f"q{qw.bits}gemv_r{rows}_n{tiling.block_n}",
    )(x4, xs, w3, scales, biases)
    return fold_splits(out[:, :, :n]).astype(x2.dtype)
