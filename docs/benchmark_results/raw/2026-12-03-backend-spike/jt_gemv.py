"""Spike: the Pallas GEMV (pallas_kernels.gemv.gemv_body, default gemv_tiling) in Triton's own language,
called from JAX through jax_triton.triton_call. For a backend comparison; not used by the library.

    jt_gemv_parts(x2, qw) -> [split, rows, N]   what launch.gemv(x2, (qw,), gemv_tiling(...), fold=False)[0]
                                                 gives: float32 when split > 1, x's dtype when split == 1
    jt_gemv(x2, qw)       -> [rows, N]           the splits folded (launch.fold_splits), cast to x's dtype
    run_torch(x2, qw)     -> numpy partials      the same launch on torch CPU tensors: TRITON_INTERPRET=1
                                                 (set before triton is imported) runs it in Triton's interpreter
    gemv_kernel                                  the raw @triton.jit kernel

Only 4-bit, group-64 weights (one layer, no stack), bf16 x of 1..16 rows. Self-check on CPU:
    TRITON_INTERPRET=1 PYTHONPATH=/work/main:/tmp/jt-site .venv/bin/python .probe/jt_gemv.py
"""
from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import triton
import triton.language as tl

from pallas_kernels import launch
from pallas_kernels.gemv import group_sums, kpairs_order
from pallas_kernels.quant import QuantizedWeight

# The one format, spelled out as literals in the kernel: 4 bits, groups of 64 = 8 words of 8 codes (codes
# j and j+4 of a word 16 bits apart), 64-row word tiles; bf16 codes by 0x4300 | q = 128 + q.
BITS, GROUP = 4, 64


@triton.jit
def _pair(w, J: tl.constexpr, INTERPRET: tl.constexpr):
    """[bn, 8] words -> [bn, 8, 2] bf16: codes J and J+4 of each word as 128 + q (unpack.code_pairs)."""
    v = w >> (4 * J)  # both codes now in bits [0, 4) and [16, 20)
    if INTERPRET:  # the interpreter has no inline asm: the same bits by integer ops
        v = (v & 0x000F000F) | 0x43004300
        lo = (v & 0xFFFF).to(tl.uint16).to(tl.bfloat16, bitcast=True)
        hi = (v >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:  # one LOP3 ((a & b) | c) makes the bf16x2 register; its halves are the two results
        lo, hi = tl.inline_asm_elementwise(
            "{ .reg .b32 t; lop3.b32 t, $2, 0x000f000f, 0x43004300, 0xea; mov.b32 {$0, $1}, t; }",
            "=h,=h,r", [v], dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=1)
    return tl.join(lo, hi)


@triton.jit
def gemv_kernel(x_ptr, xs_ptr, w_ptr, s_ptr, b_ptr, o_ptr,
                ROWS: tl.constexpr, N: tl.constexpr, N_GROUPS: tl.constexpr, GROUPS_PER_SPLIT: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, XS_INPUT: tl.constexpr, INTERPRET: tl.constexpr):
    """One program: a [BLOCK_N] slice of the weight over the groups of one K split (gemv_body).
    x [ROWS, K] bf16 in kpairs order; xs [N_GROUPS, ROWS] f32 group sums (read only if XS_INPUT);
    w uint32 [ceil(N/64), N_GROUPS, 64, 8]; s, b [N_GROUPS, N]; o [split, ROWS, N]."""
    pid_n, pid_m, pid_s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok, col_ok = m < ROWS, n < N
    x_ptrs = x_ptr + m[:, None] * (N_GROUPS * 64) + tl.arange(0, 64)[None, :]
    # row n's 8 words of group g sit at [n // 64, g, n % 64, :]
    w_ptrs = w_ptr + ((n // 64) * (N_GROUPS * 64) + n % 64)[:, None] * 8 + tl.arange(0, 8)[None, :]
    g0 = pid_s * GROUPS_PER_SPLIT
    g1 = tl.minimum(g0 + GROUPS_PER_SPLIT, N_GROUPS)
    acc = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
    for g in range(g0, g1):  # one group per step (groups_per_step 1)
        # scales and biases first, both loads issued before either convert (as gemv_body)
        s = tl.load(s_ptr + g * N + n, mask=col_ok, other=0)
        b = tl.load(b_ptr + g * N + n, mask=col_ok, other=0)
        s, b = s.to(tl.float32), b.to(tl.float32)
        x = tl.load(x_ptrs + g * 64, mask=row_ok[:, None], other=0)
        w = tl.load(w_ptrs + g * (64 * 8), mask=col_ok[:, None], other=0)
        # [n, word, half, c, d] with pair j = 2c + d -> [n, j, word, half]: x's kpairs order
        q = tl.join(tl.join(_pair(w, 0, INTERPRET), _pair(w, 2, INTERPRET)),
                    tl.join(_pair(w, 1, INTERPRET), _pair(w, 3, INTERPRET)))
        codes = tl.reshape(tl.permute(q, (0, 3, 4, 1, 2)), (BLOCK_N, 64))
        if INTERPRET:  # the interpreter's bf16 dot multiplies the raw uint16 bits: go through f32
            d = tl.dot(codes.to(tl.float32), tl.trans(x.to(tl.float32)), input_precision="ieee")
        else:
            d = tl.dot(codes, tl.trans(x), out_dtype=tl.float32)  # [BLOCK_N, BLOCK_M]
        b = b - 128.0 * s  # x . (128 + q) = x . q + 128 * sum(x): the bias absorbs it
        if XS_INPUT:
            xsum = tl.load(xs_ptr + g * ROWS + m, mask=row_ok, other=0)
        else:
            xsum = tl.sum(x.to(tl.float32), axis=1)
        acc = acc + d * s[:, None] + b[:, None] * xsum[None, :]
    o_ptrs = o_ptr + pid_s * (ROWS * N) + m[None, :] * N + n[:, None]
    tl.store(o_ptrs, acc.to(o_ptr.dtype.element_ty), mask=col_ok[:, None] & row_ok[None, :])


def _plan(x2, qw: QuantizedWeight):
    """The Pallas launch's choices for this shape: (prepared operands, constexprs, grid, tiling, out dtype)."""
    if (qw.bits, qw.group_size) != (BITS, GROUP) or qw.weight.ndim != 4:
        raise ValueError(f"jt_gemv: 4-bit group-64 single-layer weights only, got bits={qw.bits} "
                         f"group_size={qw.group_size} weight {tuple(qw.weight.shape)}")
    t = launch.gemv_tiling(qw.shape, GROUP)
    rows, k = x2.shape
    n = qw.shape[0]
    if x2.dtype != jnp.bfloat16 or not 1 <= rows <= t.block_m or k != qw.shape[1]:
        raise ValueError(f"jt_gemv: bf16 x of 1..{t.block_m} rows and K={qw.shape[1]}, got {x2.dtype} {x2.shape}")
    if t.groups_per_step != 1:
        raise NotImplementedError("jt_gemv: one group per step only")
    n_groups = k // GROUP
    split, gps = launch.split_groups(n_groups, t.split_k)
    xk = kpairs_order(x2, GROUP, BITS)
    xs = group_sums(xk, GROUP) if t.xsum == "input" else xk  # unused placeholder unless XS_INPUT
    consts = dict(ROWS=rows, N=n, N_GROUPS=n_groups, GROUPS_PER_SPLIT=gps, BLOCK_M=t.block_m,
                  BLOCK_N=t.block_n, XS_INPUT=t.xsum == "input")
    grid = (-(-n // t.block_n), -(-rows // t.block_m), split)
    out_dtype = x2.dtype if split == 1 else jnp.float32  # as the Pallas launch
    return (xk, xs, qw.weight, qw.scales, qw.biases), consts, grid, t, out_dtype


@functools.partial(jax.jit, static_argnames=("enable_fp_fusion", "compute_capability"))
def jt_gemv_parts(x2: jax.Array, qw: QuantizedWeight, *, enable_fp_fusion: bool = False,
                  compute_capability: int | None = None) -> jax.Array:
    """Split-K partials `[split, rows, N]` via jax_triton. enable_fp_fusion=False (jax_triton's default
    is True): mul + add stay FMUL + FADD, as the Pallas kernel's; compute_capability: e.g. 90 to lower
    without asking a device."""
    from jax_triton import triton_call  # imported here: the package refuses to import on CPU-only jaxlib
    ops, consts, grid, t, out_dtype = _plan(x2, qw)
    return triton_call(
        *ops, kernel=gemv_kernel, grid=grid, name=f"jt_q4gemv_n{t.block_n}",
        out_shape=jax.ShapeDtypeStruct((grid[2], x2.shape[0], qw.shape[0]), out_dtype),
        num_warps=t.num_warps, num_stages=t.num_stages, enable_fp_fusion=enable_fp_fusion,
        compute_capability=compute_capability, INTERPRET=False, **consts)


def jt_gemv(x2: jax.Array, qw: QuantizedWeight, **kw) -> jax.Array:
    """`x2 @ dequantize(qw).T` `[rows, N]` in x's dtype: the partials added in split order."""
    return launch.fold_splits(jt_gemv_parts(x2, qw, **kw)).astype(x2.dtype)


def _interpreter_index_shim():
    """Triton 3.6's interpreter turns a loop bound into a Python int with int() of a 1-element 1-d
    array, which NumPy >= 2.4 refuses (`range(g0, g1)` with g0 from program_id fails): use .item()."""
    from triton.runtime import interpreter as ti
    orig = ti._patch_lang_tensor
    if getattr(orig, "jt_shim", False):
        return

    def patched(tensor, scope):
        orig(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))
    patched.jt_shim = True
    ti._patch_lang_tensor = patched


def run_torch(x2, qw: QuantizedWeight, *, interpret: bool | None = None, device: str = "cpu") -> np.ndarray:
    """The kernel launched on torch tensors (Triton's own launcher); float32 numpy partials. interpret
    (default: TRITON_INTERPRET=1 is set) selects the integer-op code conversion."""
    import torch
    interpret = os.environ.get("TRITON_INTERPRET") == "1" if interpret is None else interpret
    ops, consts, grid, t, out_dtype = _plan(jnp.asarray(x2), qw)
    if os.environ.get("TRITON_INTERPRET") == "1":
        _interpreter_index_shim()

    def to_torch(a):
        a = np.asarray(a)
        if a.dtype == jnp.bfloat16:
            return torch.from_numpy(a.view(np.uint16).copy()).view(torch.bfloat16).to(device)
        return torch.from_numpy(a.copy()).to(device)

    args = [to_torch(a) for a in ops]
    out = torch.empty((grid[2], x2.shape[0], qw.shape[0]),
                      dtype=torch.bfloat16 if out_dtype == jnp.bfloat16 else torch.float32, device=device)
    gemv_kernel[grid](*args, out, INTERPRET=interpret, num_warps=t.num_warps, num_stages=t.num_stages, **consts)
    return out.float().cpu().numpy()


def _ulps(a, b, shift: int) -> int:
    """Largest distance in units in the last place (shift 16: of bf16 values held as float32)."""
    def ordered(v):
        i = np.asarray(v, np.float32).view(np.int32).astype(np.int64)
        return np.where(i < 0, -(i & 0x7FFFFFFF), i)
    return int(np.abs(ordered(a) - ordered(b)).max()) >> shift


def check(n: int, k: int, rows_list=(1, 5, 16), seed: int = 0) -> None:
    """CPU check of run_torch (under TRITON_INTERPRET=1) against the Pallas kernel in interpret mode
    (partials) and float64 numpy of the exact dequantization (folded)."""
    from pallas_kernels.quant import quantize, unpack
    kw, kx = jax.random.split(jax.random.key(seed))
    qw = quantize(jax.random.normal(kw, (n, k), jnp.float32).astype(jnp.bfloat16))
    words, sc, bi = (np.asarray(a) for a in qw.to_mlx())
    w64 = (np.asarray(unpack(words, BITS), np.float64).reshape(n, -1, GROUP) * np.asarray(sc, np.float64)[..., None]
           + np.asarray(bi, np.float64)[..., None]).reshape(n, k)
    for rows in rows_list:
        x2 = jax.random.normal(jax.random.fold_in(kx, rows), (rows, k), jnp.float32).astype(jnp.bfloat16)
        ref = np.asarray(launch.gemv(x2, (qw,), launch.gemv_tiling(qw.shape, GROUP), interpret=True, fold=False)[0],
                         np.float32)
        got = run_torch(x2, qw)
        exact = np.asarray(x2, np.float64) @ w64.T
        bf16_ulps = f" ({_ulps(got, ref, 16)} bf16 ulp)" if got.shape[0] == 1 else ""  # split 1: bf16 out
        err = np.abs(got.astype(np.float64).sum(0) - exact)
        print(f"N={n} K={k} rows={rows:2d} split={got.shape[0]}: partials vs pallas-interpret max|d|={np.abs(got - ref).max():.3g} "
              f"rel={np.abs(got - ref).max() / np.abs(ref).max():.3g}{bf16_ulps}, {(got != ref).sum()}/{got.size} not bitwise; "
              f"folded vs float64 max|d|={err.max():.3g} rel={err.max() / np.abs(exact).max():.3g}")


if __name__ == "__main__":
    for n, k, seed in ((128, 512, 0), (192, 1024, 1), (200, 256, 2)):  # split 2, split 4, split 1 + ragged N
        check(n, k, seed=seed)
