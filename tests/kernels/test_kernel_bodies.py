"""The two kernel bodies under explicit launch shapes (pallas_kernels.launch: gemv, qmm), the qmm
tiling rules and the qmm dense fallback, against float64. Each body rounds in its own way (the GEMV
scales exact-code products, qmm dequantizes each weight to the dot's dtype first), so each must agree
with float64 to that rounding and keep bitwise row invariance."""
import jax
import numpy as np
import jax.numpy as jnp
import pytest

from jaxspec.kernels import DispatchConfig, dequantize, quantize, quantized_matmul
from jaxspec.kernels import launch
from jaxspec.kernels.launch import Tiling, qmm_tiling
from support.seeds import seeded_rng


def _case(rng, n, k, dtype, bits=4, group_size=64):
    qw = quantize(jnp.asarray(rng.standard_normal((n, k)) * 0.5, dtype), bits=bits, group_size=group_size)
    return qw, np.asarray(dequantize(qw, jnp.float32), np.float64)


def _rel(a, ref):
    return np.linalg.norm(np.asarray(jnp.asarray(a, jnp.float32), np.float64) - ref) / np.linalg.norm(ref)


def _ref(x, wd):
    return np.asarray(x.astype(jnp.float32), np.float64) @ wd.T


@pytest.mark.parametrize("dtype,tol,bits,group_size,k,gps,split", [
    (jnp.bfloat16, 1e-2, 4, 64, 320, 2, 2),   # 5 groups: uneven splits, a half-empty last step
    (jnp.float16, 2e-3, 8, 128, 384, 1, 3),   # 3 groups, 4 codes per word (no magic conversion in bf16)
    (jnp.bfloat16, 1e-2, 2, 32, 224, 3, 2),   # 7 groups, 16 codes per word
    (jnp.float32, 1e-5, 4, 64, 448, 2, 1)])   # float32 dots: int->float codes
def test_gemv_body_matches_float64_and_keeps_rows_invariant(dtype, tol, bits, group_size, k, gps, split):
    rng = seeded_rng()
    qw, wd = _case(rng, 72, k, dtype, bits, group_size)
    x = jnp.asarray(rng.standard_normal((5, k)), dtype)
    t = Tiling(block_n=64, groups_per_step=gps, split_k=split)
    (y,) = launch.gemv(x, (qw,), t, interpret=True)
    assert y.shape == (5, 72) and y.dtype == dtype
    assert _rel(y, _ref(x, wd)) < tol
    (one,) = launch.gemv(x[3:4], (qw,), t, interpret=True)
    np.testing.assert_array_equal(np.asarray(one.astype(jnp.float32)), np.asarray(y[3:4].astype(jnp.float32)))


def test_gemv_group_sums_from_the_wrapper():
    """Tiling.xsum="input" (each group's sum(x) summed once by the wrapper, gemv.group_sums) against
    float64 through a two-weight launch over 3 row tiles (the sums' row offset), with rows bitwise the
    same alone as among others; bad values rejected."""
    from jaxspec.kernels.gemv import group_sums
    rng = seeded_rng()
    (qa, wa), (qb, wb) = _case(rng, 40, 192, jnp.bfloat16), _case(rng, 24, 192, jnp.bfloat16)
    x = jnp.asarray(rng.standard_normal((40, 192)), jnp.bfloat16)
    t = Tiling(block_m=16, block_n=64, split_k=2, xsum="input")
    ya, yb = launch._launch(launch.gemv_body, x, (qa, qb), t, interpret=True)  # 40 rows: 3 row tiles
    assert _rel(ya, _ref(x, wa)) < 1e-2 and _rel(yb, _ref(x, wb)) < 1e-2
    for i in (17, 39):  # row tiles 1 and 2: the sums' row offset
        (one,) = launch.gemv(x[i:i + 1], (qa,), t, interpret=True)
        np.testing.assert_array_equal(np.asarray(one.astype(jnp.float32)), np.asarray(ya[i:i + 1].astype(jnp.float32)))
    with pytest.raises(ValueError, match="group_size=96"):
        group_sums(x[:, :96], 96)
    with pytest.raises(ValueError, match="xsum='mma'"):
        Tiling(xsum="mma")
    with pytest.raises(ValueError, match="block_n=32"):
        Tiling(block_n=32)
    with pytest.raises(ValueError, match="at most block_m=16 rows"):
        launch.gemv(x, (qa,), t, interpret=True)
    with pytest.raises(ValueError, match="xsum must be 'reduce'"):
        launch.qmm(x, (qa,), t, interpret=True)


@pytest.mark.parametrize("dtype,tol,k,gps,split", [(jnp.float32, 1e-5, 320, 2, 2), (jnp.bfloat16, 1e-2, 448, 3, 1),
                                                    (jnp.float16, 2e-3, 256, 1, 3), (jnp.bfloat16, 1e-2, 320, 2, 2)])
def test_qmm_body_matches_float64(dtype, tol, k, gps, split):
    """Uneven splits and a last step past a split's end (5 or 7 groups over 2..3 per step)."""
    rng = seeded_rng()
    qw, wd = _case(rng, 72, k, dtype)
    x = jnp.asarray(rng.standard_normal((20, k)), dtype)
    (y,) = launch.qmm(x, (qw,), Tiling(block_m=16, block_n=64, groups_per_step=gps, split_k=split), interpret=True)
    assert y.shape == (20, 72) and y.dtype == dtype
    assert _rel(y, _ref(x, wd)) < tol


def test_qmm_takes_tall_tiles_from_256_rows_of_16_bit_x():
    """256-row tiles from QMM_TALL_ROWS rows (16-bit x only: a float32 tile that tall overflows shared
    memory); below, or when tile_m is configured, 64. The tall launch against float64 in interpret
    mode (one program: a small weight)."""
    cfg = DispatchConfig()
    tall = qmm_tiling(256, (96, 320), 64, cfg)
    assert (tall.block_m, tall.num_warps, tall.num_stages) == (256, 8, 2)
    assert qmm_tiling(255, (96, 320), 64, cfg).block_m == 64
    assert qmm_tiling(512, (96, 320), 64, cfg, x_itemsize=4).block_m == 64
    assert qmm_tiling(512, (96, 320), 64, cfg.replace(qmm_tile_m=32)).block_m == 32
    assert qmm_tiling(64, (3840, 15360), 64, cfg).split_k > 1   # a tall K splits to fill the machine
    rng = seeded_rng()
    qw, wd = _case(rng, 48, 128, jnp.bfloat16)
    x = jnp.asarray(rng.standard_normal((260, 128)), jnp.bfloat16)
    # 260 rows: two 256-row tiles, the second mostly masked (the dense fallback off)
    y = quantized_matmul(x, qw, config=cfg.replace(qmm_dense_rows=0))
    assert y.shape == (260, 48)
    assert _rel(y, _ref(x, wd)) < 1e-2


def test_qmm_dense_fallback_from_its_row_count(monkeypatch):
    """From DispatchConfig.qmm_dense_rows rows the qmm path is dequantize + XLA's dot (no Pallas
    kernel in the program, and bitwise the xla backend); below it, with it set to 0, or for a weight
    over QMM_DENSE_MAX_ELEMENTS, the tiled kernel. Both against float64."""
    rng = seeded_rng()
    qw, wd = _case(rng, 40, 128, jnp.bfloat16)
    cfg = DispatchConfig(qmm_dense_rows=24)
    x = jnp.asarray(rng.standard_normal((24, 128)), jnp.bfloat16)

    def kernel_runs(x, config):
        return "pallas_call" in str(jax.make_jaxpr(lambda x: quantized_matmul(x, qw, config=config))(x))
    assert not kernel_runs(x, cfg)
    y = quantized_matmul(x, qw, config=cfg)
    np.testing.assert_array_equal(np.asarray(y.astype(jnp.float32)),
                                  np.asarray(quantized_matmul(x, qw, config=cfg.replace(backend="xla")).astype(jnp.float32)))
    assert _rel(y, _ref(x, wd)) < 1e-2
    assert kernel_runs(x[:23], cfg)
    assert kernel_runs(x, cfg.replace(qmm_dense_rows=0))
    assert _rel(quantized_matmul(x, qw, config=cfg.replace(qmm_dense_rows=0)), _ref(x, wd)) < 1e-2
    monkeypatch.setattr(launch, "QMM_DENSE_MAX_ELEMENTS", 40 * 128 - 1)
    assert kernel_runs(x, cfg)


def test_qmm_dense_fallback_keeps_one_layers_bf16_weight_alive():
    """The dense fallback dequantizes each weight only once its input exists (xla.dense_after_x), so
    a chain of 6 such matmuls, compiled for this CPU, holds about one transient bf16 weight, not one
    per layer (without that dependency XLA dequantized all six up front: 7 weights of temporaries)."""
    n = k = 512
    cfg = DispatchConfig(qmm_dense_rows=256)

    def chain(x, qws):
        for qw in qws:
            x = jnp.tanh(quantized_matmul(x, qw, config=cfg))
        return x
    qw = jax.eval_shape(lambda: quantize(jnp.ones((n, k), jnp.bfloat16)))
    x = jax.ShapeDtypeStruct((256, k), jnp.bfloat16)
    assert "pallas_call" not in str(jax.make_jaxpr(chain)(x, [qw] * 6))
    compiled = jax.jit(chain).lower(x, [qw] * 6).compile()
    assert compiled.memory_analysis().temp_size_in_bytes < 3 * n * k * 2
