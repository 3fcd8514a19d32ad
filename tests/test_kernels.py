"""quantized_matmul on every path against a float64 numpy reference; row invariance; bad input.

On a machine without a GPU the Pallas kernels run in interpret mode (the same kernel code); on a
GPU these same tests run the Triton-compiled kernels."""
import numpy as np
import jax
import jax.numpy as jnp
import pytest

from pallas_kernels import DispatchConfig, dequantize, quantize, quantized_matmul, select_path

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
    return np.linalg.norm(np.asarray(a, np.float64) - b) / np.linalg.norm(b)


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 13, 20])
def test_default_dispatch_matches_float64(n, k, rows):
    rng = np.random.default_rng()
    qw, wd = _case(rng, n, k, jnp.float32)
    x = jnp.asarray(rng.standard_normal((rows, k)), jnp.float32)
    y = quantized_matmul(x, qw)
    assert y.shape == (rows, n) and y.dtype == jnp.float32
    assert np.all(np.isfinite(np.asarray(y)))
    assert _rel(y, _ref(x, wd)) < 1e-5


# kernel: "fma" the CUDA-core GEMV, "mma" the tensor-core one (default)
@pytest.mark.parametrize("path,rows,kernel", [("qmv", 1, "fma"), ("qmv", 3, "fma"), ("multirow", 4, "fma"),
                                              ("multirow", 16, "fma"), ("qmv", 1, "mma"), ("qmv", 3, "mma"), ("multirow", 4, "mma"),
                                              ("multirow", 16, "mma"), ("qmm", 2, None), ("qmm", 20, None)])
@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 1e-2), (jnp.float16, 2e-3)])
def test_each_path_each_dtype(path, rows, kernel, dtype, tol):
    rng = np.random.default_rng()
    qw, wd = _case(rng, 176, 192, dtype)
    x = jnp.asarray(rng.standard_normal((rows, 192)), dtype)
    y = quantized_matmul(x, qw, path=path, config=DispatchConfig(gemv_kernel=kernel or "mma"))
    assert y.dtype == dtype
    assert _rel(y, _ref(x, wd)) < tol


@pytest.mark.parametrize("dtype,bits", [(jnp.bfloat16, 2), (jnp.bfloat16, 4), (jnp.bfloat16, 8),
                                        (jnp.float16, 4), (jnp.float16, 8), (jnp.float32, 4)])
def test_magic_code_conversion_is_exact(dtype, bits):
    """The kernel's "bits" conversion: (pattern | code) read as a float must be offset + code exactly,
    for every code; where the codes do not fit the mantissa there must be no pattern."""
    import ml_dtypes
    from pallas_kernels.kernel import magic_offset
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


@pytest.mark.parametrize("dtype,bits", [(jnp.bfloat16, 4), (jnp.float16, 4), (jnp.float16, 8)])
def test_bits_and_cvt_conversions_agree(dtype, bits):
    """Both code conversions give the product to within one rounding of x's dtype."""
    from pallas_kernels.kernel import Tiling, launch
    rng = np.random.default_rng()
    qw, wd = _case(rng, 176, 192, dtype, bits=bits)
    x = jnp.asarray(rng.standard_normal((5, 192)), dtype)
    ref = _ref(x, wd)
    outs = {c: np.asarray(launch(x, qw, Tiling(block_n=64, convert=c, split_k=2), interpret=True), np.float64)
            for c in ("bits", "cvt")}
    eps = float(jnp.finfo(dtype).eps)
    for c, y in outs.items():
        assert np.all(np.abs(y - ref) <= eps * np.abs(ref) + 1e-3 * np.abs(ref).max()), c
    assert np.abs(outs["bits"] - outs["cvt"]).max() <= 2 * eps * np.abs(ref).max()


@pytest.mark.parametrize("bits,group_size", [(8, 64), (4, 32), (4, 128), (8, 128)])
def test_other_formats(bits, group_size):
    rng = np.random.default_rng()
    qw, wd = _case(rng, 48, 256, jnp.float32, bits=bits, group_size=group_size)
    for rows in (1, 6, 24):
        x = jnp.asarray(rng.standard_normal((rows, 256)), jnp.float32)
        assert _rel(quantized_matmul(x, qw), _ref(x, wd)) < 1e-5


def test_leading_dims_and_poisoned_output_is_overwritten():
    rng = np.random.default_rng()
    qw, wd = _case(rng, 96, 128, jnp.float32)
    x = jnp.asarray(rng.standard_normal((2, 3, 128)), jnp.float32)
    out = jnp.full((2, 3, 96), jnp.nan)  # poison: the result must replace every element

    @jax.jit
    def f(x, out):
        return out.at[...].set(quantized_matmul(x, qw))

    y = np.asarray(f(x, out))
    assert np.all(np.isfinite(y))
    np.testing.assert_allclose(y.reshape(6, 96), _ref(x.reshape(6, 128), wd), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype,k,kernel", [(jnp.bfloat16, 192, "mma"), (jnp.float32, 512, "mma"),
                                            (jnp.float32, 512, "fma")])
def test_multirow_rows_bitwise_equal_qmv(dtype, k, kernel):
    """Row i of a multirow launch is bitwise the qmv result for row i alone (greedy parity needs it).
    (K = 512 catches the fma GEMV's group sums depending on the row count through XLA's reduce; a
    float32 case at K = 192 added nothing to it and cost CI 42 s. The fma GEMV computes in a float32
    copy of x, so its bfloat16 case (26 s) added only the cast: dropped in session 8.)"""
    rng = np.random.default_rng()
    qw, _ = _case(rng, 176, k, dtype)
    cfg = DispatchConfig(gemv_kernel=kernel)
    x = jnp.asarray(rng.standard_normal((8, k)), dtype)
    alone = [np.asarray(quantized_matmul(x[i:i + 1], qw, path="qmv", config=cfg).astype(jnp.float32))
             for i in range(8)]
    for rows in range(2, 9):  # each row count is its own launch; row i must not notice the others
        multi = np.asarray(quantized_matmul(x[:rows], qw, path="multirow", config=cfg).astype(jnp.float32))
        for i in range(rows):
            np.testing.assert_array_equal(multi[i:i + 1], alone[i])


def test_qmm_rows_do_not_depend_on_other_rows():
    """Reported property: within one tiled launch shape, a row's result ignores the other rows."""
    rng = np.random.default_rng()
    qw, _ = _case(rng, 96, 192, jnp.float32)
    x = jnp.asarray(rng.standard_normal((24, 192)), jnp.float32)
    y1 = np.asarray(quantized_matmul(x, qw, path="qmm"))
    x2 = x.at[1:].set(jnp.asarray(rng.standard_normal((23, 192)), jnp.float32))
    y2 = np.asarray(quantized_matmul(x2, qw, path="qmm"))
    np.testing.assert_array_equal(y1[0], y2[0])


def test_xla_backend_matches_and_is_row_invariant():
    rng = np.random.default_rng()
    qw, wd = _case(rng, 96, 192, jnp.float32)
    cfg = DispatchConfig(backend="xla")
    x = jnp.asarray(rng.standard_normal((5, 192)), jnp.float32)
    y = quantized_matmul(x, qw, config=cfg)
    assert _rel(y, _ref(x, wd)) < 1e-5
    np.testing.assert_array_equal(np.asarray(y[2:3]), np.asarray(quantized_matmul(x[2:3], qw, config=cfg)))


def test_float_weight_path():
    rng = np.random.default_rng()
    w = jnp.asarray(rng.standard_normal((40, 64)), jnp.float32)
    x = jnp.asarray(rng.standard_normal((3, 64)), jnp.float32)
    np.testing.assert_allclose(np.asarray(quantized_matmul(x, w)),
                               np.asarray(x, np.float64) @ np.asarray(w, np.float64).T, rtol=1e-5, atol=1e-5)


def test_select_path_rule(monkeypatch):
    assert select_path(1) == "qmv"
    assert [select_path(r) for r in (2, 5, 8)] == ["multirow"] * 3
    assert select_path(9) == "qmm"
    assert select_path(4, DispatchConfig(multirow=False)) == "qmv"
    assert select_path(12, DispatchConfig(multirow_max_rows=12)) == "multirow"
    monkeypatch.setenv("JAXSPEC_QMV_MULTIROW", "0")
    monkeypatch.setenv("JAXSPEC_QMV_MULTIROW_MAX_ROWS", "4")
    monkeypatch.setenv("JAXSPEC_QMM_TILE_M", "32")
    cfg = DispatchConfig()
    assert (cfg.multirow, cfg.multirow_max_rows, cfg.qmm_tile_m) == (False, 4, 32)
    assert select_path(3, cfg) == "qmv" and select_path(5, cfg) == "qmm"
    monkeypatch.setenv("JAXSPEC_QMM_TILE_M", "24")
    with pytest.raises(ValueError, match="power of two"):
        DispatchConfig()


def test_fma_gemv_env_overrides_reach_the_tiling(monkeypatch):
    from pallas_kernels.tiling import gemv_tiling
    for name, value in (("JAXSPEC_GEMV_KERNEL", "fma"), ("JAXSPEC_GEMV_BLOCK_N", "256"),
                        ("JAXSPEC_GEMV_GROUPS_PER_STEP", "1"), ("JAXSPEC_GEMV_CHAINS", "1")):
        monkeypatch.setenv(name, value)
    t = gemv_tiling((3840, 2048), 64, DispatchConfig())
    assert (t.block_n, t.groups_per_step, t.chains) == (256, 1, True)
    monkeypatch.delenv("JAXSPEC_GEMV_CHAINS")
    assert gemv_tiling((3840, 2048), 64, DispatchConfig()).chains is False
    monkeypatch.setenv("JAXSPEC_GEMV_GROUPS_PER_STEP", "0")
    with pytest.raises(ValueError, match="gemv_groups_per_step"):
        DispatchConfig()
    monkeypatch.delenv("JAXSPEC_GEMV_GROUPS_PER_STEP")
    monkeypatch.setenv("JAXSPEC_GEMV_KERNEL", "mma")
    assert gemv_tiling((3840, 2048), 64, DispatchConfig()).num_stages == 3   # the tensor-core GEMV's default
    monkeypatch.setenv("JAXSPEC_GEMV_STAGES", "2")
    assert gemv_tiling((3840, 2048), 64, DispatchConfig()).num_stages == 2
    monkeypatch.setenv("JAXSPEC_GEMV_STAGES", "0")
    with pytest.raises(ValueError, match="gemv_num_stages"):
        DispatchConfig()


@pytest.mark.parametrize("bits,group_size,k,split_k,gps,dtype", [
    (4, 64, 320, 3, 2, jnp.float32),    # 5 groups: uneven splits, a half-empty last step
    (4, 32, 224, 2, 4, jnp.bfloat16),   # 7 groups
    (8, 128, 384, 1, 2, jnp.float16),   # 3 groups, 4 codes per word
    (4, 128, 256, 2, 1, jnp.float32),
    (4, 64, 384, 2, 2, jnp.float32),    # 6 groups, 3 per split: a step straddles each split's end
    (8, 32, 320, 2, 4, jnp.float16)])   # 10 groups, 5 per split, 4 per step
def test_fma_gemv_tilings(bits, group_size, k, split_k, gps, dtype):
    """The CUDA-core GEMV with split-K and several groups per step, where the groups do not divide
    evenly (the masked tail must add exact zeros), on every format, with and without the prefetch
    and the word-quad chains;
    rows 1..3 against float64 and against each other bitwise."""
    from pallas_kernels.gemv import GemvTiling, gemv_launch
    rng = np.random.default_rng()
    qw, wd = _case(rng, 72, k, dtype, bits=bits, group_size=group_size)
    x = jnp.asarray(rng.standard_normal((3, k)), dtype)
    tol = 1e-5 if dtype == jnp.float32 else 1e-2
    for prefetch, chains in ((True, False), (False, False), (True, True)):
        tiling = GemvTiling(block_n=32, groups_per_step=gps, split_k=split_k, prefetch=prefetch, chains=chains)
        y = gemv_launch(x, qw, tiling, interpret=True)
        assert y.shape == (3, 72) and y.dtype == dtype
        assert _rel(y, _ref(x, wd)) < tol
        one = gemv_launch(x[2:], qw, tiling, interpret=True)
        np.testing.assert_array_equal(np.asarray(y[2:], np.float32), np.asarray(one, np.float32))


def test_multirow_off_still_correct():
    rng = np.random.default_rng()
    qw, wd = _case(rng, 96, 128, jnp.float32)
    x = jnp.asarray(rng.standard_normal((4, 128)), jnp.float32)
    y = quantized_matmul(x, qw, config=DispatchConfig(multirow=False))
    assert _rel(y, _ref(x, wd)) < 1e-5


def test_bad_input_errors():
    rng = np.random.default_rng()
    qw, _ = _case(rng, 32, 128, jnp.float32)
    with pytest.raises(ValueError, match="K mismatch"):
        quantized_matmul(jnp.ones((2, 64)), qw)
    with pytest.raises(ValueError, match="float32/float16/bfloat16 x"):
        quantized_matmul(jnp.ones((2, 128), jnp.int32), qw)
    with pytest.raises(ValueError, match="rank-2"):
        quantized_matmul(jnp.ones((2, 128)), jnp.ones((2, 32, 128)))
    with pytest.raises(ValueError, match="path="):
        quantized_matmul(jnp.ones((2, 128)), qw, path="gemm")
    with pytest.raises(ValueError, match="at most 16 rows"):
        quantized_matmul(jnp.ones((17, 128)), qw, path="multirow")
    with pytest.raises(ValueError, match="backend"):
        DispatchConfig(backend="cuda")


def test_tall_weight_gemv_launch(monkeypatch):
    """Weights of at least tiling.TALL_N rows (the tied head) take 128-row tiles split 4 with the
    wrapper's group sums; explicit overrides still win. Lowered threshold, so interpret mode can run
    it: rows agree with float64 and each row is bitwise the same alone or among 8."""
    from pallas_kernels import tiling
    head = tiling.gemv_tiling((262144, 3840), 64, DispatchConfig())
    assert (head.block_n, head.split_k, head.xsum) == (128, 4, "input")
    assert tiling.gemv_tiling((262144, 3840), 64, DispatchConfig(gemv_block_n=64, gemv_xsum="reduce")).block_n == 64
    assert tiling.gemv_tiling((15360, 3840), 64, DispatchConfig()).xsum == "reduce"
    monkeypatch.setattr(tiling, "TALL_N", 256)
    assert tiling.gemv_tiling((256, 512), 64, DispatchConfig()).block_n == 128
    rng = np.random.default_rng()
    qw, wd = _case(rng, 256, 512, jnp.bfloat16)
    x = jnp.asarray(rng.standard_normal((8, 512)), jnp.bfloat16)
    multi = np.asarray(quantized_matmul(x, qw, path="multirow").astype(jnp.float32))
    assert _rel(multi, _ref(x, wd)) < 1e-2
    for i in (0, 7):
        alone = quantized_matmul(x[i:i + 1], qw, path="qmv")
        np.testing.assert_array_equal(np.asarray(alone.astype(jnp.float32)), multi[i:i + 1])
