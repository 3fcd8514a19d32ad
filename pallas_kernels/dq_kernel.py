"""The dequantize-first body of the tensor-core kernel (`Tiling.dequant="weights"`): each weight becomes
`s*q + b` in the dot's dtype before the dot, so one accumulating `dot` per loop step covers
`groups_per_step` groups and the accumulator stays in the MMA unit.

The other body (kernel.py, `dequant="codes"`) multiplies the exact codes and applies each group's
scale and bias to the small product, which costs a synchronous MMA and an epilogue per group; this
one costs a float32 FMA and a rounding per weight instead. Per code: one shift and one LOP3 put it
into a float32 mantissa as `1 + q/2^bits` (codes.code_as_float), one FMA gives `s*q + b` (scale and
bias pre-folded per group: `2^bits*s * (1 + q/2^bits) + (b - 2^bits*s)`), then a conversion to bf16/f16
(one instruction per two weights). The codes of a word are interleaved into input order with joins
(codes.interleave), as in the other body. Weights are rounded once to the dot dtype, as
`dequantize(qw, dtype)` would round them; float32 dots keep them in float32.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from . import codes as C
from .codes import load_words


def uses_bf16x2(tiling, dot_dtype, bits: int, scale_dtype) -> bool:
    """Whether the body dequantizes in bf16x2 (codes.dequant_pairs): `Tiling.dq_math == "bf16x2"`, a bf16
    dot, bf16 scales and codes that fit the magic pattern (bits <= 7). Else float32 FMAs."""
    return (tiling.dq_math == "bf16x2" and tiling.convert == "bits" and bits <= 7
            and jnp.dtype(dot_dtype) == jnp.bfloat16 and jnp.dtype(scale_dtype) == jnp.bfloat16)


def dq_body(x_ref, w_ref, s_ref, b_ref, o_ref, *, rows, n, bits, group_size, tiling, n_groups,
            groups_per_split, dot_dtype, precision, interpret, pids, sb_kn, w_tiles, kpairs):
    """w_ref is the packed weight as `[N, groups, words per group]`, or `[N/64, groups, 64, words per
    group]` for "tiles" weights (`w_tiles`: codes.load_words); pids: this program's (N block
    within this weight, M block, K split), from kernel.launch_many (several weights in one grid).
    kpairs (kernel.uses_kpairs, only with the bf16x2 math: uses_bf16x2): the bf16x2 pairs stay whole
    along K, each group ordered [pair, word, half] to match x (kernel.kpairs_order), so the weight
    tile goes from registers to the MMA without a shared-memory round trip."""
    t = tiling
    epw = 32 // bits
    gps = t.groups_per_step
    pid_n, pid_m, pid_s = pids
    m0, n0 = pid_m * t.block_m, pid_n * t.block_n
    row_ok = (m0 + jnp.arange(t.block_m)) < rows
    col_ok = (n0 + jnp.arange(t.block_n)) < n
    g_start = pid_s * groups_per_split
    g_end = jnp.minimum(g_start + groups_per_split, n_groups)
    top = 23 - bits
    bf16x2 = uses_bf16x2(t, dot_dtype, bits, s_ref.dtype)
    code_as_float = functools.partial(C.code_as_float, bits=bits, interpret=interpret)
    fma = functools.partial(C.fma, interpret=interpret)

    def step(i, acc):
        g = g_start + i * gps
        g_ok = (g + jnp.arange(gps)) < g_end   # groups past the split's end load as zeros
        k_ok = (g * group_size + jnp.arange(gps * group_size)) < g_end * group_size
        x = pltriton.load(x_ref.at[pl.ds(m0, t.block_m), pl.ds(g * group_size, gps * group_size)],
                          mask=row_ok[:, None] & k_ok[None, :], other=0)
        w = load_words(w_ref, n0, t.block_n, g, gps, col_ok, g_ok, w_tiles)
        s, b = C.load_sb_tiles(s_ref, b_ref, n0, t.block_n, g, gps, col_ok, g_ok, sb_kn)
        xd = x.astype(dot_dtype)
        if bf16x2:  # [block_n, gps, words] -> bf16 s*q + b, two weights per instruction
            s, b = (jnp.broadcast_to(v[:, :, None], w.shape) for v in (s, b))
            pairs = C.dequant_pairs(w, s, b, bits, interpret=interpret)
            if kpairs:  # K ordered [group, pair, word, half], as x (kernel.kpairs_order)
                q = C.pairs_in_k_order(pairs)
            else:  # input order ([word, half, pair index bits]: codes.stack_halves)
                q = C.stack_halves(pairs).reshape(t.block_n, gps * group_size)
            if t.w_left:
                return pltriton.dot(q, xd, trans_b=True, precision=precision) + acc
            return pltriton.dot(xd, q, trans_b=True, precision=precision) + acc
        s, b = s.astype(jnp.float32), b.astype(jnp.float32)
        s = s * float(2**bits)        # exact: a power-of-two scaling
        b = jnp.broadcast_to((b - s)[:, :, None], w.shape)
        s = jnp.broadcast_to(s[:, :, None], w.shape)
        # code j of every word, dequantized: s*q + b = 2^bits*s * (1 + q/2^bits) + (b - 2^bits*s)
        codes = [fma(code_as_float(w, top - bits * j), s, b).astype(dot_dtype) for j in range(epw)]
        q = C.interleave(codes).reshape(t.block_n, gps * group_size)
        if t.w_left:  # acc is [block_n, block_m]
            return pltriton.dot(q, xd, trans_b=True, precision=precision) + acc
        return acc + pltriton.dot(xd, q, trans_b=True, precision=precision)

    shape = (t.block_n, t.block_m) if t.w_left else (t.block_m, t.block_n)
    acc = jax.lax.fori_loop(0, pl.cdiv(g_end - g_start, gps), step, jnp.zeros(shape, jnp.float32))
    if t.w_left:
        acc = acc.T
    pltriton.store(o_ref.at[pid_s, pl.ds(m0, t.block_m), pl.ds(n0, t.block_n)], acc.astype(o_ref.dtype),
                   mask=row_ok[:, None] & col_ok[None, :])
