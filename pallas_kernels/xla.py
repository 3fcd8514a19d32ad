"""The `xla` backend: dequantize + dot in plain jnp. The reference, and what a JAX user has today."""
from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp

from .config import ROW_TILE
from .dense import DenseWeight
from .quant import QuantizedWeight, dequantize

# XLA's CPU dot gives a row the same bits for every row count from 2 on (a GEMM library kernel
# whose reduction order does not depend on the rows), while 1 row takes a GEMV that sums in another
# order (measured on JAX 0.10.2, float32 and bfloat16, [2048, 640], [640, 2048], [4096, 512], 2..16
# rows; tests/kernels/test_kernels.py checks it). So on a CPU one row is padded to 2, not to ROW_TILE.
CPU_DOT_ROWS = 2


# XLA's CPU backend (JAX 0.10.2) hands a reduce of 4096 elements or more, with the elementwise ops
# after it, to a YNNPACK fusion and emits a smaller one itself, in another order (and YNNPACK's exp
# rounds some inputs otherwise than XLA's). A row's norm or softmax then depended on how many rows
# shared the op: the batch. With this option on a program only dots go to YNNPACK, and XLA's own
# reduces and elementwise code give a row the same bits at 1 to 128 rows (measured: norms over 256
# and 640, softmaxes over 64 to 262,144, the sampler's sort and cumsum; tests/engine/
# test_batch_invariance.py). It is set per program (jaxspec's own, `program_options`), never in
# XLA_FLAGS: a user's other programs keep XLA's defaults.
CPU_PROGRAM_OPTIONS = {"xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT"}


def program_options() -> dict:
    """The XLA options jaxspec compiles its programs with: CPU_PROGRAM_OPTIONS on a CPU when this
    jaxlib knows them (else none, with one warning: a row's bits may then depend on its batch), and
    none elsewhere (the GPU path is unchanged)."""
    return dict(_cpu_options()) if jax.default_backend() == "cpu" else {}


@functools.cache
def _cpu_options() -> tuple:
    try:  # one tiny compile: an XLA that lacks the option (or its value) refuses it at compile time
        jax.jit(lambda x: x + 1, compiler_options=CPU_PROGRAM_OPTIONS).lower(jnp.zeros((2,), jnp.float32)).compile()
    except Exception as e:  # noqa: BLE001 (XLA's own error types vary by version)
        warnings.warn(f"this jaxlib refuses {CPU_PROGRAM_OPTIONS} ({str(e).splitlines()[0][:200]}): on a CPU a "
                      "request's text may then depend on the requests batched beside it", stacklevel=2)
        return ()
    return tuple(CPU_PROGRAM_OPTIONS.items())


def dense_rows() -> int:
    """The rows a dense dot of fewer rows is computed as, so that its rows are bitwise those of any
    wider dot: CPU_DOT_ROWS on a CPU, ROW_TILE elsewhere."""
    return CPU_DOT_ROWS if jax.default_backend() == "cpu" else ROW_TILE


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
    so fewer than `dense_rows()` rows are computed as that many: a [B, 1] decode step and a [B, K]
    verify then give bitwise-identical rows."""
    rows, pad_to = x2.shape[0], dense_rows()
    xp = jnp.pad(x2, ((0, pad_to - rows), (0, 0))) if rows < pad_to else x2
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


def prepare_dense(w, dtype=None) -> DenseWeight:
    """A QuantizedWeight (or a float array) as a DenseWeight in `dtype` (default: the weight's own),
    dequantized once: `dense_matmul` on it gives bitwise `xla_quantized_matmul`'s result for an x of
    that dtype, and `take_rows` the rows `quant.take_rows` gives. A stacked QuantizedWeight (one more
    leading axis) is dequantized layer by layer."""
    if isinstance(w, DenseWeight):
        return w if dtype is None or jnp.dtype(dtype) == w.dtype else DenseWeight.of(w.value().astype(dtype))
    if not isinstance(w, QuantizedWeight):
        w = jnp.asarray(w)
        return DenseWeight.of(w if dtype is None else w.astype(dtype))
    dtype = w.dtype if dtype is None else dtype
    if w.scales.ndim == 3:
        return DenseWeight.of(jnp.stack([_dequantize(jax.tree_util.tree_map(lambda a, i=i: a[i], w), dtype)
                                         for i in range(w.scales.shape[0])]))
    return DenseWeight.of(_dequantize(w, dtype))


def _dequantize(qw: QuantizedWeight, dtype) -> jax.Array:
    qw.validate()
    return _dequantize_jit(qw, jnp.dtype(dtype).name)


@functools.partial(jax.jit, static_argnums=(1,))
def _dequantize_jit(qw, dtype_name):
    return dequantize(qw, jnp.dtype(dtype_name))
