"""QuantizedWeight.w_layout: packed words stored as MLX's rows ("rows") or as 64-row tiles per group
("tiles", [N/64, K/g, 64, words per group]: a step's words one contiguous run). The codes are the
same, so every kernel must give bitwise the "rows" result, and MLX's words must come back out
(words(), dequantize, take_rows, checkpoints)."""
import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import (DispatchConfig, QuantizedWeight, dequantize, for_kernels, quantize, quantized_matmul,
                            quantized_matmul_many, take_rows, with_sb_layout, with_w_layout)
from pallas_kernels.gemv import GemvTiling, gemv_launch
from pallas_kernels.kernel import Tiling, launch
from pallas_kernels.quant import default_w_layout


def _weight(rng, n, k, dtype=jnp.bfloat16, group_size=64, bits=4):
    return quantize(jnp.asarray(rng.standard_normal((n, k)), dtype), group_size=group_size, bits=bits)


def _f32(a):
    return np.asarray(jnp.asarray(a).astype(jnp.float32))


@pytest.mark.parametrize("bits,group_size", [(4, 64), (4, 32), (8, 128)])
def test_tiles_hold_each_64_row_group_block_contiguously_and_round_trip(bits, group_size):
    rng = np.random.default_rng()
    qw = _weight(rng, 192, 512, group_size=group_size, bits=bits)
    t = with_w_layout(qw, "tiles")
    wpg = group_size * bits // 32
    assert t.weight.shape == (3, 512 // group_size, 64, wpg) and t.shape == qw.shape == (192, 512)
    t.validate()
    words = np.asarray(qw.weight)
    tiles = np.asarray(t.weight)
    for _ in range(5):  # tile (i, g) row r is row 64 i + r's words of group g
        i, g, r = rng.integers(3), rng.integers(512 // group_size), rng.integers(64)
        np.testing.assert_array_equal(tiles[i, g, r], words[64 * i + r, g * wpg:(g + 1) * wpg])
    np.testing.assert_array_equal(np.asarray(t.words()), words)
    back = with_w_layout(t, "rows")
    assert back.w_layout == "rows" and with_w_layout(t, "tiles") is t
    np.testing.assert_array_equal(np.asarray(back.weight), words)
    np.testing.assert_array_equal(_f32(dequantize(t)), _f32(dequantize(qw)))
    ids = jnp.asarray([[3, 191], [64, 3]])
    np.testing.assert_array_equal(_f32(take_rows(t, ids)), _f32(take_rows(qw, ids)))
    dense = _f32(dequantize(qw))
    odd = jnp.asarray([-1, 250, -200])  # JAX's gather: -1 wraps to 191, the rest clamp to 191 and 0
    for w in (qw, t):
        np.testing.assert_array_equal(_f32(take_rows(w, odd)), dense[[191, 191, 0]])
        assert take_rows(w, jnp.zeros((0,), jnp.int32)).shape == (0, 512)
    kn = with_sb_layout(t, "kn")  # the two layouts are independent
    assert (kn.sb_layout, kn.w_layout) == ("kn", "tiles")
    np.testing.assert_array_equal(_f32(take_rows(kn, ids)), _f32(take_rows(qw, ids)))


def test_bad_layouts_are_named():
    rng = np.random.default_rng()
    qw = _weight(rng, 96, 128)
    with pytest.raises(ValueError, match="multiple of 64, got N=96"):
        with_w_layout(qw, "tiles")
    with pytest.raises(ValueError, match="w_layout='cols'"):
        with_w_layout(qw, "cols")
    with pytest.raises(ValueError, match=r"'tiles' layout must be \[N/64, K/group_size, 64, 8\]"):
        dataclasses.replace(qw, w_layout="tiles").validate()  # row-major words labelled "tiles"
    t = with_w_layout(_weight(rng, 64, 128), "tiles")
    with pytest.raises(ValueError, match="rank 2"):
        dataclasses.replace(t, w_layout="rows").validate()
    x = jnp.asarray(rng.standard_normal((1, 128)), jnp.bfloat16)
    with pytest.raises(ValueError, match="block_n that is a multiple of 64 or divides it, got 96"):
        launch(x, t, Tiling(block_n=96), interpret=True)
    with pytest.raises(ValueError, match="block_n that is a multiple of 64 or divides it, got 48"):
        gemv_launch(x, t, GemvTiling(block_n=48), interpret=True)  # (the dispatch's blocks are powers of two)
    with pytest.raises(ValueError, match="rank 2"):  # validated before converting
        with_w_layout(dataclasses.replace(qw, weight=qw.weight[None]), "tiles")


def test_for_kernels_tiles_only_where_n_allows(monkeypatch):
    rng = np.random.default_rng()
    monkeypatch.delenv("JAXSPEC_W_LAYOUT", raising=False)
    assert default_w_layout() == "tiles"
    a, b = for_kernels(_weight(rng, 128, 64)), for_kernels(_weight(rng, 96, 64))
    assert (a.w_layout, a.sb_layout, b.w_layout, b.sb_layout) == ("tiles", "kn", "rows", "kn")
    monkeypatch.setenv("JAXSPEC_W_LAYOUT", "rows")
    assert for_kernels(_weight(rng, 128, 64)).w_layout == "rows"


@pytest.mark.parametrize("tiling", [
    Tiling(block_n=64, split_k=2, unpack="kpairs"),                       # the GEMV's body
    Tiling(block_n=128, split_k=3, unpack="join", w_left=False),          # two tiles per block
    Tiling(block_m=32, block_n=128, groups_per_step=2, split_k=2, w_left=False, dequant="weights"),  # qmm's
    Tiling(block_m=32, block_n=64, groups_per_step=2, split_k=1, w_left=False, dequant="weights"),
    Tiling(block_n=32, split_k=2, unpack="kpairs"),                       # rows of one tile
    Tiling(block_m=16, block_n=16, groups_per_step=2, split_k=2, w_left=False, dequant="weights"),
])
@pytest.mark.parametrize("sb", ["nk", "kn"])
def test_every_body_reads_tiles_bitwise_like_rows(tiling, sb):
    """N = 192 leaves a 128-wide block half past the end (masked tiles); K = 320 gives 5 groups over the
    splits (a last two-group step past the end)."""
    rng = np.random.default_rng()
    qw = with_sb_layout(_weight(rng, 192, 320), sb)
    x = jnp.asarray(rng.standard_normal((3, 320)), jnp.bfloat16)
    want = _f32(launch(x, qw, tiling, interpret=True))
    ref = np.asarray(x, np.float64) @ np.asarray(dequantize(qw, jnp.float32), np.float64).T
    assert np.linalg.norm(want - ref) / np.linalg.norm(ref) < 1e-2
    np.testing.assert_array_equal(_f32(launch(x, with_w_layout(qw, "tiles"), tiling, interpret=True)), want)


@pytest.mark.parametrize("rows,config", [
    (1, DispatchConfig()), (5, DispatchConfig()), (20, DispatchConfig()), (40, DispatchConfig(qmm_dense_rows=32)),
    (5, DispatchConfig(backend="xla")), (1, DispatchConfig(gemv_kernel="fma")),
    (6, DispatchConfig(gemv_kernel="fma", gemv_block_n=128, gemv_groups_per_step=2, gemv_chains=True)),
    (3, DispatchConfig(gemv_kernel="fma", gemv_block_n=32, gemv_groups_per_step=2)),
    (2, DispatchConfig(gemv_block_n=16)), (20, DispatchConfig(qmm_tile_n=32)),
])
def test_dispatch_paths_read_tiles_bitwise_like_rows(rows, config):
    rng = np.random.default_rng()
    qw = with_sb_layout(_weight(rng, 128, 192), "kn")
    x = jnp.asarray(rng.standard_normal((rows, 192)), jnp.bfloat16)
    np.testing.assert_array_equal(_f32(quantized_matmul(x, with_w_layout(qw, "tiles"), config=config)),
                                  _f32(quantized_matmul(x, qw, config=config)))


def test_fused_launch_reads_tiles_and_mixed_layouts_run_apart():
    rng = np.random.default_rng()
    a, b = _weight(rng, 128, 128), _weight(rng, 64, 128)
    x = jnp.asarray(rng.standard_normal((2, 128)), jnp.bfloat16)
    want = [_f32(quantized_matmul(x, w)) for w in (a, b)]
    for pair in ((with_w_layout(a, "tiles"), with_w_layout(b, "tiles")), (with_w_layout(a, "tiles"), b)):
        for g, w in zip(quantized_matmul_many(x, pair), want):
            np.testing.assert_array_equal(_f32(g), w)


def test_models_store_tiles_and_checkpoints_keep_mlx_words(monkeypatch, tmp_path):
    """With $JAXSPEC_W_LAYOUT=tiles a model stores tiles where N is a multiple of 64; models.save
    writes MLX's row-major words, which load back bitwise (and as rows when the env says rows)."""
    import models
    from models import presets
    from models.checkpoint import _ckpt_module
    from safetensors.numpy import load_file
    monkeypatch.setenv("JAXSPEC_W_LAYOUT", "tiles")
    cfg = models.TargetConfig.from_dict(presets.tiny_target_dict())
    t = presets.random_model(cfg, jax.random.PRNGKey(0), quantize={"bits": 4, "group_size": 32})
    quantized = {n: w for n, w in t.params.items() if isinstance(w, QuantizedWeight)}
    tiled = [n for n, w in quantized.items() if w.w_layout == "tiles"]
    assert tiled and all((w.w_layout == "tiles") == (w.shape[0] % 64 == 0) for w in quantized.values())
    models.save(t, str(tmp_path / "t"))
    files = {}
    for f in os.listdir(tmp_path / "t"):
        if f.endswith(".safetensors"):
            files.update(load_file(str(tmp_path / "t" / f)))
    name = tiled[0]
    np.testing.assert_array_equal(files[_ckpt_module(t, name) + ".weight"], np.asarray(quantized[name].words()))
    monkeypatch.setenv("JAXSPEC_W_LAYOUT", "rows")
    t2 = models.load_target(str(tmp_path / "t"))
    assert t2.params[name].w_layout == "rows"
    np.testing.assert_array_equal(np.asarray(t2.params[name].weight), np.asarray(quantized[name].words()))

