"""A Mosaic GPU (Hopper: TMA + wgmma) kernel for the 4-bit matmul, behind `DispatchConfig.mosaic`.

Why: the Triton kernels (kernel.py) are bound by instructions and latency per loop step, not by
bytes (docs/kernels.md, log entries 10-11); Mosaic GPU moves each step's tiles with bulk tensor
copies (TMA) several steps ahead and has a dedicated 4-bit upcast. The product is computed
transposed, `out^T = W @ x^T`: the weight tile is wgmma's left operand, dequantized in registers
(wgmma reads its left operand from registers, the right one only from shared memory), x^T the right.

Per step of one quantization group, a warpgroup (128 threads) owns 64 weight rows:
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

Not yet run on a GPU (written in session 10 after the device time ran out). CPU tests lower it for
CUDA (Mosaic GPU's lowering checks layouts, transforms and the wgmma operands); Mosaic GPU's
interpreter cannot run a wgmma whose left operand is in registers, so its numbers wait for
tests/test_kernels_gpu.py::test_mosaic_qmm_on_gpu.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from .kernel import fold_splits, pad_to, split_groups
from .quant import QuantizedWeight

ROWS_PER_WG = 64  # weight rows per warpgroup: the wgmma tile height


@dataclasses.dataclass(frozen=True)
class MosaicTiling:
    """tile_m: x rows per program (a multiple of 8, at most 256: the wgmma width); split_k: programs
    along K; stages: pipeline steps in flight (TMA copies issued ahead)."""
    tile_m: int = 16
    split_k: int = 1
    stages: int = 4

    def __post_init__(self):
        if self.tile_m % 8 or not 8 <= self.tile_m <= 256:
            raise ValueError(f"MosaicTiling.tile_m={self.tile_m}: expected a multiple of 8 in [8, 256]")
        if self.split_k < 1 or self.stages < 1:
            raise ValueError(f"MosaicTiling: split_k={self.split_k} and stages={self.stages} must be >= 1")


def supports(x2: jax.Array, qw: QuantizedWeight) -> bool:
    """The formats this kernel takes: 4-bit, groups of 64, "kn" scales, 16-bit x, N a multiple of 64."""
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
    if split * groups_per_split != n_groups:  # every split the same length (static pipeline grids)
        raise ValueError(f"mosaic_qmm: split_k={tiling.split_k} does not divide the {n_groups} groups evenly")
    tm = tiling.tile_m
    xp = pad_to(x2, 0, tm)
    m_tiles = xp.shape[0] // tm
    codes = jax.lax.bitcast_convert_type(qw.weight, jnp.int4).reshape(n, k)
    dt = x2.dtype
    x_spec = plgpu.BlockSpec((tm, g), lambda s: (0, s), transforms=_swizzled(g * 16, 16))
    w_spec = plgpu.BlockSpec((ROWS_PER_WG, g), lambda s: (0, s), transforms=_swizzled(g * 4, 4))
    sb_spec = plgpu.BlockSpec((1, ROWS_PER_WG), lambda s: (s, 0))
    out_transforms = _swizzled(tm * 32, 32)

    def step(_, x_smem, w_smem, s_smem, b_smem, acc):
        q = plgpu.load(w_smem, (), layout=plgpu.Layout.WGMMA_UPCAST_4X)
        q = q ^ jnp.asarray(-8, jnp.int4)  # unsigned code q -> signed q - 8 (flip the top bit)
        # relayout while packed (one shuffle per 8 codes), then the int4 -> 16-bit conversion
        q = plgpu.layout_cast(q, plgpu.Layout.WGMMA).astype(dt)
        row = plgpu.Layout.WGMMA.reduce(1)
        s = plgpu.load(s_smem, (0,), layout=row).astype(jnp.float32)
        b = plgpu.load(b_smem, (0,), layout=row).astype(jnp.float32)
        per_row = lambda v: jax.lax.broadcast_in_dim(v.astype(dt), q.shape, (0,))  # (no [64, 1] step: no layout)
        w = q * per_row(s) + per_row(b + 8.0 * s)  # 16-bit pairs: two weights per instruction
        plgpu.wgmma(acc, w, plgpu.transpose_ref(x_smem, (1, 0)))
        plgpu.wgmma_wait(0)
        return acc

    def body(x_gmem, w_gmem, s_gmem, b_gmem, o_gmem, o_smem):
        n0 = jax.lax.axis_index("n") * ROWS_PER_WG
        m0 = jax.lax.axis_index("m") * tm
        si = jax.lax.axis_index("s")
        k0 = si * groups_per_split * g
        g0 = si * groups_per_split

        def scoped(acc):
            pipeline = plgpu.emit_pipeline(
                lambda idx, *refs: step(idx, *refs, acc), grid=(groups_per_split,),
                in_specs=[x_spec, w_spec, sb_spec, sb_spec], max_concurrent_steps=tiling.stages)
            pipeline(x_gmem.at[pl.ds(m0, tm), pl.ds(k0, groups_per_split * g)],
                     w_gmem.at[pl.ds(n0, ROWS_PER_WG), pl.ds(k0, groups_per_split * g)],
                     s_gmem.at[pl.ds(g0, groups_per_split), pl.ds(n0, ROWS_PER_WG)],
                     b_gmem.at[pl.ds(g0, groups_per_split), pl.ds(n0, ROWS_PER_WG)])
            o_smem[...] = acc[...]
        pl.run_scoped(scoped, plgpu.ACC((ROWS_PER_WG, tm), jnp.float32))
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, o_gmem.at[si, pl.ds(n0, ROWS_PER_WG), pl.ds(m0, tm)])
        plgpu.wait_smem_to_gmem(0)

    call = plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((split, n, xp.shape[0]), jnp.float32),
        grid=(n // ROWS_PER_WG, m_tiles, split), grid_names=("n", "m", "s"),
        scratch_types=[plgpu.SMEM((ROWS_PER_WG, tm), jnp.float32, transforms=out_transforms)],
        compiler_params=plgpu.CompilerParams(),
    )
    out_t = call(xp, codes, qw.scales, qw.biases)  # [split, N, rows (padded)]
    return fold_splits(out_t).T[:rows].astype(dt)
