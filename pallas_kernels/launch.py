"""Launch shapes and the pallas_call: `gemv` (qmv, multirow) and `qmm` run one or several weights of
one format on one x, each program computing one output tile of one weight; K may be split across
programs, the float32 partials added afterwards in a fixed order.

The tiling rules (`gemv_tiling`, `qmm_tiling`) are the defaults the dispatch uses; a benchmark passes
its own `Tiling` to `gemv` / `qmm` instead. Why each default: docs/kernels.md.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from .config import ROW_TILE, DispatchConfig
from .gemv import gemv_body, group_sums, kpairs_order, uses_kpairs
from .qmm import qmm_body
from .quant import TILE_ROWS, QuantizedWeight
from .stack import with_layer

XSUMS = ("reduce", "input")


@dataclasses.dataclass(frozen=True)
class Tiling:
    """One launch shape. block_m / block_n: output tile (block_n a multiple of 64, whole stored word
    tiles); groups_per_step: quantization groups per loop iteration; split_k: programs along K;
    num_warps / num_stages: Triton's. xsum (GEMV only): "reduce" sums each group of the x tile in
    the kernel, "input" has the wrapper sum it once (`gemv.group_sums`) and programs load the sums."""

    block_m: int = ROW_TILE
    block_n: int = 64
    groups_per_step: int = 1
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3
    xsum: str = "reduce"

    def __post_init__(self):
        if self.xsum not in XSUMS:
            raise ValueError(f"Tiling.xsum={self.xsum!r}: expected one of {XSUMS}")
        if self.block_n < TILE_ROWS or self.block_n % TILE_ROWS:
            raise ValueError(f"Tiling.block_n={self.block_n} must be a multiple of {TILE_ROWS} (stored word tiles)")
        for name in ("block_m", "groups_per_step", "split_k", "num_warps", "num_stages"):
            if getattr(self, name) < 1:
                raise ValueError(f"Tiling.{name}={getattr(self, name)} must be >= 1")


# ---- tiling rules -----------------------------------------------------------------------------
# The GEMV is latency-bound per group, so it wants many small programs resident per SM (H200: 132
# SMs): 64-row tiles, K split until about 1920 programs, a few groups per split at least.
_GEMV_TARGET_PROGRAMS = 1920
_MIN_GROUPS_PER_SPLIT = 4
# The tall tied head (N >= 2^17, e.g. 262144 x 3840): 128-row tiles split 4, the wrapper's group sums.
TALL_N = 1 << 17
# qmm: about one wave of programs.
_QMM_TARGET_PROGRAMS = 132
QMM_TILE_M = 64
# From this many rows, 256-row qmm tiles (8 warps, 2 stages: 3 do not fit shared memory): each weight
# tile is dequantized once per 256 rows.
QMM_TALL_ROWS = 256
QMM_TALL_TILE_M = 256
# The dense fallback (DispatchConfig.qmm_dense_rows) only for weights of at most 2^28 elements: its
# transient bf16 copy stays under 512 MiB (every 12B layer weight; not the tied head).
QMM_DENSE_MAX_ELEMENTS = 1 << 28


def split_for(programs: int, n_groups: int, target: int) -> int:
    """The power-of-two K split that brings `programs` up to `target`, keeping a few groups per split."""
    split = 1
    while programs * split < target and n_groups // (split * 2) >= _MIN_GROUPS_PER_SPLIT:
        split *= 2
    return split


def gemv_tiling(shape: tuple[int, int], group_size: int) -> Tiling:
    """The qmv / multirow launch: from the weight shape only (never the row count), so a row computed
    alone and among others sees identical arithmetic."""
    n, k = shape
    n_groups = k // group_size
    if n >= TALL_N:
        return Tiling(block_n=128, split_k=min(4, n_groups), xsum="input")
    return Tiling(block_n=64, split_k=split_for(-(-n // 64), n_groups, _GEMV_TARGET_PROGRAMS))


def qmm_tiling(rows: int, shape: tuple[int, int], group_size: int, config: DispatchConfig,
               x_itemsize: int = 2) -> Tiling:
    """The tiled GEMM launch: 64-row tiles (config.qmm_tile_m overrides), 256 from QMM_TALL_ROWS rows
    for 16-bit x (a float32 x tile that tall does not fit shared memory); 128 columns; two groups
    of 64 per step; K split to about one wave."""
    n, k = shape
    tall = config.qmm_tile_m is None and rows >= QMM_TALL_ROWS and x_itemsize <= 2
    block_m = QMM_TALL_TILE_M if tall else config.qmm_tile_m or QMM_TILE_M
    programs = -(-n // 128) * -(-rows // block_m)
    return Tiling(block_m=block_m, block_n=128, groups_per_step=max(1, 128 // group_size),
                  split_k=split_for(programs, k // group_size, _QMM_TARGET_PROGRAMS),
                  num_warps=8 if tall else 4, num_stages=2 if tall else 3)


def qmm_dense(rows: int, shape: tuple[int, int], config: DispatchConfig) -> bool:
    """Whether qmm runs as dequantize + XLA's dense dot at `rows` (DispatchConfig.qmm_dense_rows)."""
    n, k = shape
    return 0 < config.qmm_dense_rows <= rows and n * k <= QMM_DENSE_MAX_ELEMENTS


# ---- the launch -------------------------------------------------------------------------------
def gemv(x2: jax.Array, qws, tiling: Tiling, *, interpret: bool, layer=None, fold: bool = True) -> tuple[jax.Array, ...]:
    """`x2 [rows <= ROW_TILE, K] @ dequantize(qw).T` for each qw (one format), one launch of the GEMV body.
    `layer` (an int32 `[1]` array, `stack.Layer.operand()`): the qws are stacks, use that layer's.
    `fold=False`: each result is the split-K partials `[split, rows, N]` (float32 when split > 1), for
    a consumer that adds them in split order itself (one kernel fewer)."""
    if x2.shape[0] > tiling.block_m:
        raise ValueError(f"the GEMV computes at most block_m={tiling.block_m} rows, got {x2.shape[0]}")
    return _launch(gemv_body, x2, tuple(qws), tiling, interpret=interpret, layer=layer, fold=fold)


def qmm(x2: jax.Array, qws, tiling: Tiling, *, interpret: bool, layer=None, fold: bool = True) -> tuple[jax.Array, ...]:
    """`x2 [rows, K] @ dequantize(qw).T` for each qw (one format), one launch of the tiled GEMM body
    (`layer`, `fold` as in `gemv`)."""
    if tiling.xsum != "reduce":
        raise ValueError("the qmm body computes no group sums: Tiling.xsum must be 'reduce'")
    return _launch(qmm_body, x2, tuple(qws), tiling, interpret=interpret, layer=layer, fold=fold)


def same_format(qws) -> bool:
    """Whether QuantizedWeights can share a launch: the same bits, group size, K and scale dtype."""
    def fmt(q):
        return q.bits, q.group_size, q.shape[1], q.scales.dtype
    return all(fmt(q) == fmt(qws[0]) for q in qws)


def dot_dtype(x_dtype):
    """bf16/f16 activations multiply as they are (codes are exact in either); float32 stays float32
    with full-precision dots."""
    return jnp.dtype(x_dtype) if jnp.dtype(x_dtype) in (jnp.bfloat16, jnp.float16) else jnp.dtype(jnp.float32)


def pad_by(a, axis, extra, value=0):
    if not extra:
        return a
    pads = [(0, 0)] * a.ndim
    pads[axis] = (0, extra)
    return jnp.pad(a, pads, constant_values=jnp.asarray(value, a.dtype))


def pad_to(a, axis, multiple, value=0):
    return pad_by(a, axis, (-a.shape[axis]) % multiple, value)


def split_groups(n_groups: int, split_k: int) -> tuple[int, int]:
    """(programs along K, groups per program) for a requested split: no program left without groups."""
    split = max(1, min(split_k, n_groups))
    groups_per_split = -(-n_groups // split)
    return -(-n_groups // groups_per_split), groups_per_split


def fold_splits(parts: jax.Array) -> jax.Array:
    """Sum split-K partials `[split, rows, N]` over the split in a fixed order: elementwise adds keep
    every row's sum independent of the row count (XLA's reduce may pick its order by shape)."""
    total = parts[0]
    for part in range(1, parts.shape[0]):
        total = total + parts[part]
    return total


def _through_weights(x_ref, *refs, body, ns, blocks, with_sums, **common):
    """The grid's N axis runs through the weights one after another, each over its own
    ceil(N_i / block_n) blocks. Program ids are read here, outside the branches (interpret mode
    cannot lower them inside one)."""
    count = len(ns)
    if with_sums:
        common["xs_ref"], refs = refs[0], refs[1:]
    w_refs, o_refs = refs[:3 * count], refs[3 * count:]
    pid, pid_m, pid_s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    if count == 1:
        body(x_ref, *w_refs, o_refs[0], n=ns[0], pids=(pid, pid_m, pid_s), **common)
        return
    start = 0
    for i, (n, nb) in enumerate(zip(ns, blocks)):
        @pl.when((pid >= start) & (pid < start + nb))
        def _(i=i, n=n, start=start):
            body(x_ref, *w_refs[3 * i:3 * i + 3], o_refs[i], n=n, pids=(pid - start, pid_m, pid_s), **common)
        start += nb


@functools.partial(jax.jit, static_argnames=("body", "tiling", "interpret", "fold"))
def _launch(body, x2: jax.Array, qws: tuple[QuantizedWeight, ...], tiling: Tiling, *,
            interpret: bool, layer=None, fold: bool = True) -> tuple[jax.Array, ...]:
    """Every weight in one pallas_call, bitwise what one launch per weight gives (every program runs
    the same body on its own tile): a layer's q/k/v or gate/up cost one launch and one wave tail.
    Jitted so that a launch repeated at the same shapes (every layer of a kind) is traced and
    lowered to Triton once per program: lowering is most of a model's trace time."""
    if not qws or not same_format(qws):
        raise ValueError("a launch needs weights of one format (bits, group size, K, scale dtype), got "
                         f"{[(q.bits, q.group_size, q.shape, q.scales.dtype) for q in qws]}")
    rows, k = x2.shape
    first = qws[0]
    n_groups = k // first.group_size
    split, groups_per_split = split_groups(n_groups, tiling.split_k)
    dt = dot_dtype(x2.dtype)
    ns = tuple(qw.shape[0] for qw in qws)
    arrays = [(qw.weight, qw.scales, qw.biases) for qw in qws]
    lead = 0 if layer is None else 1  # a stack's leading layer axis
    if interpret:
        # Interpret mode clamps out-of-range slices instead of masking them: pad to whole tiles.
        x2 = pad_to(x2, 0, tiling.block_m)
        arrays = [(pad_to(w, lead, tiling.block_n // TILE_ROWS), pad_to(s, lead + 1, tiling.block_n),
                   pad_to(b, lead + 1, tiling.block_n)) for w, s, b in arrays]
        if body is qmm_body:  # a last step may run past the last group: poison there, hidden by the masks
            extra = tiling.groups_per_step
            arrays = [(pad_by(w, lead + 1, extra, 0xFFFFFFFF), pad_by(s, lead, extra, 1.0), pad_by(b, lead, extra, 1.0))
                      for w, s, b in arrays]
            x2 = pad_by(x2, 1, extra * first.group_size, 1.0)
    out_rows = x2.shape[0] if interpret else rows
    out_ns = [s.shape[-1] for _, s, _ in arrays] if interpret else ns
    with_sums = False
    if body is gemv_body:
        if uses_kpairs(dt, first.bits):
            x2 = kpairs_order(x2, first.group_size, first.bits)
        if tiling.xsum == "input":  # [K/g, rows (padded)] sums, read by _through_weights
            arrays = [(group_sums(x2, first.group_size),)] + arrays
            with_sums = True
    blocks = tuple(pl.cdiv(n, tiling.block_n) for n in ns)
    common = dict(rows=rows, bits=first.bits, group_size=first.group_size, tiling=tiling, n_groups=n_groups,
                  groups_per_split=groups_per_split, dot_dtype=dt, interpret=interpret,
                  precision=None if dt != jnp.float32 else jax.lax.Precision.HIGHEST)
    first_w = 1 + with_sums  # operands: x, the group sums if any, then each weight's three arrays
    kernel = functools.partial(with_layer(_through_weights, layer is not None, range(first_w, first_w + 3 * len(qws))),
                               body=body, ns=ns, blocks=blocks, with_sums=with_sums, **common)
    name = "gemv" if body is gemv_body else "qmm"
    outs = pl.pallas_call(
        kernel,
        out_shape=tuple(jax.ShapeDtypeStruct((split, out_rows, on), x2.dtype if split == 1 else jnp.float32)
                        for on in out_ns),
        grid=(sum(blocks), pl.cdiv(rows, tiling.block_m), split),
        interpret=interpret,
        compiler_params=None if interpret else pltriton.CompilerParams(
            num_warps=tiling.num_warps, num_stages=tiling.num_stages),
        name=f"q{first.bits}{name}_m{tiling.block_m}_n{tiling.block_n}" + (f"_x{len(qws)}" if len(qws) > 1 else ""),
    )(*([] if layer is None else [layer]), x2, *(a for group in arrays for a in group))
    if not fold:
        return tuple(o[:, :rows, :n] for o, n in zip(outs, ns))
    return tuple(fold_splits(o[:, :rows, :n]).astype(x2.dtype) for o, n in zip(outs, ns))
