"""Launch shapes per weight shape (chosen statically, from measurements in docs/kernels.md)."""
from __future__ import annotations

import dataclasses

from .config import DispatchConfig
from .gemv import GemvTiling
from .kernel import MMA_ROWS, Tiling
from .mosaic_qmm import ROWS_PER_WG, MosaicTiling

# H200: 132 SMs. The tensor-core GEMV is latency-bound per group (docs/kernels.md, log entry 7), so
# it wants many small programs resident per SM: 64-row tiles with K split to ~1920 programs (about
# 15 per SM) ran 15360x3840 in 35 us against 41.3 for 128-row tiles at 240, and the whole-12B decode
# forward in 10.06 ms against 10.78 (and 10.31 at 960 programs). Keep a few groups per split.
_TARGET_PROGRAMS = 1920
_GEMV_BLOCK_N = 64
_QMM_TARGET_PROGRAMS = 132
_MIN_GROUPS_PER_SPLIT = 4


# The tall tied head (262144x3840 at Gemma 4 12B; one launch a forward, the largest): 64-row tiles
# unsplit (4096 programs of 60 groups, the 1920-program rule's choice) took 261-263 us under ncu on
# the H200, 128-row tiles split 4 with the wrapper's group sums 217-219 (session 13, docs/kernels.md
# log entry 14). At the layer shapes those launches had not helped the whole model (entry 11).
TALL_N = 1 << 17
_TALL_BLOCK_N, _TALL_SPLIT, _TALL_XSUM = 128, 4, "input"


def split_for(programs: int, n_groups: int, target: int) -> int:
    """The power-of-two K split that brings `programs` up to `target`, keeping a few groups per split."""
    split = 1
    while programs * split < target and n_groups // (split * 2) >= _MIN_GROUPS_PER_SPLIT:
        split *= 2
    return split


# The fma GEMV: about 8 programs of 4 warps fit on an SM, so split K until there are about 8 per SM.
_FMA_TARGET_PROGRAMS = 1024


def gemv_tiling(shape: tuple[int, int], group_size: int, config: DispatchConfig) -> Tiling | GemvTiling:
    """The qmv/multirow launch. Depends only on the weight shape (never on the row count), so a
    row computed alone and the same row computed among others see identical arithmetic."""
    if config.gemv_kernel == "fma":
        return fma_gemv_tiling(shape, group_size, config)
    n, k = shape
    tall = n >= TALL_N
    block_n = config.gemv_block_n or (_TALL_BLOCK_N if tall else _GEMV_BLOCK_N)
    n_groups = k // group_size
    if config.gemv_split_k is not None:
        split = config.gemv_split_k
    elif tall and config.gemv_target_programs is None:
        split = min(_TALL_SPLIT, n_groups)
    else:
        split = split_for(-(-n // block_n), n_groups, config.gemv_target_programs or _TARGET_PROGRAMS)
    # One group per loop step and the weight tile on the left of the dot won the sweep at all shapes;
    # the kpairs unpack skips the code tile's shared-memory round trip (log entry 8). Three pipeline
    # stages on "kn" weights (what models store): 20.7 against 21.9 us under ncu on 15360x3840, and
    # the whole-12B decode forward 6.30 ms against 6.73/6.90 at two (log entry 10). (On MLX-layout
    # weights two stages had won: 8.38/8.43 against 8.65/8.64 ms, log entry 9.)
    return Tiling(block_m=MMA_ROWS, block_n=block_n, groups_per_step=config.gemv_groups_per_step or 1,
                  split_k=split, w_left=True, num_warps=4, num_stages=config.gemv_num_stages or 3,
                  dequant=config.dequant or "codes", unpack=config.gemv_unpack or "kpairs",
                  xsum=config.gemv_xsum or (_TALL_XSUM if tall else "reduce"))


def fma_gemv_tiling(shape: tuple[int, int], group_size: int, config: DispatchConfig) -> GemvTiling:
    """The CUDA-core GEMV launch (pallas_kernels/gemv.py), from the weight shape only. 64 rows x 4
    groups per loop step (128 bytes of each row): on the H200 at one row 20.3 us on 15360x3840
    against 37.9 for 128 x 1 (Nsight Compute, docs/kernels.md, log entry 6); at 8 rows it spills
    (114 us; 256 x 1 with chains: 79), but one row is what this kernel is for. The config's
    gemv_block_n / gemv_groups_per_step / gemv_chains override it."""
    n, k = shape
    block_n = config.gemv_block_n or 64
    if config.gemv_split_k is not None:
        split = config.gemv_split_k
    else:
        split = split_for(-(-n // block_n), k // group_size, config.gemv_target_programs or _FMA_TARGET_PROGRAMS)
    return GemvTiling(block_n=block_n, groups_per_step=config.gemv_groups_per_step or 4, split_k=split,
                      chains=config.gemv_chains)


# The qmm path's dense fallback (DispatchConfig.qmm_dense_rows) only for weights of at most 2^28
# elements (a transient copy of 512 MiB in bf16, 1 GiB for float32 x): every Gemma-4-12B layer weight
# (59 M elements), not the 262144-row tied head.
QMM_DENSE_MAX_ELEMENTS = 1 << 28


def qmm_dense(rows: int, shape: tuple[int, int], config: DispatchConfig) -> bool:
    """Whether the qmm path runs as dequantize + XLA's dense dot at `rows` (DispatchConfig.qmm_dense_rows)."""
    n, k = shape
    return 0 < config.qmm_dense_rows <= rows and n * k <= QMM_DENSE_MAX_ELEMENTS


QMM_TILE_M = 64
# From this many rows on, 256-row tiles (8 warps; 2 stages: 3 ask 240 KiB of shared memory): each
# weight tile is dequantized once per 256 rows instead of 64. H200, dequantize-first body, 512 rows:
# 220-227 us against 264-267 (15360x3840) and 238-246 against 262-270 (3840x15360); 256 rows 3-8%
# faster; 128 rows slower (131-141 against 79-102). docs/kernels.md, log entry 8.
# (With the dense fallback on, DispatchConfig.qmm_dense_rows = 256, it takes those calls first, so
# these tiles then run only for weights over its cap: log entry 11.)
QMM_TALL_ROWS = 256
QMM_TALL_TILE_M = 256


def qmm_tiling(rows: int, shape: tuple[int, int], group_size: int, config: DispatchConfig,
               x_itemsize: int = 2) -> Tiling:
    """The tiled GEMM launch. tile_m 64 unless configured: on the H200 it was the fastest or tied at
    16, 64 and 512 rows against 16, 32 and 128 (docs/kernels.md); 256 from QMM_TALL_ROWS rows for the
    dequantize-first body with 16-bit x (a float32 x tile that tall does not fit shared memory).
    K is split until there are about one wave of programs: the down projection (3840x15360) went
    from 308 to 73 us at 64 rows."""
    n, k = shape
    dequant = config.dequant or "weights"
    tall = (config.qmm_tile_m is None and rows >= QMM_TALL_ROWS and dequant == "weights" and x_itemsize <= 2)
    block_m = QMM_TALL_TILE_M if tall else config.qmm_tile_m or QMM_TILE_M
    groups_per_step = max(1, (config.qmm_tile_k or (128 if dequant == "weights" else 64)) // group_size)
    programs = -(-n // config.qmm_tile_n) * -(-rows // block_m)
    split = split_for(programs, k // group_size, _QMM_TARGET_PROGRAMS)
    return Tiling(block_m=block_m, block_n=config.qmm_tile_n, groups_per_step=groups_per_step,
                  split_k=split, w_left=False, num_warps=8 if tall else 4, num_stages=2 if tall else 3,
                  dequant=dequant)


# The Mosaic GPU kernel (mosaic_qmm.py): programs of 64 weight rows, K split into equal parts until
# about this many programs (several small ones per SM, as for the Triton GEMV). Its launch options
# all took 20-22 us alone on 15360x3840 at 1 row (docs/kernels.md, log entry 12): none is the default.
_MOSAIC_TARGET_PROGRAMS = 1024


def mosaic_tiling(rows: int, shape: tuple[int, int], group_size: int, **choices) -> MosaicTiling:
    """Up to 16 rows one 16-row tile whatever the row count (so a row's arithmetic is the same alone or
    among others, as for the Triton GEMV); more rows 64-, 128- or 256-row tiles. K is split into an
    equal number of whole steps per program (at least 4 groups and 2 steps), the largest split under the program
    target. `choices` overrides MosaicTiling's other fields (groups_per_step, n_sub, stages;
    benchmarks/mosaic_sweep.py); the split follows them. n_sub falls back to 1 where N does not divide."""
    n, k = shape
    tile_m = choices.pop("tile_m", None) or (16 if rows <= MMA_ROWS else 64 if rows <= 64 else 128 if rows <= 128
                                              else 256)
    t = MosaicTiling(tile_m=tile_m, **choices)
    if n % (ROWS_PER_WG * t.n_sub):
        t = dataclasses.replace(t, n_sub=1)
    if "split_k" in choices:
        return t
    programs = -(-n // (ROWS_PER_WG * t.n_sub)) * -(-rows // tile_m)
    n_groups = k // group_size
    per_step = t.groups_per_step
    splits = [d for d in range(1, n_groups + 1) if n_groups % d == 0 and (n_groups // d) % per_step == 0
              and n_groups // d >= max(_MIN_GROUPS_PER_SPLIT, 2 * per_step)]
    if not splits:  # a step size that does not divide K's groups (or under 4 groups): one group per step
        return dataclasses.replace(t, groups_per_step=1, split_k=1)
    split = max([d for d in splits if programs * d <= _MOSAIC_TARGET_PROGRAMS] or [min(splits)])
    return dataclasses.replace(t, split_k=split)
