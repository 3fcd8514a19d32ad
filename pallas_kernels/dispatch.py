"""quantized_matmul: validate, flatten rows, pick the path statically from the row count, launch.
quantized_matmul_many: several weights on one x, in one launch where they share a format."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from .config import PATHS, DispatchConfig, select_path
from .gemv import GemvTiling, gemv_launch
from .kernel import MMA_ROWS, launch, launch_many, same_format
from .quant import FLOAT_DTYPES, QuantizedWeight
from . import mosaic_qmm
from .tiling import gemv_tiling, mosaic_tiling, qmm_dense, qmm_tiling
from .xla import dense_after_x, dense_matmul, xla_quantized_matmul


def _use_interpret(config: DispatchConfig) -> bool:
    if config.interpret is not None:
        return config.interpret
    return jax.default_backend() != "gpu"


def _check(x, w):
    if not hasattr(x, "dtype") or x.dtype not in FLOAT_DTYPES:
        raise ValueError(f"quantized_matmul expects a float32/float16/bfloat16 x, got "
                         f"{getattr(x, 'dtype', type(x).__name__)}")
    if x.ndim < 1:
        raise ValueError("quantized_matmul expects x of shape [..., K], got a scalar")
    if isinstance(w, QuantizedWeight):
        w.validate()
    else:
        if not hasattr(w, "ndim") or w.ndim != 2:
            raise ValueError(f"weight must be a QuantizedWeight or a rank-2 [N, K] float array, got shape "
                             f"{getattr(w, 'shape', None)}")
        if w.dtype not in FLOAT_DTYPES:
            raise ValueError(f"float weight must be float32/float16/bfloat16, got {w.dtype}")
    n, k = w.shape
    if x.shape[-1] != k:
        raise ValueError(f"K mismatch: x has K={x.shape[-1]} (shape {tuple(x.shape)}) but the weight is "
                         f"[N={n}, K={k}]")
    return n, k


def _check_path(path):
    if path is not None and path not in PATHS:
        raise ValueError(f"path={path!r}: expected one of {PATHS} or None")


def quantized_matmul_many(x, weights, *, path: str | None = None,
                          config: DispatchConfig | None = None) -> tuple[jax.Array, ...]:
    """`tuple(quantized_matmul(x, w, path=path, config=config) for w in weights)`. With
    `config.fused_launch` (the default; $JAXSPEC_FUSED_LAUNCH=0 turns it off), QuantizedWeights of
    one format (bits, group size, K, scale dtype and layout) on the tensor-core kernel run in one launch
    (`kernel.launch_many`): a layer's q/k/v or gate/up then cost one launch and one wave tail. Its tiling comes from the weights'
    summed N, so it depends on the weights only: rows stay invariant. Anything else (float weights,
    mixed formats, the xla backend, the CUDA-core GEMV, qmv row by row) runs one call per weight, and
    so do the qmm dense fallback and the Mosaic GPU kernel (`_pallas` takes them one weight at a time)."""
    config = DispatchConfig() if config is None else config
    weights = tuple(weights)
    if not weights:
        raise ValueError("quantized_matmul_many needs at least one weight")
    x = jnp.asarray(x)
    ns = [_check(x, w)[0] for w in weights]
    _check_path(path)
    lead, k = x.shape[:-1], x.shape[-1]
    rows = math.prod(lead)
    chosen = path or (select_path(rows, config) if rows else None)
    fusable = (config.fused_launch and len(weights) > 1 and rows > 0 and config.backend == "pallas"
               and all(isinstance(w, QuantizedWeight) for w in weights) and same_format(weights)
               and _tensor_core_launch(chosen, rows, config))
    if not fusable:
        return tuple(quantized_matmul(x, w, path=path, config=config) for w in weights)
    outs = _pallas(x.reshape(rows, k), weights, chosen, config)
    return tuple(o.reshape(*lead, n) for o, n in zip(outs, ns))


def quantized_matmul(x, w, *, path: str | None = None, config: DispatchConfig | None = None) -> jax.Array:
    """`x @ dequantize(w).T` for x `[..., K]` and w a QuantizedWeight (or a float `[N, K]` array),
    float32 accumulation, output `[..., N]` in x's dtype. `path` forces "qmv" | "multirow" | "qmm";
    None picks `select_path(prod(x.shape[:-1]))` at trace time."""
    config = DispatchConfig() if config is None else config
    x = jnp.asarray(x)
    n, k = _check(x, w)
    _check_path(path)
    lead = x.shape[:-1]
    rows = math.prod(lead)
    if rows == 0:
        return jnp.zeros((*lead, n), x.dtype)
    x2 = x.reshape(rows, k)
    if not isinstance(w, QuantizedWeight):
        out = dense_matmul(x2, w)
    elif config.backend == "xla":
        out = xla_quantized_matmul(x2, w)
    else:
        out = _pallas(x2, (w,), select_path(rows, config) if path is None else path, config)[0]
    return out.astype(x.dtype).reshape(*lead, n)


def launcher(tiling):
    """The launch function for a tiling: the CUDA-core GEMV's or the tensor-core kernel's."""
    return gemv_launch if isinstance(tiling, GemvTiling) else launch


def _tensor_core_launch(path: str, rows: int, config: DispatchConfig) -> bool:
    """Whether `path` at `rows` runs as one tensor-core launch (kernel.launch_many, which can take
    several weights): qmm, and the mma GEMV at one row or multirow. Not the CUDA-core GEMV, and not
    qmv row by row."""
    return path == "qmm" or (config.gemv_kernel == "mma" and (path == "multirow" or rows == 1))


def _dense_runs(x2, qws, path: str, config: DispatchConfig) -> bool:
    """Whether the qmm dense fallback (dequantize + XLA's dot) takes this call."""
    return path == "qmm" and all(qmm_dense(x2.shape[0], qw.shape, config) for qw in qws)


def _mosaic_runs(x2, qws, path: str, config: DispatchConfig, interpret: bool) -> bool:
    """Whether the Mosaic GPU kernel takes this call: DispatchConfig.mosaic, on a GPU, weights of a
    format it takes; one row, multirow, or qmm the dense fallback does not take (not qmv row by row)."""
    if not config.mosaic or interpret or (path == "qmv" and x2.shape[0] > 1):
        return False
    return not _dense_runs(x2, qws, path, config) and all(mosaic_qmm.supports(x2, qw) for qw in qws)


def _pallas(x2, qws, path, config) -> tuple[jax.Array, ...]:
    """The Pallas launch for QuantizedWeights of one format on x2 `[rows, K]`, tiled as one weight of
    their summed N (several weights only where kernel.launch_many runs them: quantized_matmul_many)."""
    rows, k = x2.shape
    interpret = _use_interpret(config)
    shape, group_size = (sum(qw.shape[0] for qw in qws), k), qws[0].group_size
    if path == "multirow" and rows > MMA_ROWS:
        raise ValueError(f"path='multirow' handles at most {MMA_ROWS} rows, got {rows}")
    if _mosaic_runs(x2, qws, path, config, interpret):
        return tuple(mosaic_qmm.mosaic_qmm(x2, qw, mosaic_tiling(rows, qw.shape, group_size)) for qw in qws)
    if _dense_runs(x2, qws, path, config):
        # tall inputs: the dense GEMM's tensor-core rate beats dequantizing inside the tiled kernel
        return tuple(dense_after_x(x2, qw).astype(x2.dtype) for qw in qws)
    if path == "qmm":
        tiling = qmm_tiling(rows, shape, group_size, config, x_itemsize=x2.dtype.itemsize)
    else:
        tiling = gemv_tiling(shape, group_size, config)
    if _tensor_core_launch(path, rows, config):
        return launch_many(x2, qws, tiling, interpret=interpret)
    (qw,) = qws  # the CUDA-core GEMV and qmv row by row launch one weight at a time
    run = launcher(tiling)
    if path == "multirow":
        return (run(x2, qw, tiling, interpret=interpret),)
    # qmv: one launch per row. For rows > 1 this re-reads the weight once per row; it is the
    # behaviour multirow replaces, kept for A/B runs (JAXSPEC_QMV_MULTIROW=0).
    outs = [run(x2[i:i + 1], qw, tiling, interpret=interpret) for i in range(rows)]
    return (outs[0] if rows == 1 else jnp.concatenate(outs, axis=0),)
