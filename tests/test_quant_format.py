"""The MLX affine format: bit-exact against mlx.core.quantize, and dequantize against mlx."""
import mlx.core as mx
import numpy as np
import jax.numpy as jnp
import pytest

from pallas_kernels import QuantizedWeight, dequantize, quantize, take_rows

MLX_DTYPES = {jnp.float32: mx.float32, jnp.float16: mx.float16, jnp.bfloat16: mx.bfloat16}


def _special_groups(w, g, rng):
    """Plant the groups the format treats specially: all zero, all negative, constant, one spike."""
    w[0, :g] = 0.0
    w[1, :g] = -np.abs(w[1, :g]) - 0.1
    w[2, :g] = rng.uniform(-3, 3)
    w[3, :g] = 0.0
    w[3, g // 2] = rng.uniform(1, 5)
    return w


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16, jnp.bfloat16])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_quantize_bit_exact_with_mlx(dtype, bits, group_size):
    rng = np.random.default_rng()
    w = (rng.standard_normal((48, 4 * group_size)) * rng.uniform(0.01, 20)).astype(np.float32)
    w = _special_groups(w, group_size, rng)
    wj = jnp.asarray(w, dtype)
    qw = quantize(wj, bits=bits, group_size=group_size)
    wm = mx.array(np.asarray(wj.astype(jnp.float32)), dtype=MLX_DTYPES[dtype])
    mq, ms, mb = mx.quantize(wm, group_size=group_size, bits=bits)
    assert qw.weight.dtype == jnp.uint32 and qw.scales.dtype == dtype
    np.testing.assert_array_equal(np.asarray(qw.weight), np.array(mq))
    np.testing.assert_array_equal(np.asarray(qw.scales.astype(jnp.float32)), np.array(ms.astype(mx.float32)))
    np.testing.assert_array_equal(np.asarray(qw.biases.astype(jnp.float32)), np.array(mb.astype(mx.float32)))
    # Dequantize in float32 from the same words matches mlx's dequantize.
    ref = np.array(mx.dequantize(mq, ms.astype(mx.float32), mb.astype(mx.float32),
                                 group_size=group_size, bits=bits))
    np.testing.assert_allclose(np.asarray(dequantize(qw, jnp.float32)), ref, rtol=1e-6, atol=1e-6)


def test_format_properties():
    """The larger-magnitude extreme of each group is exact and 0.0 is representable (up to the float
    rounding of `-q0 * (edge / q0) + edge`)."""
    rng = np.random.default_rng()
    w = rng.standard_normal((32, 256)).astype(np.float32)
    w[:, ::7] = 0.0
    deq = np.asarray(dequantize(quantize(jnp.asarray(w)), jnp.float32))
    groups, dgroups = w.reshape(32, 4, 64), deq.reshape(32, 4, 64)
    idx = np.abs(groups).argmax(-1)
    np.testing.assert_allclose(np.take_along_axis(dgroups, idx[..., None], -1),
                               np.take_along_axis(groups, idx[..., None], -1), rtol=1e-6)
    zeros = np.abs(dgroups) * (groups == 0)
    assert np.all(zeros <= 1e-6 * np.abs(groups).max(-1, keepdims=True))


def test_take_rows_matches_dequantize():
    rng = np.random.default_rng()
    qw = quantize(jnp.asarray(rng.standard_normal((40, 128)), jnp.bfloat16))
    ids = rng.integers(0, 40, size=(3, 5))
    got = np.asarray(take_rows(qw, jnp.asarray(ids), jnp.float32))
    np.testing.assert_array_equal(got, np.asarray(dequantize(qw, jnp.float32))[ids])


@pytest.mark.parametrize("kwargs, msg", [
    (dict(bits=3), "unsupported bits"),
    (dict(bits=5), "unsupported bits"),
    (dict(group_size=16), "unsupported group_size"),
])
def test_quantize_rejects_unsupported_format(kwargs, msg):
    with pytest.raises(ValueError, match=msg):
        quantize(jnp.ones((4, 128)), **kwargs)


def test_quantize_rejects_bad_shapes_and_dtypes():
    with pytest.raises(ValueError, match="not a multiple of group_size"):
        quantize(jnp.ones((4, 96)), group_size=64)
    with pytest.raises(ValueError, match="rank-2"):
        quantize(jnp.ones((2, 4, 64)))
    with pytest.raises(ValueError, match="float32/float16/bfloat16"):
        quantize(jnp.ones((4, 64), jnp.int32))


def test_validate_names_bad_fields():
    qw = quantize(jnp.asarray(np.random.default_rng().standard_normal((8, 128)), jnp.float32))
    bad = QuantizedWeight(qw.weight, qw.scales[:, :1], qw.biases, 4, 64)
    with pytest.raises(ValueError, match="scales has shape"):
        bad.validate()
    with pytest.raises(ValueError, match="rank 2"):
        QuantizedWeight(qw.weight[None], qw.scales, qw.biases, 4, 64).validate()
