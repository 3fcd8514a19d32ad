"""quantized_matmul on every path against a float64 numpy reference; row invariance; the config and
its environment knobs; bad input.

On a machine without a GPU the Pallas kernels run in interpret mode (the same kernel code); on a
GPU these same tests run the Triton-compiled kernels."""
import numpy as np
import jax
import jax.numpy as jnp
import pytest

from jaxspec.kernels import (ROW_TILE, DispatchConfig, dequantize, einsum_f32, quantize, quantized_matmul,
                            quantized_matmul_many, quantized_matmul_parts, select_path)
from jaxspec.kernels import launch
from support.seeds import seeded_rng

# Scaled-down Gemma shapes with non-power-of-two N and K (3840 -> 192, 2816 -> 176, 1536 -> 96 ...).
SHAPES = [(176, 192), (96, 320), (80, 128)]


def _case(rng, n, k, dtype, bits=4, group_size=64):
    w = rng.standard_normal((n, k)).astype(np.float32) * 0.5
    qw = quantize(jnp.asarray(w, dtype), bits=bits, group_size=group_size)
    wd = np.asarray(dequantize(qw, jnp.float32), np.float64)
    return qw, wd


def _ref(x, wd):
    return np.asarray(jnp.asarray(x, jnp.float32), np.float64) @ wd.T


def _rel(a, b):
    return np.linalg.norm(np.asarray(jnp.asarray(a, jnp.float32), np.float64) - b) / np.linalg.norm(b)


# Every path on every shape (1 row: qmv; 2..16: multirow; 17+: tiled), each row count once.
DISPATCH_CASES = [(SHAPES[0], (1, 2, 20)), (SHAPES[1], (1, 5, 13, 20)), (SHAPES[2], (1, 3, 8, 20))]


@pytest.mark.parametrize("n,k,rows", [(n, k, rows) for (n, k), counts in DISPATCH_CASES for rows in counts])
def test_default_dispatch_matches_float64(n, k, rows):
    rng = seeded_rng()
    qw, wd = _case(rng, n, k, jnp.float32)
    x = jnp.asarray(rng.standard_normal((rows, k)), jnp.float32)
    y = quantized_matmul(x, qw)
    assert y.shape == (rows, n) and y.dtype == jnp.float32
    assert np.all(np.isfinite(np.asarray(y)))
    assert _rel(y, _ref(x, wd)) < 1e-5


@pytest.mark.parametrize("path,rows", [("qmv", 1), ("qmv", 3), ("multirow", 4), ("multirow", ROW_TILE),
                                       ("qmm", 2), ("qmm", 20)])
@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 1e-2), (jnp.float16, 2e-3)])
def test_each_path_each_dtype(path, rows, dtype, tol):
    rng = seeded_rng()
    qw, wd = _case(rng, 176, 192, dtype)
    x = jnp.asarray(rng.standard_normal((rows, 192)), dtype)
    y = quantized_matmul(x, qw, path=path)
    assert y.dtype == dtype
    assert _rel(y, _ref(x, wd)) < tol


@pytest.mark.parametrize("dtype,bits", [(jnp.bfloat16, 2), (jnp.bfloat16, 4), (jnp.bfloat16, 8),
                                        (jnp.float16, 4), (jnp.float16, 8), (jnp.float32, 4)])
def test_magic_code_conversion_is_exact(dtype, bits):
    """The GEMV's conversion: (pattern | code) read as a float must be offset + code exactly, for
    every code; where the codes do not fit the mantissa there must be no pattern."""
    import ml_dtypes
    from jaxspec.kernels.unpack import magic_offset
    got = magic_offset(dtype, bits)
    np_dtype = {jnp.bfloat16: ml_dtypes.bfloat16, jnp.float16: np.float16, jnp.float32: np.float32}[dtype]
    mantissa = {jnp.bfloat16: 7, jnp.float16: 10, jnp.float32: 23}[dtype]
    if dtype == jnp.float32 or bits > mantissa:
        assert got is None
        return
    pattern, offset = got
    codes = np.arange(2**bits, dtype=np.uint16)
    values = (codes | np.uint16(pattern)).view(np_dtype).astype(np.float64)
    np.testing.assert_array_equal(values, offset + codes.astype(np.float64))


@pytest.mark.parametrize("bits,group_size,dtype", [(8, 64, jnp.float32), (4, 32, jnp.bfloat16),
                                                   pytest.param(4, 128, jnp.float32, marks=pytest.mark.slow),
                                                   pytest.param(8, 128, jnp.bfloat16, marks=pytest.mark.slow),
                                                   (2, 64, jnp.bfloat16)])
def test_other_formats(bits, group_size, dtype):
    rng = seeded_rng()
    qw, wd = _case(rng, 48, 256, dtype, bits=bits, group_size=group_size)
    for rows in (1, 6, 24):
        x = jnp.asarray(rng.standard_normal((rows, 256)), dtype)
        assert _rel(quantized_matmul(x, qw), _ref(x, wd)) < (1e-5 if dtype == jnp.float32 else 1e-2)


def test_leading_dims_and_poisoned_output_is_overwritten():
    rng = seeded_rng()
    qw, wd = _case(rng, 96, 128, jnp.float32)
    x = jnp.asarray(rng.standard_normal((2, 3, 128)), jnp.float32)
    out = jnp.full((2, 3, 96), jnp.nan)  # poison: the result must replace every element

    @jax.jit
    def f(x, out):
        return out.at[...].set(quantized_matmul(x, qw))

    y = np.asarray(f(x, out))
    assert np.all(np.isfinite(y))
    np.testing.assert_allclose(y.reshape(6, 96), _ref(x.reshape(6, 128), wd), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype,k", [(jnp.bfloat16, 192), pytest.param(jnp.float32, 512, marks=pytest.mark.slow)])
def test_multirow_rows_bitwise_equal_qmv(dtype, k):
    """Row i of a multirow launch is bitwise the qmv result for row i alone (greedy parity needs it)."""
    rng = seeded_rng()
    qw, _ = _case(rng, 176, k, dtype)
    x = jnp.asarray(rng.standard_normal((8, k)), dtype)
    alone = [np.asarray(quantized_matmul(x[i:i + 1], qw, path="qmv").astype(jnp.float32)) for i in range(8)]
    for rows in range(2, 9):  # each row count is its own launch; row i must not notice the others
        multi = np.asarray(quantized_matmul(x[:rows], qw, path="multirow").astype(jnp.float32))
        for i in range(rows):
            np.testing.assert_array_equal(multi[i:i + 1], alone[i])


def test_qmm_rows_do_not_depend_on_other_rows():
    """Within one tiled launch shape, a row's result ignores the other rows."""
    rng = seeded_rng()
    qw, _ = _case(rng, 96, 192, jnp.float32)
    x = jnp.asarray(rng.standard_normal((24, 192)), jnp.float32)
    y1 = np.asarray(quantized_matmul(x, qw, path="qmm"))
    x2 = x.at[1:].set(jnp.asarray(rng.standard_normal((23, 192)), jnp.float32))
    y2 = np.asarray(quantized_matmul(x2, qw, path="qmm"))
    np.testing.assert_array_equal(y1[0], y2[0])


def test_xla_backend_matches_and_is_row_invariant():
    rng = seeded_rng()
    qw, wd = _case(rng, 96, 192, jnp.float32)
    cfg = DispatchConfig(backend="xla")
    x = jnp.asarray(rng.standard_normal((5, 192)), jnp.float32)
    y = quantized_matmul(x, qw, config=cfg)
    assert _rel(y, _ref(x, wd)) < 1e-5
    np.testing.assert_array_equal(np.asarray(y[2:3]), np.asarray(quantized_matmul(x[2:3], qw, config=cfg)))


def test_float_weight_path():
    rng = seeded_rng()
    w = jnp.asarray(rng.standard_normal((40, 64)), jnp.float32)
    x = jnp.asarray(rng.standard_normal((3, 64)), jnp.float32)
    np.testing.assert_allclose(np.asarray(quantized_matmul(x, w)),
                               np.asarray(x, np.float64) @ np.asarray(w, np.float64).T, rtol=1e-5, atol=1e-5)


def test_einsum_f32_value_and_gradient_dtype():
    """Forward: the float32-accumulated einsum (float64 reference). Gradient: exact in float32 (that
    of the plain einsum), and in bf16 every dot of the backward reads bf16 operands (no float32
    x float32 GEMM), with values within bf16 rounding of the float64 gradient."""
    rng = seeded_rng()
    a64, b64, g64 = (rng.standard_normal(s) for s in ((3, 5, 24), (7, 24), (3, 5, 7)))
    spec = "btk,nk->btn"
    for dt, tol in ((jnp.float32, 1e-5), (jnp.bfloat16, 2e-2)):
        a, b, g = (jnp.asarray(x, dt) for x in (a64, b64, g64))
        out = einsum_f32(spec, a, b)
        assert out.dtype == jnp.float32
        ref = np.einsum(spec, *(np.asarray(x.astype(jnp.float32), np.float64) for x in (a, b)))
        assert np.abs(np.asarray(out, np.float64) - ref).max() < 1e-5 * np.abs(ref).max()
        loss = lambda a, b: jnp.sum(einsum_f32(spec, a, b).astype(dt) * g)  # noqa: E731
        da, db = jax.grad(loss, argnums=(0, 1))(a, b)
        assert da.dtype == dt and db.dtype == dt
        ga, gb = (np.asarray(x.astype(jnp.float32), np.float64) for x in (g, b))
        ref_da = np.einsum("btn,nk->btk", ga, gb)
        assert np.abs(np.asarray(da.astype(jnp.float32), np.float64) - ref_da).max() < tol * np.abs(ref_da).max()
        if dt == jnp.float32:
            plain = lambda a, b: jnp.sum(jnp.einsum(spec, a, b, precision="highest") * g)  # noqa: E731
            for x, y in zip((da, db), jax.grad(plain, argnums=(0, 1))(a, b)):
                np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
        else:
            hlo = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(a, b).as_text()
            dots = [ln for ln in hlo.splitlines() if "stablehlo.dot_general" in ln]
            assert len(dots) == 2 and all("xf32>" not in ln.split("->")[0] for ln in dots), dots


def test_select_path_rule():
    assert select_path(1) == "qmv"
    assert [select_path(r) for r in (2, 5, 8, 16)] == ["multirow"] * 4
    assert select_path(17) == "qmm"
    assert select_path(4, DispatchConfig(multirow=False)) == "qmv"
    assert select_path(12, DispatchConfig(multirow_max_rows=12)) == "multirow"


def test_environment_is_read_by_from_env_only(monkeypatch):
    """The five user knobs reach the config through from_env (explicit overrides win); DispatchConfig()
    ignores the environment; malformed values name the variable."""
    for var, value in (("JAXSPEC_QMV_MULTIROW", "0"), ("JAXSPEC_QMV_MULTIROW_MAX_ROWS", "4"),
                       ("JAXSPEC_QMM_TILE_M", "32"), ("JAXSPEC_QMM_DENSE_ROWS", "0"), ("JAXSPEC_MTP_VERIFY_PAD", "1")):
        monkeypatch.setenv(var, value)
    assert DispatchConfig() == DispatchConfig(multirow=True, multirow_max_rows=16, qmm_tile_m=None, qmm_dense_rows=256,
                                              verify_pad=False)
    cfg = DispatchConfig.from_env()
    assert (cfg.multirow, cfg.multirow_max_rows, cfg.qmm_tile_m, cfg.qmm_dense_rows, cfg.verify_pad) == (
        False, 4, 32, 0, True)
    assert select_path(3, cfg) == "qmv" and select_path(5, cfg) == "qmm"
    assert DispatchConfig.from_env(backend="xla", qmm_tile_m=64).qmm_tile_m == 64
    assert DispatchConfig.from_env({}) == DispatchConfig()
    monkeypatch.setenv("JAXSPEC_QMM_TILE_M", "24")
    with pytest.raises(ValueError, match="power of two.*JAXSPEC_QMM_TILE_M"):
        DispatchConfig.from_env()
    monkeypatch.setenv("JAXSPEC_QMM_TILE_M", "big")
    with pytest.raises(ValueError, match="JAXSPEC_QMM_TILE_M='big' is not an integer"):
        DispatchConfig.from_env()
    monkeypatch.setenv("JAXSPEC_QMM_TILE_M", "")
    monkeypatch.setenv("JAXSPEC_MTP_VERIFY_PAD", "maybe")
    with pytest.raises(ValueError, match="JAXSPEC_MTP_VERIFY_PAD='maybe' must be 0 or 1"):
        DispatchConfig.from_env()


def test_multirow_off_still_correct():
    rng = seeded_rng()
    qw, wd = _case(rng, 96, 128, jnp.float32)
    x = jnp.asarray(rng.standard_normal((4, 128)), jnp.float32)
    y = quantized_matmul(x, qw, config=DispatchConfig(multirow=False))
    assert _rel(y, _ref(x, wd)) < 1e-5


def test_bad_input_errors():
    rng = seeded_rng()
    qw, _ = _case(rng, 32, 128, jnp.float32)
    with pytest.raises(ValueError, match="K mismatch"):
        quantized_matmul(jnp.ones((2, 64)), qw)
    with pytest.raises(ValueError, match="float32/float16/bfloat16 x"):
        quantized_matmul(jnp.ones((2, 128), jnp.int32), qw)
    with pytest.raises(ValueError, match="rank-2"):
        quantized_matmul(jnp.ones((2, 128)), jnp.ones((2, 32, 128)))
    with pytest.raises(ValueError, match="path="):
        quantized_matmul(jnp.ones((2, 128)), qw, path="gemm")
    with pytest.raises(ValueError, match=f"at most {ROW_TILE} rows"):
        quantized_matmul(jnp.ones((ROW_TILE + 1, 128)), qw, path="multirow")
    for bad, msg in ((dict(backend="cuda"), "backend"), (dict(multirow_max_rows=ROW_TILE + 1), "multirow_max_rows"),
                     (dict(qmm_dense_rows=-1), "qmm_dense_rows"), (dict(multirow=1), "multirow=1"),
                     (dict(qmm_tile_m=48), "power of two")):
        with pytest.raises(ValueError, match=msg):
            DispatchConfig(**bad)


def test_tall_weight_gemv_launch():
    """Weights of at least TALL_N rows (the tied head) take 128-row tiles split 4 with the wrapper's
    group sums. That launch on a small weight: rows agree with float64 and each row is bitwise the
    same alone or among 8."""
    head = launch.gemv_tiling((262144, 3840), 64)
    assert (head.block_n, head.split_k, head.xsum) == (128, 4, "input")
    layer = launch.gemv_tiling((15360, 3840), 64)
    assert (layer.block_n, layer.xsum) == (64, "reduce")
    rng = seeded_rng()
    qw, wd = _case(rng, 256, 512, jnp.bfloat16)
    x = jnp.asarray(rng.standard_normal((8, 512)), jnp.bfloat16)
    t = launch.Tiling(block_n=128, split_k=4, xsum="input")
    multi = np.asarray(launch.gemv(x, (qw,), t, interpret=True)[0].astype(jnp.float32))
    assert _rel(multi, _ref(x, wd)) < 1e-2
    for i in (0, 7):
        alone = launch.gemv(x[i:i + 1], (qw,), t, interpret=True)[0]
        np.testing.assert_array_equal(np.asarray(alone.astype(jnp.float32)), multi[i:i + 1])


@pytest.mark.parametrize("rows,body", [(3, "gemv"), (20, "qmm")])
def test_one_launch_of_several_weights_is_bitwise_one_launch_each(rows, body):
    rng = seeded_rng()
    (qa, wa), (qb, wb) = _case(rng, 100, 192, jnp.bfloat16), _case(rng, 16, 192, jnp.bfloat16)  # ragged ends
    x = jnp.asarray(rng.standard_normal((rows, 192)), jnp.bfloat16)
    run = getattr(launch, body)
    t = launch.Tiling(block_m=16 if body == "gemv" else 32, block_n=64, split_k=2,
                      groups_per_step=1 if body == "gemv" else 2)
    together = run(x, (qa, qb), t, interpret=True)
    for got, qw, wd in zip(together, (qa, qb), (wa, wb)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(run(x, (qw,), t, interpret=True)[0]))
        assert _rel(got, _ref(x, wd)) < 1e-2


def test_quantized_matmul_many_matches_float64_keeps_rows_invariant_and_falls_back():
    rng = seeded_rng()
    (qa, wa), (qb, wb) = _case(rng, 96, 192, jnp.bfloat16), _case(rng, 40, 192, jnp.bfloat16)
    x = jnp.asarray(rng.standard_normal((2, 6, 192)), jnp.bfloat16)   # 12 rows: qmm
    for xs in (x[0, :5], x):                                            # 5 rows: multirow
        for y, wd in zip(quantized_matmul_many(xs, (qa, qb)), (wa, wb)):
            assert y.shape == (*xs.shape[:-1], wd.shape[0]) and y.dtype == jnp.bfloat16
            assert _rel(y, _ref(xs, wd)) < 1e-2
    multi = quantized_matmul_many(x[0, :5], (qa, qb))
    alone = quantized_matmul_many(x[0, 3:4], (qa, qb))  # a row alone (qmv) and among five: one tiling
    for a, m in zip(alone, multi):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(m[3:4]))
    q8 = quantize(jnp.asarray(rng.standard_normal((24, 192)), jnp.bfloat16), bits=8)
    dense = jnp.asarray(rng.standard_normal((16, 192)), jnp.bfloat16)
    ws = (qa, q8, dense)   # mixed formats: one call per weight, the same results
    for y, w in zip(quantized_matmul_many(x[0, :1], ws), ws):
        np.testing.assert_array_equal(np.asarray(y), np.asarray(quantized_matmul(x[0, :1], w)))
    with pytest.raises(ValueError, match="at least one weight"):
        quantized_matmul_many(x, ())
    with pytest.raises(ValueError, match="one format"):
        launch.gemv(x[0], (qa, q8), launch.Tiling(), interpret=True)


@pytest.mark.parametrize("rows, config", [
    pytest.param(1, DispatchConfig(), marks=pytest.mark.slow), pytest.param(5, DispatchConfig(), marks=pytest.mark.slow),
    (20, DispatchConfig()),
    (20, DispatchConfig(qmm_dense_rows=16)),
    (5, DispatchConfig(multirow=False)), (5, DispatchConfig(backend="xla"))],
    ids=["qmv", "multirow", "qmm", "dense", "per-row", "xla"])
def test_parts_fold_to_the_many_result_bitwise(rows, config):
    """quantized_matmul_parts: `[S, ..., N]` split-K partials (float32 when split) whose in-order sum
    rounded to x's dtype is bitwise quantized_matmul_many's result, on every path."""
    rng = seeded_rng()
    (qa, _), (qb, _) = _case(rng, 96, 1024, jnp.bfloat16), _case(rng, 40, 1024, jnp.bfloat16)
    dense = jnp.asarray(rng.standard_normal((24, 1024)), jnp.bfloat16)
    x = jnp.asarray(rng.standard_normal((rows, 1024)), jnp.bfloat16).reshape(1, rows, 1024)
    ws = (qa, qb, dense)
    parts, many = quantized_matmul_parts(x, ws, config=config), quantized_matmul_many(x, ws, config=config)
    for p, m in zip(parts, many):
        assert p.shape[1:] == m.shape and p.dtype == (jnp.float32 if p.shape[0] > 1 else m.dtype)
        np.testing.assert_array_equal(np.asarray(launch.fold_splits(p).astype(m.dtype)), np.asarray(m))
    if config.backend == "pallas" and rows <= ROW_TILE:
        assert parts[0].shape[0] > 1  # the GEMV splits K here: the test folds real partials
