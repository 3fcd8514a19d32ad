"""DispatchConfig: the few choices a user makes about quantized_matmul, and the static path rule.

A DispatchConfig is frozen and hashable, so it rides as a static field of a jitted pytree (a model):
two configs give two compiled programs, never a stale one. `DispatchConfig()` reads nothing from the
environment; `DispatchConfig.from_env()` is the one place in the library that does, and the model
loaders call it once, when a model is loaded.
"""
from __future__ import annotations

import dataclasses
import os

import jax

BACKENDS = ("pallas", "xla")
BACKEND_CHOICES = ("auto",) + BACKENDS  # what a user may ask for; "auto" is resolve_backend's rule
ATTENTION = ("auto", "pallas", "xla")
PATHS = ("qmv", "multirow", "qmm")

# Rows per tile of the GEMV: Triton's smallest `dot` tile. The GEMV computes this many rows whatever
# the real count (1..ROW_TILE), so a row's arithmetic is the same alone or among others; callers pad
# short blocks to it (or to a share of it) for the same reason. The multirow window fits in it.
ROW_TILE = 16

# The attention kernels' shared contract with their callers (models.cache): a key slot at position
# EMPTY is never visible (no query position is above it), and the head dims the kernels tile.
EMPTY = 2**31 - 1  # int32 max


def attention_head_dim_ok(d: int) -> bool:
    """Whether the attention kernels tile head dim d: a power of two >= 16 (Triton's dot)."""
    return d >= 16 and not d & (d - 1)

def resolve_backend(choice: str = "auto") -> str:
    """The matmul backend for `choice`: "pallas" or "xla" as given; "auto" is the Pallas kernels
    where JAX's default backend is a GPU (where they compile) and XLA's dequantize + dot elsewhere
    (on a CPU the kernels could only run in Pallas' interpreter, ~8x slower). The one rule the
    model loaders (matmul=None) and the CLI's --backend share."""
    if choice == "auto":
        return "pallas" if jax.default_backend() == "gpu" else "xla"
    if choice not in BACKENDS:
        raise ValueError(f"backend={choice!r}: expected one of {BACKEND_CHOICES}")
    return choice


ENV = {  # variable -> DispatchConfig field
    "JAXSPEC_QMV_MULTIROW": "multirow",
    "JAXSPEC_QMV_MULTIROW_MAX_ROWS": "multirow_max_rows",
    "JAXSPEC_QMM_TILE_M": "qmm_tile_m",
    "JAXSPEC_QMM_DENSE_ROWS": "qmm_dense_rows",
    "JAXSPEC_MTP_VERIFY_PAD": "verify_pad",
    "JAXSPEC_DENSE_WEIGHTS": "dense",
    "JAXSPEC_PAGED_ATTENTION": "paged_attention",
}


@dataclasses.dataclass(frozen=True)
class DispatchConfig:
    """How quantized_matmul picks its path.

    backend: "pallas" (the kernels; Pallas interpret mode where there is no GPU) or "xla"
      (dequantize + XLA's dot: the reference, and the fast choice on a CPU).
    interpret: force Pallas interpret mode on or off (None: on unless JAX's default backend is a GPU).
    multirow: 2..multirow_max_rows rows run as one multirow GEMV, which reads each weight tile once
      for all rows (off: one GEMV per row, re-reading the weight each time). $JAXSPEC_QMV_MULTIROW.
    multirow_max_rows: the largest row count sent to the GEMV (1..ROW_TILE; default ROW_TILE, as many
      rows as its MMA tile computes anyway); more rows go to qmm. $JAXSPEC_QMV_MULTIROW_MAX_ROWS.
    qmm_tile_m: the tiled GEMM's rows per tile (a power of two >= 16; None: 64, or 256 from 256
      rows). $JAXSPEC_QMM_TILE_M.
    qmm_dense_rows: from this many rows on, qmm dequantizes each weight and runs XLA's dense dot
      (faster for prefill-sized inputs); 0 keeps the tiled kernel. $JAXSPEC_QMM_DENSE_ROWS.
    verify_pad: a hint for callers that run a speculative verify: pad its rows up to the qmm path
      (jaxspec reads it; the dispatch itself does not). $JAXSPEC_MTP_VERIFY_PAD.
    attention: the attention kernels callers should run (models reads it; the matmul does not):
      "pallas" (decode_attention / flash_attention), "xla" (the einsum reference), "auto": the
      kernels where they compile for a GPU (backend "pallas", not interpret mode), else XLA.
    dense: with backend "xla", whether the model loaders prepare every quantized weight once, at
      load, as a dense float matrix (`pallas_kernels.DenseWeight`; models reads it, the dispatch does
      not): ~4x the weights' memory, no dequantization per call. None: the inference loaders turn it
      on where JAX's default backend is the CPU (there dequantizing every call cost more than the
      dots); models made to be saved, trained or sharded (the presets) keep it off. $JAXSPEC_DENSE_WEIGHTS.
    paged_attention: with the attention kernels, a decode or verify over a paged KV pool reads each
      row's blocks through its table (`paged_attention`) instead of gathering every row's whole
      capacity first (models reads it). On by default since the H200 runs of 2026-12-05: its GPU
      tests bitwise against the gathered path, and the serving step at 32 slots with no pool gather
      left (32 clients over HTTP 1,572 tok/s against the previous main's 1,386). $JAXSPEC_PAGED_ATTENTION.
    """

    backend: str = "pallas"
    interpret: bool | None = None
    multirow: bool = True
    multirow_max_rows: int = ROW_TILE
    qmm_tile_m: int | None = None
    qmm_dense_rows: int = 256
    verify_pad: bool = False
    attention: str = "auto"
    dense: bool | None = None
    paged_attention: bool = True

    def __post_init__(self):
        if self.backend not in BACKENDS:
            raise ValueError(f"backend={self.backend!r}: expected one of {BACKENDS}")
        for name in ("multirow", "verify_pad", "paged_attention"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r} must be a bool")
        if self.attention not in ATTENTION:
            raise ValueError(f"attention={self.attention!r}: expected one of {ATTENTION}")
        for name in ("interpret", "dense"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r} must be None or a bool")
        if not _is_int(self.multirow_max_rows) or not 1 <= self.multirow_max_rows <= ROW_TILE:
            raise ValueError(f"multirow_max_rows={self.multirow_max_rows!r} must be an integer in 1..{ROW_TILE} "
                             f"(the GEMV computes one {ROW_TILE}-row tile)")
        if self.qmm_tile_m is not None and (not _is_int(self.qmm_tile_m) or self.qmm_tile_m < 16
                                            or self.qmm_tile_m & (self.qmm_tile_m - 1)):
            raise ValueError(f"qmm_tile_m={self.qmm_tile_m!r} must be a power of two >= 16 (Triton block shapes)")
        if not _is_int(self.qmm_dense_rows) or self.qmm_dense_rows < 0:
            raise ValueError(f"qmm_dense_rows={self.qmm_dense_rows!r} must be an integer >= 0 "
                             "(0: always the tiled kernel)")

    @classmethod
    def from_env(cls, environ=None, **overrides) -> "DispatchConfig":
        """The defaults, then the JAXSPEC_* variables of `ENV` that are set (in `environ`, default
        os.environ), then `overrides`. A malformed value raises ValueError naming the variable.
        `backend="auto"` resolves by `resolve_backend` (the model loaders pass it when not given a
        config: XLA on a CPU, the Pallas kernels on a GPU)."""
        environ = os.environ if environ is None else environ
        if overrides.get("backend") == "auto":
            overrides["backend"] = resolve_backend("auto")
        fields = {}
        for var, field in ENV.items():
            raw = environ.get(var, "")
            if raw == "":
                continue
            if field in ("multirow", "verify_pad", "dense", "paged_attention"):
                fields[field] = _parse_bool(var, raw)
            else:
                fields[field] = _parse_int(var, raw)
        fields.update(overrides)
        try:
            return cls(**fields)
        except ValueError as e:
            set_vars = [v for v in ENV if environ.get(v, "") != ""]
            raise ValueError(f"{e} (environment: {', '.join(set_vars) or 'none set'})") from None

    def replace(self, **changes) -> "DispatchConfig":
        return dataclasses.replace(self, **changes)

    @property
    def describe(self) -> str:
        """The matmul path in a word or two, as `GenerationStats.backend` reports it: "xla",
        "pallas", or "pallas (interpret mode)" (the Pallas interpreter: no GPU, slow)."""
        if self.backend == "xla":
            return "xla"
        return "pallas (interpret mode)" if self.interpret_mode else "pallas"

    @property
    def interpret_mode(self) -> bool:
        """Whether the Pallas kernels run in interpret mode: `interpret`, or None -> no GPU."""
        return jax.default_backend() != "gpu" if self.interpret is None else self.interpret

    @property
    def dense_weights(self) -> bool:
        """Whether a model on this config holds its linear weights dense (see `dense`)."""
        if self.backend != "xla":
            return False
        return jax.default_backend() == "cpu" if self.dense is None else self.dense

    @property
    def attention_kernels(self) -> bool:
        """Whether attention runs the Pallas kernels (see `attention`)."""
        if self.attention == "auto":
            return self.backend == "pallas" and not self.interpret_mode
        return self.attention == "pallas"


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _parse_int(name: str, raw: str) -> int:
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} is not an integer") from None


def _parse_bool(name: str, raw: str) -> bool:
    if raw.lower() in ("1", "true", "on", "yes"):
        return True
    if raw.lower() in ("0", "false", "off", "no"):
        return False
    raise ValueError(f"environment variable {name}={raw!r} must be 0 or 1")


def select_path(rows: int, config: DispatchConfig | None = None) -> str:
    """The static kernel choice for `rows = prod(x.shape[:-1])`: "qmv", "multirow" or "qmm"."""
    config = DispatchConfig() if config is None else config
    if rows < 1:
        raise ValueError(f"rows={rows}: quantized_matmul needs at least one row")
    if rows == 1:
        return "qmv"
    if rows <= config.multirow_max_rows:
        return "multirow" if config.multirow else "qmv"
    return "qmm"
