"""Flash attention for prefill (Pallas, Triton lowering): `models.layers.attention`'s semantics in one
kernel, memory O(T) and no `[T, C]` score matrix.

What: q `[B, T, Hq, D]` against k, v `[B, C, Hkv, D]` (GQA: query head h reads kv head h // (Hq/Hkv)),
the mask given by positions: key slot c is visible to query t iff `k_pos[c] <= q_pos[t]` and, with a
window, `k_pos[c] > q_pos[t] - window` (`cache.EMPTY` hides a slot). Scale 1.0, scores and the online
softmax in float32, unnormalised probabilities cast to v's dtype before P @ V, float32 accumulation;
a query that sees no key gives 0.

Why: the XLA fallback (`blocked_attention`, below) runs thousands of small sequential steps per
layer at long prompts, and cuDNN refuses head_dim 512 (the 12B's global layers).

The block range: the wrapper reduces the positions (cheap XLA) to, per (row, query block), the range
[lo, hi) of key blocks that may hold a visible key: block j may, iff its smallest real position is
<= the query block's largest and (with a window) its largest real position is > the query block's
smallest minus the window. Each program loops over that range only (the exact per-element mask is
applied inside), so a causal prompt costs ~T^2/2 and a sliding-window one ~T*W, whatever the key
layout (slot = position, a ring, or old ring ++ new block); no per-block test over all of C.

d_split: d_split programs share one (head, query block). Each computes the whole q.k over D (the same
scores and softmax state, bit for bit) but only its D / d_split columns of P @ V and of the output:
a d_split times smaller float32 accumulator and V tile, for one more q.k per extra program. At D = 512
that frees the registers and shared memory for 128-row query tiles.

k_split: k_split programs share one (row, head, query block), each over its share of the key block
range, writing its unnormalised output with its running max and sum (float32); `_combine` (XLA)
merges them as one softmax. A prefill chunk of a long prompt has few query blocks (128 queries: 32
programs at D = 512) and a long key loop: unsplit it ran on a quarter of the H200's multiprocessors,
1.38 ms per global layer at 16K against 0.44 split in 4 (`key_split` picks the default from the
static shapes only, so a row's result does not depend on what else a batch holds).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from .config import EMPTY, attention_head_dim_ok
from .decode_attention import visible
from .stack import Layer, with_layer
from .xla import einsum_f32

_NEG = float(np.finfo(np.float32).min)  # finite: a fully masked row never makes inf - inf

# H200 defaults per head dim: (block_q, block_k, num_warps, num_stages, d_split). The float32 acc
# tile (block_q x D / d_split) lives in registers: 128 KB of it at most (128 of a thread's 255
# registers); the q tile and num_stages K and V tiles sit in shared memory (228 KB). Measured (bf16,
# causal / window 1024, JAX 0.11.2): D = 256 (128, 64, 8, 2) 272 TFLOP/s at 8K against 153 for
# (64, 64, 8, 2); D = 512 (128, 64, 8, 1) with d_split 2 221 / 208 TFLOP/s at 8K / 32K against 169 /
# 175 unsplit (32, 32, 4, 2); d_split 4 was 0.55-0.77x (docs/benchmark_results/flash-d512-h200-2026-12-03.md).
# D = 128 (128, 64, 8, 3) 254, D = 64 (64, 64, 4, 3) 169 (causal 8K).
_DEFAULTS = {16: (64, 64, 4, 3, 1), 32: (64, 64, 4, 3, 1), 64: (64, 64, 4, 3, 1), 128: (128, 64, 8, 3, 1),
             256: (128, 64, 8, 2, 1), 512: (128, 64, 8, 1, 2)}


# key_split: about one program per H200 multiprocessor (132), each part 4 key blocks at least. Measured
# (bf16, H200, JAX 0.11.2), ms per layer, k_split 1 / 2 / 4 / 8: D 512, 128 queries at 15.5K: 1.38 / 0.76 /
# 0.44 / 0.44, at 1K: - / - / 0.061 / 0.089; 256 queries at 15.5K: 1.38 / 0.69 / 0.72 / 0.75; 512: 1.41 /
# 1.35 / 1.35 / 1.32. D 256, window 1024, 128 queries: 0.098 / 0.070 / 0.050; 512: 0.111 / 0.068 / 0.079.
_PROGRAMS, _PART_BLOCKS = 132, 4


def _pow2(n: int) -> bool:
    return n >= 1 and not n & (n - 1)


def block_ranges(q_pos, k_pos, window, block_q: int, block_k: int):
    """(lo, hi) int32 `[B, nq]`: the key blocks [lo, hi) that may hold a key visible to some query of
    each query block (lo = hi = 0 where none). q_pos / k_pos padded to whole blocks (edge / EMPTY)."""
    b = q_pos.shape[0]
    qp = q_pos.reshape(b, -1, block_q)
    kp = k_pos.reshape(b, -1, block_k)
    real = kp != EMPTY
    kmin = jnp.min(jnp.where(real, kp, EMPTY), axis=-1)
    kmax = jnp.max(jnp.where(real, kp, np.iinfo(np.int32).min), axis=-1)
    may = kmin[:, None, :] <= jnp.max(qp, axis=-1)[:, :, None]  # [B, nq, nk]
    if window is not None:
        may = may & (kmax[:, None, :] > (jnp.min(qp, axis=-1) - window)[:, :, None])
    nk = kp.shape[1]
    some = jnp.any(may, axis=-1)
    lo = jnp.where(some, jnp.argmax(may, axis=-1), 0).astype(jnp.int32)
    hi = jnp.where(some, nk - jnp.argmax(may[..., ::-1], axis=-1), 0).astype(jnp.int32)
    return lo, hi


def _kernel(q_ref, k_ref, v_ref, qpos_ref, kpos_ref, lo_ref, hi_ref, o_ref, *ml_refs, t, c, groups, window,
            block_q, block_k, nq, d_split, k_split):
    a, b = pl.program_id(0), pl.program_id(2)
    b, split = divmod(b, k_split) if k_split > 1 else (b, 0)  # a row's key parts adjacent
    h, part = divmod(a, d_split) if d_split > 1 else (a, 0)  # head-major, its D parts adjacent
    qb = nq - 1 - pl.program_id(1)  # causal: the costliest (last) query blocks start first
    hk = h // groups
    dd = q_ref.shape[-1] // d_split
    cols = slice(None) if d_split == 1 else pl.ds(part * dd, dd)  # this program's columns of V and out
    q0 = qb * block_q
    q_ok = (q0 + jnp.arange(block_q)) < t
    q = pltriton.load(q_ref.at[b, pl.ds(q0, block_q), h, :], mask=q_ok[:, None], other=0)
    qp = pltriton.load(qpos_ref.at[b, pl.ds(q0, block_q)])
    q_prec = jax.lax.Precision.HIGHEST if q.dtype == jnp.float32 else None
    v_prec = jax.lax.Precision.HIGHEST if v_ref.dtype == jnp.float32 else None

    def step(j, carry):
        m, l, acc = carry
        k0 = j * block_k
        kv_ok = ((k0 + jnp.arange(block_k)) < c)[:, None]  # tails load as 0: never NaN in P @ V
        kp = pltriton.load(kpos_ref.at[b, pl.ds(k0, block_k)])
        k = pltriton.load(k_ref.at[b, pl.ds(k0, block_k), hk, :], mask=kv_ok, other=0)
        v = pltriton.load(v_ref.at[b, pl.ds(k0, block_k), hk, cols], mask=kv_ok, other=0)
        s = pltriton.dot(q, k.astype(q.dtype), trans_b=True, precision=q_prec)  # [bq, bk] float32
        vis = kp[None, :] <= qp[:, None]
        if window is not None:
            vis = vis & (kp[None, :] > qp[:, None] - window)
        s = jnp.where(vis, s, _NEG)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        corr = jnp.exp(m - m_new)
        p = jnp.where(vis, jnp.exp(s - m_new[:, None]), 0.0)  # masked slots add exactly nothing
        l = l * corr + jnp.sum(p, axis=1)
        acc = acc * corr[:, None] + pltriton.dot(p.astype(v.dtype), v, precision=v_prec)
        return m_new, l, acc

    init = (jnp.full((block_q,), _NEG, jnp.float32), jnp.zeros((block_q,), jnp.float32),
            jnp.zeros((block_q, dd), jnp.float32))
    lo, hi = lo_ref[b, qb], hi_ref[b, qb]
    if k_split == 1:
        _, l, acc = jax.lax.fori_loop(lo, hi, step, init)
        out = acc / jnp.where(l > 0, l, 1.0)[:, None]  # a query that sees nothing gives 0
        pltriton.store(o_ref.at[b, pl.ds(q0, block_q), h, cols], out.astype(o_ref.dtype), mask=q_ok[:, None])
        return
    # this program's share of [lo, hi): unnormalised, with its max and sum, for `_combine`
    per = (hi - lo + k_split - 1) // k_split
    start = lo + split * per
    m, l, acc = jax.lax.fori_loop(start, jnp.maximum(start, jnp.minimum(hi, start + per)), step, init)
    pltriton.store(o_ref.at[split, b, pl.ds(q0, block_q), h, cols], acc, mask=q_ok[:, None])
    m_ref, l_ref = ml_refs
    pltriton.store(m_ref.at[split, b, pl.ds(q0, block_q), h], m, mask=q_ok)  # every D part holds the same m, l
    pltriton.store(l_ref.at[split, b, pl.ds(q0, block_q), h], l, mask=q_ok)


def _combine(acc, m, l, dtype):
    """The parts of a key-split call as one softmax: `acc [S, B, T, H, D]` (unnormalised P @ V of
    each part), `m`, `l` `[S, B, T, H]` (its running max and sum; a part that saw nothing: _NEG, 0)."""
    top = jnp.max(m, axis=0)
    w = jnp.exp(m - top)  # 0 for a part that saw nothing beside one that saw a key
    den = jnp.sum(w * l, axis=0)
    num = jnp.sum(w[..., None] * acc, axis=0)
    return (num / jnp.where(den > 0, den, 1.0)[..., None]).astype(dtype)  # a query that sees nothing gives 0


@functools.partial(jax.jit, static_argnames=("window", "block_q", "block_k", "num_warps", "num_stages", "d_split",
                                             "k_split", "interpret"))
def flash_attention(q, k, v, q_pos, k_pos, window: int | None = None, *, layer=None, block_q: int | None = None,
                    block_k: int | None = None, num_warps: int | None = None, num_stages: int | None = None,
                    d_split: int | None = None, k_split: int | None = None, interpret: bool = False) -> jax.Array:
    """Attention of q `[B, T, Hq, D]` over k, v `[B, C, Hkv, D]` with the position mask (module
    docstring); q_pos int `[B, T]`, k_pos int `[B, C]`. Returns `[B, T, Hq, D]` in q's dtype. Tuning
    arguments (d_split, k_split: module docstring) left None take the H200 defaults for D (`_DEFAULTS`,
    `key_split`).
    `layer` (an int scalar): k and v are stacks `[L, B, C, Hkv, D]` and layer `layer` of each is read
    in place."""
    k_st, v_st = k, v
    if layer is not None:
        k, v = Layer(k, layer), Layer(v, layer)
    if q.ndim != 4 or k.ndim != 4:
        raise ValueError(f"q and k must be [B, T, H, D] / [B, C, H, D], got shapes {q.shape}, {k.shape}")
    b, t, hq, d = q.shape
    c, hkv = k.shape[1], k.shape[2]
    if v.shape != k.shape:
        raise ValueError(f"v has shape {v.shape}, k has {k.shape}: they must match")
    if k.shape[0] != b or k.shape[3] != d:
        raise ValueError(f"k {k.shape} does not match q {q.shape} in batch or head_dim")
    if hkv < 1 or hq % hkv:
        raise ValueError(f"query heads {hq} must be a multiple of kv heads {hkv}")
    if not attention_head_dim_ok(d):
        raise ValueError(f"head_dim {d} must be a power of two >= 16")
    if t < 1 or c < 1:
        raise ValueError(f"need at least one query and one key, got T={t}, C={c}")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise ValueError(f"{name} must be floating point, got {x.dtype}")
    for name, x, shape in (("q_pos", q_pos, (b, t)), ("k_pos", k_pos, (b, c))):
        if x.shape != shape or not jnp.issubdtype(x.dtype, jnp.integer):
            raise ValueError(f"{name} must be an integer array of shape {shape}, got {x.dtype}{list(x.shape)}")
    if window is not None and (not isinstance(window, (int, np.integer)) or isinstance(window, bool) or window < 1):
        raise ValueError(f"window must be None or an int >= 1, got {window!r}")
    given = (block_q, block_k, num_warps, num_stages, d_split)
    block_q, block_k, num_warps, num_stages, d_split = (  # only None takes the default: 0 is refused below
        default if g is None else g for g, default in zip(given, _DEFAULTS[min(d, 512)]))
    for name, x in (("block_q", block_q), ("block_k", block_k)):
        if not _pow2(x) or x < 16:
            raise ValueError(f"{name}={x} must be a power of two >= 16 (Triton's dot)")
    if num_warps < 1 or num_stages < 1:
        raise ValueError(f"num_warps={num_warps} and num_stages={num_stages} must be >= 1")
    if not _pow2(d_split):
        raise ValueError(f"d_split={d_split} must be a power of two")
    if d // d_split < 16:
        raise ValueError(f"d_split={d_split}: head_dim / d_split = {d}/{d_split} must be >= 16 (Triton's dot)")

    nq, nk = pl.cdiv(t, block_q), pl.cdiv(c, block_k)
    if k_split is None:
        k_split = key_split(hq * d_split * nq * b, nk)
    if isinstance(k_split, bool) or not isinstance(k_split, (int, np.integer)) or not 1 <= k_split <= nk:
        raise ValueError(f"k_split={k_split!r} must be an int in [1, {nk}] (the key blocks)")
    # Positions padded to whole blocks: pad queries repeat the last position (they widen no range),
    # pad keys are EMPTY (never visible). k and v are not copied: the kernel masks their tail loads.
    qpos = jnp.pad(q_pos.astype(jnp.int32), ((0, 0), (0, nq * block_q - t)), mode="edge")
    kpos = jnp.pad(k_pos.astype(jnp.int32), ((0, 0), (0, nk * block_k - c)), constant_values=EMPTY)
    lo, hi = block_ranges(qpos, kpos, window, block_q, block_k)
    t_out = t
    if interpret:  # interpret mode clamps out-of-range slices instead of masking: whole tiles there
        q = jnp.pad(q, ((0, 0), (0, nq * block_q - t), (0, 0), (0, 0)))
        lead = [(0, 0)] * (layer is not None)
        k_st, v_st = (jnp.pad(x, (*lead, (0, 0), (0, nk * block_k - c), (0, 0), (0, 0))) for x in (k_st, v_st))
        t_out = nq * block_q
    stacked = layer is not None
    kernel = functools.partial(with_layer(_kernel, stacked, (1, 2)), t=t, c=c, groups=hq // hkv, window=window, block_q=block_q,
                               block_k=block_k, nq=nq, d_split=d_split, k_split=k_split)
    if k_split == 1:
        out_shape = jax.ShapeDtypeStruct((b, t_out, hq, d), q.dtype)
    else:  # each part's unnormalised output, max and sum (float32), combined below
        out_shape = (jax.ShapeDtypeStruct((k_split, b, t_out, hq, d), jnp.float32),
                     *[jax.ShapeDtypeStruct((k_split, b, t_out, hq), jnp.float32)] * 2)
    out = pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=(hq * d_split, nq, b * k_split),  # a head's parts, then a kv group's heads, adjacent: same tiles from L2
        interpret=interpret,
        compiler_params=None if interpret else pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        name=f"flash_attention_d{d}_q{block_q}_k{block_k}" + (f"_dsplit{d_split}" if d_split > 1 else "")
        + (f"_ksplit{k_split}" if k_split > 1 else ""),
    )(*([Layer(k_st, layer).operand()] if stacked else []), q, k_st, v_st, qpos, kpos, lo, hi)
    if k_split > 1:
        out = _combine(*out, q.dtype)
    return out[:, :t]


def key_split(programs: int, key_blocks: int) -> int:
    """The default k_split: parts per (row, head, query block) so that a call with few programs (a
    prefill chunk of a long prompt: 32 at 128 queries, head dim 512) still fills the GPU (about
    `_PROGRAMS`), each part keeping `_PART_BLOCKS` key blocks at least; a power of two. Unsplit, such a
    call loops over the whole context on a quarter of the multiprocessors."""
    want = min(_PROGRAMS // max(programs, 1), key_blocks // _PART_BLOCKS)
    return 1 << (want.bit_length() - 1) if want > 1 else 1


# ---- the XLA counterpart: a prefill without kernels (and the kernel's reference at long prompts) ----
def blocked_attention(q: jax.Array, k: jax.Array, v: jax.Array, q_pos: jax.Array, k_pos: jax.Array,
                      window: int | None = None, *, q_block: int = 256, k_block: int = 512) -> jax.Array:
    """`attention` without the `[T, C]` score matrix: query blocks (lax.map) x key blocks (lax.scan)
    with an online softmax in float32; masks per block from the positions; a key block no query of
    the block can see is skipped (lax.cond). Same math as `dense_attention` (the unnormalised
    probabilities are cast to v's dtype, so bf16 results agree to bf16 rounding, float32 to float32
    rounding). Temporary memory O(B * Hq * q_block * (k_block + D))."""
    b, t, hq, d = q.shape
    c, hkv = k.shape[1], k.shape[2]
    g = hq // hkv
    bq, bk = min(q_block, t), min(k_block, c)
    nq, nk = -(-t // bq), -(-c // bk)
    qp = jnp.pad(q, ((0, 0), (0, nq * bq - t), (0, 0), (0, 0)))
    qpos = jnp.pad(q_pos.astype(jnp.int32), ((0, 0), (0, nq * bq - t)), mode="edge")
    kp = jnp.pad(k.astype(q.dtype), ((0, 0), (0, nk * bk - c), (0, 0), (0, 0)))
    vp = jnp.pad(v, ((0, 0), (0, nk * bk - c), (0, 0), (0, 0)))
    kpos = jnp.pad(k_pos.astype(jnp.int32), ((0, 0), (0, nk * bk - c)), constant_values=EMPTY)
    qs = jnp.moveaxis(qp.reshape(b, nq, bq, hkv, g, d), 1, 0)
    qps = jnp.moveaxis(qpos.reshape(b, nq, bq), 1, 0)
    ks = jnp.moveaxis(kp.reshape(b, nk, bk, hkv, d), 1, 0)
    vs = jnp.moveaxis(vp.reshape(b, nk, bk, hkv, d), 1, 0)
    kps = jnp.moveaxis(kpos.reshape(b, nk, bk), 1, 0)

    def one_query_block(args):
        qi, qpi = args  # [B, bq, Hkv, G, D], [B, bq]

        def key_block(carry, xs):
            kk, vv, kpi = xs
            mask = visible(qpi, kpi, window)  # [B, bq, bk]

            def update(carry):
                m, l, acc = carry
                s = einsum_f32("btkgd,bckd->bkgtc", qi, kk)
                s = jnp.where(mask[:, None, None], s, _NEG)
                m_new = jnp.maximum(m, jnp.max(s, axis=-1))
                corr = jnp.exp(m - m_new)
                p = jnp.exp(s - m_new[..., None])
                l = l * corr + jnp.sum(p, axis=-1)
                pv = einsum_f32("bkgtc,bckd->bkgtd", p.astype(vv.dtype), vv)
                return m_new, l, acc * corr[..., None] + pv

            return jax.lax.cond(jnp.any(mask), update, lambda c_: c_, carry), None

        init = (jnp.full((b, hkv, g, bq), _NEG, jnp.float32), jnp.zeros((b, hkv, g, bq), jnp.float32),
                jnp.zeros((b, hkv, g, bq, d), jnp.float32))
        (_, l, acc), _ = jax.lax.scan(key_block, init, (ks, vs, kps))
        o = acc / jnp.where(l > 0, l, 1.0)[..., None]  # a query that sees nothing (padding) gives 0
        return jnp.moveaxis(o, 3, 1).astype(q.dtype)  # [B, bq, Hkv, G, D]

    out = jax.lax.map(one_query_block, (qs, qps))  # [nq, B, bq, Hkv, G, D]
    return jnp.moveaxis(out, 0, 1).reshape(b, nq * bq, hq * d)[:, :t]
