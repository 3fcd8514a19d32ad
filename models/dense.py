"""Weights prepared for the CPU: every quantized linear dequantized once, at load.

On a CPU, `DispatchConfig(backend="xla")` computes a linear as dequantize + XLA's dot; dequantizing
on every call took most of a decode step (the tied 262k x 640 head of a 270M model alone is 168M
weights). `prepare_dense` swaps each QuantizedWeight of a model for a `DenseWeight` in the model's
activation dtype, whose dot gives bitwise the result the quantized weight gives on the XLA path; the
inference loaders (`load_target`, `load_assistant`, the GGUF loader) call it when
`matmul.dense_weights` says so. Models made to be saved, trained or sharded stay quantized: the
presets resolve `dense=None` to False (`stored_form`), and `save` / `shard` refuse a dense model.
`weight_bytes` reports what a model's weights hold in memory.
"""
from __future__ import annotations

import jax

from jaxspec.kernels import DenseWeight, QuantizedWeight, prepare_dense as _dense

from .layer_scan import unstack_params


def prepare_dense(model):
    """`model` (a Target or an Assistant) with every QuantizedWeight replaced by its DenseWeight in
    the model's activation dtype (float weights stay as they are). A Target's layers are left
    unstacked, so its forward runs them one by one instead of in the layer scan: on XLA's CPU
    backend the scanned forward of a 270M model took 2.3x the unrolled one (805 against 345 ms a
    decode step, measured; each layer's weights were copied out of the stacks and the loop ran its
    dots one at a time), for ~7 s more compile time at 18 layers."""
    from .assistant import Assistant

    dtype = model.dtype
    if isinstance(model, Assistant):
        return model.replace(params=_convert(model.params, dtype))
    return model.replace(params=_convert(unstack_params(model.config, model.params), dtype))


def _convert(params: dict, dtype) -> dict:
    out = {}
    for name in list(params):
        w = params[name]
        out[name] = _dense(w, dtype) if isinstance(w, QuantizedWeight) else w
    return out


def is_dense(model) -> bool:
    """Whether any of the model's weights is a DenseWeight (prepared by `prepare_dense`)."""
    return any(isinstance(w, DenseWeight) for w in model.params.values())


def weight_bytes(model) -> int:
    """Bytes the model's parameters hold in memory (every array of every param, as stored)."""
    return sum(int(a.size) * a.dtype.itemsize for a in jax.tree_util.tree_leaves(model.params))


def prepared(model):
    """`prepare_dense(model)` where its dispatch config asks for dense weights
    (`DispatchConfig.dense_weights`: the xla backend on a CPU), else `model`: what the inference
    loaders (`load_target`, `load_assistant`, the GGUF loader) return."""
    return prepare_dense(model) if model.matmul.dense_weights else model


def stored_form(matmul):
    """`matmul` with `dense=None` resolved to False: for models made to be saved, trained or sharded
    (`presets.random_model`, `presets.tiny_pair`), which keep their quantized weights unless a caller
    asks for dense ones (`dense=True`) in so many words."""
    return matmul.replace(dense=False) if matmul.dense is None else matmul
