"""The MLX affine quantization format: QuantizedWeight, quantize, dequantize, take_rows.

Per group of `group_size` consecutive elements along the input (K) axis, with n = 2**bits - 1:
the larger-magnitude extreme is represented exactly, 0.0 is representable, and
`w = q * scale + bias`. In MLX's files, element `e*j + k` of a row (e = 32 // bits) lives in bits
[bits*k, bits*(k+1)) of word j. `quantize` matches `mlx.core.quantize` bit for bit.

In memory a QuantizedWeight keeps one layout, the one the kernels read: the words of 64 weight
rows by one group are one contiguous run, and each group's scales (and biases) for consecutive
rows are one run. MLX's layout exists only at the file boundary (`from_mlx`, `to_mlx`).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from .dense import DenseWeight

SUPPORTED_BITS = (2, 4, 8)  # bit widths whose elements never straddle a 32-bit word
SUPPORTED_GROUP_SIZES = (32, 64, 128)
FLOAT_DTYPES = (jnp.float32, jnp.float16, jnp.bfloat16)
TILE_ROWS = 64  # weight rows per stored tile of words


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedWeight:
    """A quantized `[N, K]` linear weight.

    weight: uint32 `[ceil(N / 64), K / group_size, 64, group_size * bits / 32]`: tile t, group g
    holds the packed words of rows 64t..64t+63 for that group (MLX's packing within a word), one
    contiguous run a kernel program reads per step; rows past N (the last tile's padding) are zero.
    scales, biases: `[K / group_size, N]` (float): a group's values for a block of rows are one
    contiguous run. N and K come from the scales. A stack of layers' weights (`stack.Layer`) carries
    one more leading axis on all three arrays; `shape` stays the one layer's.
    """

    weight: jax.Array
    scales: jax.Array
    biases: jax.Array
    bits: int = dataclasses.field(default=4, metadata=dict(static=True))
    group_size: int = dataclasses.field(default=64, metadata=dict(static=True))

    @property
    def shape(self) -> tuple[int, int]:
        g, n = self.scales.shape[-2:]
        return n, g * self.group_size

    @property
    def dtype(self):
        return self.scales.dtype

    @property
    def nbytes(self) -> int:
        return sum(int(np.prod(a.shape)) * jnp.dtype(a.dtype).itemsize
                   for a in (self.weight, self.scales, self.biases))

    def validate(self, stacked: bool = False) -> None:
        """ValueError naming the problem; `stacked`: a stack of layers (one leading axis more)."""
        check_format(self.bits, self.group_size)
        lead = tuple(self.scales.shape[:1]) if stacked else ()
        if self.scales.ndim != 2 + len(lead):
            raise ValueError(f"QuantizedWeight.scales must be {'[L, ' if stacked else '['}K/group_size, N], got shape "
                             f"{tuple(self.scales.shape)}")
        if tuple(self.biases.shape) != tuple(self.scales.shape):
            raise ValueError(f"QuantizedWeight.biases has shape {tuple(self.biases.shape)}, expected the scales' "
                             f"{tuple(self.scales.shape)}")
        n, k = self.shape
        want = lead + (-(-n // TILE_ROWS), k // self.group_size, TILE_ROWS, self.group_size * self.bits // 32)
        if tuple(self.weight.shape) != want:
            raise ValueError(f"QuantizedWeight.weight must be [ceil(N/{TILE_ROWS}), K/group_size, {TILE_ROWS}, "
                             f"words per group] = {want} for N={n}, K={k}, bits={self.bits}, "
                             f"group_size={self.group_size}; got {tuple(self.weight.shape)}")
        if self.weight.dtype != jnp.uint32:
            raise ValueError(f"QuantizedWeight.weight must be uint32, got {self.weight.dtype}")

    @classmethod
    def from_mlx(cls, weight, scales, biases, bits: int = 4, group_size: int = 64) -> "QuantizedWeight":
        """From MLX's layout: weight uint32 `[N, K * bits / 32]`, scales and biases `[N, K / group_size]`."""
        check_format(bits, group_size)
        weight, scales, biases = (jnp.asarray(a) for a in (weight, scales, biases))
        if weight.ndim != 2 or scales.ndim != 2:
            raise ValueError(f"MLX weights are weight [N, K*bits/32] and scales [N, K/group_size], got "
                             f"{tuple(weight.shape)} and {tuple(scales.shape)}")
        n, groups = scales.shape
        wpg = group_size * bits // 32
        if tuple(weight.shape) != (n, groups * wpg) or tuple(biases.shape) != (n, groups):
            raise ValueError(f"MLX weight {tuple(weight.shape)}, scales {tuple(scales.shape)}, biases "
                             f"{tuple(biases.shape)} do not agree at bits={bits}, group_size={group_size} "
                             f"(expected weight {(n, groups * wpg)}, biases {(n, groups)})")
        if weight.dtype != jnp.uint32:
            raise ValueError(f"MLX packed weights must be uint32, got {weight.dtype}")
        tiles = -(-n // TILE_ROWS)
        words = jnp.pad(weight, ((0, tiles * TILE_ROWS - n), (0, 0)))
        words = words.reshape(tiles, TILE_ROWS, groups, wpg).transpose(0, 2, 1, 3)
        return cls(words, scales.T, biases.T, bits, group_size)

    def rows_words(self) -> jax.Array:
        """The packed words in MLX's row-major `[N, K * bits / 32]`."""
        t, g, r, w = self.weight.shape
        return self.weight.transpose(0, 2, 1, 3).reshape(t * r, g * w)[:self.shape[0]]

    def to_mlx(self) -> tuple[jax.Array, jax.Array, jax.Array]:
        """(weight `[N, K * bits / 32]`, scales `[N, K / group_size]`, biases) in MLX's layout."""
        return self.rows_words(), self.scales.T, self.biases.T


def check_format(bits: int, group_size: int) -> None:
    """ValueError unless bits and group_size are integers (Python or numpy) of a supported format."""
    for name, v, ok in (("bits", bits, SUPPORTED_BITS), ("group_size", group_size, SUPPORTED_GROUP_SIZES)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
            raise ValueError(f"{name} must be an integer, got {v!r} ({type(v).__name__})")
        if v not in ok:
            raise ValueError(f"unsupported {name}={v!r}: supported are {ok}")


_all_finite = jax.jit(lambda x: jnp.isfinite(x).all())


def all_finite(x) -> jax.Array:
    """One fused isfinite reduction on device: a bool scalar, not synchronised (for batching checks)."""
    return _all_finite(x)


def describe_nonfinite(x) -> str:
    """'2 NaN and 1 inf of 4096 values, the first at index (0, 5)' for a concrete array (host copy)."""
    h = np.asarray(jax.device_get(x), np.float32)
    nan, inf = int(np.isnan(h).sum()), int(np.isinf(h).sum())
    first = tuple(int(i) for i in np.argwhere(~np.isfinite(h))[0]) if nan + inf else None
    return f"{nan} NaN and {inf} inf of {h.size} values, the first at index {first}"


def check_finite(w, what: str = "weight") -> None:
    """ValueError naming `what` if the concrete array `w` holds NaN or inf; a no-op for a tracer
    (under jit the values are unknown)."""
    if isinstance(w, jax.core.Tracer):
        return
    if not bool(all_finite(w)):
        raise ValueError(f"{what} has non-finite values ({describe_nonfinite(w)}): refusing to quantize "
                         "(a NaN would silently become its group's minimum, an inf a NaN scale)")


def _exact_div(a, b):
    """IEEE a / b. XLA rewrites division by a broadcast (or constant) into multiplication by
    its reciprocal, which is off by an ulp often enough to flip round-half cases; materialise
    the divisor behind an optimisation barrier so the division stays a division."""
    b = jax.lax.optimization_barrier(jnp.broadcast_to(jnp.asarray(b, jnp.float32), jnp.shape(a)))
    return a / b


def _group_params(wg: jax.Array, bits: int):
    """Scale, bias (float32) and integer codes for groups `wg` [..., G, g] in float32 (MLX's rule)."""
    n_levels = float(2**bits - 1)
    mn = wg.min(axis=-1, keepdims=True)
    mx = wg.max(axis=-1, keepdims=True)
    scale = jnp.maximum(_exact_div(mx - mn, n_levels), jnp.float32(1e-7))
    use_min = jnp.abs(mn) > jnp.abs(mx)
    edge = jnp.where(use_min, mn, mx)
    scale = jnp.where(use_min, scale, -scale)
    q0 = jnp.round(_exact_div(edge, scale))  # jnp.round is round-half-to-even, like rint
    nonzero = q0 != 0
    scale = jnp.where(nonzero, _exact_div(edge, jnp.where(nonzero, q0, 1.0)), scale)
    bias = jnp.where(nonzero, edge, 0.0)
    q = jnp.clip(jnp.round(_exact_div(wg - bias, scale)), 0, n_levels)
    return scale, bias, q.astype(jnp.uint32)


def pack(q: jax.Array, bits: int) -> jax.Array:
    """Pack integer codes `q` [N, K] (uint32, < 2**bits) into uint32 words [N, K*bits/32]."""
    epw = 32 // bits
    n, k = q.shape
    q = q.reshape(n, k // epw, epw)
    shifts = (jnp.arange(epw, dtype=jnp.uint32) * bits)
    # The shifted fields are disjoint, so their sum is their bitwise OR.
    return jnp.sum(q << shifts, axis=-1, dtype=jnp.uint32)


def unpack(words: jax.Array, bits: int) -> jax.Array:
    """Inverse of `pack`: uint32 words [..., W] -> codes [..., W * 32/bits] (uint32)."""
    epw = 32 // bits
    shifts = jnp.arange(epw, dtype=jnp.uint32) * bits
    q = (words[..., None] >> shifts) & jnp.uint32(2**bits - 1)
    return q.reshape(*words.shape[:-1], words.shape[-1] * epw)


def quantize(w, *, bits: int = 4, group_size: int = 64) -> QuantizedWeight:
    """Quantize a float `[N, K]` matrix (bit-exact with `mlx.core.quantize`, see `to_mlx`).

    Raises ValueError for an unsupported or non-integer bits / group_size, a non-float dtype, a shape
    that is not `[N, K]` with K a multiple of group_size, and a weight holding NaN or inf (counted,
    with the first index; checked on the concrete array before the jitted kernel, skipped when `w` is
    a tracer)."""
    check_format(bits, group_size)
    bits, group_size = int(bits), int(group_size)  # a numpy integer becomes the static field as an int
    w = jnp.asarray(w)
    if w.dtype not in FLOAT_DTYPES:
        raise ValueError(f"quantize expects a float32/float16/bfloat16 weight, got {w.dtype}")
    if w.ndim != 2:
        raise ValueError(f"quantize expects a rank-2 [N, K] weight, got shape {w.shape}")
    n, k = w.shape
    if k % group_size:
        raise ValueError(f"K={k} (last axis) is not a multiple of group_size={group_size}")
    check_finite(w)
    return _quantize(w, bits, group_size)


@functools.partial(jax.jit, static_argnums=(1, 2))
def _quantize(w, bits, group_size):
    n, k = w.shape
    wg = w.astype(jnp.float32).reshape(n, k // group_size, group_size)
    scale, bias, q = _group_params(wg, bits)
    return QuantizedWeight.from_mlx(pack(q.reshape(n, k), bits), scale[..., 0].astype(w.dtype),
                                    bias[..., 0].astype(w.dtype), bits, group_size)


def _dequantize_rows(words, scales, biases, bits: int, group_size: int, dtype) -> jax.Array:
    """Rows of MLX words `[R, K*bits/32]` with their scales/biases `[R, K/g]` -> `[R, K]` in dtype,
    computed in float32."""
    r = words.shape[0]
    q = unpack(words, bits).astype(jnp.float32).reshape(r, -1, group_size)
    w = q * scales.astype(jnp.float32)[..., None] + biases.astype(jnp.float32)[..., None]
    return w.reshape(r, -1).astype(dtype)


def dequantize(qw: QuantizedWeight, dtype=None) -> jax.Array:
    """`q * scale + bias` as `[N, K]`, computed in float32 and cast to `dtype` (default: the scales' dtype)."""
    qw.validate()
    return _dequantize_rows(*qw.to_mlx(), qw.bits, qw.group_size, qw.dtype if dtype is None else dtype)


def take_rows(w, ids, dtype=None) -> jax.Array:
    """Rows `ids` of a float `[N, K]` matrix or a QuantizedWeight (an embedding lookup), dequantized."""
    ids = jnp.asarray(ids)
    if isinstance(w, DenseWeight):
        return w.take_rows(ids, dtype)
    if not isinstance(w, QuantizedWeight):
        out = jnp.take(w, ids, axis=0)
        return out if dtype is None else out.astype(dtype)
    n, k = w.shape
    # JAX's gather wraps negative ids and clamps the rest; done once here, so a row's words and
    # scales come from the same row
    flat = jnp.clip(jnp.where(ids < 0, ids + n, ids).reshape(-1), 0, n - 1)
    words = w.weight[flat // TILE_ROWS, :, flat % TILE_ROWS].reshape(flat.shape[0], -1)
    out = _dequantize_rows(words, w.scales[:, flat].T, w.biases[:, flat].T, w.bits, w.group_size,
                           w.dtype if dtype is None else dtype)
    return out.reshape(*ids.shape, k)
