"""DenseWeight: a linear weight prepared once as a dense float matrix, for the `xla` backend on a CPU.

Dequantizing a QuantizedWeight on every call costs a CPU more than the dot itself (the step of a
270M-parameter model spent most of its time rebuilding its weights), so a model that runs the XLA
path on a CPU dequantizes each weight once, at load (`xla.prepare_dense`), and keeps the result.

The values are stored as the unsigned integers of their width (uint16 for bfloat16/float16, uint32
for float32) and bitcast back at use: XLA's CPU backend has no native bfloat16 dynamic slice, and
slicing one layer out of a bfloat16 stack inside the layer scan made it convert the whole stack to
float32 on every call (6x a scanned forward's time, measured); integers slice in place.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

_STORAGE = {2: jnp.uint16, 4: jnp.uint32}


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DenseWeight:
    """A float `[N, K]` weight (a stack of layers: `[L, N, K]`) stored as its bits.

    bits: the values' bit patterns, uint16 or uint32 of `dtype`'s width. dtype_name: the float dtype
    (static). `value()` is the float array; `shape`, `ndim`, `dtype`, `nbytes` describe it."""

    bits: jax.Array
    dtype_name: str = dataclasses.field(default="bfloat16", metadata=dict(static=True))

    @classmethod
    def of(cls, w) -> "DenseWeight":
        """From a float array (its dtype kept)."""
        w = jnp.asarray(w)
        size = jnp.dtype(w.dtype).itemsize
        if not jnp.issubdtype(w.dtype, jnp.floating) or size not in _STORAGE:
            raise ValueError(f"DenseWeight holds a float16/bfloat16/float32 array, got {w.dtype}")
        return cls(jax.lax.bitcast_convert_type(w, _STORAGE[size]), jnp.dtype(w.dtype).name)

    def value(self) -> jax.Array:
        return jax.lax.bitcast_convert_type(self.bits, self.dtype)

    @property
    def dtype(self):
        return jnp.dtype(self.dtype_name)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.bits.shape)

    @property
    def ndim(self) -> int:
        return len(self.bits.shape)

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.bits.shape)) * jnp.dtype(self.bits.dtype).itemsize

    def take_rows(self, ids, dtype=None) -> jax.Array:
        """Rows `ids` (an embedding lookup; JAX's gather rules for out-of-range ids), in `dtype`."""
        out = jax.lax.bitcast_convert_type(jnp.take(self.bits, jnp.asarray(ids), axis=0), self.dtype)
        return out if dtype is None else out.astype(dtype)
