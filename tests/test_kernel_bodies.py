"""The tensor-core kernel's variants (pallas_kernels/kernel.py, dq_kernel.py) against float64 and each
other: the three code unpacks change only how values move, so their
results must be bitwise equal; the dequantize-first body rounds each weight once to the dot dtype,
so it must agree with float64 to that rounding and keep bitwise row invariance."""
import numpy as np
import jax.numpy as jnp
import pytest

from pallas_kernels import DispatchConfig, dequantize, quantize, quantized_matmul
from pallas_kernels.kernel import Tiling, launch
from pallas_kernels.tiling import gemv_tiling, qmm_tiling


def _case(rng, n, k, dtype, bits=4, group_size=64):
    qw = quantize(jnp.asarray(rng.standard_normal((n, k)) * 0.5, dtype), bits=bits, group_size=group_size)
    return qw, np.asarray(dequantize(qw, jnp.float32), np.float64)


def _rel(a, ref):
    return np.linalg.norm(np.asarray(a, np.float64) - ref) / np.linalg.norm(ref)


@pytest.mark.parametrize("dtype,bits", [(jnp.bfloat16, 4), (jnp.float16, 8), (jnp.bfloat16, 2), (jnp.float32, 4)])
def test_unpacks_are_bitwise_equal(dtype, bits):
    rng = np.random.default_rng()
    qw, wd = _case(rng, 80, 320, dtype, bits=bits)
    x = jnp.asarray(rng.standard_normal((3, 320)), dtype)
    outs = {}
    for unpack in ("broadcast", "join", "pairs"):
        t = Tiling(block_n=32, split_k=2, unpack=unpack)
        outs[unpack] = np.asarray(launch(x, qw, t, interpret=True).astype(jnp.float32))
    base = outs["broadcast"]
    assert _rel(base, np.asarray(x.astype(jnp.float32), np.float64) @ wd.T) < 1e-2
    for key, y in outs.items():
        np.testing.assert_array_equal(y, base, err_msg=str(key))


@pytest.mark.parametrize("dtype,bits", [(jnp.bfloat16, 4), (jnp.float16, 8), (jnp.bfloat16, 2)])
def test_kpairs_unpack_matches_float64_and_keeps_row_invariance(dtype, bits):
    """One dot per code pair sums the group's products in another order than one dot of the whole
    group, so it is compared with float64, and its rows with themselves computed alone."""
    rng = np.random.default_rng()
    qw, wd = _case(rng, 80, 320, dtype, bits=bits)
    x = jnp.asarray(rng.standard_normal((6, 320)), dtype)
    t = Tiling(block_n=32, split_k=2, unpack="kpairs")
    multi = np.asarray(launch(x, qw, t, interpret=True).astype(jnp.float32))
    assert _rel(multi, np.asarray(x.astype(jnp.float32), np.float64) @ wd.T) < 1e-2
    for i in (0, 4):
        alone = np.asarray(launch(x[i:i + 1], qw, t, interpret=True).astype(jnp.float32))
        np.testing.assert_array_equal(multi[i:i + 1], alone)


def test_kpairs_falls_back_where_it_cannot_run():
    """float32 dots (no magic conversion) and the weight on the right run the "pairs" unpack."""
    rng = np.random.default_rng()
    qw, _ = _case(rng, 48, 192, jnp.float32)
    x = jnp.asarray(rng.standard_normal((3, 192)), jnp.float32)
    for w_left in (True, False):
        got, want = (np.asarray(launch(x, qw, Tiling(block_n=16, w_left=w_left, unpack=u), interpret=True))
                     for u in ("kpairs", "pairs"))
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("dtype,tol,k,gps,split", [(jnp.float32, 1e-5, 320, 2, 2), (jnp.bfloat16, 1e-2, 448, 3, 1),
                                                    (jnp.float16, 2e-3, 256, 1, 3), (jnp.bfloat16, 1e-2, 320, 2, 2)])
def test_dequantize_first_body_matches_float64(dtype, tol, k, gps, split):
    """Uneven splits and a last step past a split's end (5 or 7 groups over 2..3 per step)."""
    rng = np.random.default_rng()
    qw, wd = _case(rng, 72, k, dtype)
    x = jnp.asarray(rng.standard_normal((5, k)), dtype)
    for w_left, block_m in ((True, 16), (False, 16)):
        t = Tiling(block_m=block_m, block_n=32, groups_per_step=gps, split_k=split, w_left=w_left,
                   dequant="weights")
        y = launch(x, qw, t, interpret=True)
        assert y.shape == (5, 72) and y.dtype == dtype
        assert _rel(y, np.asarray(x.astype(jnp.float32), np.float64) @ wd.T) < tol


def test_dequantize_first_dispatch_keeps_row_invariance(monkeypatch):
    monkeypatch.setenv("JAXSPEC_DEQUANT", "weights")
    monkeypatch.setenv("JAXSPEC_GEMV_GROUPS_PER_STEP", "2")
    cfg = DispatchConfig()
    assert gemv_tiling((96, 320), 64, cfg).dequant == "weights" and gemv_tiling((96, 320), 64, cfg).groups_per_step == 2
    assert qmm_tiling(32, (96, 320), 64, cfg).dequant == "weights"
    rng = np.random.default_rng()
    qw, wd = _case(rng, 96, 320, jnp.bfloat16)
    x = jnp.asarray(rng.standard_normal((8, 320)), jnp.bfloat16)
    multi = np.asarray(quantized_matmul(x, qw, config=cfg).astype(jnp.float32))
    for i in (0, 5, 7):
        alone = np.asarray(quantized_matmul(x[i:i + 1], qw, config=cfg).astype(jnp.float32))
        np.testing.assert_array_equal(multi[i:i + 1], alone)
    assert _rel(multi, np.asarray(x.astype(jnp.float32), np.float64) @ wd.T) < 1e-2
    big = jnp.asarray(rng.standard_normal((20, 320)), jnp.bfloat16)  # the qmm path with this body
    assert _rel(quantized_matmul(big, qw, config=cfg), np.asarray(big.astype(jnp.float32), np.float64) @ wd.T) < 1e-2


def test_new_config_fields_validate_and_reach_the_tiling(monkeypatch):
    monkeypatch.setenv("JAXSPEC_GEMV_TARGET_PROGRAMS", "64")
    monkeypatch.setenv("JAXSPEC_GEMV_BLOCK_N", "32")
    assert gemv_tiling((256, 4096), 64, DispatchConfig()).split_k == 8      # 8 n-blocks x 8 = 64 programs
    monkeypatch.setenv("JAXSPEC_GEMV_TARGET_PROGRAMS", "16")
    assert gemv_tiling((256, 4096), 64, DispatchConfig()).split_k == 2
    monkeypatch.setenv("JAXSPEC_GEMV_SPLIT_K", "4")
    assert gemv_tiling((256, 4096), 64, DispatchConfig()).split_k == 4
    monkeypatch.setenv("JAXSPEC_DEQUANT", "both")
    with pytest.raises(ValueError, match="dequant"):
        DispatchConfig()
    monkeypatch.setenv("JAXSPEC_DEQUANT", "codes")
    assert gemv_tiling((256, 4096), 64, DispatchConfig()).unpack == "kpairs"  # the GEMV default
    monkeypatch.setenv("JAXSPEC_GEMV_UNPACK", "join")
    assert gemv_tiling((256, 4096), 64, DispatchConfig()).unpack == "join"
    monkeypatch.setenv("JAXSPEC_GEMV_UNPACK", "gather")
    with pytest.raises(ValueError, match="gemv_unpack='gather'"):
        DispatchConfig()
    monkeypatch.setenv("JAXSPEC_GEMV_UNPACK", "")
    monkeypatch.setenv("JAXSPEC_GEMV_TARGET_PROGRAMS", "0")
    with pytest.raises(ValueError, match="gemv_target_programs"):
        DispatchConfig()


def test_tiling_rejects_unknown_unpack_and_body():
    with pytest.raises(ValueError, match="unpack"):
        Tiling(unpack="gather")
    with pytest.raises(ValueError, match="dequant"):
        Tiling(dequant="both")


def test_qmm_takes_tall_tiles_from_256_rows_of_16_bit_x():
    """256-row tiles from QMM_TALL_ROWS rows (dequantize-first body, 16-bit x only: a float32 tile that
    tall overflows shared memory); below, or when tile_m is configured, 64. The tall launch against
    float64 in interpret mode (one program: a small weight)."""
    cfg = DispatchConfig()
    tall = qmm_tiling(256, (96, 320), 64, cfg)
    assert (tall.block_m, tall.num_warps, tall.num_stages) == (256, 8, 2)
    assert qmm_tiling(255, (96, 320), 64, cfg).block_m == 64
    assert qmm_tiling(512, (96, 320), 64, cfg, x_itemsize=4).block_m == 64
    assert qmm_tiling(512, (96, 320), 64, cfg.replace(qmm_tile_m=32)).block_m == 32
    assert qmm_tiling(512, (96, 320), 64, cfg.replace(dequant="codes")).block_m == 64
    rng = np.random.default_rng()
    qw, wd = _case(rng, 48, 128, jnp.bfloat16)
    x = jnp.asarray(rng.standard_normal((260, 128)), jnp.bfloat16)
    # 260 rows: two 256-row tiles, the second mostly masked (the dense fallback off)
    y = quantized_matmul(x, qw, config=cfg.replace(qmm_dense_rows=0))
    assert y.shape == (260, 48)
    assert _rel(y.astype(jnp.float32), np.asarray(x.astype(jnp.float32), np.float64) @ wd.T) < 1e-2


def test_qmm_dense_fallback_from_its_row_count(monkeypatch):
    """From DispatchConfig.qmm_dense_rows rows the qmm path is dequantize + XLA's dot (no Pallas
    kernel in the program, and bitwise the xla backend); below it, with it set to 0, or for a weight
    over QMM_DENSE_MAX_ELEMENTS, the tiled kernel. Both against float64."""
    import jax
    from pallas_kernels import tiling
    rng = np.random.default_rng()
    qw, wd = _case(rng, 40, 128, jnp.bfloat16)
    cfg = DispatchConfig(qmm_dense_rows=24)
    x = jnp.asarray(rng.standard_normal((24, 128)), jnp.bfloat16)
    ref = np.asarray(x.astype(jnp.float32), np.float64) @ wd.T

    def kernel_runs(x, config):
        return "pallas_call" in str(jax.make_jaxpr(lambda x: quantized_matmul(x, qw, config=config))(x))
    assert not kernel_runs(x, cfg)
    y = quantized_matmul(x, qw, config=cfg)
    np.testing.assert_array_equal(np.asarray(y.astype(jnp.float32)),
                                  np.asarray(quantized_matmul(x, qw, config=cfg.replace(backend="xla")).astype(jnp.float32)))
    assert _rel(y.astype(jnp.float32), ref) < 1e-2
    assert kernel_runs(x[:23], cfg)
    assert kernel_runs(x, cfg.replace(qmm_dense_rows=0))
    assert _rel(quantized_matmul(x, qw, config=cfg.replace(qmm_dense_rows=0)).astype(jnp.float32), ref) < 1e-2
    monkeypatch.setattr(tiling, "QMM_DENSE_MAX_ELEMENTS", 40 * 128 - 1)
    assert kernel_runs(x, cfg)
    with pytest.raises(ValueError, match="qmm_dense_rows"):
        DispatchConfig(qmm_dense_rows=-1)
    monkeypatch.delenv("JAXSPEC_QMM_DENSE_ROWS", raising=False)
    assert DispatchConfig().qmm_dense_rows == 256  # on since the H200 measured dense_after_x (entry 13)


def test_qmm_dense_fallback_keeps_one_layers_bf16_weight_alive():
    """The dense fallback dequantizes each weight only once its input exists (xla.dense_after_x), so
    a chain of 6 such matmuls, compiled for this CPU, holds about one transient bf16 weight, not one
    per layer: without that dependency XLA dequantized all six up front (7.0 weights of temporaries
    here; a 512-token prefill of the whole 12B held 7.6 GB on the H200, docs/kernels.md entry 12)."""
    import jax
    from pallas_kernels import with_sb_layout
    n = k = 512
    cfg = DispatchConfig(qmm_dense_rows=256)

    def chain(x, qws):
        for qw in qws:
            x = jnp.tanh(quantized_matmul(x, qw, config=cfg))
        return x
    qw = jax.eval_shape(lambda: with_sb_layout(quantize(jnp.ones((n, k), jnp.bfloat16)), "kn"))
    x = jax.ShapeDtypeStruct((256, k), jnp.bfloat16)
    assert "pallas_call" not in str(jax.make_jaxpr(chain)(x, [qw] * 6))
    compiled = jax.jit(chain).lower(x, [qw] * 6).compile()
    assert compiled.memory_analysis().temp_size_in_bytes < 3 * n * k * 2


def test_group_sums_from_the_wrapper_match_float64_and_keep_rows_invariant():
    """Tiling.xsum="input" (each group's sum(x) summed once by the wrapper, kernel.group_sums)
    against float64 through a two-weight launch over 3 row tiles (the sums' row offset), with rows
    bitwise the same alone as among others; bad values rejected."""
    from pallas_kernels.kernel import group_sums, launch_many
    rng = np.random.default_rng()
    (qa, wa), (qb, wb) = _case(rng, 40, 192, jnp.bfloat16), _case(rng, 24, 192, jnp.bfloat16)
    x = jnp.asarray(rng.standard_normal((40, 192)), jnp.bfloat16)
    xf = np.asarray(x.astype(jnp.float32), np.float64)
    t = Tiling(block_m=16, block_n=32, groups_per_step=1, split_k=2, w_left=True, unpack="kpairs", xsum="input")
    ya, yb = launch_many(x, (qa, qb), t, interpret=True)
    assert _rel(ya.astype(jnp.float32), xf @ wa.T) < 1e-2 and _rel(yb.astype(jnp.float32), xf @ wb.T) < 1e-2
    for i in (17, 39):  # row tiles 1 and 2: the sums' row offset
        np.testing.assert_array_equal(np.asarray(launch(x[i:i + 1], qa, t, interpret=True).astype(jnp.float32)),
                                      np.asarray(ya[i:i + 1].astype(jnp.float32)))
    with pytest.raises(ValueError, match="group_size=96"):
        group_sums(x[:, :96], 96)
    with pytest.raises(ValueError, match="xsum='mma'"):
        Tiling(xsum="mma")
    with pytest.raises(ValueError, match="gemv_xsum='sum'"):
        DispatchConfig(gemv_xsum="sum")
