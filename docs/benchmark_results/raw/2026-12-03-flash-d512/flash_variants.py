"""Spike: variants of `pallas_kernels.flash_attention` for head_dim 512 (the 12B's global layers).

    out = flash_attention_v(q, k, v, q_pos, k_pos, window, d_split=2, heads_together=2,
                            block_q=64, block_k=32, num_warps=8, num_stages=1)

Same semantics as `flash_attention` (GQA, scale 1.0, visibility from positions, float32 scores and
online softmax, unnormalised P cast to v's dtype before P @ V, float32 accumulation, 0 for a query
that sees nothing), two extra knobs:

d_split: `d_split` programs share one (head group, query block). Each computes the full q.k scores
  over all D (the same softmax state, bit for bit: the same dot on the same tiles) but only its
  D / d_split slice of P @ V, i.e. its accumulator is `[rows, D / d_split]` and it loads only that
  slice of V. Costs (d_split - 1) extra QK dots per key tile; buys an accumulator d_split times
  smaller (registers) and smaller V tiles (shared memory).
heads_together: `heads_together` query heads of one kv group (GQA) in one program, their rows
  stacked head-major `[heads_together * block_q, D]` (row r: head h0 + r // block_q, query
  q0 + r % block_q; q, q_pos and the output are gathered / scattered with index arrays), so each K/V
  tile is loaded once for all of them and both dots are `heads_together` times taller.

d_split = heads_together = 1 is the current kernel (same loads, same ops).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.config import EMPTY, attention_head_dim_ok
from pallas_kernels.flash_attention import _NEG, _pow2, block_ranges


def _kernel(q_ref, k_ref, v_ref, qpos_ref, kpos_ref, lo_ref, hi_ref, o_ref, *, t, c, groups, window,
            block_q, block_k, nq, d, d_split, heads_together):
    a, b = pl.program_id(0), pl.program_id(2)
    qb = nq - 1 - pl.program_id(1)  # causal: the costliest (last) query blocks start first
    hg, part = a // d_split, a % d_split  # the D part varies fastest: its siblings share Q and K in L2
    ht = heads_together
    h0 = hg * ht
    hk = h0 // groups  # ht divides groups: every stacked head reads kv head hk
    dd = d // d_split
    d0 = part * dd
    q0 = qb * block_q
    rows = ht * block_q
    if ht == 1:  # the current kernel's loads
        q_ok = (q0 + jnp.arange(block_q)) < t
        q = pltriton.load(q_ref.at[b, pl.ds(q0, block_q), h0, :], mask=q_ok[:, None], other=0)
        qp = pltriton.load(qpos_ref.at[b, pl.ds(q0, block_q)])
    else:  # head-major stacked rows, gathered (all-array indices: interpret mode takes no array + slice mix)
        r = jnp.arange(rows)
        rt, rh = q0 + r % block_q, h0 + r // block_q
        q_ok = rt < t
        q = pltriton.load(q_ref.at[b, rt[:, None], rh[:, None], jnp.arange(d)[None, :]], mask=q_ok[:, None], other=0)
        qp = pltriton.load(qpos_ref.at[b, rt])  # padded to whole blocks: always in range
    q_prec = jax.lax.Precision.HIGHEST if q.dtype == jnp.float32 else None
    v_prec = jax.lax.Precision.HIGHEST if v_ref.dtype == jnp.float32 else None

    def step(j, carry):
        m, l, acc = carry
        k0 = j * block_k
        kv_ok = ((k0 + jnp.arange(block_k)) < c)[:, None]  # tails load as 0: never NaN in P @ V
        kp = pltriton.load(kpos_ref.at[b, pl.ds(k0, block_k)])
        k = pltriton.load(k_ref.at[b, pl.ds(k0, block_k), hk, :], mask=kv_ok, other=0)
        if d_split == 1:
            v = pltriton.load(v_ref.at[b, pl.ds(k0, block_k), hk, :], mask=kv_ok, other=0)
        else:
            v = pltriton.load(v_ref.at[b, pl.ds(k0, block_k), hk, pl.ds(d0, dd)], mask=kv_ok, other=0)
        s = pltriton.dot(q, k.astype(q.dtype), trans_b=True, precision=q_prec)  # [rows, bk] float32
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

    init = (jnp.full((rows,), _NEG, jnp.float32), jnp.zeros((rows,), jnp.float32),
            jnp.zeros((rows, dd), jnp.float32))
    _, l, acc = jax.lax.fori_loop(lo_ref[b, qb], hi_ref[b, qb], step, init)
    out = (acc / jnp.where(l > 0, l, 1.0)[:, None]).astype(o_ref.dtype)  # a query that sees nothing gives 0
    cols = pl.ds(0, d) if d_split == 1 else pl.ds(d0, dd)
    if ht == 1:
        pltriton.store(o_ref.at[b, pl.ds(q0, block_q), h0, cols], out, mask=q_ok[:, None])
    else:
        pltriton.store(o_ref.at[b, rt[:, None], rh[:, None], (d0 + jnp.arange(dd))[None, :]], out, mask=q_ok[:, None])


@functools.partial(jax.jit, static_argnames=("window", "d_split", "heads_together", "block_q", "block_k",
                                             "num_warps", "num_stages", "interpret"))
def flash_attention_v(q, k, v, q_pos, k_pos, window: int | None = None, *, d_split: int = 1,
                      heads_together: int = 1, block_q: int, block_k: int, num_warps: int, num_stages: int,
                      interpret: bool = False) -> jax.Array:
    """`flash_attention(q, k, v, q_pos, k_pos, window)` with d_split / heads_together (module
    docstring). q `[B, T, Hq, D]`, k, v `[B, C, Hkv, D]`, q_pos int `[B, T]`, k_pos int `[B, C]`.
    Returns `[B, T, Hq, D]` in q's dtype. All tiling arguments are explicit (no per-D defaults)."""
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
    groups = hq // hkv
    for name, x in (("d_split", d_split), ("heads_together", heads_together)):
        if not isinstance(x, (int, np.integer)) or isinstance(x, bool) or not _pow2(x):
            raise ValueError(f"{name}={x!r} must be a power of two >= 1")
    if d % d_split or d // d_split < 16:
        raise ValueError(f"d_split={d_split}: head_dim {d} / d_split must be a whole power of two >= 16 (Triton's dot)")
    if groups % heads_together:
        raise ValueError(f"heads_together={heads_together} must divide the query heads per kv head ({groups})")
    if not _pow2(block_q) or heads_together * block_q < 16:
        raise ValueError(f"block_q={block_q} must be a power of two with heads_together * block_q >= 16 (Triton's dot)")
    if not _pow2(block_k) or block_k < 16:
        raise ValueError(f"block_k={block_k} must be a power of two >= 16 (Triton's dot)")
    if num_warps < 1 or num_stages < 1:
        raise ValueError(f"num_warps={num_warps} and num_stages={num_stages} must be >= 1")

    nq, nk = pl.cdiv(t, block_q), pl.cdiv(c, block_k)
    qpos = jnp.pad(q_pos.astype(jnp.int32), ((0, 0), (0, nq * block_q - t)), mode="edge")
    kpos = jnp.pad(k_pos.astype(jnp.int32), ((0, 0), (0, nk * block_k - c)), constant_values=EMPTY)
    lo, hi = block_ranges(qpos, kpos, window, block_q, block_k)
    t_out = t
    if interpret:  # interpret mode clamps out-of-range slices instead of masking: whole tiles there
        q = jnp.pad(q, ((0, 0), (0, nq * block_q - t), (0, 0), (0, 0)))
        k, v = (jnp.pad(x, ((0, 0), (0, nk * block_k - c), (0, 0), (0, 0))) for x in (k, v))
        t_out = nq * block_q
    kernel = functools.partial(_kernel, t=t, c=c, groups=groups, window=window, block_q=block_q, block_k=block_k,
                               nq=nq, d=d, d_split=d_split, heads_together=heads_together)
    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((b, t_out, hq, d), q.dtype),
        grid=(hq // heads_together * d_split, nq, b),
        interpret=interpret,
        compiler_params=None if interpret else pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        name=f"flash_v_d{d}_s{d_split}_h{heads_together}_q{block_q}_k{block_k}",
    )(q, k, v, qpos, kpos, lo, hi)
    return out[:, :t]
