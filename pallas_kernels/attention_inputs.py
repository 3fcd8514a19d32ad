"""From a fused q/k/v projection's split-K partials to attention's inputs, in one Pallas launch.

    q, k_cache, v_cache = attention_inputs(q_parts, k_parts, v_parts, q_scale, k_scale, cos, sin,
                                           k_cache, v_cache, cols, eps=1e-6)

Per row and head: the partials summed in split order (as `launch.fold_splits`) and rounded to the
activation dtype, RMSNorm over the head dim (float32, times the head's scale), rotate-half RoPE on
q and k; k and v (v: RMSNorm without scale, or as projected with `norm_v=False` (Gemma 3); from its
own partials or, with `v_parts=None`, from k's) written into the cache at column `cols[b, t]` in place (a column outside the buffer is dropped).

Why: done by XLA this is a fusion per projection, a transpose and one scatter per cache: six small
kernels per layer of a decode step, each mostly launch latency (docs/benchmark_results/
decode-step-h200-2026-12-01.md). Here it is one launch of one small program per (row, head).

Rows are independent programs with one fixed shape, so a row's result does not depend on how many
rows the call has (the property speculative decoding's bitwise verify rests on).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from .stack import Layer, with_layer


def _fold(ref, row, col, width, dtype):
    """float32 sum over the split axis of `ref[:, row, col:col + width]`, in split order, rounded
    to `dtype` (what `fold_splits(parts).astype(dtype)` gives); every split's load issued first."""
    parts = [pltriton.load(ref.at[jnp.int32(s), row, pl.ds(col, width)]) for s in range(ref.shape[0])]
    total = parts[0].astype(jnp.float32)
    for p in parts[1:]:
        total = total + p.astype(jnp.float32)
    return total.astype(dtype).astype(jnp.float32)


def _norm(lo, hi, scale_ref, d, eps, dtype):
    """RMSNorm of the head (its two halves), times the scale if any, rounded to dtype, as float32."""
    inv = jax.lax.rsqrt((jnp.sum(lo * lo) + jnp.sum(hi * hi)) / d + eps)
    lo, hi = lo * inv, hi * inv
    if scale_ref is not None:
        half = d // 2
        lo = lo * pltriton.load(scale_ref.at[pl.ds(0, half)]).astype(jnp.float32)
        hi = hi * pltriton.load(scale_ref.at[pl.ds(half, half)]).astype(jnp.float32)
    return lo.astype(dtype).astype(jnp.float32), hi.astype(dtype).astype(jnp.float32)


def _rope(lo, hi, cos_ref, sin_ref, row, half):
    """Rotate-half RoPE: [lo, hi] * cos + [-hi, lo] * sin, float32."""
    c_lo, c_hi, s_lo, s_hi = (pltriton.load(ref.at[row, pl.ds(at, half)]).astype(jnp.float32)
                              for ref in (cos_ref, sin_ref) for at in (0, half))
    return lo * c_lo - hi * s_lo, hi * c_hi + lo * s_hi


def _kernel(*refs, hq, hkv, t, capacity, d, eps, has_kv, own_v, norm_v):
    """Operands: cos, sin, q_scale, q_parts, then with K/V: k_scale, k_parts, [v_parts], cols and
    the two caches (aliased to the last two outputs, never read); outputs: q, then the caches."""
    half = d // 2
    cos_ref, sin_ref, qs_ref, q_ref, *refs = refs
    if has_kv:
        ks_ref, k_ref, *refs = refs
        v_ref, *refs = refs if own_v else (None, *refs)
        cols_ref, _, _, q_out, kc_ref, vc_ref = refs
    else:
        (q_out,) = refs
    row, head = pl.program_id(0), pl.program_id(1)  # read outside the branches (interpret mode)
    dtype = q_out.dtype

    def load(ref, col):  # one head's two halves, folded over the split
        return tuple(_fold(ref, row, col + off, half, dtype) for off in (0, half))

    def store(ref, at, lo, hi, col=0, mask=None):
        for off, part in ((0, lo), (half, hi)):
            pltriton.store(ref.at[(*at, pl.ds(col + off, half))], part.astype(ref.dtype), mask=mask)

    @pl.when(head < hq)
    def _():
        lo, hi = _rope(*_norm(*load(q_ref, head * d), qs_ref, d, eps, dtype), cos_ref, sin_ref, row, half)
        store(q_out, (row,), lo, hi, col=head * d)

    if not has_kv:
        return
    col = pltriton.load(cols_ref.at[row])
    ok = jnp.broadcast_to((col >= 0) & (col < capacity), (half,))
    at = (row // t, jnp.clip(col, 0, capacity - 1))

    @pl.when((head >= hq) & (head < hq + hkv))
    def _():
        j = head - hq
        lo, hi = load(k_ref, j * d)
        store(kc_ref, (*at, j), *_rope(*_norm(lo, hi, ks_ref, d, eps, dtype), cos_ref, sin_ref, row, half), mask=ok)
        if not own_v:  # v is k's projection, normed without a scale (or not at all)
            store(vc_ref, (*at, j), *(_norm(lo, hi, None, d, eps, dtype) if norm_v else (lo, hi)), mask=ok)

    if own_v:
        @pl.when(head >= hq + hkv)
        def _():
            j = head - hq - hkv
            v = load(v_ref, j * d)
            store(vc_ref, (*at, j), *(_norm(*v, None, d, eps, dtype) if norm_v else v), mask=ok)


def _check(q_parts, k_parts, v_parts, q_scale, k_scale, cos, sin, k_cache, v_cache, cols, layer):
    if q_parts.ndim != 4:
        raise ValueError(f"q_parts must be [S, B, T, Hq*D] split-K partials, got shape {q_parts.shape}")
    _, b, t, _ = q_parts.shape
    d = cos.shape[-1]
    if cos.shape != (b, t, d) or sin.shape != cos.shape or d % 2 or (d // 2) & (d // 2 - 1):
        raise ValueError(f"cos/sin must be [B, T, D] = {(b, t, 'D')} with D/2 a power of two, got {cos.shape}, "
                         f"{sin.shape}")
    if q_parts.shape[-1] % d or q_scale.shape != (d,):
        raise ValueError(f"q_parts' width {q_parts.shape[-1]} must be a multiple of D={d} and q_scale [D], got "
                         f"{q_scale.shape}")
    if k_parts is None:
        if v_parts is not None or k_cache is not None or v_cache is not None:
            raise ValueError("without k_parts (a layer reading another's K/V) pass no v_parts and no caches")
        return
    if k_parts.ndim != 4 or k_parts.shape[1:3] != (b, t) or k_parts.shape[-1] % d:
        raise ValueError(f"k_parts must be [S, B, T, Hkv*D] with B, T = {(b, t)} and D={d}, got {k_parts.shape}")
    if v_parts is not None and v_parts.shape[1:] != k_parts.shape[1:]:
        raise ValueError(f"v_parts {v_parts.shape} must match k_parts {k_parts.shape} but for the split axis")
    if k_scale is None or k_scale.shape != (d,):
        raise ValueError(f"k_scale must be [D={d}], got {None if k_scale is None else k_scale.shape}")
    hkv = k_parts.shape[-1] // d
    shape = Layer(k_cache, 0).shape if layer is not None else k_cache.shape
    if k_cache.shape != v_cache.shape or len(shape) != 4 or shape[0] != b or shape[2:] != (hkv, d):
        raise ValueError(f"k_cache and v_cache must both be [B, C, Hkv, D] = {(b, 'C', hkv, d)}"
                         f"{' with a leading layer axis' if layer is not None else ''}, got {k_cache.shape} "
                         f"and {v_cache.shape}")
    if cols.shape != (b, t) or cols.dtype != jnp.int32:
        raise ValueError(f"cols must be int32 [B, T] = {(b, t)}, got {cols.dtype} {cols.shape}")


@functools.partial(jax.jit, static_argnames=("eps", "num_warps", "interpret", "norm_v"))
def attention_inputs(q_parts, k_parts, v_parts, q_scale, k_scale, cos, sin, k_cache, v_cache, cols, *,
                     eps: float, layer=None, num_warps: int = 1, interpret: bool = False, norm_v: bool = True):
    """q `[B, T, Hq, D]` and the caches with this block's K and V written, from split-K partials.

    q_parts `[S, B, T, Hq*D]`, k_parts / v_parts `[S', B, T, Hkv*D]` (any float dtype; S may differ
    per projection): a projection's value is the sum over S in order, rounded to cos's dtype.
    k_parts None: only q (a layer reading another layer's K/V; pass no v_parts and no caches).
    v_parts None: v is k's projection (normed without a scale, no RoPE). q_scale, k_scale `[D]`: the
    RMSNorm scales; cos, sin `[B, T, D]`: the RoPE tables at each token's position (activation dtype).
    k_cache, v_cache `[B, C, Hkv, D]` (with `layer`: stacks `[L, B, C, Hkv, D]`, that layer written
    in place); cols int32 `[B, T]`: the column each token's K/V goes to, dropped outside [0, C).
    `norm_v=False`: v is written as projected (rounded to cos's dtype), not RMSNormed.
    Returns (q, k_cache, v_cache); the caches are None without k_parts."""
    _check(q_parts, k_parts, v_parts, q_scale, k_scale, cos, sin, k_cache, v_cache, cols, layer)
    _, b, t, _ = q_parts.shape
    d = cos.shape[-1]
    hq = q_parts.shape[-1] // d
    r = b * t
    has_kv = k_parts is not None
    own_v = has_kv and v_parts is not None
    hkv = k_parts.shape[-1] // d if has_kv else 0
    flat = lambda a: a.reshape(a.shape[0], r, a.shape[-1])  # noqa: E731
    stacked = layer is not None
    operands = [cos.reshape(r, d), sin.reshape(r, d), q_scale, flat(q_parts)]
    out_shape = [jax.ShapeDtypeStruct((r, hq * d), cos.dtype)]
    aliases, layered = {}, ()
    if has_kv:
        operands += [k_scale, flat(k_parts)] + ([flat(v_parts)] if own_v else []) + [cols.reshape(r)]
        lead = len(operands) + stacked  # the caches' positions among the call's operands (the index first)
        aliases = {lead: 1, lead + 1: 2}
        operands += [k_cache, v_cache]
        out_shape += [jax.ShapeDtypeStruct(k_cache.shape, k_cache.dtype)] * 2
        layered = (len(operands) + 1, len(operands) + 2)  # the caches' outputs, counted after the index
    kernel = functools.partial(with_layer(_kernel, stacked, layered), hq=hq, hkv=hkv, t=t,
                               capacity=k_cache.shape[-3] if has_kv else 0,  # [(L,) B, C, Hkv, D]
                               d=d, eps=eps, has_kv=has_kv, own_v=own_v, norm_v=norm_v)
    outs = pl.pallas_call(
        kernel, out_shape=tuple(out_shape), grid=(r, hq + hkv * (1 + own_v)),
        input_output_aliases=aliases, interpret=interpret,
        compiler_params=None if interpret else pltriton.CompilerParams(num_warps=num_warps, num_stages=1),
        name=f"attention_inputs_d{d}",
    )(*([Layer(k_cache, layer).operand()] if stacked else []), *operands)
    q = outs[0].reshape(b, t, hq, d)
    return (q, outs[1], outs[2]) if has_kv else (q, None, None)


def attention_inputs_reference(q_parts, k_parts, v_parts, q_scale, k_scale, cos, sin, k_cache, v_cache, cols, *,
                               eps: float, layer=None, norm_v: bool = True):
    """`attention_inputs` in plain jnp (the reference the kernel is tested against)."""
    dtype, d = cos.dtype, cos.shape[-1]
    b, t = cos.shape[:2]

    def fold(parts):
        total = parts[0].astype(jnp.float32)
        for p in parts[1:]:
            total = total + p.astype(jnp.float32)
        return total.astype(dtype).reshape(b, t, -1, d)

    def norm(x, scale):
        xf = x.astype(jnp.float32)
        y = xf * jax.lax.rsqrt(jnp.sum(xf * xf, axis=-1, keepdims=True) / d + eps)
        return (y if scale is None else y * scale.astype(jnp.float32)).astype(dtype)

    def rope(x):
        xf, c, s = x.astype(jnp.float32), cos.astype(jnp.float32)[:, :, None], sin.astype(jnp.float32)[:, :, None]
        rot = jnp.concatenate([-xf[..., d // 2:], xf[..., :d // 2]], axis=-1)
        return (xf * c + rot * s).astype(dtype)

    q = rope(norm(fold(q_parts), q_scale))
    if k_parts is None:
        return q, None, None
    k_raw = fold(k_parts)
    k = rope(norm(k_raw, k_scale))
    v_raw = k_raw if v_parts is None else fold(v_parts)
    v = norm(v_raw, None) if norm_v else v_raw
    rows = jnp.broadcast_to(jnp.arange(b, dtype=jnp.int32)[:, None], (b, t))
    c = k_cache.shape[-3]
    cols = jnp.where((cols >= 0) & (cols < c), cols, c)  # a scatter would wrap a negative column

    def write(buf, new):
        if layer is None:
            return buf.at[rows, cols].set(new.astype(buf.dtype), mode="drop")
        return buf.at[jnp.full((b, t), layer, jnp.int32), rows, cols].set(new.astype(buf.dtype), mode="drop")
    return q, write(k_cache, k), write(v_cache, v)
