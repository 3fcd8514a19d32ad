"""The tiled GEMM body (qmm, > multirow rows): every weight dequantized to `s*q + b` in the dot's dtype
before the dot, so one accumulating `dot` per loop step covers `groups_per_step` groups and the
accumulator stays in the MMA unit.

Per code: one shift and one LOP3 put it into a float32 mantissa as `1 + q/2^bits`
(unpack.code_as_float), one FMA gives `s*q + b` (scale and bias pre-folded per group:
`2^bits*s * (1 + q/2^bits) + (b - 2^bits*s)`), then a conversion to bf16/f16. The codes of a word are
interleaved into input order (unpack.interleave). Weights are rounded once to the dot dtype, as
`dequantize(qw, dtype)` rounds them; float32 dots keep them in float32.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from . import unpack


def qmm_body(x_ref, w_ref, s_ref, b_ref, o_ref, *, rows, n, bits, group_size, tiling, n_groups,
             groups_per_split, dot_dtype, precision, interpret, pids):
    """One program: a [block_m, block_n] output tile of one weight over the groups of one K split."""
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
    code_as_float = functools.partial(unpack.code_as_float, bits=bits, interpret=interpret)
    fma = functools.partial(unpack.fma, interpret=interpret)

    def step(i, acc):
        g = g_start + i * gps
        g_ok = (g + jnp.arange(gps)) < g_end   # groups past the split's end load as zeros
        k_ok = (g * group_size + jnp.arange(gps * group_size)) < g_end * group_size
        x = pltriton.load(x_ref.at[pl.ds(m0, t.block_m), pl.ds(g * group_size, gps * group_size)],
                          mask=row_ok[:, None] & k_ok[None, :], other=0)
        w = unpack.load_words(w_ref, n0, t.block_n, g, gps, col_ok, g_ok)
        s, b = unpack.load_sb(s_ref, b_ref, n0, t.block_n, g, gps, col_ok, g_ok)
        s = s * float(2**bits)        # exact: a power-of-two scaling
        b = jnp.broadcast_to((b - s)[:, :, None], w.shape)
        s = jnp.broadcast_to(s[:, :, None], w.shape)
        # code j of every word, dequantized: s*q + b = 2^bits*s * (1 + q/2^bits) + (b - 2^bits*s)
        codes = [fma(code_as_float(w, top - bits * j), s, b).astype(dot_dtype) for j in range(epw)]
        q = unpack.interleave(codes).reshape(t.block_n, gps * group_size)
        return acc + pltriton.dot(x.astype(dot_dtype), q, trans_b=True, precision=precision)

    acc = jax.lax.fori_loop(0, pl.cdiv(g_end - g_start, gps), step, jnp.zeros((t.block_m, t.block_n), jnp.float32))
    pltriton.store(o_ref.at[pid_s, pl.ds(m0, t.block_m), pl.ds(n0, t.block_n)], acc.astype(o_ref.dtype),
                   mask=row_ok[:, None] & col_ok[None, :])
