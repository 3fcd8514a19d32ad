"""DenseWeight: a linear weight prepared once as a dense float matrix, for the `xla` backend on a CPU.

Dequantizing a QuantizedWeight on every call costs a CPU more than the dot itself (the step of a
270M-parameter model spent most of its time rebuilding its weights), so a model that runs the XLA
path on a CPU dequantizes each weight once, at load (`xla.prepare_dense`), and keeps the result.

The values are kept as they are (a bitcast at use would be a copy of the whole weight per call on
XLA's CPU backend, measured), but one layer of a stack is sliced as the unsigned integers of its
width (`layer`): XLA's CPU backend has no native bfloat16 dynamic slice, and slicing a bfloat16
stack inside the layer scan made it convert the whole stack to float32 on every call (6x a scanned
forward's time, measured); integers slice in place.
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
    """A float `[N, K]` weight (a stack of layers: `[L, N, K]`), dequantized once.

    w: the float16/bfloat16/float32 array. `value()` is it; `layer(i)` one layer of a stack;
    `shape`, `ndim`, `dtype`, `nbytes` describe it."""

    w: jax.Array

    @classmethod
    def of(cls, w) -> "DenseWeight":
        """From a float array (its dtype kept)."""
        w = jnp.asarray(w)
        if not jnp.issubdtype(w.dtype, jnp.floating) or jnp.dtype(w.dtype).itemsize not in _STORAGE:
            raise ValueError(f"DenseWeight holds a float16/bfloat16/float32 array, got {w.dtype}")
        return cls(w)

    def value(self) -> jax.Array:
        return self.w

    def layer(self, index) -> "DenseWeight":
        """Layer `index` (possibly traced) of a stack, sliced as integers (see the module's docstring)."""
        bits = jax.lax.bitcast_convert_type(self.w, _STORAGE[self.dtype.itemsize])
        one = jax.lax.dynamic_index_in_dim(bits, jnp.asarray(index, jnp.int32), 0, keepdims=False)
        return DenseWeight(jax.lax.bitcast_convert_type(one, self.dtype))

    @property
    def dtype(self):
        return jnp.dtype(self.w.dtype)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.w.shape)

    @property
    def ndim(self) -> int:
        return len(self.w.shape)

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.w.shape)) * self.dtype.itemsize

    def take_rows(self, ids, dtype=None) -> jax.Array:
        """Rows `ids` (an embedding lookup; JAX's gather rules for out-of-range ids), in `dtype`.

        XLA's CPU backend has no bfloat16 gather: it converts the table to float32 and gathers
        that. Fused with the gather, the conversion touches only the rows taken; but in a loop
        (a decode loop, the batch engine's rounds) XLA moves the conversion of the whole table, which
        the loop does not change, out of the loop, and then runs it on every call: the 270M's tied
        262,144 x 640 embedding, 671 MB of float32 written per call (0.15-0.4 s on the 2-core CPU,
        against ~0.1 ms fused; the compiled step's HLO). On a CPU the table passes an optimization
        barrier with the ids first, which makes it a value of the loop's body: the conversion stays
        fused with its gather. The rows' bits are the same."""
        ids = jnp.asarray(ids)
        w = self.w
        if jax.default_backend() == "cpu" and jnp.issubdtype(ids.dtype, jnp.integer):
            w, ids = jax.lax.optimization_barrier((w, ids))
        out = jnp.take(w, ids, axis=0)
        return out if dtype is None else out.astype(dtype)
