"""Static dispatch configuration for quantized_matmul.

A DispatchConfig is hashable and frozen, so it can ride as a static field of a jitted pytree: two
configs give two compiled functions, never a stale one. Environment variables are read when a
config is built (DispatchConfig() or DispatchConfig.from_env()), not at call time.
"""
from __future__ import annotations

import dataclasses
import os

BACKENDS = ("pallas", "xla")
GEMV_KERNELS = ("fma", "mma")
DEQUANTS = ("codes", "weights")
UNPACKS = ("pairs", "join", "broadcast", "kpairs")  # kernel.Tiling.unpack
XSUMS = ("reduce", "input")  # kernel.Tiling.xsum
PATHS = ("qmv", "multirow", "qmm")


def _env_int(name: str, default):
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} is not an integer") from None


def env_bool(name: str, default: bool) -> bool:
    """An on/off environment variable (1/true/on/yes, 0/false/off/no; unset or empty: default)."""
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    if raw.lower() in ("1", "true", "on", "yes"):
        return True
    if raw.lower() in ("0", "false", "off", "no"):
        return False
    raise ValueError(f"environment variable {name}={raw!r} must be 0 or 1")


@dataclasses.dataclass(frozen=True)
class DispatchConfig:
    """How quantized_matmul picks and shapes its kernel.

    multirow: use the multirow GEMV for 2..multirow_max_rows rows (else qmv row by row).
    multirow_max_rows: the largest row count sent to multirow; larger goes to qmm.
    qmm_tile_m/n/k: tiles of the tiled GEMM; tile_m=None picks 64 (pallas_kernels.tiling.QMM_TILE_M),
    tile_k=None 128 for the dequantize-first body and 64 (one group) for the codes body.
    qmm_dense_rows: from this many rows on, the qmm path dequantizes each weight to the dot dtype and
    runs XLA's dense dot (the xla backend's code) instead of the tiled kernel, for weights of at most
    pallas_kernels.tiling.QMM_DENSE_MAX_ELEMENTS (the bf16 copy is a transient N*K*2 bytes). On the H200
    256 and 512 rows took 115-119 / 158-174 us that way against 143-144 / 226-248 for the tiled kernel,
    which is faster up to 128 rows (docs/kernels.md, log entry 11): 256 by default. Each dequantization
    waits for its own input (xla.dense_after_x), so a 512-token prefill of the whole 12B on the H200
    compiles with 0.27 GB of temporaries, the same for 2, 6 and 48 layers (0.08 GB with the tiled
    kernel; 7.6 GB before that dependency), and an 8-layer slice takes 7.5 ms against 9.0 (log
    entry 13). 0: always the tiled kernel. $JAXSPEC_QMM_DENSE_ROWS.
    backend: "pallas" (our kernels; interpret mode where there is no GPU) or "xla" (dequantize + dot).
    interpret: force Pallas interpret mode on or off (None: on unless the default backend is a GPU).
    gemv_kernel: the kernel behind qmv and multirow: "fma" (CUDA cores, pallas_kernels/gemv.py) or
    "mma" (the tensor-core kernel of kernel.py, which qmm also uses). $JAXSPEC_GEMV_KERNEL.
    gemv_block_n / gemv_split_k: GEMV tiling overrides (None: chosen from the weight shape).
    gemv_groups_per_step / gemv_chains: the fma GEMV's groups per loop step (None: its default) and
    word-quad FMA chains (GemvTiling.chains). $JAXSPEC_GEMV_BLOCK_N, $JAXSPEC_GEMV_GROUPS_PER_STEP and
    $JAXSPEC_GEMV_CHAINS set these three for A/B runs of a whole model ($JAXSPEC_GEMV_SPLIT_K the split;
    groups per step applies to the tensor-core GEMV too). gemv_target_programs: the program count
    the split-K rule aims for when gemv_split_k is None ($JAXSPEC_GEMV_TARGET_PROGRAMS).
    gemv_num_stages: the tensor-core GEMV's pipeline stages (None: 3, log entry 10; $JAXSPEC_GEMV_STAGES).
    dequant: how the tensor-core kernel (mma GEMV and qmm) uses the codes: "codes" (exact codes on
    the tensor cores, each group's scale and bias applied to the small product) or "weights" (every
    weight dequantized to s*q + b in the dot dtype first, one accumulating dot per loop step;
    pallas_kernels/dq_kernel.py). None: "codes" for the GEMV, "weights" for qmm (the faster of each
    on the H200, docs/kernels.md log entry 7). $JAXSPEC_DEQUANT sets both.
    gemv_unpack: how the tensor-core GEMV's codes body unpacks words (kernel.Tiling.unpack). None:
    "kpairs" (29.1 us against 34.9 for "pairs" on 15360x3840, log entry 8). $JAXSPEC_GEMV_UNPACK.
    gemv_xsum: how the tensor-core GEMV gets each group's sum(x) (kernel.Tiling.xsum). None: "reduce".
    $JAXSPEC_GEMV_XSUM.
    mosaic: run qmv, multirow and qmm on the Mosaic GPU kernel (pallas_kernels/mosaic_qmm.py: TMA
    and wgmma, Hopper) for the weights it takes, on a GPU. Off by default: correct on the H200 but no
    faster than the Triton kernels (docs/kernels.md, log entry 12). Without a GPU it has no effect
    (Mosaic GPU's interpreter cannot run a wgmma whose left operand is in registers). $JAXSPEC_MOSAIC=1.
    fused_launch: quantized_matmul_many runs weights of one format in one tensor-core launch
    (kernel.launch_many) instead of one launch each. On: the whole-12B decode forward took 8.50 and
    8.61 ms against 8.93 and 8.88 unfused (H200, docs/kernels.md, log entry 9). $JAXSPEC_FUSED_LAUNCH=0
    turns it off.
    """

    multirow: bool = dataclasses.field(default_factory=lambda: env_bool("JAXSPEC_QMV_MULTIROW", True))
    multirow_max_rows: int = dataclasses.field(
        default_factory=lambda: _env_int("JAXSPEC_QMV_MULTIROW_MAX_ROWS", 8))
    qmm_tile_m: int | None = dataclasses.field(default_factory=lambda: _env_int("JAXSPEC_QMM_TILE_M", None))
    qmm_tile_n: int = dataclasses.field(default_factory=lambda: _env_int("JAXSPEC_QMM_TILE_N", 128))
    qmm_tile_k: int | None = dataclasses.field(default_factory=lambda: _env_int("JAXSPEC_QMM_TILE_K", None))
    qmm_dense_rows: int = dataclasses.field(default_factory=lambda: _env_int("JAXSPEC_QMM_DENSE_ROWS", 256))
    backend: str = dataclasses.field(default_factory=lambda: os.environ.get("JAXSPEC_MATMUL_BACKEND", "pallas"))
    interpret: bool | None = None
    gemv_kernel: str = dataclasses.field(default_factory=lambda: os.environ.get("JAXSPEC_GEMV_KERNEL", "mma"))
    gemv_block_n: int | None = dataclasses.field(default_factory=lambda: _env_int("JAXSPEC_GEMV_BLOCK_N", None))
    gemv_split_k: int | None = dataclasses.field(default_factory=lambda: _env_int("JAXSPEC_GEMV_SPLIT_K", None))
    gemv_target_programs: int | None = dataclasses.field(
        default_factory=lambda: _env_int("JAXSPEC_GEMV_TARGET_PROGRAMS", None))
    gemv_groups_per_step: int | None = dataclasses.field(
        default_factory=lambda: _env_int("JAXSPEC_GEMV_GROUPS_PER_STEP", None))
    gemv_chains: bool = dataclasses.field(default_factory=lambda: env_bool("JAXSPEC_GEMV_CHAINS", False))
    gemv_num_stages: int | None = dataclasses.field(default_factory=lambda: _env_int("JAXSPEC_GEMV_STAGES", None))
    dequant: str | None = dataclasses.field(default_factory=lambda: os.environ.get("JAXSPEC_DEQUANT") or None)
    gemv_unpack: str | None = dataclasses.field(
        default_factory=lambda: os.environ.get("JAXSPEC_GEMV_UNPACK") or None)
    gemv_xsum: str | None = dataclasses.field(default_factory=lambda: os.environ.get("JAXSPEC_GEMV_XSUM") or None)
    fused_launch: bool = dataclasses.field(default_factory=lambda: env_bool("JAXSPEC_FUSED_LAUNCH", True))
    mosaic: bool = dataclasses.field(default_factory=lambda: env_bool("JAXSPEC_MOSAIC", False))

    def __post_init__(self):
        if self.backend not in BACKENDS:
            raise ValueError(f"backend={self.backend!r}: expected one of {BACKENDS}")
        if self.gemv_kernel not in GEMV_KERNELS:
            raise ValueError(f"gemv_kernel={self.gemv_kernel!r}: expected one of {GEMV_KERNELS}")
        if self.dequant is not None and self.dequant not in DEQUANTS:
            raise ValueError(f"dequant={self.dequant!r}: expected one of {DEQUANTS}")
        if self.gemv_unpack is not None and self.gemv_unpack not in UNPACKS:
            raise ValueError(f"gemv_unpack={self.gemv_unpack!r}: expected one of {UNPACKS}")
        if self.qmm_dense_rows < 0:
            raise ValueError(f"qmm_dense_rows={self.qmm_dense_rows} must be >= 0 (0: always the tiled kernel)")
        if self.gemv_xsum is not None and self.gemv_xsum not in XSUMS:
            raise ValueError(f"gemv_xsum={self.gemv_xsum!r}: expected one of {XSUMS}")
        if not 1 <= self.multirow_max_rows <= 16:
            raise ValueError(f"multirow_max_rows={self.multirow_max_rows} must be in 1..16 "
                             "(the multirow kernel pads rows to one 16-row MMA tile)")
        for name in ("qmm_tile_m", "qmm_tile_n", "qmm_tile_k", "gemv_block_n"):
            v = getattr(self, name)
            if v is not None and (v < 16 or v & (v - 1)):
                raise ValueError(f"{name}={v} must be a power of two >= 16 (Triton block shapes)")
        if self.gemv_num_stages is not None and self.gemv_num_stages < 1:
            raise ValueError(f"gemv_num_stages={self.gemv_num_stages} must be >= 1")
        if self.gemv_groups_per_step is not None and self.gemv_groups_per_step < 1:
            raise ValueError(f"gemv_groups_per_step={self.gemv_groups_per_step} must be >= 1")
        if self.gemv_target_programs is not None and self.gemv_target_programs < 1:
            raise ValueError(f"gemv_target_programs={self.gemv_target_programs} must be >= 1")
        if self.gemv_split_k is not None and self.gemv_split_k < 1:
            raise ValueError(f"gemv_split_k={self.gemv_split_k} must be >= 1")

    @classmethod
    def from_env(cls, **overrides) -> "DispatchConfig":
        return cls(**overrides)

    def replace(self, **changes) -> "DispatchConfig":
        return dataclasses.replace(self, **changes)


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
