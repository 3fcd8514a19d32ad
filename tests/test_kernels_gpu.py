"""GPU-only kernel properties (skipped without a GPU): the Triton-compiled kernels (the fma GEMV's
inline PTX has no CPU counterpart: interpret mode runs its jnp twin) against float64 and their
row invariance at real shapes, with the dispatch's own split-K. The same properties at more shapes:
kernel_bench.py --phase check. Recorded runs: docs/benchmark_results/raw/*/pytest_gpu.log."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import DispatchConfig, dequantize, quantize, quantized_matmul

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("kernel", ["fma", "mma"])
@pytest.mark.parametrize("n,k", [(3840, 2048), (2048, 3840), (1024, 15360)])
def test_kernels_compile_to_triton_and_keep_row_invariance_at_a_real_shape(kernel, n, k):
    rng = np.random.default_rng()
    cfg = DispatchConfig(gemv_kernel=kernel)
    qw = quantize(jnp.asarray(rng.standard_normal((n, k)) * 0.05, jnp.bfloat16))
    x = jnp.asarray(rng.standard_normal((8, k)), jnp.bfloat16)
    hlo = jax.jit(lambda x: quantized_matmul(x, qw, config=cfg)).lower(x).as_text()
    assert "triton" in hlo.lower(), "the GPU path must lower through Pallas' Triton backend"
    ref = np.asarray(x, np.float64) @ np.asarray(dequantize(qw, jnp.float32), np.float64).T
    for rows in (2, 5, 8):
        multi = np.asarray(quantized_matmul(x[:rows], qw, path="multirow", config=cfg).astype(jnp.float32))
        for i in range(rows):
            alone = np.asarray(quantized_matmul(x[i:i + 1], qw, path="qmv", config=cfg).astype(jnp.float32))
            np.testing.assert_array_equal(multi[i:i + 1], alone)
        assert np.linalg.norm(multi - ref[:rows]) / np.linalg.norm(ref[:rows]) < 1e-2


@pytest.mark.parametrize("bits,group_size", [(4, 64), (4, 32), (8, 64), (4, 128)])
def test_fma_gemv_formats_and_dtypes_on_gpu(bits, group_size):
    rng = np.random.default_rng()
    w = rng.standard_normal((1000, 1536)) * 0.05
    for dtype, tol in ((jnp.float32, 1e-5), (jnp.bfloat16, 1e-2), (jnp.float16, 2e-3)):
        qw = quantize(jnp.asarray(w, dtype), bits=bits, group_size=group_size)
        x = jnp.asarray(rng.standard_normal((3, 1536)), dtype)
        y = np.asarray(quantized_matmul(x, qw, config=DispatchConfig(gemv_kernel="fma")), np.float64)
        ref = np.asarray(jnp.asarray(x, jnp.float32), np.float64) @ np.asarray(dequantize(qw, jnp.float32), np.float64).T
        assert np.linalg.norm(y - ref) / np.linalg.norm(ref) < tol, (dtype, bits, group_size)


@pytest.mark.parametrize("block_n,gps,chains", [(128, 1, False), (256, 1, True), (64, 4, True)])
def test_fma_gemv_launch_shapes_on_gpu(block_n, gps, chains):
    """The CUDA-core GEMV's other launch shapes (gemv_probe's sweep), the word-quad FMA chains among
    them: float64 accuracy and bitwise row invariance for rows 1..8 at the MLP's shape."""
    from pallas_kernels.gemv import GemvTiling, gemv_launch
    from pallas_kernels.tiling import fma_gemv_tiling
    rng = np.random.default_rng()
    qw = quantize(jnp.asarray(rng.standard_normal((15360, 3840)) * 0.05, jnp.bfloat16))
    split = fma_gemv_tiling(qw.shape, 64, DispatchConfig(gemv_kernel="fma", gemv_block_n=block_n)).split_k
    t = GemvTiling(block_n=block_n, groups_per_step=gps, split_k=split, chains=chains)
    x = jnp.asarray(rng.standard_normal((8, 3840)), jnp.bfloat16)
    run = jax.jit(lambda x: gemv_launch(x, qw, t, interpret=False))
    multi = np.asarray(run(x).astype(jnp.float32))
    ref = np.asarray(x, np.float64) @ np.asarray(dequantize(qw, jnp.float32), np.float64).T
    assert np.linalg.norm(multi - ref) / np.linalg.norm(ref) < 1e-2
    for i in (0, 3, 7):
        np.testing.assert_array_equal(np.asarray(run(x[i:i + 1]).astype(jnp.float32)), multi[i:i + 1])


@pytest.mark.parametrize("dtype,bits", [(jnp.bfloat16, 4), (jnp.float16, 8), (jnp.float32, 4)])
def test_tensor_core_unpacks_and_bodies_on_gpu(dtype, bits):
    """The Triton builds of the code unpacks (the paired unpack's inline PTX has no CPU counterpart)
    give bitwise the same product at a real shape; the kpairs unpack and
    the dequantize-first body agree with float64 and are row invariant."""
    from pallas_kernels.kernel import Tiling, launch
    rng = np.random.default_rng()
    qw = quantize(jnp.asarray(rng.standard_normal((3840, 2048)) * 0.05, dtype), bits=bits)
    x = jnp.asarray(rng.standard_normal((8, 2048)), dtype)
    ref = np.asarray(jnp.asarray(x, jnp.float32), np.float64) @ np.asarray(dequantize(qw, jnp.float32), np.float64).T
    tol = 1e-5 if dtype == jnp.float32 else 1e-2

    def run(**kw):
        t = Tiling(block_n=64, split_k=4, **kw)
        return np.asarray(jax.jit(lambda x: launch(x, qw, t, interpret=False))(x).astype(jnp.float32))

    base = run(unpack="broadcast")
    assert np.linalg.norm(base - ref) / np.linalg.norm(ref) < tol
    for kw in (dict(unpack="join"), dict(unpack="pairs")):
        np.testing.assert_array_equal(run(**kw), base, err_msg=str(kw))
    kp = jax.jit(lambda x: launch(x, qw, Tiling(block_n=64, split_k=4, unpack="kpairs"), interpret=False))
    multi = np.asarray(kp(x).astype(jnp.float32))
    assert np.linalg.norm(multi - ref) / np.linalg.norm(ref) < tol
    np.testing.assert_array_equal(np.asarray(kp(x[3:4]).astype(jnp.float32)), multi[3:4])
    for gps in (1, 2):
        t = Tiling(block_n=64, split_k=4, groups_per_step=gps, dequant="weights")
        f = jax.jit(lambda x: launch(x, qw, t, interpret=False))
        multi = np.asarray(f(x).astype(jnp.float32))
        assert np.linalg.norm(multi - ref) / np.linalg.norm(ref) < tol, gps
        np.testing.assert_array_equal(np.asarray(f(x[3:4]).astype(jnp.float32)), multi[3:4])


def test_tall_head_gemv_on_gpu():
    """The tied head's launch (tiling.TALL_N: 128-row tiles, split 4, the wrapper's group sums) at its
    real shape in the models' layouts: every row agrees with a float32 HIGHEST-precision XLA product
    and is bitwise the same alone or among 8."""
    from pallas_kernels import for_kernels
    key = jax.random.PRNGKey(int(np.random.default_rng().integers(2**31)))
    qw = for_kernels(quantize(jax.random.normal(key, (262144, 3840), jnp.bfloat16) * 0.05))
    x = jax.random.normal(jax.random.fold_in(key, 1), (8, 3840), jnp.bfloat16)
    ref = np.asarray(jnp.dot(x.astype(jnp.float32), dequantize(qw, jnp.float32).T,
                             precision=jax.lax.Precision.HIGHEST), np.float64)
    multi = np.asarray(quantized_matmul(x, qw, path="multirow").astype(jnp.float32))
    assert np.linalg.norm(multi - ref) / np.linalg.norm(ref) < 1e-2
    for i in (0, 5):
        alone = quantized_matmul(x[i:i + 1], qw, path="qmv")
        np.testing.assert_array_equal(np.asarray(alone.astype(jnp.float32)), multi[i:i + 1])


@pytest.mark.parametrize("dtype,tol", [(jnp.bfloat16, 1e-2), (jnp.float32, 1e-5)])
def test_qmm_at_prefill_rows_on_gpu(dtype, tol):
    """qmm at 256 and 520 rows through the dispatch: with the dense fallback on (the default:
    dequantize + XLA's dot), and off, the tiled kernel, where bf16 takes the 256-row tiles (8 warps, 2
    stages) and float32 keeps 64-row tiles (a 256-row float32 tile overflows shared memory)."""
    rng = np.random.default_rng()
    qw = quantize(jnp.asarray(rng.standard_normal((2048, 3840)) * 0.05, dtype))
    wd = np.asarray(dequantize(qw, jnp.float32), np.float64)
    for rows in (256, 520):
        x = jnp.asarray(rng.standard_normal((rows, 3840)), dtype)
        ref = np.asarray(jnp.asarray(x, jnp.float32), np.float64) @ wd.T
        for cfg in (DispatchConfig(qmm_dense_rows=256), DispatchConfig(qmm_dense_rows=0)):
            y = np.asarray(jax.jit(lambda x: quantized_matmul(x, qw, config=cfg))(x).astype(jnp.float32), np.float64)
            assert np.linalg.norm(y - ref) / np.linalg.norm(ref) < tol, (rows, cfg)


def test_fused_launch_on_gpu():
    """kernel.launch_many's Triton build (one branch per weight): bitwise the separate launches of the
    same tiling at gate/up-like and q/k/v-like shapes, and rows invariant through the dispatch."""
    from pallas_kernels import quantized_matmul_many
    from pallas_kernels.kernel import launch, launch_many
    from pallas_kernels.tiling import gemv_tiling
    rng = np.random.default_rng()
    cfg = DispatchConfig(fused_launch=True)
    for ns in ((3840, 3840), (2048, 1024, 1024)):
        qws = [quantize(jnp.asarray(rng.standard_normal((n, 2048)) * 0.05, jnp.bfloat16)) for n in ns]
        x = jnp.asarray(rng.standard_normal((8, 2048)), jnp.bfloat16)
        t = gemv_tiling((sum(ns), 2048), 64, cfg)
        together = jax.jit(lambda x: launch_many(x, qws, t, interpret=False))(x)
        for got, qw in zip(together, qws):
            alone = jax.jit(lambda x, qw=qw: launch(x, qw, t, interpret=False))(x)
            np.testing.assert_array_equal(np.asarray(got.astype(jnp.float32)), np.asarray(alone.astype(jnp.float32)))
            ref = np.asarray(x, np.float64) @ np.asarray(dequantize(qw, jnp.float32), np.float64).T
            assert np.linalg.norm(np.asarray(got, np.float64) - ref) / np.linalg.norm(ref) < 1e-2
        multi = quantized_matmul_many(x, qws, config=cfg)
        one = quantized_matmul_many(x[5:6], qws, config=cfg)
        for a, m in zip(one, multi):
            np.testing.assert_array_equal(np.asarray(a.astype(jnp.float32)), np.asarray(m[5:6].astype(jnp.float32)))


def test_kn_scale_layout_on_gpu():
    """Weights stored with scales/biases as [K/g, N] (what models store) through every path the
    model takes (GEMV 1 and 8 rows, fused q/k/v-style launch, qmm at 64 and 300 rows), qmm with the
    codes body and the CUDA-core GEMV: bitwise the MLX layout's result. N = 2000 is not a multiple of any tile (masked
    columns); K = 3776 is 59 groups, so a two-group qmm step runs past a split's last group."""
    from pallas_kernels import quantized_matmul_many, with_sb_layout
    rng = np.random.default_rng()
    k = 3776
    qws = [quantize(jnp.asarray(rng.standard_normal((n, k)) * 0.05, jnp.bfloat16)) for n in (2000, 512)]
    kns = [with_sb_layout(q, "kn") for q in qws]
    other = {64: DispatchConfig(dequant="codes"), 1: DispatchConfig(gemv_kernel="fma"),
             8: DispatchConfig(gemv_kernel="fma"),  # qmm's codes body; the CUDA-core GEMV
             300: DispatchConfig(qmm_dense_rows=0)}  # the tiled kernel (the default runs the dense fallback)
    for rows in (1, 8, 64, 300):
        x = jnp.asarray(rng.standard_normal((rows, k)), jnp.bfloat16)
        for q, kn in zip(qws, kns):
            for cfg in (None, other[rows]) if rows in other else (None,):
                np.testing.assert_array_equal(np.asarray(quantized_matmul(x, kn, config=cfg).astype(jnp.float32)),
                                              np.asarray(quantized_matmul(x, q, config=cfg).astype(jnp.float32)))
        for a, b in zip(quantized_matmul_many(x, kns), quantized_matmul_many(x, qws)):
            np.testing.assert_array_equal(np.asarray(a.astype(jnp.float32)), np.asarray(b.astype(jnp.float32)))


def test_tile_word_layout_on_gpu():
    """Words stored as 64-row tiles per group (QuantizedWeight.w_layout="tiles") through every
    path (the GEMV at 1 and 8 rows at its default and a 128-wide launch, the CUDA-core GEMV, the
    Mosaic kernel at 1, 8 and 64 rows, the fused launch, qmm's two bodies at 64 rows, the tiled
    kernel at 300 rows): bitwise the row-major result, and near float64. N = 1984 is 31 tiles (a 128-wide block half past the end); K = 3776 is 59 groups (a
    two-group step past a split's last group)."""
    from pallas_kernels import quantized_matmul_many, with_sb_layout, with_w_layout
    rng = np.random.default_rng()
    k = 3776
    qws = [with_sb_layout(quantize(jnp.asarray(rng.standard_normal((n, k)) * 0.05, jnp.bfloat16)), "kn")
           for n in (1984, 512)]
    tiles = [with_w_layout(q, "tiles") for q in qws]
    every = [DispatchConfig(gemv_kernel="fma"), DispatchConfig(mosaic=True)]
    configs = {1: [DispatchConfig(), DispatchConfig(gemv_block_n=128), DispatchConfig(gemv_block_n=32), *every],
               8: [DispatchConfig(), DispatchConfig(gemv_block_n=128), *every],
               64: [DispatchConfig(), DispatchConfig(dequant="codes"), DispatchConfig(mosaic=True),
                    DispatchConfig(qmm_tile_n=32)],  # (the 32-wide blocks: rows of one tile; added after call 4)
               300: [DispatchConfig(qmm_dense_rows=0)]}
    for rows, cfgs in configs.items():
        x = jnp.asarray(rng.standard_normal((rows, k)), jnp.bfloat16)
        for cfg in cfgs:
            for q, t in zip(qws, tiles):
                want = np.asarray(quantized_matmul(x, q, config=cfg).astype(jnp.float32))
                np.testing.assert_array_equal(np.asarray(quantized_matmul(x, t, config=cfg).astype(jnp.float32)),
                                              want, err_msg=f"rows={rows} {cfg}")
            for a, b in zip(quantized_matmul_many(x, tiles, config=cfg), quantized_matmul_many(x, qws, config=cfg)):
                np.testing.assert_array_equal(np.asarray(a.astype(jnp.float32)), np.asarray(b.astype(jnp.float32)))
    x = jnp.asarray(rng.standard_normal((8, k)), jnp.bfloat16)
    ref = np.asarray(x, np.float64) @ np.asarray(dequantize(qws[0], jnp.float32), np.float64).T
    y = np.asarray(quantized_matmul(x, tiles[0]).astype(jnp.float32))
    assert np.linalg.norm(y - ref) / np.linalg.norm(ref) < 1e-2


@pytest.mark.parametrize("n,k", [(3840, 2048), (2048, 3840), (1024, 15360)])
def test_mosaic_qmm_on_gpu(n, k):
    """The Mosaic GPU kernel through the dispatch (DispatchConfig.mosaic; "kn" weights, as models
    store): against float64 at 1, 8, 64 and 200 rows (GEMV tile, qmm tiles of 64 and 256 rows), and
    each of 8 rows bitwise the same row computed alone."""
    from pallas_kernels import with_sb_layout
    rng = np.random.default_rng()
    qw = with_sb_layout(quantize(jnp.asarray(rng.standard_normal((n, k)) * 0.05, jnp.bfloat16)), "kn")
    cfg = DispatchConfig(mosaic=True)
    f = jax.jit(lambda x: quantized_matmul(x, qw, config=cfg))
    x = jnp.asarray(rng.standard_normal((200, k)), jnp.bfloat16)
    assert "mosaic_gpu" in f.lower(x[:8]).as_text()
    wd = np.asarray(dequantize(qw, jnp.float32), np.float64)
    for rows in (1, 8, 64, 200):
        y = np.asarray(f(x[:rows]).astype(jnp.float32), np.float64)
        ref = np.asarray(x[:rows].astype(jnp.float32), np.float64) @ wd.T
        assert np.linalg.norm(y - ref) / np.linalg.norm(ref) < 1e-2, rows
    multi = np.asarray(f(x[:8]).astype(jnp.float32))
    for i in range(8):
        np.testing.assert_array_equal(np.asarray(f(x[i:i + 1]).astype(jnp.float32)), multi[i:i + 1])


@pytest.mark.parametrize("rows,choices", [
    (1, dict(groups_per_step=4)), (8, dict(groups_per_step=2, n_sub=2)), (64, dict(groups_per_step=2, n_sub=2)),
    (128, dict(n_sub=2)), (300, dict(groups_per_step=2, stages=2)), (1, dict(w_tiles=True)),
    (64, dict(groups_per_step=2, n_sub=2, w_tiles=True))])
def test_mosaic_qmm_launch_options_on_gpu(rows, choices):
    """MosaicTiling's options (several groups per step, two weight blocks per program, tile-major
    words) against float64 at the row counts they are swept at (mosaic_sweep.py). (The w_tiles cases
    were written after session 11's device time ran out.)"""
    from pallas_kernels import with_sb_layout
    from pallas_kernels.mosaic_qmm import mosaic_qmm
    from pallas_kernels.tiling import mosaic_tiling
    rng = np.random.default_rng()
    n, k = 2048, 3840
    qw = with_sb_layout(quantize(jnp.asarray(rng.standard_normal((n, k)) * 0.05, jnp.bfloat16)), "kn")
    t = mosaic_tiling(rows, (n, k), 64, **choices)
    assert all(getattr(t, f) == v for f, v in choices.items())
    x = jnp.asarray(rng.standard_normal((rows, k)), jnp.bfloat16)
    y = np.asarray(jax.jit(lambda x: mosaic_qmm(x, qw, t))(x).astype(jnp.float32), np.float64)
    ref = np.asarray(x.astype(jnp.float32), np.float64) @ np.asarray(dequantize(qw, jnp.float32), np.float64).T
    assert np.linalg.norm(y - ref) / np.linalg.norm(ref) < 1e-2
