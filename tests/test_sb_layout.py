"""QuantizedWeight.sb_layout: scales and biases stored as MLX's [N, K/g] ("nk") or transposed
[K/g, N] ("kn", what models store: the GEMV reads a group's scales as one contiguous run). The
values are the same, so every path's result must be bitwise the "nk" result, and MLX's layout must
come back out (dequantize, take_rows, checkpoints)."""
import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import (DispatchConfig, QuantizedWeight, dequantize, quantize, quantized_matmul,
                            quantized_matmul_many, take_rows, with_sb_layout)
from pallas_kernels.kernel import Tiling, launch
from pallas_kernels.quant import default_sb_layout


def _weight(rng, n, k, dtype=jnp.bfloat16, group_size=64):
    return quantize(jnp.asarray(rng.standard_normal((n, k)), dtype), group_size=group_size)


def _f32(a):
    return np.asarray(jnp.asarray(a).astype(jnp.float32))


def test_conversion_round_trips_and_validates():
    rng = np.random.default_rng()
    qw = _weight(rng, 48, 256)
    kn = with_sb_layout(qw, "kn")
    assert kn.sb_layout == "kn" and kn.scales.shape == (4, 48) and kn.shape == qw.shape
    kn.validate()
    back = with_sb_layout(kn, "nk")
    for a, b in ((back.scales, qw.scales), (back.biases, qw.biases), (back.weight, qw.weight)):
        np.testing.assert_array_equal(_f32(a), _f32(b))
    assert with_sb_layout(kn, "kn") is kn
    np.testing.assert_array_equal(_f32(dequantize(kn)), _f32(dequantize(qw)))
    ids = jnp.asarray([[3, 47], [0, 3]])
    np.testing.assert_array_equal(_f32(take_rows(kn, ids)), _f32(take_rows(qw, ids)))
    with pytest.raises(ValueError, match="sb_layout='mk'"):
        with_sb_layout(qw, "mk")
    with pytest.raises(ValueError, match=r"scales has shape \(48, 4\), expected \(4, 48\).*sb_layout='kn'"):
        dataclasses.replace(qw, sb_layout="kn").validate()  # MLX-shaped arrays labelled "kn"


def test_default_layout_is_kn_and_the_env_keeps_mlx(monkeypatch):
    monkeypatch.delenv("JAXSPEC_SB_LAYOUT", raising=False)
    assert default_sb_layout() == "kn"
    monkeypatch.setenv("JAXSPEC_SB_LAYOUT", "nk")
    qw = _weight(np.random.default_rng(), 32, 128)
    assert with_sb_layout(qw).sb_layout == "nk"


@pytest.mark.parametrize("tiling", [
    Tiling(block_n=32, split_k=2, unpack="kpairs"),                      # the GEMV's body
    Tiling(block_n=32, split_k=3, unpack="join", w_left=False),
    Tiling(block_m=32, block_n=32, groups_per_step=2, split_k=2, w_left=False, dequant="weights"),  # qmm's
])
def test_every_body_reads_kn_bitwise_like_nk(tiling):
    """N = 72 is not a multiple of block_n (masked / padded columns), K = 320 gives 5 groups over
    the splits (a last step past the end for the two-group body)."""
    rng = np.random.default_rng()
    qw = _weight(rng, 72, 320)
    x = jnp.asarray(rng.standard_normal((3, 320)), jnp.bfloat16)
    want = _f32(launch(x, qw, tiling, interpret=True))
    ref = np.asarray(x, np.float64) @ np.asarray(dequantize(qw, jnp.float32), np.float64).T
    assert np.linalg.norm(want - ref) / np.linalg.norm(ref) < 1e-2
    np.testing.assert_array_equal(_f32(launch(x, with_sb_layout(qw, "kn"), tiling, interpret=True)), want)


@pytest.mark.parametrize("rows,config", [
    (1, DispatchConfig()), (5, DispatchConfig()), (20, DispatchConfig()),
    (1, DispatchConfig(gemv_kernel="fma")), (6, DispatchConfig(gemv_kernel="fma", gemv_groups_per_step=2)),
    (5, DispatchConfig(backend="xla")),
])
def test_dispatch_paths_read_kn_bitwise_like_nk(rows, config):
    rng = np.random.default_rng()
    qw = _weight(rng, 40, 192)
    x = jnp.asarray(rng.standard_normal((rows, 192)), jnp.bfloat16)
    np.testing.assert_array_equal(_f32(quantized_matmul(x, with_sb_layout(qw, "kn"), config=config)),
                                  _f32(quantized_matmul(x, qw, config=config)))


def test_fused_launch_reads_kn_and_mixed_layouts_run_apart():
    rng = np.random.default_rng()
    a, b = _weight(rng, 48, 128), _weight(rng, 16, 128)
    x = jnp.asarray(rng.standard_normal((2, 128)), jnp.bfloat16)
    want = [_f32(quantized_matmul(x, w)) for w in (a, b)]
    for pair in ((with_sb_layout(a, "kn"), with_sb_layout(b, "kn")), (with_sb_layout(a, "kn"), b)):
        got = quantized_matmul_many(x, pair)
        for g, w in zip(got, want):
            np.testing.assert_array_equal(_f32(g), w)

