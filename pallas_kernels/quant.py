"""The MLX affine quantization format: QuantizedWeight, quantize, dequantize.

Per group of `group_size` consecutive elements along the input (K) axis, with n = 2**bits - 1:
the larger-magnitude extreme is represented exactly, 0.0 is representable, and
`w = q * scale + bias`. Packed little-end first: element `e*j + k` of a row (e = 32 // bits)
lives in bits [bits*k, bits*(k+1)) of word j. This matches `mlx.core.quantize` bit for bit.
"""
from __future__ import annotations

import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np

SUPPORTED_BITS = (2, 4, 8)  # bit widths whose elements never straddle a 32-bit word
SUPPORTED_GROUP_SIZES = (32, 64, 128)
FLOAT_DTYPES = (jnp.float32, jnp.float16, jnp.bfloat16)
SB_LAYOUTS = ("nk", "kn")  # QuantizedWeight.sb_layout
W_LAYOUTS = ("rows", "tiles")  # QuantizedWeight.w_layout
TILE_ROWS = 64  # weight rows per tile in the "tiles" word layout


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedWeight:
    """A quantized `[N, K]` linear weight in MLX's format.

    weight: uint32 `[N, K * bits / 32]` (MLX's packing); scales, biases: `[N, K / group_size]` (float)
    when `sb_layout == "nk"` (MLX's own), or the transpose `[K / group_size, N]` when "kn": the order
    the GEMV reads them in, a group's scales for a tile of columns in one contiguous run (29.2 -> 21.9
    us on 15360x3840 at the same launch, docs/kernels.md log entry 10). `with_sb_layout` converts;
    models store "kn".

    w_layout "rows" keeps MLX's row-major words; "tiles" stores them as `[N / 64, K / group_size, 64,
    group_size * bits / 32]`: the words of 64 rows by one group are one contiguous 2 KB run (4-bit,
    g64), where a row-major step reads 32 bytes from each of 64 rows 2*K/g*16 bytes apart. On the
    H200 a kernel that only streams the words at the GEMV's grid took 21.0 us on 15360x3840 row-major
    and 11.2 tile-major; the GEMV itself 20.5 -> 19.4 us (docs/kernels.md, log entry 13). Models store
    "tiles" where N is a multiple of 64 (`for_kernels`); checkpoints keep MLX's. `words()` gives
    MLX's order back; `with_w_layout` converts; N must be a multiple of 64.
    """

    weight: jax.Array
    scales: jax.Array
    biases: jax.Array
    bits: int = dataclasses.field(default=4, metadata=dict(static=True))
    group_size: int = dataclasses.field(default=64, metadata=dict(static=True))
    sb_layout: str = dataclasses.field(default="nk", metadata=dict(static=True))
    w_layout: str = dataclasses.field(default="rows", metadata=dict(static=True))

    @property
    def shape(self) -> tuple[int, int]:
        w = self.weight.shape
        if self.w_layout == "tiles" and len(w) == 4:
            return (w[0] * w[2], w[1] * w[3] * 32 // self.bits)
        return (w[0], w[1] * 32 // self.bits) if len(w) == 2 else (-1, -1)

    def words(self) -> jax.Array:
        """The packed words in MLX's row-major `[N, K * bits / 32]` whatever the stored layout."""
        if self.w_layout == "rows":
            return self.weight
        t, g, r, w = self.weight.shape
        return self.weight.transpose(0, 2, 1, 3).reshape(t * r, g * w)

    @property
    def dtype(self):
        return self.scales.dtype

    @property
    def sb_axes(self) -> tuple[int, int]:
        """(the N axis, the group axis) of the stored scales and biases."""
        return (0, 1) if self.sb_layout == "nk" else (1, 0)

    def sb_nk(self) -> tuple[jax.Array, jax.Array]:
        """(scales, biases) in MLX's `[N, K / group_size]` whatever the stored layout."""
        return (self.scales, self.biases) if self.sb_layout == "nk" else (self.scales.T, self.biases.T)

    @property
    def nbytes(self) -> int:
        return sum(int(np.prod(a.shape)) * jnp.dtype(a.dtype).itemsize
                   for a in (self.weight, self.scales, self.biases))

    def validate(self) -> None:
        check_format(self.bits, self.group_size)
        if self.w_layout not in W_LAYOUTS:
            raise ValueError(f"QuantizedWeight.w_layout={self.w_layout!r}: expected one of {W_LAYOUTS}")
        if self.w_layout == "rows" and self.weight.ndim != 2:
            raise ValueError(f"QuantizedWeight.weight must be rank 2 [N, K*bits/32], got shape {self.weight.shape}")
        wpg = self.group_size * self.bits // 32
        if self.w_layout == "tiles" and (self.weight.ndim != 4 or self.weight.shape[2:] != (TILE_ROWS, wpg)):
            raise ValueError(f"QuantizedWeight.weight in the 'tiles' layout must be [N/{TILE_ROWS}, K/group_size, "
                             f"{TILE_ROWS}, {wpg}], got shape {self.weight.shape}")
        if self.weight.dtype != jnp.uint32:
            raise ValueError(f"QuantizedWeight.weight must be uint32, got {self.weight.dtype}")
        if self.sb_layout not in SB_LAYOUTS:
            raise ValueError(f"QuantizedWeight.sb_layout={self.sb_layout!r}: expected one of {SB_LAYOUTS}")
        n, k = self.shape
        want = (n, k // self.group_size) if self.sb_layout == "nk" else (k // self.group_size, n)
        for name in ("scales", "biases"):
            a = getattr(self, name)
            if tuple(a.shape) != want:
                raise ValueError(f"QuantizedWeight.{name} has shape {tuple(a.shape)}, expected {want} "
                                 f"for weight {tuple(self.weight.shape)} at bits={self.bits}, group_size={self.group_size}, "
                                 f"sb_layout={self.sb_layout!r}")


def default_sb_layout() -> str:
    """The layout models store weights in: "kn" (what the kernels read fastest), or
    $JAXSPEC_SB_LAYOUT ("nk" keeps MLX's, for A/B runs)."""
    return os.environ.get("JAXSPEC_SB_LAYOUT") or "kn"


def with_sb_layout(qw: QuantizedWeight, layout: str | None = None) -> QuantizedWeight:
    """qw with its scales and biases stored as `layout` ("nk": MLX's [N, K/g]; "kn": [K/g, N]; None:
    default_sb_layout()). Same values, so every kernel's result is bitwise unchanged."""
    layout = default_sb_layout() if layout is None else layout
    if layout not in SB_LAYOUTS:
        raise ValueError(f"sb_layout={layout!r}: expected one of {SB_LAYOUTS}")
    if layout == qw.sb_layout:
        return qw
    s, b = qw.sb_nk()
    if layout == "kn":
        s, b = s.T, b.T
    return QuantizedWeight(qw.weight, s, b, qw.bits, qw.group_size, layout, qw.w_layout)


def word_tiles(words: jax.Array, rows: int, words_per_tile: int) -> jax.Array:
    """`[N, W]` packed words as `[N / rows, W / words_per_tile, rows, words_per_tile]`: every tile of
    `rows` weight rows by one step's words contiguous in memory. With rows = 64 and one group per tile
    it is QuantizedWeight's stored "tiles" layout (with_w_layout); gemv_probe's "stream tiles"
    kernels make other shapes of it inside the op (a pure read at the GEMV's grid: 21.0 us row-major,
    11.2 tile-major; docs/kernels.md, log entry 13)."""
    n, w = words.shape
    if n % rows or w % words_per_tile:
        raise ValueError(f"word_tiles: a [{n}, {w}] word array does not split into [{rows}, {words_per_tile}] tiles")
    return words.reshape(n // rows, rows, w // words_per_tile, words_per_tile).transpose(0, 2, 1, 3)


def default_w_layout() -> str:
    """The word layout models store where N allows: "tiles" (the whole 12B decode forward on the
    H200: 6.07 / 6.19 ms against 6.27-6.28 / 6.55 for rows in two calls, docs/kernels.md log entry
    13), or $JAXSPEC_W_LAYOUT ("rows" keeps MLX's, for A/B runs)."""
    return os.environ.get("JAXSPEC_W_LAYOUT") or "tiles"


def with_w_layout(qw: QuantizedWeight, layout: str | None = None) -> QuantizedWeight:
    """qw with its packed words stored as `layout` ("rows": MLX's; "tiles": 64-row tiles per group,
    see QuantizedWeight; None: default_w_layout()). Same codes, so every kernel's result is bitwise
    unchanged. "tiles" needs N to be a multiple of 64."""
    layout = default_w_layout() if layout is None else layout
    if layout not in W_LAYOUTS:
        raise ValueError(f"w_layout={layout!r}: expected one of {W_LAYOUTS}")
    qw.validate()
    if layout == qw.w_layout:
        return qw
    words = qw.words()
    if layout == "tiles":
        if qw.shape[0] % TILE_ROWS:
            raise ValueError(f"w_layout='tiles' needs N to be a multiple of {TILE_ROWS}, got N={qw.shape[0]}")
        words = word_tiles(words, TILE_ROWS, qw.group_size * qw.bits // 32)
    return QuantizedWeight(words, qw.scales, qw.biases, qw.bits, qw.group_size, qw.sb_layout, layout)


def for_kernels(qw: QuantizedWeight) -> QuantizedWeight:
    """qw in the layouts models store: default_sb_layout(), and default_w_layout() where N is a
    multiple of 64 (else MLX's rows)."""
    qw = with_sb_layout(qw)
    layout = default_w_layout()
    return with_w_layout(qw, layout if qw.shape[0] % TILE_ROWS == 0 else "rows")


def check_format(bits: int, group_size: int) -> None:
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"unsupported bits={bits}: supported are {SUPPORTED_BITS}")
    if group_size not in SUPPORTED_GROUP_SIZES:
        raise ValueError(f"unsupported group_size={group_size}: supported are {SUPPORTED_GROUP_SIZES}")


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
    """Inverse of `pack`: uint32 words [N, W] -> codes [N, W * 32/bits] (uint32)."""
    epw = 32 // bits
    shifts = jnp.arange(epw, dtype=jnp.uint32) * bits
    q = (words[..., None] >> shifts) & jnp.uint32(2**bits - 1)
    return q.reshape(*words.shape[:-1], words.shape[-1] * epw)


def quantize(w, *, bits: int = 4, group_size: int = 64) -> QuantizedWeight:
    """Quantize a float `[N, K]` matrix to MLX affine format (bit-exact with `mlx.core.quantize`)."""
    check_format(bits, group_size)
    w = jnp.asarray(w)
    if w.dtype not in FLOAT_DTYPES:
        raise ValueError(f"quantize expects a float32/float16/bfloat16 weight, got {w.dtype}")
    if w.ndim != 2:
        raise ValueError(f"quantize expects a rank-2 [N, K] weight, got shape {w.shape}")
    n, k = w.shape
    if k % group_size:
        raise ValueError(f"K={k} (last axis) is not a multiple of group_size={group_size}")
    return _quantize(w, bits, group_size)


@functools.partial(jax.jit, static_argnums=(1, 2))
def _quantize(w, bits, group_size):
    n, k = w.shape
    wg = w.astype(jnp.float32).reshape(n, k // group_size, group_size)
    scale, bias, q = _group_params(wg, bits)
    weight = pack(q.reshape(n, k), bits)
    return QuantizedWeight(weight, scale[..., 0].astype(w.dtype), bias[..., 0].astype(w.dtype), bits, group_size)


def dequantize(qw: QuantizedWeight, dtype=None) -> jax.Array:
    """`q * scale + bias` as `[N, K]`, computed in float32 and cast to `dtype` (default: the scales' dtype)."""
    qw.validate()
    dtype = qw.scales.dtype if dtype is None else dtype
    n, k = qw.shape
    q = unpack(qw.words(), qw.bits).astype(jnp.float32).reshape(n, k // qw.group_size, qw.group_size)
    scales, biases = qw.sb_nk()
    w = q * scales.astype(jnp.float32)[..., None] + biases.astype(jnp.float32)[..., None]
    return w.reshape(n, k).astype(dtype)


def take_rows(w, ids, dtype=None) -> jax.Array:
    """Rows `ids` of a float `[N, K]` matrix or a QuantizedWeight (an embedding lookup), dequantized."""
    ids = jnp.asarray(ids)
    if isinstance(w, QuantizedWeight):
        n, k = w.shape
        # JAX's gather wraps negative ids and clamps the rest; done here once, so a tiled weight's
        # words and every layout's scales come from the same row
        flat = jnp.clip(jnp.where(ids < 0, ids + n, ids).reshape(-1), 0, n - 1)
        # a "kn" weight's scales of these rows are columns: gather them, not the transposed table
        s, b = ((a[flat] for a in (w.scales, w.biases)) if w.sb_layout == "nk"
                else (a[:, flat].T for a in (w.scales, w.biases)))
        words = (w.weight[flat] if w.w_layout == "rows"  # a tiled weight's row r: tile r // 64, row r % 64
                 else w.weight[flat // TILE_ROWS, :, flat % TILE_ROWS].reshape(flat.shape[0], k * w.bits // 32))
        sub = QuantizedWeight(words, s, b, w.bits, w.group_size)
        out = dequantize(sub, dtype)
        return out.reshape(*ids.shape, out.shape[-1])
    out = jnp.take(w, ids, axis=0)
    return out if dtype is None else out.astype(dtype)
