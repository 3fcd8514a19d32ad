"""From packed words to dot operands, shared by the kernels: the interleave of a word's codes into
input order (kernel.py, dq_kernel.py), and two element-wise instructions the Triton that XLA bundles
does not emit from jnp code, as inline PTX (plain jnp in interpret mode): a fused multiply-add, and
a code put at the top of a float32 mantissa with one shift and one LOP3 (gemv.py, dq_kernel.py);
and the loads of a step's words and of its scales and biases from either stored layout."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from .quant import TILE_ROWS

ONE_F32 = 0x3F800000  # the bit pattern of 1.0f


def load_sb_tiles(s_ref, b_ref, n0, block_n, g, gps, col_ok, g_ok, sb_kn: bool):
    """Scales and biases of columns [n0, n0 + block_n) and groups [g, g + gps) as `[block_n, gps]`
    each (masked: zeros), from MLX's `[N, K/g]` or, for "kn" weights (`sb_kn`), `[K/g, N]`, where
    each group's block_n values are one contiguous run (docs/kernels.md, log entry 10)."""
    if sb_kn:
        mask = g_ok[:, None] & col_ok[None, :]
        return tuple(pltriton.load(ref.at[pl.ds(g, gps), pl.ds(n0, block_n)], mask=mask, other=0).T
                     for ref in (s_ref, b_ref))
    mask = col_ok[:, None] & g_ok[None, :]
    return tuple(pltriton.load(ref.at[pl.ds(n0, block_n), pl.ds(g, gps)], mask=mask, other=0)
                 for ref in (s_ref, b_ref))


def load_words(w_ref, n0, block_n, g, gps, col_ok, g_ok, w_tiles: bool):
    """Packed words of columns [n0, n0 + block_n) and groups [g, g + gps) as `[block_n, gps, *words]`
    (masked: zeros), from `[N, groups, *words]` or, for "tiles" weights (`w_tiles`), `[N/64, groups,
    64, *words]`, where the step's words are gps-long runs of contiguous 64-row tiles
    (QuantizedWeight); `words` is the words per group, or gemv.py's [quads, 4] of them. block_n is a
    multiple of 64 (whole tiles) or a divisor of it (rows of one tile: check_tile_block)."""
    words = tuple(w_ref.shape[3 if w_tiles else 2:])
    ones, rest = (1,) * len(words), (slice(None),) * len(words)
    if not w_tiles:
        shape = (block_n, gps) + words
        mask = jnp.broadcast_to(col_ok.reshape(block_n, 1, *ones) & g_ok.reshape(1, gps, *ones), shape)
        return pltriton.load(w_ref.at[(pl.ds(n0, block_n), pl.ds(g, gps)) + rest], mask=mask, other=0)
    nt, rows = tile_span(block_n), min(block_n, TILE_ROWS)
    shape = (nt, gps, rows) + words
    mask = jnp.broadcast_to(col_ok.reshape(nt, 1, rows, *ones) & g_ok.reshape(1, gps, 1, *ones), shape)
    # (a block narrower than a tile starts n0 % 64 rows into tile n0 // 64)
    at = (pl.ds(n0 // TILE_ROWS, nt), pl.ds(g, gps), pl.ds(n0 % TILE_ROWS, rows) if rows < TILE_ROWS else slice(None))
    w = pltriton.load(w_ref.at[at + rest], mask=mask, other=0)
    if gps > 1:  # [tile, group, row, ...] -> [tile, row, group, ...]
        w = jnp.swapaxes(w, 1, 2)
    return w.reshape((block_n, gps) + words)


def tile_span(block_n: int) -> int:
    """How many 64-row tiles a block of block_n weight rows reads (one for a block inside a tile)."""
    return max(1, block_n // TILE_ROWS)


def check_tile_block(block_n: int) -> None:
    """A launch on "tiles" weights reads whole 64-row tiles or rows of one: block_n must be a
    multiple of 64 or divide it."""
    if block_n % TILE_ROWS and TILE_ROWS % block_n:
        raise ValueError(f"'tiles' weights need a block_n that is a multiple of {TILE_ROWS} or divides it, "
                         f"got {block_n}")


def fma(a, b, c, *, interpret: bool):
    """a * b + c in one rounding, float32. The device's Triton (XLA's) leaves `a * b + c` as FMUL +
    FADD (Nsight Compute: 0 fused FP32 instructions, docs/kernels.md log entry 6)."""
    if interpret:
        return a * b + c
    return pltriton.elementwise_inline_asm(
        "fma.rn.f32 $0, $1, $2, $3;", args=[a, b, c], constraints="=f,f,f,f", pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(a.shape, jnp.float32)])[0]


def code_as_float(w, shift: int, bits: int, *, interpret: bool):
    """float32 `1 + q / 2**bits` for the code q that `w << shift` (a right shift if negative) moves to
    mantissa bits [23 - bits, 23): the code ORed under the exponent of 1.0, so no int->float convert.
    On the GPU one shift and one LOP3 ((a & b) | c; from jnp, ptxas emits AND then OR)."""
    code_mask = (2**bits - 1) << (23 - bits)
    if not interpret:
        op = f"shl.b32 t, $1, {shift};" if shift >= 0 else f"shr.u32 t, $1, {-shift};"
        asm = f"{{ .reg .b32 t; {op} lop3.b32 $0, t, {code_mask:#x}, {ONE_F32:#x}, 0xea; }}"
        return pltriton.elementwise_inline_asm(
            asm, args=[w], constraints="=r,r", pack=1,
            result_shape_dtypes=[jax.ShapeDtypeStruct(w.shape, jnp.float32)])[0]
    q = (w << shift) if shift >= 0 else (w >> -shift)
    return jax.lax.bitcast_convert_type((q & jnp.uint32(code_mask)) | jnp.uint32(ONE_F32), jnp.float32)


def stack_halves(parts: list) -> jax.Array:
    """Pairwise stacks along new last axes only (what Pallas lowers to Triton's `join`, which keeps
    the new axis inside the thread): each level pairs parts j and j + half, so the new axes come out
    highest index bit first and read j itself in row-major order. len(parts) must be a power of two."""
    while len(parts) > 1:
        half = len(parts) // 2
        parts = [jnp.stack([parts[j], parts[j + half]], axis=-1) for j in range(half)]
    return parts[0]


def interleave(codes: list) -> jax.Array:
    """`codes[j]` `[..., words]` (code j of each word) -> `[..., words, len(codes)]` with code j of word
    w at `[..., w, j]` (stack_halves)."""
    return stack_halves(codes).reshape(*codes[0].shape, -1)


def code_pairs(w, bits: int, pattern: int, dtype, *, interpret: bool) -> list:
    """For a magic-pattern conversion (kernel.magic_offset: `pattern | code` reads as offset + code in
    the 16-bit dtype): `pairs[j]` `[..., words, 2]` holds codes j and j + half of each word as that
    dtype. Code j + half sits exactly 16 bits above code j, so one shift and one LOP3 make both halves
    of a 32-bit register (the usual bf16x2 unpack), where per-code extraction spends two each."""
    epw = 32 // bits
    half = epw // 2
    mask = (2**bits - 1) * 0x10001
    both = pattern * 0x10001
    pairs = []
    for j in range(half):
        if interpret:
            v = ((w >> jnp.uint32(bits * j)) & jnp.uint32(mask)) | jnp.uint32(both)
            lo, hi = ((v >> jnp.uint32(sh)) & jnp.uint32(0xFFFF) for sh in (0, 16))
            lo, hi = (jax.lax.bitcast_convert_type(c.astype(jnp.uint16), dtype) for c in (lo, hi))
        else:
            # One asm per half (Pallas lowers a multi-result inline asm wrongly in JAX 0.10): both
            # compute the same register, which ptxas computes once, and read one half of it.
            op = f"shr.u32 t, $1, {bits * j};" if j else "mov.b32 t, $1;"
            lo, hi = (pltriton.elementwise_inline_asm(
                f"{{ .reg .b32 t; .reg .b16 d; {op} lop3.b32 t, t, {mask:#x}, {both:#x}, 0xea; mov.b32 {halves}, t; }}",
                args=[w], constraints="=h,r", pack=1,
                result_shape_dtypes=[jax.ShapeDtypeStruct(w.shape, dtype)])[0] for halves in ("{$0, d}", "{d, $0}"))
        pairs.append(jnp.stack([lo, hi], axis=-1))
    return pairs


def pairs_in_k_order(pairs: list) -> jax.Array:
    """`pairs[j]` `[n, words, 2]` (code_pairs) -> `[n, len(pairs) * words * 2]` ordered [j, word, half].
    Stacks on new last axes (joins), then one transpose moves the pair index ahead of the words: the
    two halves of every 32-bit register stay neighbours along K, which is how the MMA operand holds
    bf16/f16 pairs, so Triton needs no shuffle through shared memory (pip Triton's sm_90 build)."""
    n = pairs[0].shape[0]
    q = stack_halves(pairs)  # [n, words, half, pair index bits...]
    j_axes = tuple(range(3, q.ndim))
    return jnp.transpose(q, (0, *j_axes, 1, 2)).reshape(n, -1)

