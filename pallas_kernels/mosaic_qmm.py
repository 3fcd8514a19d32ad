"""A Mosaic GPU (Hopper: TMA + wgmma) kernel for the 4-bit matmul, behind `DispatchConfig.mosaic`.

Why: the Triton kernels (kernel.py) looked bound by instructions and latency per loop step, not by
bytes (docs/kernels.md, log entries 10-11); Mosaic GPU moves each step's tiles with bulk tensor
copies (TMA) several steps ahead and has a dedicated 4-bit upcast. The product is computed
transposed, `out^T = W @ x^T`: the weight tile is wgmma's left operand, dequantized in registers
(wgmma reads its left operand from registers, the right one only from shared memory), x^T the right.

Per quantization group, a warpgroup (128 threads) owns 64 weight rows (MosaicTiling: several
groups per pipeline step, several 64-row blocks per program):
  1. the packed words, viewed as int4 `[N, K]` (MLX puts code 8j+i at bits 4i of word j: the same
     little-endian order), arrive by TMA with x's `[tile_m, 64]` tile and the group's 64 scales and
     biases ("kn" layout: one contiguous run each);
  2. codes load in the 4-bit upcast layout; XOR 8 turns the unsigned code q into the signed int4
     q - 8, which has a fast int4 -> bf16 conversion; so each weight is `s * (q - 8) + (b + 8 s)`;
  3. the codes move to the wgmma operand layout while still packed, convert, are dequantized in
     x's 16-bit dtype (two weights per instruction; `b + 8 s` in float32, rounded once) and are
     multiplied into a float32 accumulator `[64, tile_m]`.
K may be split across programs (partial sums added outside in a fixed order, as kernel.py does).

Numerics: each weight is rounded twice in 16 bits (`s * (q - 8)`, then `+ (b + 8 s)`), where the
Triton codes body multiplies exact codes; the tests' 1e-2 relative tolerance allows for it.

Measured on the H200 (session 11, docs/kernels.md log entry 12): correct (tests/test_kernels_gpu.py),
but no faster than the Triton kernels: 20-22 us alone at one row on 15360x3840 like the Triton
GEMV, whatever the launch option, and slower from 128 rows. CPU tests lower it for CUDA (Mosaic GPU's
lowering checks layouts, transforms and the wgmma operands); Mosaic GPU's interpreter cannot run a
wgmma whose left operand is in registers, so its numbers need the GPU.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from .kernel import fold_splits, pad_to, split_groups
from .quant import QuantizedWeight, with_w_layout

ROWS_PER_WG = 64  # weight rows per warpgroup: the wgmma tile height


@dataclasses.dataclass(frozen=True)
class MosaicTiling:
    """tile_m: x rows per program (a multiple of 8, at most 256: the wgmma width); split_k: programs
    along K; stages: pipeline steps in flight (TMA copies issued ahead); groups_per_step: quantization
    groups per pipeline step (each its own TMA copies, one barrier for all: bigger steps amortise the
    step's wait and wgmma latency); n_sub: 64-row weight blocks per program, each with its own
    accumulator (x's tile is fetched once for all of them); w_tiles: read the words from a tile-major
    copy (quant.with_w_layout: each [64, group] tile one contiguous 2 KB run) made inside the call, for
    measuring the kernel alone (ncu, traces) against row-major reads. Weights stored as "tiles"
    (QuantizedWeight.w_layout) are read that way as they are, whatever w_tiles says.

    (Session 11 also tried leaving a step's wgmmas in flight while the next step dequantized, the
    pipeline releasing buffers a step late: at 128 and 256-row tiles it gave wrong sums, relative
    error 0.01-62. A wgmma reads its register operand asynchronously, and nothing in Pallas keeps the
    next tile's dequantized values out of those registers. Removed.)"""
    tile_m: int = 16
    split_k: int = 1
    stages: int = 4
    groups_per_step: int = 1
    n_sub: int = 1
    w_tiles: bool = False

    def __post_init__(self):
        if self.tile_m % 8 or not 8 <= self.tile_m <= 256:
            raise ValueError(f"MosaicTiling.tile_m={self.tile_m}: expected a multiple of 8 in [8, 256]")
        if min(self.split_k, self.stages, self.groups_per_step, self.n_sub) < 1:
            raise ValueError(f"MosaicTiling: split_k={self.split_k}, stages={self.stages}, groups_per_step="
                             f"{self.groups_per_step} and n_sub={self.n_sub} must be >= 1")


def supports(x2: jax.Array, qw: QuantizedWeight) -> bool:
    """The formats this kernel takes: 4-bit, groups of 64, "kn" scales, 16-bit x, N a multiple of 64
    (words in either layout: "tiles" weights are read as stored, as with MosaicTiling.w_tiles)."""
    return (qw.bits == 4 and qw.group_size == 64 and qw.sb_layout == "kn" and qw.shape[0] % ROWS_PER_WG == 0
            and jnp.dtype(x2.dtype) in (jnp.bfloat16, jnp.float16))


def _swizzled(minor_bits: int, item_bits: int):
    """TMA/wgmma-friendly transforms for a tile whose rows are `minor_bits` long."""
    swizzle = plgpu.find_swizzle(minor_bits)
    return (plgpu.TilingTransform((8, swizzle * 8 // item_bits)), plgpu.SwizzleTransform(swizzle))


def mosaic_qmm(x2: jax.Array, qw: QuantizedWeight, tiling: MosaicTiling) -> jax.Array:
    """`x2 [rows, K] @ dequantize(qw).T` -> `[rows, N]` in x2's dtype (float32 accumulation)."""
    if not supports(x2, qw):
        raise ValueError(f"mosaic_qmm takes 4-bit g64 'kn' weights with N % {ROWS_PER_WG} == 0 and 16-bit x; got "
                         f"bits={qw.bits} group_size={qw.group_size} sb_layout={qw.sb_layout!r} "
                         f"shape={qw.shape} x dtype={x2.dtype}")
    rows, k = x2.shape
    n = qw.shape[0]
    g = qw.group_size
    n_groups = k // g
    split, groups_per_split = split_groups(n_groups, tiling.split_k)
    gps, n_sub = tiling.groups_per_step, tiling.n_sub
    if split * groups_per_split != n_groups or groups_per_split % gps:  # static, equal pipeline grids
        raise ValueError(f"mosaic_qmm: split_k={tiling.split_k} x groups_per_step={gps} does not divide the "
                         f"{n_groups} groups evenly")
    bn = ROWS_PER_WG * n_sub  # weight rows per program
    if n % bn:
        raise ValueError(f"mosaic_qmm: N={n} is not a multiple of n_sub * {ROWS_PER_WG} = {bn}")
    tm = tiling.tile_m
    xp = pad_to(x2, 0, tm)
    m_tiles = xp.shape[0] // tm
    w_tiles = tiling.w_tiles or qw.w_layout == "tiles"
    if w_tiles:  # [N/64, K/g, 64, g]: a step's tiles are contiguous runs (as stored, or a copy)
        words = with_w_layout(qw, "tiles").weight  # 64-row tiles: one warpgroup's block each
        codes = jax.lax.bitcast_convert_type(words, jnp.int4).reshape(n // ROWS_PER_WG, n_groups, ROWS_PER_WG, g)
    else:
        codes = jax.lax.bitcast_convert_type(qw.weight, jnp.int4).reshape(n, k)
    dt = x2.dtype
    # one TMA copy per group and operand: a [64, 64] int4 tile is 32-byte rows, which the swizzled
    # layouts and the 4-bit upcast take as they are; a wider block would need slicing inside a swizzle
    x_specs = [plgpu.BlockSpec((tm, g), lambda s, j=j: (0, s * gps + j), transforms=_swizzled(g * 16, 16))
              for j in range(gps)]
    if w_tiles:  # one copy of n_sub x gps contiguous tiles
        w_specs = [plgpu.BlockSpec((n_sub, gps, ROWS_PER_WG, g), lambda s: (0, s, 0, 0),
                                   transforms=_swizzled(g * 4, 4))]
    else:
        w_specs = [plgpu.BlockSpec((bn, g), lambda s, j=j: (0, s * gps + j), transforms=_swizzled(g * 4, 4))
                   for j in range(gps)]
    n_w = len(w_specs)
    sb_spec = plgpu.BlockSpec((gps, bn), lambda s: (s, 0))
    out_transforms = _swizzled(tm * 32, 32)
    row = plgpu.Layout.WGMMA.reduce(1)

    def tile(ws, j, i):
        """The smem [64, g] codes of group j (of the step) and weight block i."""
        if w_tiles:
            return ws[0].at[i, j]
        return ws[j].at[pl.ds(i * ROWS_PER_WG, ROWS_PER_WG)]

    def dequantized(w_tile, s_smem, b_smem, j, i):
        """Group j of weight block i as a [64, 64] wgmma register operand in x's dtype."""
        q = plgpu.load(w_tile, (), layout=plgpu.Layout.WGMMA_UPCAST_4X)
        q = q ^ jnp.asarray(-8, jnp.int4)  # unsigned code q -> signed q - 8 (flip the top bit)
        # relayout while packed (one shuffle per 8 codes), then the int4 -> 16-bit conversion
        q = plgpu.layout_cast(q, plgpu.Layout.WGMMA).astype(dt)
        cols = pl.ds(i * ROWS_PER_WG, ROWS_PER_WG)
        s = plgpu.load(s_smem.at[j], cols, layout=row).astype(jnp.float32)
        b = plgpu.load(b_smem.at[j], cols, layout=row).astype(jnp.float32)
        per_row = lambda v: jax.lax.broadcast_in_dim(v.astype(dt), q.shape, (0,))  # (no [64, 1] step: no layout)
        return q * per_row(s) + per_row(b + 8.0 * s)  # 16-bit pairs: two weights per instruction

    def step(_, *refs):
        xs, ws, (s_smem, b_smem), accs = refs[:gps], refs[gps:gps + n_w], refs[gps + n_w:gps + n_w + 2], refs[-1]
        for j in range(gps):
            for i in range(n_sub):
                w = dequantized(tile(ws, j, i), s_smem, b_smem, j, i)
                plgpu.wgmma(accs[i], w, plgpu.transpose_ref(xs[j], (1, 0)))
        plgpu.wgmma_wait(0)  # before the pipeline refills these buffers
        return accs

    def q4_mosaic(x_gmem, w_gmem, s_gmem, b_gmem, o_gmem, o_smem):  # (the name profilers show)
        n0 = jax.lax.axis_index("n") * bn
        m0 = jax.lax.axis_index("m") * tm
        si = jax.lax.axis_index("s")
        k0 = si * groups_per_split * g
        g0 = si * groups_per_split

        def scoped(*accs):
            pipeline = plgpu.emit_pipeline(
                lambda idx, *refs: step(idx, *refs, accs), grid=(groups_per_split // gps,),
                in_specs=[*x_specs, *w_specs, sb_spec, sb_spec], max_concurrent_steps=tiling.stages)
            x_in = x_gmem.at[pl.ds(m0, tm), pl.ds(k0, groups_per_split * g)]
            if w_tiles:
                w_in = w_gmem.at[pl.ds(n0 // ROWS_PER_WG, n_sub), pl.ds(g0, groups_per_split)]
            else:
                w_in = w_gmem.at[pl.ds(n0, bn), pl.ds(k0, groups_per_split * g)]
            pipeline(*[x_in] * gps, *[w_in] * n_w, s_gmem.at[pl.ds(g0, groups_per_split), pl.ds(n0, bn)],
                     b_gmem.at[pl.ds(g0, groups_per_split), pl.ds(n0, bn)])
            for i, acc in enumerate(accs):
                o_smem[pl.ds(i * ROWS_PER_WG, ROWS_PER_WG)] = acc[...]
        pl.run_scoped(scoped, *[plgpu.ACC((ROWS_PER_WG, tm), jnp.float32)] * n_sub)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, o_gmem.at[si, pl.ds(n0, bn), pl.ds(m0, tm)])
        plgpu.wait_smem_to_gmem(0)

    call = plgpu.kernel(
        q4_mosaic,
        out_type=jax.ShapeDtypeStruct((split, n, xp.shape[0]), jnp.float32),
        grid=(n // bn, m_tiles, split), grid_names=("n", "m", "s"),
        scratch_types=[plgpu.SMEM((bn, tm), jnp.float32, transforms=out_transforms)],
        compiler_params=plgpu.CompilerParams(),
    )
    out_t = call(xp, codes, qw.scales, qw.biases)  # [split, N, rows (padded)]
    return fold_splits(out_t).T[:rows].astype(dt)
