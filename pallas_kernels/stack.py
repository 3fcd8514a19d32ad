"""One layer of a stacked array, read in place: `Layer(stack, index)`.

A model that scans over its layers keeps each kind of weight (and of KV cache) as one array with a
leading layer axis. Slicing a layer out under the scan (`stack[i]`) makes XLA copy it before every
custom call, which would double a decode step's weight traffic; the kernels take the whole stack
plus the index instead and put the index in front of each load (`LayerRef`). The XLA paths take the
slice (`Layer.take`), where XLA fuses it into the consumer.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from .dense import DenseWeight
from .quant import QuantizedWeight


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Layer:
    """Layer `index` (an int or an int32 scalar, possibly traced) of `stack`: an array `[L, ...]` or a
    QuantizedWeight whose arrays carry the leading `[L]` axis."""

    stack: Any
    index: Any

    @property
    def shape(self) -> tuple[int, ...]:
        shape = self.stack.shape
        return tuple(shape) if isinstance(self.stack, QuantizedWeight) else tuple(shape[1:])

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def dtype(self):
        return self.stack.dtype

    def take(self):
        """The layer itself (a dynamic slice): for the XLA paths."""
        i = jnp.asarray(self.index, jnp.int32)
        if isinstance(self.stack, DenseWeight):
            return self.stack.layer(i)
        return jax.tree_util.tree_map(lambda a: jax.lax.dynamic_index_in_dim(a, i, 0, keepdims=False), self.stack)

    def operand(self) -> jax.Array:
        """The index as the int32 `[1]` operand a kernel reads with `read_layer`."""
        return jnp.reshape(jnp.asarray(self.index, jnp.int32), (1,))


def unwrap(w):
    """(the stored arrays' owner, the Layer or None): a plain weight or cache buffer passes through."""
    return (w.stack, w) if isinstance(w, Layer) else (w, None)


def take(w):
    """`w.take()` for a Layer, `w` otherwise."""
    return w.take() if isinstance(w, Layer) else w


def with_layer(kernel, stacked: bool, layered):
    """`kernel` for a pallas_call whose first operand is the layer index when `stacked`: the refs at
    positions `layered` (counted after the index) become that layer's views."""
    if not stacked:
        return kernel

    def run(layer_ref, *refs, **kw):
        layer = read_layer(layer_ref)
        layered_ = set(layered)
        refs = tuple(LayerRef(r, layer) if i in layered_ else r for i, r in enumerate(refs))
        return kernel(*refs, **kw)
    return run


def read_layer(ref):
    """Inside a kernel: the layer index from `Layer.operand()`'s ref."""
    return ref[0]


class LayerRef:
    """A kernel ref of a stack seen as one layer's: `.at[idx]` becomes `ref.at[(layer, *idx)]` (one
    indexer per load: Triton's lowering takes no chain of them); `.shape` is the layer's."""

    def __init__(self, ref, layer):
        self.ref, self.layer = ref, layer

    @property
    def shape(self):
        return tuple(self.ref.shape[1:])

    @property
    def dtype(self):
        return self.ref.dtype

    @property
    def at(self):
        return _At(self)


class _At:
    def __init__(self, view: LayerRef):
        self.view = view

    def __getitem__(self, idx):
        idx = idx if isinstance(idx, tuple) else (idx,)
        return self.view.ref.at[(self.view.layer, *idx)]
