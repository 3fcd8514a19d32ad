"""4-bit (MLX affine) quantized matmul for JAX: the format, Pallas GPU kernels, static dispatch.

    qw = quantize(w, bits=4, group_size=64)      # w: float [N, K]
    y = quantized_matmul(x, qw)                  # x [..., K] -> [..., N]

Rows (prod of x's leading dims) pick the kernel at trace time: 1 -> qmv, 2..16 -> multirow (each
weight tile read once for all rows), more -> qmm (the tiled kernel; from `DispatchConfig.qmm_dense_rows`
rows dequantize + XLA's dense dot). See `select_path`, `DispatchConfig`.

Attention with the mask given by positions (causal, optional sliding window, hidden slots):
`decode_attention.decode_attention` (flash-decoding for blocks of <= ROW_TILE queries; a query's
result bitwise independent of the block width) and `flash_attention.flash_attention` (prefill);
`paged_attention.paged_attention`: decode_attention over a paged KV pool, read through a block table.
`attention_inputs.attention_inputs` turns a q/k/v projection's split-K partials
(`quantized_matmul_parts`) into attention's inputs in one launch: norms, RoPE, the K/V cache write.
On a CPU the `xla` backend runs models whose weights were dequantized once, at load
(`prepare_dense` -> `DenseWeight`, see `DispatchConfig.dense`).
`Layer(stack, i)` passes layer i of a stacked weight (or KV cache) to any of these: the kernels read
it in place (a model scanning its layers copies no weights). This package knows nothing about models.
"""
from .config import EMPTY, ROW_TILE, DispatchConfig, attention_head_dim_ok, resolve_backend, select_path
from .dispatch import quantized_matmul, quantized_matmul_many, quantized_matmul_parts
from .dense import DenseWeight
from .quant import QuantizedWeight, dequantize, quantize, take_rows
from .stack import Layer
from .xla import einsum_f32, prepare_dense

__all__ = ["EMPTY", "ROW_TILE", "DenseWeight", "DispatchConfig", "attention_head_dim_ok", "resolve_backend", "einsum_f32",
           "Layer", "QuantizedWeight", "dequantize", "quantize", "quantized_matmul", "quantized_matmul_many",
           "quantized_matmul_parts", "prepare_dense", "select_path", "take_rows"]
