"""The `xla` backend: dequantize + dot in plain jnp. The reference, and what a JAX user has today."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from .config import ROW_TILE
from .quant import QuantizedWeight, dequantize


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def einsum_f32(spec: str, a: jax.Array, b: jax.Array) -> jax.Array:
    """`jnp.einsum(spec, a, b)` accumulated and returned in float32 (HIGHEST precision), whose gradient
    runs in the operands' dtype. Differentiating the plain einsum would multiply the float32
    cotangent by a bf16 operand as float32 x float32: CUDA-core SGEMMs, which took over half of a
    bf16 training step on the H200. Here the cotangent is cast to the operands' dtype first (bf16
    tensor-core GEMMs with float32 accumulation, as in the usual mixed-precision training); in
    float32 nothing changes. The forward is the einsum itself, bit for bit."""
    return jnp.einsum(spec, a, b, preferred_element_type=jnp.float32, precision=jax.lax.Precision.HIGHEST)


def _einsum_f32_fwd(spec, a, b):
    return einsum_f32(spec, a, b), (a, b)


def _einsum_f32_bwd(spec, res, g):
    a, b = res
    _, vjp = jax.vjp(lambda a, b: jnp.einsum(spec, a, b, precision=jax.lax.Precision.HIGHEST), a, b)
    return vjp(g.astype(jnp.promote_types(a.dtype, b.dtype)))


einsum_f32.defvjp(_einsum_f32_fwd, _einsum_f32_bwd)


def dense_matmul(x2: jax.Array, w: jax.Array) -> jax.Array:
    """`x2 [R, K] @ w[N, K].T` with float32 accumulation. A dot's result for row i may depend on the
    row count (XLA picks a GEMV for one row and a GEMM for several, with different reduction orders),
    so fewer than ROW_TILE rows are computed as ROW_TILE: a [B, 1] decode step and a [B, K] verify
    then give bitwise-identical rows."""
    rows = x2.shape[0]
    xp = jnp.pad(x2, ((0, ROW_TILE - rows), (0, 0))) if rows < ROW_TILE else x2
    dot_dtype = jnp.promote_types(x2.dtype, w.dtype)
    return einsum_f32("rk,nk->rn", xp.astype(dot_dtype), w.astype(dot_dtype))[:rows]


def xla_quantized_matmul(x2: jax.Array, qw: QuantizedWeight) -> jax.Array:
    """Reference path: dequantize the whole weight in x's dtype, then dot (float32 accumulation)."""
    return dense_matmul(x2, dequantize(qw, x2.dtype))


def dense_after_x(x2: jax.Array, qw: QuantizedWeight) -> jax.Array:
    """`xla_quantized_matmul`, with the dequantization made to depend on x2 (its weights plus an exact
    zero computed from x2[0, 0]): the qmm dense fallback's form. Dequantizing reads only the weight,
    so XLA would otherwise schedule every layer's dequantization early and keep all their bf16 copies
    alive at once (gigabytes in a 12B prefill). The zero is exact (nan_to_num keeps it finite), so
    the result is bitwise xla_quantized_matmul's."""
    w = dequantize(qw, x2.dtype)
    zero = (jnp.nan_to_num(x2[0, 0]) * 0).astype(w.dtype)
    return dense_matmul(x2, w + zero)
