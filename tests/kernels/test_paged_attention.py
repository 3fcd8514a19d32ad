"""paged_attention (decode attention through a block table) against a float64 reference built from
the rows' blocks, bitwise against today's path (the row's view gathered, then decode_attention), and
beside its XLA reference; a row's result bitwise independent of the other rows (their lengths, their
blocks, how many there are) and of how many queries share its call; bad input; the Triton lowering
at the 12B's global-layer shapes. Random inputs: ragged lengths (one row empty), each row's blocks
scattered over one shared pool of stale values, queries past a row's length. On CPU the kernel runs
in interpret mode; the gpu-marked tests run it compiled at 12B shapes."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.kernels.decode_attention import EMPTY, decode_attention
from jaxspec.kernels.paged_attention import paged_attention, paged_attention_reference, paged_view
from support.gpu_lowering import TRITON_CALL, lower_for_cuda
from support.seeds import seeded_rng

INTERPRET = not any(d.platform == "gpu" for d in jax.devices())


def _inputs(rng, *, b, t, hq, hkv, d, page, blocks, pool, dtype, hides=False, stack=None, lengths=None):
    """(q, k_pool, v_pool, table, lengths, q_pos, k_pos) with random values everywhere (the pool's
    unowned blocks are stale values, not zeros). Each row owns just the blocks its length needs,
    disjoint and scattered over the pool; a table entry past them names no block (`pool`) or, on
    odd rows, another row's block (never read: past the length). Row 0's last query is at its
    length - 1, the other rows' 1 to 3 positions past it (keys past a length stay hidden).
    `hides`: k_pos with a random fifth of each row's slots EMPTY."""
    c = blocks * page
    if lengths is None:
        lengths = rng.integers(t, c + 1, b)
        lengths[-1] = 0  # an empty row: its queries see nothing
    owned = [-(-int(n) // page) for n in lengths]
    perm = rng.permutation(pool)[:sum(owned)]
    table = np.full((b, blocks), pool, np.int32)
    at = 0
    for r, k in enumerate(owned):
        table[r, :k] = perm[at:at + k]
        at += k
        if r % 2 and k < blocks:
            table[r, k:] = rng.choice(perm, blocks - k)
    past = rng.integers(1, 4, (b, 1))
    past[0] = 0  # row 0 as a decode step has it: the last query at length - 1
    q_pos = (lengths[:, None] - t + np.arange(t)[None, :] + past).astype(np.int32)
    k_pos = None
    if hides:
        k_pos = np.broadcast_to(np.arange(c, dtype=np.int32), (b, c)).copy()
        k_pos[rng.random((b, c)) < 0.2] = EMPTY
        k_pos = jnp.asarray(k_pos)

    def f(*shape, scale=1.0):
        return jnp.asarray(rng.standard_normal(shape) * scale, jnp.float32).astype(dtype)
    lead = () if stack is None else (stack,)
    return (f(b, t, hq, d, scale=2.0 / d ** 0.5), f(*lead, pool, page, hkv, d), f(*lead, pool, page, hkv, d),
            jnp.asarray(table), jnp.asarray(lengths, jnp.int32), jnp.asarray(q_pos), k_pos)


def _float64(q, k_pool, v_pool, table, lengths, q_pos, k_pos, window, layer=None):
    """float64 attention of the (rounded) inputs, each row's keys read from its blocks in numpy; 0 for
    a query that sees nothing."""
    f64 = lambda x: np.asarray(jnp.asarray(x, jnp.float32), np.float64)  # noqa: E731
    q, kp, vp = f64(q), f64(k_pool), f64(v_pool)
    if layer is not None:
        kp, vp = kp[layer], vp[layer]
    table, lengths, q_pos = np.asarray(table), np.asarray(lengths), np.asarray(q_pos, np.int64)
    b, t, hq, d = q.shape
    page, g = kp.shape[1], hq // kp.shape[2]
    out = np.zeros((b, t, hq, d))
    for r in range(b):
        n = int(lengths[r])
        slots = np.arange(n)
        pos = slots if k_pos is None else np.asarray(k_pos)[r, :n].astype(np.int64)
        blk = table[r, slots // page]
        k, v = kp[blk, slots % page], vp[blk, slots % page]  # [n, Hkv, D]
        for i in range(t):
            vis = (pos <= q_pos[r, i]) & ((pos > q_pos[r, i] - window) if window is not None else True)
            if not vis.any():
                continue
            for h in range(hq):
                s = k[vis, h // g] @ q[r, i, h]
                p = np.exp(s - s.max())
                out[r, i, h] = p @ v[vis, h // g] / p.sum()
    return out


def _assert_close(out, ref, dtype):
    out = np.asarray(jnp.asarray(out, jnp.float32), np.float64)
    tol = 1e-5 if dtype == jnp.float32 else 2.0 ** -7  # bf16: the result and the probabilities rounded
    np.testing.assert_allclose(out, ref, rtol=tol, atol=tol * np.abs(ref).max())


def _view_call(q, k_pool, v_pool, table, lengths, q_pos, k_pos, window, layer=None, **tiling):
    """Today's path: each row's whole capacity gathered, the slots past its length hidden, decode_attention."""
    if layer is not None:
        k_pool, v_pool = k_pool[layer], v_pool[layer]
    c = table.shape[1] * k_pool.shape[1]
    slots = jnp.arange(c, dtype=jnp.int32)[None, :]
    kp = jnp.where(slots < lengths[:, None], slots if k_pos is None else k_pos, EMPTY)
    return decode_attention(q, paged_view(k_pool, table), paged_view(v_pool, table), q_pos, kp, window,
                            interpret=INTERPRET, **tiling)


_reference = jax.jit(paged_attention_reference, static_argnames="window")

# dtype, T, Hq, Hkv, D, block, blocks per row, pool blocks, window, hides, stack; key blocks of 16
# over pool blocks of 8 (two per key block) or 5 (a key block across three pool blocks, and a
# capacity of 50 that is no multiple of the split: a masked tail)
CASES = [
    (jnp.float32, 1, 4, 2, 16, 8, 6, 24, None, False, None),
    (jnp.float32, 4, 4, 1, 32, 5, 10, 40, 6, True, None),
    (jnp.bfloat16, 4, 4, 2, 16, 8, 6, 24, None, False, 3),
    (jnp.bfloat16, 1, 8, 2, 16, 5, 10, 40, 6, True, None),
]
TILING = dict(split=32, block_k=16)


@pytest.mark.parametrize("case", range(len(CASES)))
def test_matches_float64_and_todays_gathered_path_bitwise(case):
    dtype, t, hq, hkv, d, page, blocks, pool, window, hides, stack = CASES[case]
    rng = seeded_rng()
    q, kp, vp, table, lengths, q_pos, k_pos = _inputs(rng, b=3, t=t, hq=hq, hkv=hkv, d=d, page=page, blocks=blocks,
                                                      pool=pool, dtype=dtype, hides=hides, stack=stack)
    layer = None if stack is None else int(rng.integers(stack))
    args = (q, kp, vp, table, lengths, q_pos)
    out = paged_attention(*args, window, k_pos=k_pos, layer=None if layer is None else jnp.int32(layer),
                          interpret=INTERPRET, **TILING)
    assert out.shape == q.shape and out.dtype == dtype
    ref = _float64(*args, k_pos, window, layer)
    _assert_close(out, ref, dtype)
    np.testing.assert_array_equal(np.asarray(out[-1]), 0.0)  # the empty row
    np.testing.assert_array_equal(np.asarray(out), np.asarray(_view_call(*args, k_pos, window, layer, **TILING)))
    xla = _reference(*args, window, k_pos=k_pos, layer=layer)
    _assert_close(xla[:-1], ref[:-1], dtype)  # (the XLA path gives a query that sees nothing v's mean, not 0)


@pytest.fixture(scope="module")
def invariance_inputs():
    """float32, G = 4, window 6, 4 queries a row, 3 rows, blocks of 8, and each row's result alone."""
    rng = seeded_rng()
    shape = dict(t=4, hq=8, hkv=2, d=16, page=8, blocks=6, pool=24, dtype=jnp.float32)
    args = _inputs(rng, b=3, **shape)[:6]
    return rng, shape, args, np.asarray(paged_attention(*args, 6, interpret=INTERPRET, **TILING))


def test_a_row_does_not_depend_on_the_other_rows(invariance_inputs):
    """Row 0 bitwise the same whatever the other rows' lengths and blocks, and alone (B = 1)."""
    rng, shape, (q, kp, vp, table, lengths, q_pos), full = invariance_inputs
    c = shape["blocks"] * shape["page"]
    others = _inputs(rng, b=3, **shape, lengths=np.array([1, rng.integers(1, c + 1), c]))
    table2, lengths2 = table.at[1:].set(others[3][1:]), lengths.at[1:].set(others[4][1:])
    changed = paged_attention(q, kp, vp, table2, lengths2, q_pos, 6, interpret=INTERPRET, **TILING)
    assert not np.array_equal(np.asarray(changed[1:]), full[1:])
    np.testing.assert_array_equal(np.asarray(changed[0]), full[0])
    alone = paged_attention(q[:1], kp, vp, table[:1], lengths[:1], q_pos[:1], 6, interpret=INTERPRET, **TILING)
    np.testing.assert_array_equal(np.asarray(alone), full[:1])


def test_rows_equal_single_query_calls_bitwise(invariance_inputs):
    """Query i of a 4-query call is bitwise a 1-query call with only query i (speculative decoding's
    verify against its decode steps)."""
    _, _, (q, kp, vp, table, lengths, q_pos), full = invariance_inputs
    for i in range(q.shape[1]):
        one = paged_attention(q[:, i:i + 1], kp, vp, table, lengths, q_pos[:, i:i + 1], 6, interpret=INTERPRET,
                              **TILING)
        np.testing.assert_array_equal(np.asarray(one)[:, 0], full[:, i], err_msg=f"query {i}")


@pytest.mark.parametrize("change,match", [
    (dict(t=17), "T=17"),
    (dict(q_dtype=jnp.int32), "floating point"),
    (dict(hq=3), "multiple of kv heads"),
    (dict(d=24), "power of two"),
    (dict(v_pages=3), "k_pool = v_pool"),
    (dict(table_dtype=jnp.int16), "table must be int32"),
    (dict(table_rows=2), "table must be int32"),
    (dict(lengths_shape=(1, 1)), "lengths must be int32"),
    (dict(q_pos_dtype=jnp.int16), "q_pos must be int32"),
    (dict(k_pos_slots=20), "k_pos must be int32"),
    (dict(window=0), "window"),
    (dict(tiling=dict(split=48, block_k=16)), "power of two >= block_k"),
])
def test_bad_input_raises(change, match):
    b, t, hq, d = 1, change.get("t", 2), change.get("hq", 4), change.get("d", 16)
    q = jnp.ones((b, t, hq, d), change.get("q_dtype", jnp.float32))
    kp = jnp.ones((6, 8, 2, d), jnp.float32)
    vp = jnp.ones((6, change.get("v_pages", 8), 2, d), jnp.float32)
    table = jnp.zeros((change.get("table_rows", b), 3), change.get("table_dtype", jnp.int32))
    lengths = jnp.zeros(change.get("lengths_shape", (b,)), jnp.int32)
    q_pos = jnp.zeros((b, t), change.get("q_pos_dtype", jnp.int32))
    k_pos = jnp.zeros((b, change["k_pos_slots"]), jnp.int32) if "k_pos_slots" in change else None
    with pytest.raises(ValueError, match=match):
        paged_attention(q, kp, vp, table, lengths, q_pos, change.get("window"), k_pos=k_pos, interpret=INTERPRET,
                        **change.get("tiling", {}))


# ---- the 12B's global layers (16 query heads, 1 KV head of 512) in 32 slots of 4,096 -------------
REAL = [  # B, T, Hq, Hkv, D, block, blocks per row, window
    (32, 1, 16, 1, 512, 16, 256, None),
    (32, 4, 16, 1, 512, 16, 256, None),
    (8, 4, 16, 8, 256, 16, 256, 1024),  # sliding-layer shapes (paged when a cache has no ring)
]


@pytest.mark.parametrize("shape", REAL[1:])
def test_lowers_to_triton_for_cuda(shape):
    b, t, hq, hkv, d, page, blocks, window = shape
    q = jnp.zeros((b, t, hq, d), jnp.bfloat16)
    pool = jnp.zeros((2, b * blocks, page, hkv, d), jnp.bfloat16)  # a stack: the scanned model's layout
    ints = jnp.zeros((b, blocks), jnp.int32), jnp.zeros((b,), jnp.int32), jnp.zeros((b, t), jnp.int32)
    fn = functools.partial(paged_attention, window=window, layer=jnp.int32(1))
    assert TRITON_CALL in lower_for_cuda(lambda q, k, v, tb, n, p: fn(q, k, v, tb, n, p), q, pool, pool, *ints)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", REAL)
def test_gpu_real_shapes_against_xla_and_row_invariance(shape):
    """Compiled: close to the XLA reference and float64 (two rows), bitwise today's gathered path at
    the default tiling, a query bitwise the same alone as among T, and a row bitwise the same when
    every other row's length and blocks change."""
    b, t, hq, hkv, d, page, blocks, window = shape
    rng = seeded_rng()
    pool = b * blocks + 64
    args = _inputs(rng, b=b, t=t, hq=hq, hkv=hkv, d=d, page=page, blocks=blocks, pool=pool, dtype=jnp.bfloat16)[:6]
    out = np.asarray(paged_attention(*args, window))
    xla = np.asarray(_reference(*args, window))
    _assert_close(out[:-1], np.asarray(xla[:-1], np.float64), jnp.bfloat16)
    few = [a[:2] for a in args[3:]]
    _assert_close(out[:2], _float64(args[0][:2], args[1], args[2], *few, None, window), jnp.bfloat16)
    np.testing.assert_array_equal(out, np.asarray(_view_call(*args, None, window)))
    q, kp, vp, table, lengths, q_pos = args
    last = np.asarray(paged_attention(q[:, -1:], kp, vp, table, lengths, q_pos[:, -1:], window))
    np.testing.assert_array_equal(last[:, 0], out[:, -1])
    lengths2 = lengths.at[1:].set(jnp.asarray(rng.integers(1, blocks * page + 1, b - 1), jnp.int32))
    table2 = table.at[1:].set(jnp.asarray(rng.permutation(pool)[:(b - 1) * blocks].reshape(b - 1, blocks)))
    again = np.asarray(paged_attention(q, kp, vp, table2, lengths2, q_pos, window))
    np.testing.assert_array_equal(again[0], out[0])
    assert not np.array_equal(again[1:], out[1:])
