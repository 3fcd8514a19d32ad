"""quantized_matmul: validate, flatten rows, pick the path statically from the row count, launch.
quantized_matmul_many: several weights on one x, in one launch where they share a format.
quantized_matmul_parts: the same before the split-K fold, for a consumer kernel that folds."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from .config import PATHS, ROW_TILE, DispatchConfig, select_path
from .dense import DenseWeight
from .launch import gemv, gemv_tiling, qmm, qmm_dense, qmm_tiling, same_format
from .quant import FLOAT_DTYPES, QuantizedWeight
from .stack import Layer, unwrap
from .xla import dense_after_x, dense_matmul, xla_quantized_matmul


def _check(x, w) -> int:
    """N of `w`, after checking x and w (ValueError naming the problem)."""
    if not hasattr(x, "dtype") or x.dtype not in FLOAT_DTYPES:
        raise ValueError(f"quantized_matmul expects a float32/float16/bfloat16 x, got "
                         f"{getattr(x, 'dtype', type(x).__name__)}")
    if x.ndim < 1:
        raise ValueError("quantized_matmul expects x of shape [..., K], got a scalar")
    stored, layer = unwrap(w)
    if isinstance(stored, QuantizedWeight):
        stored.validate(stacked=layer is not None)
    else:
        rank = 2 if layer is None else 3
        if not hasattr(stored, "ndim") or stored.ndim != rank:
            raise ValueError(f"weight must be a QuantizedWeight, a DenseWeight or a rank-2 [N, K] float array (a "
                             f"Layer: of "
                             f"[L, N, K]), got shape {getattr(stored, 'shape', None)}")
        if stored.dtype not in FLOAT_DTYPES:
            raise ValueError(f"float weight must be float32/float16/bfloat16, got {stored.dtype}")
    n, k = w.shape
    if x.shape[-1] != k:
        raise ValueError(f"K mismatch: x has K={x.shape[-1]} (shape {tuple(x.shape)}) but the weight is "
                         f"[N={n}, K={k}]")
    return n


def quantized_matmul(x, w, *, path: str | None = None, config: DispatchConfig | None = None) -> jax.Array:
    """`x @ dequantize(w).T` for x `[..., K]` and w a QuantizedWeight (or a float `[N, K]` array, or a
    `Layer` of a stack of either), float32 accumulation, output `[..., N]` in x's dtype. `path` forces "qmv" | "multirow" | "qmm";
    None picks `select_path(prod(x.shape[:-1]))` at trace time."""
    return quantized_matmul_many(x, (w,), path=path, config=config)[0]


def quantized_matmul_many(x, weights, *, path: str | None = None,
                          config: DispatchConfig | None = None) -> tuple[jax.Array, ...]:
    """`tuple(quantized_matmul(x, w) for w in weights)`. QuantizedWeights of one format run in one
    launch on the pallas backend (a layer's q/k/v or gate/up: one launch and one wave tail); the
    launch's tiling depends on the weights only, so each result is bitwise what it is alone."""
    return _many(x, weights, path, config, fold=True)


def quantized_matmul_parts(x, weights, *, path: str | None = None,
                           config: DispatchConfig | None = None) -> tuple[jax.Array, ...]:
    """`quantized_matmul_many` without its last step: each result `[S, ..., N]`, the K split's
    partials (float32 when S > 1, else x's dtype; S = 1 where the path does not split), whose sum in
    split order rounded to x's dtype (`launch.fold_splits(p).astype(x.dtype)`) is bitwise the
    `quantized_matmul_many` result. For a kernel that consumes the result and can add the partials
    itself (pallas_kernels.attention_inputs): the fold's own kernel goes."""
    return _many(x, weights, path, config, fold=False)


def _many(x, weights, path, config, fold: bool) -> tuple[jax.Array, ...]:
    config = DispatchConfig() if config is None else config
    weights = tuple(weights)
    if not weights:
        raise ValueError("quantized_matmul_many needs at least one weight")
    x = jnp.asarray(x)
    ns = [_check(x, w) for w in weights]
    if path is not None and path not in PATHS:
        raise ValueError(f"path={path!r}: expected one of {PATHS} or None")
    lead, k = x.shape[:-1], x.shape[-1]
    rows = math.prod(lead)
    if rows == 0:
        return tuple(jnp.zeros((*lead, n) if fold else (1, *lead, n), x.dtype) for n in ns)
    x2 = x.reshape(rows, k)
    stored = [unwrap(w) for w in weights]
    quantized = all(isinstance(q, QuantizedWeight) for q, _ in stored)
    layer = stored[0][1]
    # one launch: one format, and all plain or all the same layer (one index object) of their stacks
    shared = len({None if lw is None else id(lw.index) for _, lw in stored}) == 1
    if config.backend == "pallas" and quantized and shared and same_format([q for q, _ in stored]):
        outs = _pallas(x2, [q for q, _ in stored], path or select_path(rows, config), config, layer, fold)
    else:
        outs = [_one(x2, w, path, config, fold) for w in weights]
    if fold:
        return tuple(o.astype(x.dtype).reshape(*lead, n) for o, n in zip(outs, ns))
    return tuple(o.reshape(o.shape[0], *lead, n) for o, n in zip(outs, ns))


def _one(x2, w, path, config, fold: bool):
    stored, layer = unwrap(w)
    if isinstance(stored, QuantizedWeight) and config.backend == "pallas":
        return _pallas(x2, (stored,), path or select_path(x2.shape[0], config), config, layer, fold)[0]
    if isinstance(stored, DenseWeight):
        out = dense_matmul(x2, (stored if layer is None else layer.take()).value())
    elif not isinstance(stored, QuantizedWeight):
        out = dense_matmul(x2, w if layer is None else layer.take())
    else:
        out = xla_quantized_matmul(x2, stored if layer is None else layer.take())
    return out if fold else out.astype(x2.dtype)[None]


def _pallas(x2, qws, path: str, config: DispatchConfig, layer: Layer | None = None,
            fold: bool = True) -> tuple[jax.Array, ...]:
    """The Pallas launch for QuantizedWeights of one format on x2 `[rows, K]`; with `layer`, the qws
    are stacks and that layer of each is read in place. `fold=False`: `[S, rows, N]` partials."""
    rows, k = x2.shape
    interpret = config.interpret_mode
    shape, group_size = (sum(qw.shape[0] for qw in qws), k), qws[0].group_size
    index = None if layer is None else layer.operand()
    if path == "qmm":
        if all(qmm_dense(rows, qw.shape, config) for qw in qws):
            # tall inputs: the dense GEMM's tensor-core rate beats dequantizing inside the tiled kernel
            outs = tuple(dense_after_x(x2, qw if layer is None else Layer(qw, layer.index).take()) for qw in qws)
            return outs if fold else tuple(o.astype(x2.dtype)[None] for o in outs)
        return qmm(x2, qws, qmm_tiling(rows, shape, group_size, config, x2.dtype.itemsize), interpret=interpret,
                   layer=index, fold=fold)
    tiling = gemv_tiling(shape, group_size)
    if path == "multirow" or rows == 1:
        if rows > ROW_TILE:
            raise ValueError(f"path='multirow' handles at most {ROW_TILE} rows, got {rows}")
        return gemv(x2, qws, tiling, interpret=interpret, layer=index, fold=fold)
    # qmv with several rows: one launch per row, re-reading the weight each time (multirow off)
    per_row = [gemv(x2[i:i + 1], qws, tiling, interpret=interpret, layer=index, fold=fold) for i in range(rows)]
    return tuple(jnp.concatenate(outs, axis=-2) for outs in zip(*per_row))
