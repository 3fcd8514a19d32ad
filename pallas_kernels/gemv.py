"""The GEMV body (qmv and multirow): exact codes on the tensor cores, each group's scale and bias
applied to the small product.

Per group of g inputs, `x . (s*q + b) = s * (x . q) + b * sum(x)`, so no weight is ever scaled:
the codes (0..2^bits-1) are exact in bf16/f16, one `dot` per group gives `x . q` for a
[block_n, ROW_TILE] tile, and scale and bias touch only that tile. Every launch computes ROW_TILE
rows (masked loads past the real ones) with a tiling that depends on the weight shape only, so row
i's arithmetic is identical whether it is computed alone or among up to ROW_TILE - 1 others:
greedy speculative decoding depends on that.

16-bit codes come from the magic conversion (`pattern | code` reads as `offset + code`; the offset
folds into the bias), two codes per 32-bit register, kept in that pair order along K (x is
reordered to match by `kpairs_order`), so the tile goes from registers to the MMA without a trip
through shared memory. Float32 dots (tests, float32 models) convert codes with int->float.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from .unpack import code_pairs, interleave, load_words, magic_offset, pairs_in_k_order


def uses_kpairs(dot_dtype, bits: int) -> bool:
    """Whether the body reads x in `kpairs_order` (16-bit dots whose codes fit the magic conversion)."""
    return magic_offset(dot_dtype, bits) is not None


def kpairs_order(x2: jax.Array, group_size: int, bits: int) -> jax.Array:
    """x's inputs reordered within each group from [word, half, j] to [j, word, half], the order of
    unpack.pairs_in_k_order: code pair j (codes j and j + half of every word) is one run of 2*words."""
    wpg = group_size * bits // 32
    rows, k = x2.shape
    return x2.reshape(rows, k // group_size, wpg, 2, -1).transpose(0, 1, 4, 2, 3).reshape(rows, k)


def group_sums(x2: jax.Array, group_size: int) -> jax.Array:
    """`[K/g, rows]` float32 sums of each group of x's inputs, by halving adds in a fixed order
    (elementwise, so a row's sums never depend on the other rows, where XLA's reduce may choose its
    order by shape). Taken of the x the kernel reads (kpairs_order'd where it is)."""
    if group_size & (group_size - 1):
        raise ValueError(f"group_sums halves groups: group_size={group_size} must be a power of two")
    rows, k = x2.shape
    v = x2.astype(jnp.float32).reshape(rows, k // group_size, group_size)
    while v.shape[-1] > 1:
        half = v.shape[-1] // 2
        v = v[..., :half] + v[..., half:]
    return v[..., 0].T


def gemv_body(x_ref, w_ref, s_ref, b_ref, o_ref, *, rows, n, bits, group_size, tiling, n_groups,
              groups_per_split, dot_dtype, precision, interpret, pids, xs_ref=None):
    """One program: a [block_n] slice of one weight over groups of one K split. `xs_ref`: the wrapper's
    `group_sums` (tiling.xsum == "input"); else each group's sum(x) is reduced here."""
    t = tiling
    epw = 32 // bits
    pid_n, pid_m, pid_s = pids
    m0, n0 = pid_m * t.block_m, pid_n * t.block_n
    row_ok = (m0 + jnp.arange(t.block_m)) < rows
    col_ok = (n0 + jnp.arange(t.block_n)) < n
    x_mask = jnp.broadcast_to(row_ok[:, None], (t.block_m, group_size))
    one_ok = jnp.ones((1,), jnp.bool_)
    magic = magic_offset(dot_dtype, bits)
    code_mask = jnp.uint32(2**bits - 1)

    def codes(w):  # [block_n, words] -> the dot operand [block_n, group_size], in x's order
        if magic is not None:
            return pairs_in_k_order(code_pairs(w, bits, magic[0], dot_dtype, interpret=interpret))
        q = [((w >> jnp.uint32(bits * j)) & code_mask).astype(jnp.int32).astype(dot_dtype) for j in range(epw)]
        return interleave(q).reshape(t.block_n, group_size)

    def one_group(g, acc):
        # scales and biases first, both loads issued before either convert
        s, b = (pltriton.load(ref.at[g, pl.ds(n0, t.block_n)], mask=col_ok, other=0) for ref in (s_ref, b_ref))
        s, b = s.astype(jnp.float32), b.astype(jnp.float32)
        x = pltriton.load(x_ref.at[pl.ds(m0, t.block_m), pl.ds(g * group_size, group_size)], mask=x_mask, other=0)
        w = load_words(w_ref, n0, t.block_n, g, 1, col_ok, one_ok).reshape(t.block_n, -1)
        d = pltriton.dot(codes(w), x.astype(dot_dtype), trans_b=True, precision=precision)  # [block_n, block_m]
        if magic is not None:  # x . (offset + q) = x . q + offset * sum(x): the bias absorbs it
            b = b - magic[1] * s
        if xs_ref is not None:
            xsum = pltriton.load(xs_ref.at[g, pl.ds(m0, t.block_m)], mask=row_ok, other=0)
        else:
            xsum = jnp.sum(x.astype(jnp.float32), axis=1)
        return acc + d * s[:, None] + b[:, None] * xsum[None, :]

    def step(i, acc):  # groups_per_step groups per iteration: more loads in flight
        for j in range(t.groups_per_step):
            acc = one_group(g0 + i * t.groups_per_step + j, acc)
        return acc

    g0 = pid_s * groups_per_split
    g1 = jnp.minimum(g0 + groups_per_split, n_groups)
    acc = jnp.zeros((t.block_n, t.block_m), jnp.float32)
    full_steps = (g1 - g0) // t.groups_per_step
    acc = jax.lax.fori_loop(0, full_steps, step, acc)
    acc = jax.lax.fori_loop(g0 + full_steps * t.groups_per_step, g1, one_group, acc)
    pltriton.store(o_ref.at[pid_s, pl.ds(m0, t.block_m), pl.ds(n0, t.block_n)], acc.T.astype(o_ref.dtype),
                   mask=row_ok[:, None] & col_ok[None, :])
