"""From stored words to dot operands, shared by the two kernel bodies (gemv.py, qmm.py): the loads of
a step's words, scales and biases, the conversion of 4-bit codes to 16-bit floats without an
int->float instruction, and two PTX instructions the Triton that XLA bundles does not emit from jnp
code (plain jnp in interpret mode)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from .quant import TILE_ROWS

ONE_F32 = 0x3F800000  # the bit pattern of 1.0f


def load_sb(s_ref, b_ref, n0, block_n, g, gps, col_ok, g_ok):
    """Scales and biases of rows [n0, n0 + block_n) and groups [g, g + gps) as float32 `[block_n, gps]`
    each (masked: zeros), from the stored `[K/g, N]`."""
    mask = g_ok[:, None] & col_ok[None, :]
    return tuple(pltriton.load(ref.at[pl.ds(g, gps), pl.ds(n0, block_n)], mask=mask, other=0).T.astype(jnp.float32)
                 for ref in (s_ref, b_ref))


def load_words(w_ref, n0, block_n, g, gps, col_ok, g_ok):
    """Packed words of rows [n0, n0 + block_n) and groups [g, g + gps) as `[block_n, gps, words per
    group]` (masked: zeros) from the stored `[N/64, groups, 64, words]`: per group, block_n / 64
    contiguous runs. block_n is a multiple of 64."""
    nt, words = block_n // TILE_ROWS, w_ref.shape[3]
    shape = (nt, gps, TILE_ROWS, words)
    mask = jnp.broadcast_to(col_ok.reshape(nt, 1, TILE_ROWS, 1) & g_ok.reshape(1, gps, 1, 1), shape)
    w = pltriton.load(w_ref.at[pl.ds(n0 // TILE_ROWS, nt), pl.ds(g, gps)], mask=mask, other=0)
    if gps > 1:  # [tile, group, row, word] -> [tile, row, group, word]
        w = jnp.swapaxes(w, 1, 2)
    return w.reshape(block_n, gps, words)


def magic_offset(dot_dtype, bits: int):
    """(exponent bit pattern, value offset) such that `pattern | code` read as dot_dtype equals
    `offset + code` exactly, or None where the codes do not fit the mantissa (then convert)."""
    dot_dtype = jnp.dtype(dot_dtype)
    if dot_dtype == jnp.bfloat16 and bits <= 7:   # [128, 256) has step 1 in bf16 (7 mantissa bits)
        return 0x4300, 128.0
    if dot_dtype == jnp.float16 and bits <= 10:   # [1024, 2048) has step 1 in f16
        return 0x6400, 1024.0
    return None


def fma(a, b, c, *, interpret: bool):
    """a * b + c in one rounding, float32 (Triton leaves `a * b + c` as FMUL + FADD)."""
    if interpret:
        return a * b + c
    return pltriton.elementwise_inline_asm(
        "fma.rn.f32 $0, $1, $2, $3;", args=[a, b, c], constraints="=f,f,f,f", pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(a.shape, jnp.float32)])[0]


def code_as_float(w, shift: int, bits: int, *, interpret: bool):
    """float32 `1 + q / 2**bits` for the code q that `w << shift` (a right shift if negative) moves to
    mantissa bits [23 - bits, 23): the code ORed under the exponent of 1.0, so no int->float convert.
    On the GPU one shift and one LOP3 ((a & b) | c)."""
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
    w at `[..., w, j]`: input order (stack_halves)."""
    return stack_halves(codes).reshape(*codes[0].shape, -1)


def code_pairs(w, bits: int, pattern: int, dtype, *, interpret: bool) -> list:
    """For the magic-pattern conversion (`pattern | code` reads as offset + code in the 16-bit dtype):
    `pairs[j]` `[..., words, 2]` holds codes j and j + half of each word as that dtype. Code j + half
    sits exactly 16 bits above code j, so one shift and one LOP3 make both halves of a 32-bit register."""
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
    The two halves of every 32-bit register stay neighbours along K, which is how the MMA operand
    holds 16-bit pairs, so Triton moves the tile from registers to the MMA without shared memory."""
    n = pairs[0].shape[0]
    q = stack_halves(pairs)  # [n, words, half, pair index bits...]
    j_axes = tuple(range(3, q.ndim))
    return jnp.transpose(q, (0, *j_axes, 1, 2)).reshape(n, -1)
