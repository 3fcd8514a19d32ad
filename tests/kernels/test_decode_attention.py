"""decode_attention (flash-decoding) against dense_attention and a float64 reference; the bitwise
row invariance speculative decoding rests on (a T-query call == T one-query calls); queries that see
nothing; bad input; the Triton lowering at the real shapes. On CPU the kernels run in interpret mode;
the gpu-marked test runs them compiled on the H200."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.kernels.decode_attention import EMPTY, decode_attention, dense_attention, visible
from support.gpu_lowering import TRITON_CALL, lower_for_cuda
from support.seeds import seeded_int

INTERPRET = not any(d.platform == "gpu" for d in jax.devices())


def _layout(rng, kind, b, c, t, window):
    """(q_pos [B, T], k_pos [B, C]) int32, ragged per row. global: slot = position, queries at a
    random start. ring: position p in slot p mod C for the newest C positions, older slots EMPTY on
    short rows. perm: positions 0..n-1 in random slots (the rest EMPTY), queries anywhere in [0, n+4)."""
    q_pos, k_pos = np.zeros((b, t), np.int32), np.full((b, c), EMPTY, np.int32)
    for r in range(b):
        if kind == "global":
            start = int(rng.integers(0, c - t + 1))
            k_pos[r] = np.arange(c)
            q_pos[r] = start + np.arange(t)
        elif kind == "ring":
            end = int(rng.integers(t + 1, 3 * c))  # positions < end are written
            pos = np.arange(max(0, end - c), end)
            k_pos[r, pos % c] = pos
            q_pos[r] = end - t + np.arange(t)
        else:
            n = int(rng.integers(c // 2, c + 1))
            k_pos[r, rng.permutation(c)[:n]] = np.arange(n)
            q_pos[r] = rng.integers(0, n + 4, size=t)
    return jnp.asarray(q_pos), jnp.asarray(k_pos)


def _normal(key, shape, dtype, scale=1.0):
    """jax.random normals drawn at a power-of-two length (few compiles for many shapes)."""
    n = int(np.prod(shape))
    x = np.asarray(jax.random.normal(key, (1 << (n - 1).bit_length(),), jnp.float32))[:n]
    return jnp.asarray((x * scale).reshape(shape)).astype(dtype)


def _inputs(seed, b, t, hq, hkv, d, c, dtype, kind, window):
    kq, kk, kv = jax.random.split(jax.random.PRNGKey(seed), 3)
    q = _normal(kq, (b, t, hq, d), dtype, 2.0 / d ** 0.5)
    k, v = _normal(kk, (b, c, hkv, d), dtype), _normal(kv, (b, c, hkv, d), dtype)
    return (q, k, v, *_layout(np.random.default_rng(seed), kind, b, c, t, window))


@functools.partial(jax.jit, static_argnums=5)
def _dense(q, k, v, q_pos, k_pos, window):
    return dense_attention(q, k, v, visible(q_pos, k_pos, window)).reshape(q.shape)


def _reference(q, k, v, q_pos, k_pos, window):
    """float64 attention of the (rounded) inputs; 0 for a query that sees nothing."""
    q, k, v = (np.asarray(jnp.asarray(x, jnp.float32), np.float64) for x in (q, k, v))
    qp, kp = np.asarray(q_pos, np.int64), np.asarray(k_pos, np.int64)
    b, t, hq, d = q.shape
    g = hq // k.shape[2]
    out = np.zeros((b, t, hq, d))
    for r in range(b):
        for i in range(t):
            vis = (kp[r] <= qp[r, i]) & ((kp[r] > qp[r, i] - window) if window is not None else True)
            if not vis.any():
                continue
            for h in range(hq):
                s = k[r, vis, h // g] @ q[r, i, h]
                p = np.exp(s - s.max())
                out[r, i, h] = p @ v[r, vis, h // g] / p.sum()
    return out


def _sees_something(q_pos, k_pos, window):
    """[B, T] whether each query sees a key (numpy: no compile)."""
    qp, kp = np.asarray(q_pos, np.int64)[:, :, None], np.asarray(k_pos, np.int64)[:, None, :]
    vis = (kp <= qp) & ((kp > qp - window) if window is not None else True)
    return vis.any(axis=-1)


def _assert_close(out, ref, dtype, where=None):
    out = np.asarray(jnp.asarray(out, jnp.float32), np.float64)
    ref = np.asarray(ref, np.float64)
    if where is not None:
        out, ref = out[where], ref[where]
    scale = np.abs(ref).max()
    # float32: float32 rounding; bf16: the result and the probabilities are rounded to bf16
    tol = 1e-5 if dtype == jnp.float32 else 2.0 ** -7
    np.testing.assert_allclose(out, ref, rtol=tol, atol=tol * scale)


def _call(q, k, v, q_pos, k_pos, window, **tiling):
    return decode_attention(q, k, v, q_pos, k_pos, window, interpret=INTERPRET, **tiling)


CASES = [  # dtype, Hq, Hkv, D, C, T, window, layout, tiling
    (jnp.float32, 4, 4, 16, 37, 1, None, "global", {}),
    (jnp.float32, 4, 2, 32, 150, 5, 8, "ring", dict(split=32, block_k=16)),
    (jnp.float32, 16, 1, 64, 201, 16, None, "perm", dict(split=64, block_k=32)),
    (jnp.bfloat16, 2, 2, 64, 100, 7, None, "ring", dict(split=32, block_k=16)),
    (jnp.bfloat16, 16, 1, 16, 190, 4, 8, "global", dict(split=32, block_k=32)),
    (jnp.bfloat16, 8, 2, 32, 61, 1, 8, "ring", {}),
]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_matches_dense_and_float64(case):
    dtype, hq, hkv, d, c, t, window, kind, tiling = CASES[case]
    q, k, v, q_pos, k_pos = _inputs(100 + case, 2, t, hq, hkv, d, c, dtype, kind, window)
    out = _call(q, k, v, q_pos, k_pos, window, **tiling)
    assert out.shape == q.shape and out.dtype == dtype
    assert np.all(np.isfinite(np.asarray(out, np.float32)))
    _assert_close(out, _reference(q, k, v, q_pos, k_pos, window), dtype)
    dense = _dense(q, k, v, q_pos, k_pos, window)
    seen = _sees_something(q_pos, k_pos, window)  # dense gives a blind query the mean of v, not 0
    _assert_close(out, dense, dtype, where=seen)


# ---- row invariance: the same 16 queries, computed T at a time and one at a time ----------------
_B, _HQ, _C, _D = 2, 8, 133, 32
_TILING = dict(split=64, block_k=16)


@functools.lru_cache(maxsize=None)
def _invariance_case(dtype):
    """Inputs with 16 queries spread over all positions, one of them seeing nothing, and each
    query's result from a one-query call. float32: G = 4, window 8; bf16: G = 2, no window."""
    hkv, window = (2, 8) if dtype == jnp.float32 else (4, None)
    q, k, v, q_pos, k_pos = _inputs(7, _B, 16, _HQ, hkv, _D, _C, dtype, "perm", window)
    q_pos = q_pos.at[0, 2].set(-1)  # sees nothing: stays 0 among others
    singles = [np.asarray(_call(q[:, i:i + 1], k, v, q_pos[:, i:i + 1], k_pos, window, **_TILING))[:, 0]
               for i in range(16)]
    return (q, k, v, q_pos, k_pos), window, singles


# Query rows are T * G (G = 4 in float32, 2 in bf16) in blocks of 16: one block padded, one block
# exactly full, two blocks with a ragged end, and every block full.
@pytest.mark.parametrize("dtype,t", [(jnp.float32, 1), (jnp.float32, 4), (jnp.float32, 5), (jnp.float32, 16),
                                     (jnp.bfloat16, 3), (jnp.bfloat16, 8), (jnp.bfloat16, 9)])
def test_rows_equal_single_query_calls_bitwise(dtype, t):
    (q, k, v, q_pos, k_pos), window, singles = _invariance_case(dtype)
    q, q_pos = q[:, :t], q_pos[:, :t]
    out = np.asarray(_call(q, k, v, q_pos, k_pos, window, **_TILING))
    for i in range(t):
        np.testing.assert_array_equal(out[:, i], singles[i], err_msg=f"row {i} of a {t}-query call")
    _assert_close(out, _reference(q, k, v, q_pos, k_pos, window), dtype)


def test_query_that_sees_nothing_is_zero():
    q, k, v, q_pos, k_pos = _inputs(3, 2, 4, 4, 2, 16, 70, jnp.float32, "global", 8)
    q_pos = jnp.asarray([[-1, 30, -5, 69], [10, 11, 12, 13]], jnp.int32)
    k_pos = k_pos.at[1].set(EMPTY)  # row 1: an empty cache
    out = np.asarray(_call(q, k, v, q_pos, k_pos, 8, split=32, block_k=16))
    assert np.all(np.isfinite(out))
    np.testing.assert_array_equal(out[0, [0, 2]], 0.0)
    np.testing.assert_array_equal(out[1], 0.0)
    _assert_close(out, _reference(q, k, v, q_pos, k_pos, 8), jnp.float32)


@pytest.mark.parametrize("change,match", [
    (dict(t=17), "T=17"),
    (dict(q_dtype=jnp.int32), "floating point"),
    (dict(hq=5), "multiple of kv heads"),
    (dict(d=24), "power of two"),
    (dict(q_pos_dtype=jnp.int16), "int32"),
    (dict(k_slots=40), "k_pos"),
    (dict(v_dim=16), "k = v"),
    (dict(window=0), "window"),
    (dict(tiling=dict(split=48, block_k=16)), "power of two >= block_k"),
    (dict(tiling=dict(rows=8)), "rows=8"),
])
def test_bad_input_raises(change, match):
    b, t, hq, hkv, d, c = 1, change.get("t", 2), change.get("hq", 4), 2, change.get("d", 32), 48
    q = jnp.ones((b, t, hq, d), change.get("q_dtype", jnp.float32))
    k = jnp.ones((b, c, hkv, d), jnp.float32)
    v = jnp.ones((b, c, hkv, change.get("v_dim", d)), jnp.float32)
    q_pos = jnp.zeros((b, t), change.get("q_pos_dtype", jnp.int32))
    k_pos = jnp.zeros((b, change.get("k_slots", c)), jnp.int32)
    with pytest.raises(ValueError, match=match):
        _call(q, k, v, q_pos, k_pos, change.get("window"), **change.get("tiling", {}))


# ---- the real shapes ---------------------------------------------------------------------------
REAL = [  # B, T, Hq, Hkv, D, C, window, layout
    (1, 1, 16, 8, 256, 1041, 1024, "ring"),
    (2, 4, 16, 8, 256, 1041, 1024, "ring"),
    (1, 4, 16, 1, 512, 4099, None, "global"),
]


@pytest.mark.parametrize("shape", REAL)
def test_lowers_to_triton_for_cuda(shape):
    b, t, hq, hkv, d, c, window, _ = shape
    q = jnp.zeros((b, t, hq, d), jnp.bfloat16)
    kv = jnp.zeros((b, c, hkv, d), jnp.bfloat16)
    pos = jnp.zeros((b, t), jnp.int32), jnp.zeros((b, c), jnp.int32)
    fn = functools.partial(decode_attention, window=window)
    assert TRITON_CALL in lower_for_cuda(fn, q, kv, kv, *pos)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", REAL)
def test_gpu_real_shapes(shape):
    b, t, hq, hkv, d, c, window, kind = shape
    for seed, width in enumerate(sorted({t, 8, 16})):
        q, k, v, q_pos, k_pos = _inputs(seed, 2, width, hq, hkv, d, c, jnp.bfloat16, kind, window)
        out = decode_attention(q, k, v, q_pos, k_pos, window)
        dense = _dense(q, k, v, q_pos, k_pos, window)
        _assert_close(out, dense, jnp.bfloat16, where=_sees_something(q_pos, k_pos, window))
        _assert_close(out, _reference(q, k, v, q_pos, k_pos, window), jnp.bfloat16)
        out = np.asarray(out)
        for i in range(width):
            one = decode_attention(q[:, i:i + 1], k, v, q_pos[:, i:i + 1], k_pos, window)
            np.testing.assert_array_equal(out[:, i], np.asarray(one)[:, 0], err_msg=f"row {i} of {width}")


@pytest.mark.parametrize("path", ["pallas", "xla"])
def test_attention_of_the_real_rows_only(path):
    """models.layers.attention(rows=r): a forward padded to the row bucket reads the cache for its r
    real queries only; those rows are bitwise the padded call's, the pad rows zeros."""
    from jaxspec.models.layers import attention
    from jaxspec.kernels import DispatchConfig
    mm = DispatchConfig(attention=path, interpret=INTERPRET if path == "pallas" else None)
    seed = seeded_int(1 << 30)
    q, k, v, q_pos, k_pos = _inputs(seed, 2, 8, 4, 2, 16, 70, jnp.float32, "global", None)
    full = np.asarray(attention(q, k, v, q_pos, k_pos, None, matmul=mm))
    for r in (1, 3):
        got = np.asarray(attention(q, k, v, q_pos, k_pos, None, matmul=mm, rows=r))
        np.testing.assert_array_equal(got[:, :r], full[:, :r], err_msg=f"{path}, rows={r}")
        np.testing.assert_array_equal(got[:, r:], 0.0)
