"""Spike (issue 42): a Mosaic GPU GEMV with programmatic dependent launch (PDL).

Per program: 64 * n_sub weight rows by gp = K/64/split groups. Every TMA copy of the program's
weights, scales and biases is issued first (they do not depend on the previous kernel), then
griddepcontrol.wait, then x's tiles; the codes are dequantized in registers (s*(q-8) + (b+8s), the
removed mosaic_qmm's form) and multiplied by wgmma into a float32 [64, tm] accumulator per 64 rows.
Output: split-K partials [split, N, tm] float32 (x^T's layout); `mosaic_gemv` folds them.
"""
from __future__ import annotations

import functools
import inspect

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.launch import fold_splits

G = 64  # quantization group (inputs)
R = 64  # weight rows per warpgroup tile (wgmma M)


def _swz(minor_bits: int, item_bits: int):
    s = plgpu.find_swizzle(minor_bits)
    return (plgpu.TilingTransform((8, s * 8 // item_bits)), plgpu.SwizzleTransform(s))


_IDX_OPTIONAL = inspect.signature(plgpu.load).parameters["idx"].default is not inspect.Parameter.empty


def _load(ref, layout):  # JAX 0.11 deprecates load's separate index; 0.10 requires it
    return plgpu.load(ref, layout=layout) if _IDX_OPTIONAL else plgpu.load(ref, (), layout=layout)


def codes_of(qw):
    """The stored words as int4 [N/64, K/64, 64, 64] (same bytes; code i of word j is input 8j+i)."""
    nt, ng = qw.weight.shape[:2]
    return jax.lax.bitcast_convert_type(qw.weight, jnp.int4).reshape(nt, ng, R, G)


@functools.partial(jax.jit, static_argnames=("split", "n_sub", "pdl", "tm"))
def mosaic_gemv_parts(x2, codes, scales, biases, *, split: int, n_sub: int = 1, pdl: bool = True, tm: int = 16):
    rows, k = x2.shape
    nt, ng = codes.shape[:2]
    n = nt * R
    gp = ng // split
    if gp * split != ng or nt % n_sub or rows > tm:
        raise ValueError(f"split={split} n_sub={n_sub} rows={rows} do not fit N={n} groups={ng}")
    bn = R * n_sub
    dt = x2.dtype
    xp = jnp.pad(x2, ((0, tm - rows), (0, 0)))
    row_layout = plgpu.Layout.WGMMA.reduce(1)
    nbar = 2 * gp + 2

    def q4_gemv(x_g, w_g, s_g, b_g, o_g, x_s, w_s, s_s, b_s, o_s, bars):
        nb, si = jax.lax.axis_index("n"), jax.lax.axis_index("s")
        g0, n0 = si * gp, nb * bn
        if pdl:  # the next kernel may start its own weight copies during this one's last wave
            plgpu.griddepcontrol_launch_dependents()
        for j in range(gp):  # weights, scales, biases: independent of the previous kernel
            plgpu.copy_gmem_to_smem(w_g.at[pl.ds(nb * n_sub, n_sub), g0 + j], w_s.at[j], bars.at[j])
        plgpu.copy_gmem_to_smem(s_g.at[pl.ds(g0, gp), pl.ds(n0, bn)], s_s, bars.at[gp])
        plgpu.copy_gmem_to_smem(b_g.at[pl.ds(g0, gp), pl.ds(n0, bn)], b_s, bars.at[gp + 1])
        if pdl:  # x is the previous kernel's output
            plgpu.griddepcontrol_wait()
        for j in range(gp):
            plgpu.copy_gmem_to_smem(x_g.at[:, pl.ds((g0 + j) * G, G)], x_s.at[j], bars.at[gp + 2 + j])
        plgpu.barrier_wait(bars.at[gp])
        plgpu.barrier_wait(bars.at[gp + 1])

        def scoped(*accs):
            for j in range(gp):
                plgpu.barrier_wait(bars.at[j])
                plgpu.barrier_wait(bars.at[gp + 2 + j])
                for i in range(n_sub):
                    q = _load(w_s.at[j, i], plgpu.Layout.WGMMA_UPCAST_4X)
                    q = q ^ jnp.asarray(-8, jnp.int4)  # unsigned q -> signed q - 8
                    q = plgpu.layout_cast(q, plgpu.Layout.WGMMA).astype(dt)
                    cols = pl.ds(i * R, R)
                    s = _load(s_s.at[j, cols], row_layout).astype(jnp.float32)
                    b = _load(b_s.at[j, cols], row_layout).astype(jnp.float32)
                    per_row = lambda v: jax.lax.broadcast_in_dim(v.astype(dt), q.shape, (0,))
                    plgpu.wgmma(accs[i], q * per_row(s) + per_row(b + 8.0 * s), x_s.at[j].T)
                plgpu.wgmma_wait(0)  # the register operand must not be overwritten in flight
            for i, acc in enumerate(accs):
                o_s[pl.ds(i * R, R)] = acc[...]

        pl.run_scoped(scoped, *[plgpu.ACC((R, tm), jnp.float32)] * n_sub)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_s, o_g.at[si, pl.ds(n0, bn)])
        plgpu.wait_smem_to_gmem(0)

    call = plgpu.kernel(
        q4_gemv,
        out_type=jax.ShapeDtypeStruct((split, n, tm), jnp.float32),
        grid=(nt // n_sub, split), grid_names=("n", "s"),
        scratch_types=[
            plgpu.SMEM((gp, tm, G), dt, transforms=_swz(G * 16, 16)),
            plgpu.SMEM((gp, n_sub, R, G), jnp.int4, transforms=_swz(G * 4, 4)),
            plgpu.SMEM((gp, bn), scales.dtype),
            plgpu.SMEM((gp, bn), biases.dtype),
            plgpu.SMEM((bn, tm), jnp.float32, transforms=_swz(tm * 32, 32)),
            plgpu.Barrier(num_arrivals=1, num_barriers=nbar),
        ],
        compiler_params=plgpu.CompilerParams(),
    )
    return call(xp, codes, scales, biases)


def mosaic_gemv(x2, codes, scales, biases, **kw):
    """[rows, K] @ W^T -> [rows, N] in x's dtype."""
    parts = mosaic_gemv_parts(x2, codes, scales, biases, **kw)
    return fold_splits(parts).T[: x2.shape[0]].astype(x2.dtype)


def default_split(shape) -> int:
    """About 1,900-2,400 programs with n_sub=1, the split dividing the groups evenly."""
    n, k = shape
    ng, nt = k // G, n // R
    best = 1
    for s in range(1, ng + 1):
        if ng % s == 0 and nt * s <= 2400:
            best = s
    return best
