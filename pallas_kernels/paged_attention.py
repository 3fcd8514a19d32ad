"""Decode attention over a paged KV pool: each row's keys read through its block table, only the
blocks its length covers. The semantics of `decode_attention` (GQA, scale 1.0, visibility from
positions) over the keys a contiguous cache would hold.

    out = paged_attention(q, k_pool, v_pool, table, lengths, q_pos, window)   # q [B, T<=16, Hq, D]

The pool `[N, block, Hkv, D]` is shared by all rows; `table [B, C // block]` maps row b's logical
block (slot // block) to a pool block (an entry outside [0, N): no block, its slots read as zeros);
`lengths [B]`: row b's keys are its logical slots [0, lengths[b]), slot c at position c (or
`k_pos[b, c]`). Why: the paged cache's decode path gathered every row's whole capacity into a
contiguous view per global layer (`models.cache.paged_view`) and then ran `decode_attention` on it:
at 32 rows x 4,096 slots that copy was most of a decode step's attention cost. Here the kernel's
K/V loads go through the table (a gather of `block_k` rows of D), and nothing else moves.

The work is `decode_attention`'s, launch for launch: fixed-size key splits (from the capacity and
the head count only, never B, T, or the lengths), one program per (row block, row, kv head, split)
running the same online-softmax step (`decode_attention.softmax_step`) over the key blocks between
the first and the last slot its rows can see, then the same combine. A split past a row's length
loads nothing. So a row's result depends on its own keys, table and length only (not on the other
rows, nor on B), and with the same tiling it is bitwise what `decode_attention` gives on the
gathered view. `paged_attention_reference` is the XLA counterpart: that gather, then
`dense_attention`.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from .config import EMPTY, ROW_TILE, attention_head_dim_ok
from .decode_attention import (_check_tiling, combine, default_split, dense_attention, partials_shape, query_rows,
                               softmax_init, softmax_step, store_partials, visible)
from .stack import Layer, with_layer


def _split_kernel(q_ref, qpos_ref, len_ref, table_ref, k_ref, v_ref, *refs, c, page, num_blocks, n_rows, rows,
                  block_k, split, window, precision, has_kpos):
    kpos_ref, (m_ref, l_ref, acc_ref) = (refs[0], refs[1:]) if has_kpos else (None, refs)
    rb, b, j, s = (pl.program_id(i) for i in range(4))
    r0, s0 = rb * rows, s * split
    q = pltriton.load(q_ref.at[b, j, pl.ds(r0, rows), :])
    qp = pltriton.load(qpos_ref.at[b, pl.ds(r0, rows)])
    row_ok = (r0 + jnp.arange(rows)) < n_rows  # pad rows see nothing
    d = q.shape[-1]
    n = jnp.minimum(pltriton.load(len_ref.at[b]), c)  # the row's keys: logical slots [0, n)

    def positions(at, size):
        """(positions of slots at..at+size, EMPTY past the row's keys; which are the row's)."""
        slots = at + jnp.arange(size)
        mine = slots < n
        if kpos_ref is None:
            return jnp.where(mine, slots, EMPTY), mine
        return pltriton.load(kpos_ref.at[b, pl.ds(at, size)], mask=mine, other=EMPTY), mine

    # The blocks of this split any row may see (as decode_attention): the loop runs from the first
    # to the last; a split at or past the row's length has none and loads no K/V.
    idx = jnp.arange(split)
    kps, mine = positions(s0, split)
    maybe = (kps <= jnp.max(jnp.where(row_ok, qp, np.iinfo(np.int32).min))) & mine
    if window is not None:
        lo = qp - window  # a row whose window start wraps around sees nothing: left out
        maybe = maybe & (kps > jnp.min(jnp.where(row_ok & (lo < qp), lo, EMPTY)))
    first = jnp.min(jnp.where(maybe, idx, split)) // block_k
    end = (jnp.max(jnp.where(maybe, idx, -1)) + block_k) // block_k

    def block(i, carry):
        c0 = s0 + i * block_k
        kp, col_ok = positions(c0, block_k)
        vis = (kp[None, :] <= qp[:, None]) & col_ok[None, :] & row_ok[:, None]
        if window is not None:
            vis = vis & (kp[None, :] > (qp - window)[:, None])
        # each slot's pool block from the table (a gather of block_k entries), then K/V as a gather
        # of block_k rows of D: every index an array (Pallas' interpreter takes no slice among them)
        slots = c0 + jnp.arange(block_k)
        blk = pltriton.load(table_ref.at[b, jnp.minimum(slots // page, c // page - 1)], mask=col_ok,
                            other=num_blocks)
        has = col_ok & (blk >= 0) & (blk < num_blocks)  # no block: zeros, as the gathered view holds

        def tile(x):
            return jnp.broadcast_to(x, (block_k, d))
        at = (tile(jnp.where(has, blk, 0)[:, None]), tile((slots % page)[:, None]), j, tile(jnp.arange(d)[None, :]))
        kk = pltriton.load(k_ref.at[at], mask=tile(has[:, None]), other=0)
        vv = pltriton.load(v_ref.at[at], mask=tile(has[:, None]), other=0)
        return softmax_step(q, kk, vv, vis, carry, precision)

    m, l, acc = jax.lax.fori_loop(first, end, block, softmax_init(rows, d))
    store_partials(m_ref, l_ref, acc_ref, (b, j, s), r0, m, l, acc)


def _check(q, k_pool, v_pool, table, lengths, q_pos, window, k_pos):
    if q.ndim != 4 or k_pool.ndim != 4 or v_pool.shape != k_pool.shape:
        raise ValueError(f"paged_attention wants q [B, T, Hq, D] and k_pool = v_pool [N, block, Hkv, D], got "
                         f"q {q.shape}, k_pool {k_pool.shape}, v_pool {v_pool.shape}")
    if not all(jnp.issubdtype(x.dtype, jnp.floating) for x in (q, k_pool, v_pool)):
        raise ValueError(f"q and the pools must be floating point, got {q.dtype}, {k_pool.dtype}, {v_pool.dtype}")
    b, t, hq, d = q.shape
    n, page, hkv, _ = k_pool.shape
    if t < 1 or t > ROW_TILE:
        raise ValueError(f"paged_attention takes 1..{ROW_TILE} queries per row (T), got T={t}")
    if k_pool.shape[3] != d or n < 1 or page < 1:
        raise ValueError(f"pools {k_pool.shape} do not match q {q.shape} (head_dim) or hold no block")
    if hkv < 1 or hq % hkv:
        raise ValueError(f"query heads Hq={hq} must be a multiple of kv heads Hkv={hkv}")
    if not attention_head_dim_ok(d):
        raise ValueError(f"head_dim D={d} must be a power of two >= 16 (Triton tiles)")
    if table.ndim != 2 or table.shape[0] != b or table.shape[1] < 1 or table.dtype != jnp.int32:
        raise ValueError(f"table must be int32 [B={b}, blocks per row], got {table.dtype} {table.shape}")
    if lengths.shape != (b,) or lengths.dtype != jnp.int32:
        raise ValueError(f"lengths must be int32 [B={b}], got {lengths.dtype} {lengths.shape}")
    if q_pos.shape != (b, t) or q_pos.dtype != jnp.int32:
        raise ValueError(f"q_pos must be int32 {(b, t)}, got {q_pos.dtype} {q_pos.shape}")
    c = table.shape[1] * page
    if k_pos is not None and (k_pos.shape != (b, c) or k_pos.dtype != jnp.int32):
        raise ValueError(f"k_pos must be int32 [B, blocks per row * block] = {(b, c)}, got {k_pos.dtype} {k_pos.shape}")
    if window is not None and (not isinstance(window, (int, np.integer)) or window < 1):
        raise ValueError(f"window must be a positive int or None, got {window!r}")


@functools.partial(jax.jit, static_argnames=("window", "split", "block_k", "rows", "num_warps",
                                             "num_stages", "interpret"))
def paged_attention(q: jax.Array, k_pool: jax.Array, v_pool: jax.Array, table: jax.Array, lengths: jax.Array,
                    q_pos: jax.Array, window: int | None = None, *, k_pos: jax.Array | None = None,
                    layer: jax.Array | None = None, split: int | None = None, block_k: int | None = None,
                    rows: int = ROW_TILE, num_warps: int = 4, num_stages: int = 2,
                    interpret: bool = False) -> jax.Array:
    """GQA attention of q `[B, T, Hq, D]` (T <= 16) over each row's keys in the pools
    `[N, block, Hkv, D]`, through table int32 `[B, C // block]`. Row b's keys are its logical slots
    c < lengths[b] (int32 `[B]`; only their blocks are read), slot c at position c, or `k_pos[b, c]`
    (int32 `[B, C]`, `EMPTY` hides a slot); key c is visible to query t iff its position <= q_pos[t]
    (and > q_pos[t] - window). Returns `[B, T, Hq, D]` in q's dtype; 0 for a query that sees no key.
    `layer` (an int scalar): the pools are stacks `[L, N, block, Hkv, D]`, layer `layer` read in place.

    Tuning as `decode_attention` (block_k, split, rows, warps, stages; the same defaults, from the
    capacity C = table.shape[1] * block): with equal tiling a row's result is bitwise
    `decode_attention`'s over the gathered view."""
    k_st, v_st = k_pool, v_pool
    if layer is not None:
        k_pool, v_pool = Layer(k_pool, layer), Layer(v_pool, layer)
    _check(q, k_pool, v_pool, table, lengths, q_pos, window, k_pos)
    b, t, hq, d = q.shape
    n_pool, page, hkv, _ = k_pool.shape
    c = table.shape[1] * page
    block_k = block_k or (64 if d < 512 else 32)
    split = split or default_split(c, hkv, block_k)
    _check_tiling(rows, block_k, split)
    n_rows = t * (hq // hkv)
    n_rb, splits = -(-n_rows // rows), -(-c // split)
    qr, qpos = query_rows(q, q_pos, hkv, rows)
    precision = jax.lax.Precision.HIGHEST if q.dtype == jnp.float32 else None
    params = None if interpret else pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)
    stacked = layer is not None
    has_kpos = k_pos is not None
    m, l, acc = pl.pallas_call(
        functools.partial(with_layer(_split_kernel, stacked, (4, 5)), c=c, page=page, num_blocks=n_pool,
                          n_rows=n_rows, rows=rows, block_k=block_k, split=split, window=window,
                          precision=precision, has_kpos=has_kpos),
        out_shape=partials_shape(b, hkv, splits, qr.shape[2], d),
        grid=(n_rb, b, hkv, splits), interpret=interpret, compiler_params=params,
        name=f"paged_attention_d{d}_k{block_k}_s{split}",
    )(*([Layer(k_st, layer).operand()] if stacked else []), qr, qpos, lengths, table, k_st, v_st,
      *([k_pos] if has_kpos else []))
    return combine(m, l, acc, q.shape, q.dtype, rows, interpret, params, "paged_attention")


def paged_view(pool: jax.Array, table: jax.Array) -> jax.Array:
    """`[B, C, Hkv, D]`: each row's slots gathered from `pool [N, block, Hkv, D]` through `table`;
    zeros where an entry names no block (outside [0, N))."""
    n = pool.shape[0]
    table = jnp.where((table >= 0) & (table < n), table, n)
    got = pool.at[table].get(mode="fill", fill_value=0)
    return got.reshape((table.shape[0], table.shape[1] * pool.shape[1]) + pool.shape[2:])


def paged_attention_reference(q: jax.Array, k_pool: jax.Array, v_pool: jax.Array, table: jax.Array,
                              lengths: jax.Array, q_pos: jax.Array, window: int | None = None, *,
                              k_pos: jax.Array | None = None, layer: jax.Array | None = None) -> jax.Array:
    """`paged_attention` in XLA: every row's whole capacity gathered through its table, the slots at
    or past its length hidden, then `dense_attention` (which gives a query that sees nothing the
    mean of v, not 0). `[B, T, Hq, D]`."""
    if layer is not None:
        k_pool, v_pool = Layer(k_pool, layer).take(), Layer(v_pool, layer).take()
    _check(q, k_pool, v_pool, table, lengths, q_pos, window, k_pos)
    c = table.shape[1] * k_pool.shape[1]
    slots = jnp.arange(c, dtype=jnp.int32)[None, :]
    kp = jnp.where(slots < lengths[:, None], slots if k_pos is None else k_pos, EMPTY)
    out = dense_attention(q, paged_view(k_pool, table), paged_view(v_pool, table), visible(q_pos, kp, window))
    return out.reshape(q.shape)
