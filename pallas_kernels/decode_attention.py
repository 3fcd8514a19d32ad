"""Flash-decoding attention for short query blocks (decode, speculative verify): the semantics of
`models.layers.attention` (GQA, scale 1.0, visibility from positions) in two Pallas launches.

    out = decode_attention(q, k, v, q_pos, k_pos, window)   # q [B, T<=16, Hq, D] -> [B, T, Hq, D]

Why flash-decoding: a decode step has a handful of queries against a long cache, so one program per
query block would leave most SMs idle. The key slots are cut into fixed splits; each program runs
an online softmax (float32 m, l, acc) over one split for one block of `rows` query rows (the T*G
queries of one kv head, padded), looping only over the key blocks between the first and the last
slot any of its rows can see (found from one load of the split's positions: future and unwritten
slots cost no K/V load); a second small launch combines the splits' partials in a fixed order.

Exactness (speculative decoding rests on it): row t of a T-query call equals bitwise a 1-query call
with only query t. Every launch computes the same tile shapes whatever T, split boundaries depend
only on the slot index, and a block or split a row sees nothing of leaves that row's state bitwise
unchanged (selected, not computed), so whether another row made a program process it is invisible.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from .config import EMPTY, ROW_TILE, attention_head_dim_ok
from .stack import Layer, with_layer
from .xla import einsum_f32

_NEG = float(np.finfo(np.float32).min)  # finite running-max sentinel: exp(_NEG - _NEG) = 1, no NaN
_TARGET_PROGRAMS = 128                  # Hkv * splits: about one wave of the H200's 132 SMs
_COMBINE_BLOCK_D = 32                   # combine programs own a slice of D: more of them in flight
_COMBINE_UNROLL = 8                     # splits whose partials the combine loads at once
DENSE_KEY_BLOCK = 64                    # key slots per softmax block of dense_attention (the XLA path)


def default_split(c: int, hkv: int, block_k: int) -> int:
    """Slots per split: from the cache shape only (never B, T or the positions), halved from 2048
    while Hkv * splits is under about one wave, down to 256 (a split's loop of a few key blocks
    must outweigh its partials' write and combine)."""
    split = 2048
    while split > 256 and hkv * -(-c // split) < _TARGET_PROGRAMS:
        split //= 2
    return max(split, block_k)


def _split_kernel(q_ref, qpos_ref, k_ref, v_ref, kpos_ref, m_ref, l_ref, acc_ref, *, c, n_rows, rows,
                  block_k, split, window, precision):
    rb, b, j, s = (pl.program_id(i) for i in range(4))
    r0, s0 = rb * rows, s * split
    q = pltriton.load(q_ref.at[b, j, pl.ds(r0, rows), :])
    qp = pltriton.load(qpos_ref.at[b, pl.ds(r0, rows)])
    row_ok = (r0 + jnp.arange(rows)) < n_rows  # pad rows see nothing
    d = q.shape[-1]

    # The blocks of this split any row may see, from one load of its positions: a superset of the
    # union of the rows' (q_pos - window, q_pos]; the loop runs from the first to the last.
    idx = jnp.arange(split)
    kps = pltriton.load(kpos_ref.at[b, pl.ds(s0, split)], mask=s0 + idx < c, other=EMPTY)
    maybe = (kps <= jnp.max(jnp.where(row_ok, qp, np.iinfo(np.int32).min))) & (s0 + idx < c)
    if window is not None:
        lo = qp - window  # a row whose window start wraps around sees nothing: left out
        maybe = maybe & (kps > jnp.min(jnp.where(row_ok & (lo < qp), lo, EMPTY)))
    first = jnp.min(jnp.where(maybe, idx, split)) // block_k
    end = (jnp.max(jnp.where(maybe, idx, -1)) + block_k) // block_k

    def block(i, carry):
        c0 = s0 + i * block_k
        col_ok = (c0 + jnp.arange(block_k)) < c  # the tail past C: masked loads, never padding
        kp = pltriton.load(kpos_ref.at[b, pl.ds(c0, block_k)], mask=col_ok, other=EMPTY)
        vis = (kp[None, :] <= qp[:, None]) & col_ok[None, :] & row_ok[:, None]
        if window is not None:
            vis = vis & (kp[None, :] > (qp - window)[:, None])
        kv_mask = jnp.broadcast_to(col_ok[:, None], (block_k, d))
        kk = pltriton.load(k_ref.at[b, pl.ds(c0, block_k), j, :], mask=kv_mask, other=0)
        vv = pltriton.load(v_ref.at[b, pl.ds(c0, block_k), j, :], mask=kv_mask, other=0)
        return softmax_step(q, kk, vv, vis, carry, precision)

    m, l, acc = jax.lax.fori_loop(first, end, block, softmax_init(rows, d))
    store_partials(m_ref, l_ref, acc_ref, (b, j, s), r0, m, l, acc)


def softmax_init(rows: int, d: int):
    """The online softmax's empty state for `rows` query rows: (running max, sum, weighted V)."""
    return (jnp.full((rows,), _NEG, jnp.float32), jnp.zeros((rows,), jnp.float32), jnp.zeros((rows, d), jnp.float32))


def softmax_step(q, kk, vv, vis, carry, precision):
    """One key block of the online softmax (inside a kernel): q `[rows, D]`, kk / vv `[block_k, D]`,
    vis bool `[rows, block_k]`; carry = (m, l, acc) float32. Shared by decode_attention and
    paged_attention, so the two give a row the same bits for the same keys."""
    row_sees = jnp.max(vis.astype(jnp.int32), axis=1) > 0
    m, l, acc = carry
    sc = pltriton.dot(q, kk.astype(q.dtype), trans_b=True, precision=precision)
    sc = jnp.where(vis, sc.astype(jnp.float32), _NEG)
    m_new = jnp.maximum(m, jnp.max(sc, axis=1))
    corr = jnp.exp(m - m_new)
    p = jnp.where(vis, jnp.exp(sc - m_new[:, None]), 0.0)  # masked slots: exactly 0
    pv = pltriton.dot(p.astype(vv.dtype), vv, precision=precision)
    # a row that sees nothing here keeps its state bit for bit (no -0.0 + 0.0 drift)
    return (jnp.where(row_sees, m_new, m), jnp.where(row_sees, l * corr + jnp.sum(p, axis=1), l),
            jnp.where(row_sees[:, None], acc * corr[:, None] + pv.astype(jnp.float32), acc))


def store_partials(m_ref, l_ref, acc_ref, at, r0, m, l, acc):
    """A split program's state into the partials at `at` = (b, j, split), rows r0.. (inside a kernel)."""
    rows = m.shape[0]
    pltriton.store(m_ref.at[(*at, pl.ds(r0, rows))], m)
    pltriton.store(l_ref.at[(*at, pl.ds(r0, rows))], l)

    @pl.when(jnp.max(l) > 0)  # l >= 1 once a row saw a key; unseen splits write no acc (combine skips them)
    def _():
        pltriton.store(acc_ref.at[(*at, pl.ds(r0, rows), slice(None))], acc)


def _combine_kernel(m_ref, l_ref, acc_ref, o_ref, *, rows, splits, block_d):
    rb, b, j, dc = (pl.program_id(i) for i in range(4))
    r0, d0 = rb * rows, dc * block_d

    # every split's max and sum in one load: the overall max (exact in any order) and the range of
    # splits any row saw (the others hold nothing and are never read)
    n = pl.next_power_of_2(splits)
    s_ok = jnp.broadcast_to((jnp.arange(n) < splits)[:, None], (n, rows))
    mm = jnp.max(pltriton.load(m_ref.at[b, j, pl.ds(0, n), pl.ds(r0, rows)], mask=s_ok, other=_NEG), axis=0)
    seen = jnp.max(pltriton.load(l_ref.at[b, j, pl.ds(0, n), pl.ds(r0, rows)], mask=s_ok, other=0), axis=1) > 0
    first = jnp.min(jnp.where(seen, jnp.arange(n), n))
    end = jnp.max(jnp.where(seen, jnp.arange(n), -1)) + 1

    def add_group(i, carry):
        # _COMBINE_UNROLL splits' loads issued before any is used (latency, not bandwidth, bounds
        # this loop), then added in split order: the same additions for a row whatever the others
        parts = []
        for u in range(_COMBINE_UNROLL):
            s = i * _COMBINE_UNROLL + u
            ok = jnp.broadcast_to(s < end, (rows,))
            ls = pltriton.load(l_ref.at[b, j, s, pl.ds(r0, rows)], mask=ok, other=0)
            ms = pltriton.load(m_ref.at[b, j, s, pl.ds(r0, rows)], mask=ok, other=_NEG)
            a_s = pltriton.load(acc_ref.at[b, j, s, pl.ds(r0, rows), pl.ds(d0, block_d)],
                                mask=jnp.broadcast_to(ok[:, None], (rows, block_d)), other=0)
            parts.append((ls, ms, a_s))
        ll, acc = carry
        for ls, ms, a_s in parts:
            has = ls > 0  # the row saw a key in this split (else its acc may be unwritten: never used)
            w = jnp.exp(ms - mm)
            ll, acc = jnp.where(has, ll + ls * w, ll), jnp.where(has[:, None], acc + a_s * w[:, None], acc)
        return ll, acc

    ll, acc = jax.lax.fori_loop(first // _COMBINE_UNROLL, pl.cdiv(end, _COMBINE_UNROLL), add_group,
                                (jnp.zeros((rows,), jnp.float32), jnp.zeros((rows, block_d), jnp.float32)))
    out = jnp.where((ll > 0)[:, None], acc / jnp.where(ll > 0, ll, 1.0)[:, None], 0.0)  # sees nothing: 0
    pltriton.store(o_ref.at[b, j, pl.ds(r0, rows), pl.ds(d0, block_d)], out.astype(o_ref.dtype))


def _check(q, k, v, q_pos, k_pos, window):
    if q.ndim != 4 or k.ndim != 4 or v.shape != k.shape:
        raise ValueError(f"decode_attention wants q [B, T, Hq, D] and k = v [B, C, Hkv, D], got "
                         f"q {q.shape}, k {k.shape}, v {v.shape}")
    if not all(jnp.issubdtype(x.dtype, jnp.floating) for x in (q, k, v)):
        raise ValueError(f"q, k, v must be floating point, got {q.dtype}, {k.dtype}, {v.dtype}")
    b, t, hq, d = q.shape
    if t < 1 or t > ROW_TILE:
        raise ValueError(f"decode_attention takes 1..{ROW_TILE} queries per row (T), got T={t}")
    if k.shape[0] != b or k.shape[3] != d or k.shape[1] < 1:
        raise ValueError(f"k/v {k.shape} do not match q {q.shape} (batch, head_dim) or have no slots")
    if k.shape[2] < 1 or hq % k.shape[2]:
        raise ValueError(f"query heads Hq={hq} must be a multiple of kv heads Hkv={k.shape[2]}")
    if not attention_head_dim_ok(d):
        raise ValueError(f"head_dim D={d} must be a power of two >= 16 (Triton tiles)")
    if q_pos.shape != (b, t) or k_pos.shape != (b, k.shape[1]):
        raise ValueError(f"q_pos {q_pos.shape} / k_pos {k_pos.shape}: expected {(b, t)} / {(b, k.shape[1])}")
    if q_pos.dtype != jnp.int32 or k_pos.dtype != jnp.int32:
        raise ValueError(f"q_pos and k_pos must be int32, got {q_pos.dtype} and {k_pos.dtype}")
    if window is not None and (not isinstance(window, (int, np.integer)) or window < 1):
        raise ValueError(f"window must be a positive int or None, got {window!r}")


def _check_tiling(rows, block_k, split):
    for name, x in (("rows", rows), ("block_k", block_k)):
        if x < 16 or x & (x - 1):
            raise ValueError(f"{name}={x} must be a power of two >= 16 (Triton's smallest dot tile)")
    if split < block_k or split & (split - 1):
        raise ValueError(f"split={split} must be a power of two >= block_k={block_k}")


@functools.partial(jax.jit, static_argnames=("window", "split", "block_k", "rows", "num_warps",
                                             "num_stages", "interpret"))
def decode_attention(q: jax.Array, k: jax.Array, v: jax.Array, q_pos: jax.Array, k_pos: jax.Array,
                     window: int | None = None, *, layer: jax.Array | None = None, split: int | None = None,
                     block_k: int | None = None, rows: int = ROW_TILE, num_warps: int = 4, num_stages: int = 2,
                     interpret: bool = False) -> jax.Array:
    """GQA attention of q `[B, T, Hq, D]` (T <= 16) over k, v `[B, C, Hkv, D]`; key c visible to query
    t iff `k_pos[c] <= q_pos[t]` (and `> q_pos[t] - window`). Returns `[B, T, Hq, D]` in q's dtype;
    0 for a query that sees no key. `layer` (an int scalar): k and v are stacks `[L, B, C, Hkv, D]`
    and layer `layer` of each is read in place.

    Tuning (none changes a result's dependence on T): block_k, key slots per loop step (default 64;
    32 from D = 512, where a K and a V tile per pipeline stage fill 128 KiB of shared memory);
    split, slots per program (`default_split`); rows, query rows per program. Blocks inside the
    loop's range that no row sees are masked, not branched around: a branch keeps Triton from
    pipelining the K/V loads (measured 20-40% slower on an H200)."""
    k_st, v_st = k, v
    if layer is not None:
        k, v = Layer(k, layer), Layer(v, layer)
    _check(q, k, v, q_pos, k_pos, window)
    block_k = block_k or (64 if q.shape[-1] < 512 else 32)
    split = split or default_split(k.shape[1], k.shape[2], block_k)
    _check_tiling(rows, block_k, split)
    b, t, hq, d = q.shape
    c, hkv = k.shape[1], k.shape[2]
    n_rows = t * (hq // hkv)
    n_rb, splits = -(-n_rows // rows), -(-c // split)
    qr, qpos = query_rows(q, q_pos, hkv, rows)
    precision = jax.lax.Precision.HIGHEST if q.dtype == jnp.float32 else None
    params = None if interpret else pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)
    # grid (row block, B, Hkv, split): the row block varies fastest, so programs that read the same
    # keys run side by side and share them through L2
    stacked = layer is not None
    m, l, acc = pl.pallas_call(
        functools.partial(with_layer(_split_kernel, stacked, (2, 3)), c=c, n_rows=n_rows, rows=rows,
                          block_k=block_k, split=split, window=window, precision=precision),
        out_shape=partials_shape(b, hkv, splits, qr.shape[2], d),
        grid=(n_rb, b, hkv, splits), interpret=interpret, compiler_params=params,
        name=f"decode_attention_d{d}_k{block_k}_s{split}",
    )(*([Layer(k_st, layer).operand()] if stacked else []), qr, qpos, k_st, v_st, k_pos)
    return combine(m, l, acc, q.shape, q.dtype, rows, interpret, params, "decode_attention")


def query_rows(q, q_pos, hkv: int, rows: int):
    """(q as `[B, Hkv, R, D]`, q_pos as `[B, R]`): the T * G query rows (t, g) of each kv head,
    padded to whole blocks of `rows`. Copying q and the positions is cheap; k/v are read in place."""
    b, t, hq, d = q.shape
    g = hq // hkv
    n_rows = t * g
    rp = -(-n_rows // rows) * rows
    qr = jnp.pad(q.reshape(b, t, hkv, g, d).transpose(0, 2, 1, 3, 4).reshape(b, hkv, n_rows, d),
                 ((0, 0), (0, 0), (0, rp - n_rows), (0, 0)))
    return qr, jnp.pad(jnp.repeat(q_pos, g, axis=1), ((0, 0), (0, rp - n_rows)))


def partials_shape(b: int, hkv: int, splits: int, rp: int, d: int):
    """The split launch's outputs: each split's running max and sum `[B, Hkv, S, R]` and weighted V
    `[B, Hkv, S, R, D]` (float32)."""
    f32 = jnp.float32
    return (jax.ShapeDtypeStruct((b, hkv, splits, rp), f32), jax.ShapeDtypeStruct((b, hkv, splits, rp), f32),
            jax.ShapeDtypeStruct((b, hkv, splits, rp, d), f32))


def combine(m, l, acc, q_shape, dtype, rows: int, interpret: bool, params, name: str):
    """The second launch: the splits' partials combined in split order, back to q's `[B, T, Hq, D]`."""
    b, t, hq, d = q_shape
    hkv, splits, rp = m.shape[1], m.shape[2], m.shape[3]
    g = hq // hkv
    block_d = min(d, _COMBINE_BLOCK_D)
    out = pl.pallas_call(
        functools.partial(_combine_kernel, rows=rows, splits=splits, block_d=block_d),
        out_shape=jax.ShapeDtypeStruct((b, hkv, rp, d), dtype),
        grid=(rp // rows, b, hkv, d // block_d), interpret=interpret, compiler_params=params,
        name=f"{name}_combine_d{d}",
    )(m, l, acc)
    return out[:, :, :t * g].reshape(b, hkv, t, g, d).transpose(0, 2, 1, 3, 4).reshape(b, t, hq, d)


# ---- the XLA counterpart: the reference, and the short-block path without kernels ---------------
def visible(q_pos: jax.Array, k_pos: jax.Array, window: int | None) -> jax.Array:
    """`[B, T, C]` bool: k_pos `[B, C]` visible to q_pos `[B, T]` (causal, and within the window)."""
    kp, qp = k_pos[:, None, :], q_pos[:, :, None]
    m = kp <= qp
    if window is not None:
        m = m & (kp > qp - window)
    return m


def dense_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
    """Scaled-by-1.0 GQA attention over all C keys (the reference, and the short path).

    q `[B, T, Hq, D]`, k/v `[B, C, Hkv, D]`, mask bool `[B, T, C]` (True = visible).
    Returns `[B, T, Hq * D]` in q's dtype. Scores and softmax in float32; the probabilities (each
    key block's, unnormalised, as in `blocked_attention`) are cast to v's dtype before the weighted
    sum (as HF casts its probabilities); a query that sees nothing gives 0.

    Row invariance: a block of T < ROW_TILE queries is padded to ROW_TILE (pad rows repeat the last
    row's mask and are dropped), so a [B, 1] decode step and a [B, K] verify run the same dot
    shapes (XLA picks kernels and fusions per shape) and each real row gets the same result.

    Key-count invariance: the keys are cut into blocks of DENSE_KEY_BLOCK slots (the last one
    padded, hidden). Each block's softmax partial (its max, its sum of exp, its weighted sum of V)
    reduces over exactly DENSE_KEY_BLOCK slots, and the blocks are combined by a reduce over the
    block axis that is not the minor one, which XLA's CPU code accumulates block by block. A block
    a query sees nothing of adds exact zeros, so a query's bits do not depend on how many empty
    slots follow its keys: a generate cache of 96 positions and an engine's of 4,096 give the same
    row (a plain reduce over all C slots sums in an order that follows C: docs/design.md)."""
    b, t, hq, d = q.shape
    c, hkv = k.shape[1], k.shape[2]
    if t < ROW_TILE:
        pad = ROW_TILE - t
        q = jnp.pad(q, ((0, 0), (0, pad), (0, 0), (0, 0)))
        mask = jnp.pad(mask, ((0, 0), (0, pad), (0, 0)), mode="edge")
    tp, bk = q.shape[1], DENSE_KEY_BLOCK
    nb = -(-c // bk)
    if nb * bk != c:
        k, v = (jnp.pad(x, ((0, 0), (0, nb * bk - c), (0, 0), (0, 0))) for x in (k, v))
        mask = jnp.pad(mask, ((0, 0), (0, 0), (0, nb * bk - c)))
    qg = q.reshape(b, tp, hkv, hq // hkv, d)
    seen = mask.reshape(b, 1, 1, tp, nb, bk)
    s = einsum_f32("btkgd,bjckd->bkgtjc", qg, k.reshape(b, nb, bk, hkv, d).astype(q.dtype))
    s = jnp.where(seen, s, _NEG)
    m = jnp.max(s, axis=-1)                                        # [B, Hkv, G, T, nb]
    p = jnp.where(seen, jnp.exp(s - m[..., None]), 0.0)
    o = einsum_f32("bkgtjc,bjckd->bkgtjd", p.astype(v.dtype), v.reshape(b, nb, bk, hkv, d))
    part = jnp.concatenate([o, jnp.sum(p, axis=-1)[..., None]], axis=-1)  # [..., nb, D + 1]: V sums, exp sum
    w = jnp.exp(m - jnp.max(m, axis=-1, keepdims=True))              # a block seen by nothing: 0 x 0
    acc = jnp.sum(part * w[..., None], axis=-2)                     # over blocks: not the minor axis
    out = acc[..., :d] / jnp.where(acc[..., d:] > 0, acc[..., d:], 1.0)
    return jnp.moveaxis(out, 3, 1)[:, :t].reshape(b, t, hq * d).astype(q.dtype)
