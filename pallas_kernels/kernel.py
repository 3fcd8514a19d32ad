"""The Pallas kernel behind all three paths: dequantize one group-wide weight tile, multiply on the
tensor cores, apply the group's scale and bias to the small product.

Per group of g inputs, `x . (s*q + b) = s * (x . q) + b * sum(x)`, so the kernel never scales
individual weights: codes q (0..15) convert exactly to bf16, one `dot` per group gives `x . q` for
a [block_m, block_n] tile, and scale/bias touch only that tile. The qmv and multirow paths are this
kernel with block_m = 16 (the smallest MMA tile) and the same weight tiling, so row i's arithmetic
is identical whether it is computed alone or with up to 15 others: greedy speculative decoding
depends on that. Rows beyond the real ones are masked loads (no memory traffic) and zeros.
The qmm path runs with a taller block_m, by default with the other body (dq_kernel.py), which
dequantizes each weight before the dot; `launch` picks the body from `Tiling.dequant`.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from .codes import check_tile_block, code_pairs, interleave, load_words, pairs_in_k_order, stack_halves, tile_span
from .config import DEQUANTS, UNPACKS, XSUMS
from .dq_kernel import dq_body
from .quant import QuantizedWeight

MMA_ROWS = 16  # Triton's `dot` needs at least 16 rows; GEMV launches use exactly this many.


@dataclasses.dataclass(frozen=True)
class Tiling:
    """One launch shape. block_m/block_n: output tile; groups_per_step: quantization groups loaded per
    loop iteration (bytes in flight); split_k: programs along K (partial sums added outside);
    w_left: put the dequantized weight tile on the left of the dot (output tile [block_n, block_m]).
    convert: how codes become dot operands: "bits" ORs each code into the mantissa of a float whose
    exponent makes the value `offset + code` (no int->float instruction; the offset goes into the
    bias), "cvt" converts with int->float instructions (always used for float32 dots).
    unpack: how a tile of packed words becomes the [block_n, group_size] code tile. "join": each
    thread that holds a word extracts all its codes (one shift and mask per code, in the word's own
    layout) and pairwise stacks (Triton `join`, which keeps the new axis in the thread) interleave
    them into input order; "broadcast": broadcast the words to [block_n, words, codes] and shift,
    where Triton spreads the codes of one word over 8 threads, each re-reading the word from shared
    memory and storing one 16-bit code back (a shared-memory load and store per weight: log entry 7).
    "pairs": as "join", with codes j and j + half of a word made together in one 32-bit register
    (shift + LOP3 per two codes; bf16/f16 magic conversion only, else "join"). "kpairs": the pairs
    stay whole, ordered along K as [pair j, word, half] (codes.pairs_in_k_order) with x reordered to
    match by the wrapper; pip Triton then reads them as the MMA operand without the shared-memory
    round trip and barrier of the other unpacks (29.1 against 34.9 us for "pairs": log entry 8).
    dequant: "codes" multiplies the exact codes and scales each group's small product (this file);
    "weights" dequantizes every weight to s*q + b first and accumulates one dot per loop step
    (dq_kernel.py; join unpack only).
    xsum: how the codes body gets each group's sum(x) for the bias term. "reduce" sums the x tile
    (converts, adds, shuffles and a shared-memory exchange across warps: about 30 instructions and a
    barrier per loop step in pip Triton's SASS); "input" has the wrapper sum each group of x once
    (`group_sums`, [K/g, rows] float32) and every program load its group's block_m sums: 21.2 ->
    20.0 us kernel alone at best (one row, 15360x3840; slower on 3840x15360), and the whole 12B
    forward took 6.57 ms against 6.41 (the sums are a kernel per launch; log entry 11). (A ones-tile dot, whose rows come out as sum(x) in the accumulator's
    layout, lost: 22.0 us.)
    (A prefetch of the next group's scales and biases lost on the H200 twice, log entries 3 and 7,
    and was removed in session 8; so was one of its words, scales and biases together, carried
    through the loop: 29-39 us against 19-21, session 12, log entry 13. Word tiles are a stored
    layout, QuantizedWeight.w_layout, read by both bodies: 29.2 -> 27.3 us alone on MLX-layout
    scales in log entry 10, 20.5 -> 19.4 on "kn" in entry 13.)"""

    block_m: int = MMA_ROWS
    block_n: int = 128
    groups_per_step: int = 2
    split_k: int = 1
    w_left: bool = True
    num_warps: int = 4
    num_stages: int = 3
    convert: str = "bits"
    unpack: str = "pairs"
    dequant: str = "codes"
    xsum: str = "reduce"

    def __post_init__(self):
        if self.xsum not in XSUMS:
            raise ValueError(f"Tiling.xsum={self.xsum!r}: expected one of {XSUMS}")
        if self.unpack not in UNPACKS:
            raise ValueError(f"Tiling.unpack={self.unpack!r}: expected one of {UNPACKS}")
        if self.dequant not in DEQUANTS:
            raise ValueError(f"Tiling.dequant={self.dequant!r}: expected one of {DEQUANTS}")


def magic_offset(dot_dtype, bits: int):
    """(exponent bit pattern, value offset) such that `pattern | code` read as dot_dtype equals
    `offset + code` exactly, or None where the codes do not fit the mantissa (then convert)."""
    dot_dtype = jnp.dtype(dot_dtype)
    if dot_dtype == jnp.bfloat16 and bits <= 7:   # [128, 256) has step 1 in bf16 (7 mantissa bits)
        return 0x4300, 128.0
    if dot_dtype == jnp.float16 and bits <= 10:   # [1024, 2048) has step 1 in f16
        return 0x6400, 1024.0
    return None


def uses_kpairs(tiling: Tiling, dot_dtype, bits: int) -> bool:
    """Whether the launch runs the "kpairs" unpack: only the codes body has it, and it needs the magic
    conversion and the weight on the left of the dot (else the codes body falls back to "pairs")."""
    return (tiling.unpack == "kpairs" and tiling.dequant == "codes" and tiling.w_left
            and tiling.convert == "bits" and magic_offset(dot_dtype, bits) is not None)


def kpairs_order(x2: jax.Array, group_size: int, bits: int) -> jax.Array:
    """x's inputs reordered within each group from [word, half, j] to [j, word, half], the order of
    codes.pairs_in_k_order: code pair j (codes j and j + half of every word) is one run of 2*words."""
    wpg = group_size * bits // 32
    rows, k = x2.shape
    return x2.reshape(rows, k // group_size, wpg, 2, -1).transpose(0, 1, 4, 2, 3).reshape(rows, k)


def group_sums(x2: jax.Array, group_size: int) -> jax.Array:
    """`[K/g, rows]` float32 sums of each group of x's inputs, by halving adds in a fixed order
    (elementwise, so a row's sums never depend on the other rows; XLA's reduce may choose its
    order by shape: see fold_splits)."""
    if group_size & (group_size - 1):
        raise ValueError(f"group_sums halves groups: group_size={group_size} must be a power of two")
    rows, k = x2.shape
    v = x2.astype(jnp.float32).reshape(rows, k // group_size, group_size)
    while v.shape[-1] > 1:
        half = v.shape[-1] // 2
        v = v[..., :half] + v[..., half:]
    return v[..., 0].T


def _kernel(x_ref, w_ref, s_ref, b_ref, o_ref, *, rows, n, bits, group_size, tiling, n_groups,
            groups_per_split, dot_dtype, precision, interpret, pids, sb_kn, w_tiles, xs_ref=None):
    t = tiling
    epw = 32 // bits            # codes per uint32 word
    wpg = group_size // epw     # words per group
    pid_n, pid_m, pid_s = pids
    m0 = pid_m * t.block_m
    n0 = pid_n * t.block_n
    row_ok = (m0 + jnp.arange(t.block_m)) < rows
    col_ok = (n0 + jnp.arange(t.block_n)) < n
    x_mask = jnp.broadcast_to(row_ok[:, None], (t.block_m, group_size))
    w_mask = jnp.broadcast_to(col_ok[:, None], (t.block_n, wpg))
    one_ok = jnp.ones((1,), jnp.bool_)
    shifts = jnp.arange(epw, dtype=jnp.uint32) * jnp.uint32(bits)
    code_mask = jnp.uint32(2**bits - 1)
    magic = magic_offset(dot_dtype, bits) if t.convert == "bits" else None
    kpairs = uses_kpairs(t, dot_dtype, bits)

    def load_sb(g):  # the scales and biases of group g, [block_n], as float32 (both loads issued
        # before either convert: the order the measured kernel had)
        # ("kn" weights: the block_n values are one contiguous run; MLX's "nk": block_n loads 2*K/g
        # bytes apart, 2.3x the global-load sectors of the whole kernel, log entry 10)
        at = (lambda ref: ref.at[g, pl.ds(n0, t.block_n)]) if sb_kn else (lambda ref: ref.at[pl.ds(n0, t.block_n), g])
        s, b = (pltriton.load(at(ref), mask=col_ok, other=0) for ref in (s_ref, b_ref))
        return s.astype(jnp.float32), b.astype(jnp.float32)

    def as_operand(c):  # codes -> dot operand values, elementwise (any layout)
        if magic is None:
            return c.astype(jnp.int32).astype(dot_dtype)  # exact: small ints
        # (pattern | code) is offset + code as a float: one OR per weight instead of a slow
        # int->float convert. x . (offset + q) = x . q + offset * sum(x), so the bias absorbs it.
        return jax.lax.bitcast_convert_type((c | jnp.uint32(magic[0])).astype(jnp.uint16), dot_dtype)

    def tile_product(w, x):  # the whole [block_n, group_size] code tile, one dot
        if kpairs:  # x comes in the same order (the wrapper's kpairs_order)
            q = pairs_in_k_order(code_pairs(w, bits, magic[0], dot_dtype, interpret=interpret))
        elif t.unpack == "pairs" and magic is not None:
            # [block_n, words, half, pair index bits]: code h * half + j of each word, input order
            q = stack_halves(code_pairs(w, bits, magic[0], dot_dtype, interpret=interpret))
        elif t.unpack in ("join", "pairs"):  # converted before the joins: they move 16-bit values
            q = interleave([as_operand((w >> jnp.uint32(bits * j)) & code_mask) for j in range(epw)])
        else:
            q = as_operand((w[:, :, None] >> shifts[None, None, :]) & code_mask)
        q = q.reshape(t.block_n, group_size)
        xd = x.astype(dot_dtype)
        if t.w_left:
            return pltriton.dot(q, xd, trans_b=True, precision=precision)
        return pltriton.dot(xd, q, trans_b=True, precision=precision)

    def group_math(acc, g, s, b):  # one group: load its tiles, dot, apply scale and bias
        x = pltriton.load(x_ref.at[pl.ds(m0, t.block_m), pl.ds(g * group_size, group_size)],
                          mask=x_mask, other=0)
        if w_tiles:
            w = load_words(w_ref, n0, t.block_n, g, 1, col_ok, one_ok, True).reshape(t.block_n, wpg)
        else:  # MLX's [N, K * bits / 32]
            w = pltriton.load(w_ref.at[pl.ds(n0, t.block_n), pl.ds(g * wpg, wpg)], mask=w_mask, other=0)
        d = tile_product(w, x)
        if magic is not None:
            b = b - magic[1] * s
        if xs_ref is not None:  # the wrapper's group_sums
            xsum = pltriton.load(xs_ref.at[g, pl.ds(m0, t.block_m)], mask=row_ok, other=0)
        else:
            xsum = jnp.sum(x.astype(jnp.float32), axis=1)
        if t.w_left:  # acc is [block_n, block_m]
            return acc + d * s[:, None] + b[:, None] * xsum[None, :]
        return acc + d * s[None, :] + xsum[:, None] * b[None, :]

    def one_group(g, acc):
        return group_math(acc, g, *load_sb(g))

    def step(i, acc):  # groups_per_step groups per iteration: more loads in flight
        for j in range(t.groups_per_step):
            acc = one_group(g0 + i * t.groups_per_step + j, acc)
        return acc

    g0 = pid_s * groups_per_split
    g1 = jnp.minimum(g0 + groups_per_split, n_groups)
    shape = (t.block_n, t.block_m) if t.w_left else (t.block_m, t.block_n)
    acc = jnp.zeros(shape, jnp.float32)
    full_steps = (g1 - g0) // t.groups_per_step
    acc = jax.lax.fori_loop(0, full_steps, step, acc)
    acc = jax.lax.fori_loop(g0 + full_steps * t.groups_per_step, g1, one_group, acc)
    if t.w_left:
        acc = acc.T
    pltriton.store(o_ref.at[pid_s, pl.ds(m0, t.block_m), pl.ds(n0, t.block_n)], acc.astype(o_ref.dtype),
                   mask=row_ok[:, None] & col_ok[None, :])


def _dot_dtype(x_dtype):
    # bf16/f16 activations multiply as they are (codes are exact in either); float32 stays float32
    # with full-precision dots, for tests and f32 models.
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
    """Sum split-K partials `[split, rows, N]` over the split in a fixed order. Elementwise adds keep
    every row's sum independent of the row count; XLA's reduce may pick its order by shape (it did
    for the fma GEMV's group sums on CPU: docs/kernels.md, log entry 6)."""
    total = parts[0]
    for part in range(1, parts.shape[0]):
        total = total + parts[part]
    return total


def _through_weights(x_ref, *refs, body, ns, blocks, **common):
    """The grid's N axis runs through the weights one after another, each over its own
    ceil(N_i / block_n) blocks; a program computes one tile of one weight with `body`. The program
    ids are read here, outside the branches (interpret mode cannot lower them inside one)."""
    count = len(ns)
    if common["tiling"].xsum == "input" and body is _kernel:
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


def same_format(qws) -> bool:
    """Whether QuantizedWeights can share a launch: the same bits, group size, K, scale dtype and layouts."""
    def fmt(q):
        return q.bits, q.group_size, q.shape[1], q.scales.dtype, q.sb_layout, q.w_layout
    return all(fmt(q) == fmt(qws[0]) for q in qws)


def launch(x2: jax.Array, qw: QuantizedWeight, tiling: Tiling, *, interpret: bool) -> jax.Array:
    """`x2 [rows, K] @ dequantize(qw).T` -> `[rows, N]` in x2's dtype (float32 accumulation)."""
    return launch_many(x2, (qw,), tiling, interpret=interpret)[0]


def launch_many(x2: jax.Array, qws, tiling: Tiling, *, interpret: bool) -> tuple[jax.Array, ...]:
    """`tuple(launch(x2, qw, tiling) for qw in qws)` in one launch, bitwise the same (every program
    runs the same body on its own tile): the projections that read one x (q/k/v, gate/up) cost one
    launch and one wave tail instead of several. The weights must share a format (`same_format`)."""
    if not same_format(qws):
        raise ValueError("launch_many: the weights differ in bits, group size, K, scale dtype or layouts: "
                         f"{[(q.bits, q.group_size, q.shape, q.scales.dtype, q.sb_layout, q.w_layout) for q in qws]}")
    rows, k = x2.shape
    first = qws[0]
    w_tiles = first.w_layout == "tiles"
    if w_tiles:
        check_tile_block(tiling.block_n)
    n_groups = k // first.group_size
    split, groups_per_split = split_groups(n_groups, tiling.split_k)
    dot_dtype = _dot_dtype(x2.dtype)
    precision = None if dot_dtype != jnp.float32 else jax.lax.Precision.HIGHEST
    ns = tuple(qw.shape[0] for qw in qws)
    arrays = [(qw.weight, qw.scales, qw.biases) for qw in qws]
    sb_kn = first.sb_layout == "kn"
    n_axis, g_axis = first.sb_axes
    if interpret:
        # Interpret mode clamps out-of-range slices instead of masking them: pad to whole tiles.
        x2 = pad_to(x2, 0, tiling.block_m)
        w_rows = tile_span(tiling.block_n) if w_tiles else tiling.block_n  # weight rows or 64-row tiles
        arrays = [(pad_to(w, 0, w_rows), pad_to(s, n_axis, tiling.block_n), pad_to(b, n_axis, tiling.block_n))
                  for w, s, b in arrays]
    out_rows = x2.shape[0] if interpret else rows
    out_ns = [s.shape[n_axis] for _, s, _ in arrays] if interpret else ns
    out_dtype = x2.dtype if split == 1 else jnp.float32
    blocks = tuple(pl.cdiv(n, tiling.block_n) for n in ns)
    grid = (sum(blocks), pl.cdiv(rows, tiling.block_m), split)
    if uses_kpairs(tiling, dot_dtype, first.bits):
        x2 = kpairs_order(x2, first.group_size, first.bits)
    common = dict(rows=rows, bits=first.bits, group_size=first.group_size, tiling=tiling, n_groups=n_groups,
                  groups_per_split=groups_per_split, dot_dtype=dot_dtype, precision=precision,
                  interpret=interpret, sb_kn=sb_kn, w_tiles=w_tiles)
    if tiling.dequant == "weights":
        body = dq_body
        if not w_tiles:  # [N, groups, words per group] (tiles already have a group axis)
            arrays = [(w.reshape(w.shape[0], n_groups, -1), s, b) for w, s, b in arrays]
        if interpret:  # a last step may run past the last group: poison there, hidden by the masks
            extra = tiling.groups_per_step
            arrays = [(pad_by(w, 1, extra, 0xFFFFFFFF), pad_by(s, g_axis, extra, 1.0), pad_by(b, g_axis, extra, 1.0))
                      for w, s, b in arrays]
            x2 = pad_by(x2, 1, extra * first.group_size, 1.0)
    else:
        body = _kernel
        if tiling.xsum == "input":  # [K/g, rows (padded)] sums, read by _through_weights
            arrays = [(group_sums(x2, first.group_size),)] + arrays
    kernel = functools.partial(_through_weights, body=body, ns=ns, blocks=blocks, **common)
    outs = pl.pallas_call(
        kernel,
        out_shape=tuple(jax.ShapeDtypeStruct((split, out_rows, on), out_dtype) for on in out_ns),
        grid=grid,
        interpret=interpret,
        compiler_params=None if interpret else pltriton.CompilerParams(
            num_warps=tiling.num_warps, num_stages=tiling.num_stages),
        name=f"q{first.bits}mm{'dq' if tiling.dequant == 'weights' else ''}_m{tiling.block_m}_n{tiling.block_n}"
             + (f"_x{len(qws)}" if len(qws) > 1 else ""),
    )(x2, *(a for wsb in arrays for a in wsb))
    return tuple(fold_splits(o[:, :rows, :n]).astype(x2.dtype) for o, n in zip(outs, ns))
