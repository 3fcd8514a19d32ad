"""The `xla` backend: dequantize + dot in plain jnp. The reference, and what a JAX user has today."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from .quant import QuantizedWeight, dequantize

# A dot's result for row i may depend on the row count (XLA picks a GEMV for one row and a GEMM for
# several, with different reduction orders). Up to this many rows we always compute exactly this many,
# so a [B, 1] decode step and a [B, K] verify give bitwise-identical rows.
ROW_BUCKET = 16


def pad_rows(x2: jax.Array, rows: int) -> jax.Array:
    return x2 if x2.shape[0] == rows else jnp.pad(x2, ((0, rows - x2.shape[0]), (0, 0)))


def dense_matmul(x2: jax.Array, w: jax.Array) -> jax.Array:
    """`x2 [R, K] @ w[N, K].T` with float32 accumulation, row-bucketed for row invariance."""
    rows = x2.shape[0]
    xp = pad_rows(x2, ROW_BUCKET) if rows < ROW_BUCKET else x2
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
    so XLA otherwise schedules every layer's dequantization early and keeps their bf16 copies alive
    together: a 512-token prefill of the whole 12B held 7.6 GB of temporaries on the H200 without
    this dependency, and holds 0.27 GB with it, as 2 layers do (benchmarks/prefill_memory.py;
    docs/kernels.md, log entries 12-13); an optimization barrier on (x, qw) had not changed it. The
    zero is exact (nan_to_num keeps it finite), so the result is bitwise xla_quantized_matmul's."""
    w = dequantize(qw, x2.dtype)
    zero = (jnp.nan_to_num(x2[0, 0]) * 0).astype(w.dtype)
    return dense_matmul(x2, w + zero)
