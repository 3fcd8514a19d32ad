"""The `xla` backend: dequantize + dot in plain jnp. The reference, and what a JAX user has today."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from .config import ROW_TILE
from .quant import QuantizedWeight, dequantize


def dense_matmul(x2: jax.Array, w: jax.Array) -> jax.Array:
    """`x2 [R, K] @ w[N, K].T` with float32 accumulation. A dot's result for row i may depend on the
    row count (XLA picks a GEMV for one row and a GEMM for several, with different reduction orders),
    so fewer than ROW_TILE rows are computed as ROW_TILE: a [B, 1] decode step and a [B, K] verify
    then give bitwise-identical rows."""
    rows = x2.shape[0]
    xp = jnp.pad(x2, ((0, ROW_TILE - rows), (0, 0))) if rows < ROW_TILE else x2
    dot_dtype = jnp.promote_types(x2.dtype, w.dtype)
    out = jax.lax.dot_general(xp.astype(dot_dtype), w.astype(dot_dtype), (((1,), (1,)), ((), ())),
                              precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
    return out[:rows]


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
