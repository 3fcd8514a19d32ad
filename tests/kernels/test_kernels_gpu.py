"""GPU-only kernel properties (skipped without a GPU): the Triton-compiled kernels (their inline PTX
has no CPU counterpart: interpret mode runs jnp twins) against float64 and their row invariance at
real shapes, with the dispatch's own tilings. Recorded runs: docs/benchmark_results/."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.kernels import DispatchConfig, dequantize, quantize, quantized_matmul, quantized_matmul_many
from jaxspec.kernels import launch
from support.seeds import seeded_int, seeded_rng

pytestmark = pytest.mark.gpu


def _ref(x, qw):
    return np.asarray(jnp.asarray(x, jnp.float32), np.float64) @ np.asarray(dequantize(qw, jnp.float32), np.float64).T


def _rel(y, ref):
    return np.linalg.norm(np.asarray(jnp.asarray(y, jnp.float32), np.float64) - ref) / np.linalg.norm(ref)


def _f32(y):
    return np.asarray(y.astype(jnp.float32))


@pytest.mark.parametrize("n,k", [(3840, 2048), (2048, 3840), (1024, 15360)])
def test_gemv_compiles_to_triton_and_keeps_row_invariance_at_a_real_shape(n, k):
    rng = seeded_rng()
    qw = quantize(jnp.asarray(rng.standard_normal((n, k)) * 0.05, jnp.bfloat16))
    x = jnp.asarray(rng.standard_normal((8, k)), jnp.bfloat16)
    hlo = jax.jit(lambda x: quantized_matmul(x, qw)).lower(x).as_text()
    assert "triton" in hlo.lower(), "the GPU path must lower through Pallas' Triton backend"
    ref = _ref(x, qw)
    alone = [_f32(quantized_matmul(x[i:i + 1], qw, path="qmv")) for i in range(8)]
    for rows in (2, 5, 8):
        multi = _f32(quantized_matmul(x[:rows], qw, path="multirow"))
        for i in range(rows):
            np.testing.assert_array_equal(multi[i:i + 1], alone[i])
        assert _rel(multi, ref[:rows]) < 1e-2


@pytest.mark.parametrize("bits,group_size", [(4, 64), (4, 32), (8, 64), (8, 32), (4, 128), (2, 64)])
def test_every_path_format_and_dtype_on_gpu(bits, group_size):
    """Through the dispatch at 1, 8 (GEMV), 64 (qmm) and 300 rows (the dense fallback and, off, the
    tiled kernel's 256-row tiles): N = 2000 is not a multiple of any tile (masked rows); K = 3776 is 59
    groups, so a two-group qmm step runs past a split's last group."""
    rng = seeded_rng()
    n, k = 2000, 3776 if group_size == 64 else 3840
    w = rng.standard_normal((n, k)) * 0.05
    for dtype, tol in ((jnp.float32, 1e-5), (jnp.bfloat16, 1e-2), (jnp.float16, 2e-3)):
        qw = quantize(jnp.asarray(w, dtype), bits=bits, group_size=group_size)
        for rows in (1, 8, 64, 300):
            x = jnp.asarray(rng.standard_normal((rows, k)), dtype)
            ref = _ref(x, qw)
            for cfg in (DispatchConfig(), DispatchConfig(qmm_dense_rows=0)) if rows == 300 else (DispatchConfig(),):
                y = jax.jit(lambda x: quantized_matmul(x, qw, config=cfg))(x)
                assert _rel(y, ref) < tol, (dtype, rows, cfg)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_explicit_launch_shapes_on_gpu(dtype):
    """Launch shapes a benchmark may pass: the GEMV with 128-row blocks, two groups per step and other
    splits; qmm with one and two groups per step. Float64 accuracy, and bitwise row invariance."""
    rng = seeded_rng()
    qw = quantize(jnp.asarray(rng.standard_normal((3840, 2048)) * 0.05, dtype))
    x = jnp.asarray(rng.standard_normal((8, 2048)), dtype)
    ref = _ref(x, qw)
    for t in (launch.Tiling(block_n=128, split_k=2), launch.Tiling(groups_per_step=2, split_k=4),
              launch.Tiling(split_k=1, num_stages=2), launch.Tiling(block_n=128, split_k=4, xsum="input")):
        f = jax.jit(lambda x, t=t: launch.gemv(x, (qw,), t, interpret=False)[0])
        multi = _f32(f(x))
        assert _rel(multi, ref) < 1e-2, t
        np.testing.assert_array_equal(_f32(f(x[3:4])), multi[3:4])
    for gps in (1, 2):
        t = launch.Tiling(block_m=64, block_n=128, groups_per_step=gps, split_k=4)
        y = jax.jit(lambda x, t=t: launch.qmm(x, (qw,), t, interpret=False)[0])(x)
        assert _rel(y, ref) < 1e-2, gps


def test_tall_head_gemv_on_gpu():
    """The tied head's launch (launch.TALL_N: 128-row tiles, split 4, the wrapper's group sums) at its
    real shape: every row agrees with a float32 HIGHEST-precision XLA product and is bitwise the same
    alone or among 8."""
    key = jax.random.PRNGKey(seeded_int(2**31))
    qw = quantize(jax.random.normal(key, (262144, 3840), jnp.bfloat16) * 0.05)
    x = jax.random.normal(jax.random.fold_in(key, 1), (8, 3840), jnp.bfloat16)
    ref = np.asarray(jnp.dot(x.astype(jnp.float32), dequantize(qw, jnp.float32).T,
                             precision=jax.lax.Precision.HIGHEST), np.float64)
    multi = _f32(quantized_matmul(x, qw, path="multirow"))
    assert _rel(multi, ref) < 1e-2
    for i in (0, 5):
        np.testing.assert_array_equal(_f32(quantized_matmul(x[i:i + 1], qw, path="qmv")), multi[i:i + 1])


def test_fused_launch_on_gpu():
    """One launch of several weights (one branch per weight): bitwise the separate launches of the
    same tiling at gate/up-like and q/k/v-like shapes, and rows invariant through the dispatch."""
    rng = seeded_rng()
    for ns in ((3840, 3840), (2048, 1024, 1024)):
        qws = [quantize(jnp.asarray(rng.standard_normal((n, 2048)) * 0.05, jnp.bfloat16)) for n in ns]
        x = jnp.asarray(rng.standard_normal((8, 2048)), jnp.bfloat16)
        t = launch.gemv_tiling((sum(ns), 2048), 64)
        together = jax.jit(lambda x: launch.gemv(x, qws, t, interpret=False))(x)
        for got, qw in zip(together, qws):
            alone = jax.jit(lambda x, qw=qw: launch.gemv(x, (qw,), t, interpret=False)[0])(x)
            np.testing.assert_array_equal(_f32(got), _f32(alone))
            assert _rel(got, _ref(x, qw)) < 1e-2
        multi = quantized_matmul_many(x, qws)
        one = quantized_matmul_many(x[5:6], qws)
        for a, m in zip(one, multi):
            np.testing.assert_array_equal(_f32(a), _f32(m[5:6]))
