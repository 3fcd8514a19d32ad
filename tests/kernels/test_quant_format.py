"""The MLX affine format: bit-exact against mlx.core.quantize, dequantize against mlx, and the
in-memory layout's round trip through MLX's file layout."""
import mlx.core as mx
import numpy as np
import jax.numpy as jnp
import pytest

from jaxspec.kernels import QuantizedWeight, dequantize, quantize, take_rows
from support.seeds import seeded_rng

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
    rng = seeded_rng()
    w = (rng.standard_normal((48, 4 * group_size)) * rng.uniform(0.01, 20)).astype(np.float32)
    w = _special_groups(w, group_size, rng)
    wj = jnp.asarray(w, dtype)
    qw = quantize(wj, bits=bits, group_size=group_size)
    wm = mx.array(np.asarray(wj.astype(jnp.float32)), dtype=MLX_DTYPES[dtype])
    mq, ms, mb = mx.quantize(wm, group_size=group_size, bits=bits)
    words, scales, biases = qw.to_mlx()
    assert words.dtype == jnp.uint32 and scales.dtype == dtype and qw.shape == (48, 4 * group_size)
    np.testing.assert_array_equal(np.asarray(words), np.array(mq))
    np.testing.assert_array_equal(np.asarray(scales.astype(jnp.float32)), np.array(ms.astype(mx.float32)))
    np.testing.assert_array_equal(np.asarray(biases.astype(jnp.float32)), np.array(mb.astype(mx.float32)))
    # Dequantize in float32 from the same words matches mlx's dequantize.
    ref = np.array(mx.dequantize(mq, ms.astype(mx.float32), mb.astype(mx.float32),
                                 group_size=group_size, bits=bits))
    np.testing.assert_allclose(np.asarray(dequantize(qw, jnp.float32)), ref, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("n,bits,group_size", [(64, 4, 64), (100, 4, 32), (130, 8, 128), (7, 2, 64)])
def test_mlx_layout_round_trip(n, bits, group_size):
    """from_mlx stores 64-row tiles per group (rows past N zero) and [K/g, N] scales; to_mlx gives
    MLX's arrays back bit for bit; each stored tile holds the MLX words of its rows and group."""
    rng = seeded_rng()
    k = 4 * group_size
    wpg = group_size * bits // 32
    words = rng.integers(0, 2**32, (n, k * bits // 32), dtype=np.uint32)
    scales, biases = (jnp.asarray(rng.standard_normal((n, k // group_size)), jnp.bfloat16) for _ in range(2))
    qw = QuantizedWeight.from_mlx(words, scales, biases, bits, group_size)
    qw.validate()
    assert qw.shape == (n, k) and qw.weight.shape == (-(-n // 64), k // group_size, 64, wpg)
    assert qw.scales.shape == (k // group_size, n)
    for got, want in zip(qw.to_mlx(), (words, scales, biases)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    r, g = int(rng.integers(n)), int(rng.integers(k // group_size))
    np.testing.assert_array_equal(np.asarray(qw.weight[r // 64, g, r % 64]), words[r, g * wpg:(g + 1) * wpg])
    pad = np.asarray(qw.weight).transpose(0, 2, 1, 3).reshape(-1, k * bits // 32)[n:]
    assert not pad.any()


def test_format_properties():
    """The larger-magnitude extreme of each group is exact and 0.0 is representable (up to the float
    rounding of `-q0 * (edge / q0) + edge`)."""
    rng = seeded_rng()
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
    """An embedding lookup, negative ids wrapping and out-of-range ids clamped as JAX's gather does."""
    rng = seeded_rng()
    qw = quantize(jnp.asarray(rng.standard_normal((140, 128)), jnp.bfloat16))
    ids = rng.integers(-140, 140, size=(3, 5))
    ids[0, 0] = 500
    got = np.asarray(take_rows(qw, jnp.asarray(ids), jnp.float32))
    full = np.asarray(dequantize(qw, jnp.float32))
    np.testing.assert_array_equal(got, full[np.clip(np.where(ids < 0, ids + 140, ids), 0, 139)])


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


def test_validate_and_from_mlx_name_bad_fields():
    rng = seeded_rng()
    qw = quantize(jnp.asarray(rng.standard_normal((8, 128)), jnp.float32))
    with pytest.raises(ValueError, match="biases has shape"):
        QuantizedWeight(qw.weight, qw.scales, qw.biases[:1], 4, 64).validate()
    with pytest.raises(ValueError, match="weight must be"):
        QuantizedWeight(qw.weight[..., :4], qw.scales, qw.biases, 4, 64).validate()
    with pytest.raises(ValueError, match="uint32"):
        QuantizedWeight(qw.weight.astype(jnp.int32), qw.scales, qw.biases, 4, 64).validate()
    words, scales, biases = qw.to_mlx()
    with pytest.raises(ValueError, match="do not agree"):
        QuantizedWeight.from_mlx(words[:, :8], scales, biases, 4, 64)
    with pytest.raises(ValueError, match="unsupported bits"):
        QuantizedWeight.from_mlx(words, scales, biases, 3, 64)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("bad", ["nan", "inf", "-inf"])
def test_quantize_refuses_non_finite_weights(dtype, bad):
    """A NaN would silently become its group's minimum, an inf a NaN scale: both are a ValueError that
    counts them and gives the first index. Under jit (a tracer) the check is skipped, not failed."""
    import jax
    rng = seeded_rng()
    w = rng.standard_normal((16, 128)).astype(np.float32)
    i, j = int(rng.integers(0, 16)), int(rng.integers(0, 128))
    w[i, j] = float(bad)
    n_nan, n_inf = (1, 0) if bad == "nan" else (0, 1)
    with pytest.raises(ValueError, match=rf"weight has non-finite values \({n_nan} NaN and {n_inf} inf of 2048 "
                                         rf"values, the first at index \({i}, {j}\)\)"):
        quantize(jnp.asarray(w, dtype))
    jax.jit(lambda x: quantize(x).scales)(jnp.asarray(w, dtype))  # traced: no check, no error
    w[i, j] = 0.0
    assert quantize(jnp.asarray(w, dtype)).shape == (16, 128)


@pytest.mark.parametrize("kwargs, msg", [
    (dict(bits="4"), r"bits must be an integer, got '4' \(str\)"),
    (dict(group_size="64"), r"group_size must be an integer, got '64' \(str\)"),
    (dict(bits=4.0), r"bits must be an integer, got 4\.0 \(float\)"),
    (dict(bits=True), r"bits must be an integer, got True \(bool\)"),
])
def test_quantize_says_bits_and_group_size_must_be_integers(kwargs, msg):
    with pytest.raises(ValueError, match=msg):
        quantize(jnp.ones((4, 128)), **kwargs)
    from jaxspec.models.params import quant_spec  # the quantize= argument of the loaders and random_model
    with pytest.raises(ValueError, match=msg):
        quant_spec(kwargs)
    qw = quantize(jnp.ones((4, 128)), bits=np.int64(8), group_size=np.int32(32))  # numpy integers are integers
    assert (qw.bits, qw.group_size) == (8, 32) and type(qw.bits) is int
