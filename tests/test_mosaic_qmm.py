"""The Mosaic GPU kernel (pallas_kernels/mosaic_qmm.py) without a GPU: its assumptions about the
format, its launch shapes, which calls the dispatch gives it, and that it lowers through Mosaic GPU
for CUDA (layouts, TMA transforms and the wgmma operands are checked there). Its numbers need the
GPU: test_kernels_gpu.py::test_mosaic_qmm_on_gpu."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import DispatchConfig, quantize, quantized_matmul, with_sb_layout
from pallas_kernels.quant import word_tiles
from pallas_kernels.dispatch import _mosaic_runs
from pallas_kernels.mosaic_qmm import MosaicTiling, mosaic_qmm, supports
from pallas_kernels.tiling import mosaic_tiling


def _kn(rng, n, k, dtype=jnp.bfloat16):
    return with_sb_layout(quantize(jnp.asarray(rng.standard_normal((n, k)), dtype)), "kn")


def test_int4_view_of_the_words_is_the_code_order_minus_8():
    """The kernel reads the packed words as int4 [N, K] and XORs 8 in: element k must be code k - 8
    (MLX puts code 8j + i at bits 4i of word j), checked against a shift-and-mask unpack."""
    rng = np.random.default_rng()
    qw = _kn(rng, 16, 128)
    words = np.asarray(qw.weight)
    codes = (words[:, :, None] >> (4 * np.arange(8, dtype=np.uint32))) & 0xF
    view = jax.lax.bitcast_convert_type(qw.weight, jnp.int4).reshape(16, 128) ^ jnp.asarray(-8, jnp.int4)
    np.testing.assert_array_equal(np.asarray(view.astype(jnp.int32)), codes.reshape(16, 128).astype(np.int32) - 8)


def test_tiling_depends_on_the_weight_only_up_to_16_rows_and_splits_evenly():
    for shape in ((15360, 3840), (3840, 15360), (2048, 3840), (262144, 3840)):
        t1 = mosaic_tiling(1, shape, 64)
        assert all(mosaic_tiling(r, shape, 64) == t1 for r in range(2, 17))
        groups = shape[1] // 64
        for rows in (1, 64, 100, 200):
            t = mosaic_tiling(rows, shape, 64)
            assert groups % t.split_k == 0 and groups // t.split_k >= 4
            assert t.tile_m >= min(rows, 256) or t.tile_m == 16
    assert mosaic_tiling(1, (15360, 3840), 64).split_k == 4  # 240 x 4 = 960 programs
    assert mosaic_tiling(200, (4096, 3840), 64).tile_m == 256
    with pytest.raises(ValueError, match="tile_m"):
        MosaicTiling(tile_m=12)


def test_dispatch_gives_it_supported_calls_below_the_dense_rows_on_a_gpu_only():
    rng = np.random.default_rng()
    qw = _kn(rng, 128, 256)
    on = DispatchConfig(mosaic=True, qmm_dense_rows=256)
    x = jnp.ones((1, 256), jnp.bfloat16)
    assert _mosaic_runs(x, (qw,), "qmv", on, interpret=False)
    assert not _mosaic_runs(x, (qw,), "qmv", on, interpret=True)  # no interpreter for it
    assert not _mosaic_runs(x, (qw,), "qmv", DispatchConfig(mosaic=False), interpret=False)
    assert _mosaic_runs(jnp.ones((8, 256), jnp.bfloat16), (qw,), "multirow", on, interpret=False)
    assert not _mosaic_runs(jnp.ones((3, 256), jnp.bfloat16), (qw,), "qmv", on, interpret=False)  # row by row
    assert _mosaic_runs(jnp.ones((100, 256), jnp.bfloat16), (qw,), "qmm", on, interpret=False)
    assert not _mosaic_runs(jnp.ones((300, 256), jnp.bfloat16), (qw,), "qmm", on, interpret=False)  # dense
    assert not _mosaic_runs(x.astype(jnp.float32), (qw,), "qmv", on, interpret=False)
    assert not _mosaic_runs(x, (with_sb_layout(qw, "nk"),), "qmv", on, interpret=False)
    assert not supports(x, _kn(rng, 96, 256))  # N not a multiple of 64


def test_word_tiles_put_each_tile_in_one_run():
    """word_tiles: tile (a, b) holds rows [64a, 64a + 64) and words [8b, 8b + 8), row-major inside."""
    rng = np.random.default_rng()
    words = rng.integers(0, 2**32, (192, 48), dtype=np.uint32)
    t = np.asarray(word_tiles(jnp.asarray(words), 64, 8))
    a, b, r, w = (rng.integers(0, d) for d in t.shape)
    assert t.shape == (3, 6, 64, 8) and t[a, b, r, w] == words[64 * a + r, 8 * b + w]
    assert t[a, b].tobytes() == words[64 * a:64 * a + 64, 8 * b:8 * b + 8].tobytes()
    with pytest.raises(ValueError, match="does not split into"):
        word_tiles(jnp.asarray(words[:100]), 64, 8)


def test_tile_major_option_lowers_with_groups_and_blocks():
    rng = np.random.default_rng()
    qw = _kn(rng, 256, 1024)
    for choices in ({"w_tiles": True}, {"w_tiles": True, "groups_per_step": 2, "n_sub": 2}):
        t = mosaic_tiling(16, qw.shape, 64, **choices)
        assert t.w_tiles and t.split_k > 1
        text = jax.jit(lambda x: mosaic_qmm(x, qw, t)).trace(jax.ShapeDtypeStruct((16, 1024), jnp.bfloat16)).lower(
            lowering_platforms=("cuda",)).as_text()
        assert "mosaic_gpu" in text


def test_stored_tiles_are_read_as_they_are():
    """Weights stored as "tiles" (QuantizedWeight.w_layout) take the w_tiles reads without the copy:
    the traced call holds no tile-major transpose of the words (a row-major weight with w_tiles does),
    and it lowers with groups and blocks per step."""
    from pallas_kernels import with_w_layout
    rng = np.random.default_rng()
    rows = _kn(rng, 256, 1024)
    qw = with_w_layout(rows, "tiles")
    x = jax.ShapeDtypeStruct((16, 1024), jnp.bfloat16)
    copy = "transpose[permutation=(0, 2, 1, 3)]"
    assert copy in str(jax.make_jaxpr(lambda x: mosaic_qmm(x, rows, mosaic_tiling(16, qw.shape, 64, w_tiles=True)))(x))
    for choices in ({}, {"groups_per_step": 2, "n_sub": 2}):
        t = mosaic_tiling(16, qw.shape, 64, **choices)
        assert not t.w_tiles and supports(jnp.zeros((1, 1024), jnp.bfloat16), qw)
        assert copy not in str(jax.make_jaxpr(lambda x: mosaic_qmm(x, qw, t))(x))
        text = jax.jit(lambda x: mosaic_qmm(x, qw, t)).trace(x).lower(lowering_platforms=("cuda",)).as_text()
        assert "mosaic_gpu" in text


@pytest.mark.parametrize("rows", [1, 8, 100])
def test_lowers_through_mosaic_gpu_for_cuda(rows):
    """The dispatch's call at one row, multirow and qmm, built for CUDA on this machine: Mosaic GPU's
    lowering infers and checks every layout, transform and wgmma operand here."""
    rng = np.random.default_rng()
    qw = _kn(rng, 128, 512)
    cfg = DispatchConfig(mosaic=True, interpret=False, qmm_dense_rows=256)
    x = jax.ShapeDtypeStruct((rows, 512), jnp.bfloat16)
    text = jax.jit(lambda x: quantized_matmul(x, qw, config=cfg)).trace(x).lower(
        lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text and "triton" not in text.lower()


def test_rejects_formats_it_does_not_take():
    rng = np.random.default_rng()
    qw = _kn(rng, 128, 256)
    x = jnp.ones((2, 256), jnp.bfloat16)
    with pytest.raises(ValueError, match="sb_layout='nk'"):
        mosaic_qmm(x, with_sb_layout(qw, "nk"), MosaicTiling())
    with pytest.raises(ValueError, match="x dtype=float32"):
        mosaic_qmm(x.astype(jnp.float32), qw, MosaicTiling())
    with pytest.raises(ValueError, match="split_k=3 x groups_per_step=1 does not divide the 5 groups"):
        mosaic_qmm(jnp.ones((2, 320), jnp.bfloat16), _kn(rng, 128, 320), MosaicTiling(split_k=3))
