"""Several weights on one x in one launch (kernel.launch_many, quantized_matmul_many): bitwise the
same as one launch per weight with the same tiling, float64-accurate through the dispatch, rows
invariant, and the model's forward unchanged in meaning with it on (interpret mode on CPU)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import models
from models import presets
from pallas_kernels import DispatchConfig, dequantize, quantize, quantized_matmul, quantized_matmul_many
from pallas_kernels.kernel import Tiling, launch, launch_many


def _weights(rng, ns, k, dtype=jnp.bfloat16, group_size=64):
    qws = [quantize(jnp.asarray(rng.standard_normal((n, k)) * 0.5, dtype), group_size=group_size) for n in ns]
    return qws, [np.asarray(dequantize(q, jnp.float32), np.float64) for q in qws]


def _rel(a, ref):
    return np.linalg.norm(np.asarray(a, np.float64) - ref) / np.linalg.norm(ref)


@pytest.mark.parametrize("rows,tiling", [
    (3, Tiling(block_n=32, split_k=2, unpack="kpairs")),                       # the GEMV's body
    (20, Tiling(block_m=32, block_n=32, split_k=2, w_left=False, dequant="weights")),  # qmm's body
])
def test_launch_many_is_bitwise_one_launch_per_weight(rows, tiling):
    rng = np.random.default_rng()
    qws, wds = _weights(rng, (40, 16), 192)   # 2 and 1 N blocks, ragged ends
    x = jnp.asarray(rng.standard_normal((rows, 192)), jnp.bfloat16)
    together = launch_many(x, qws, tiling, interpret=True)
    for got, qw, wd in zip(together, qws, wds):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(launch(x, qw, tiling, interpret=True)))
        assert _rel(got.astype(jnp.float32), np.asarray(x.astype(jnp.float32), np.float64) @ wd.T) < 1e-2


def test_quantized_matmul_many_fused_matches_float64_and_keeps_rows_invariant():
    rng = np.random.default_rng()
    qws, wds = _weights(rng, (96, 40), 192)
    fused = DispatchConfig(fused_launch=True)
    x = jnp.asarray(rng.standard_normal((2, 6, 192)), jnp.bfloat16)   # 12 rows: qmm
    for xs in (x[0, :5], x):                                             # 5 rows: multirow
        outs = quantized_matmul_many(xs, qws, config=fused)
        ref = np.asarray(xs.astype(jnp.float32), np.float64)
        for y, wd in zip(outs, wds):
            assert y.shape == (*xs.shape[:-1], wd.shape[0]) and y.dtype == jnp.bfloat16
            assert _rel(y.astype(jnp.float32), ref @ wd.T) < 1e-2
    multi = quantized_matmul_many(x[0, :5], qws, config=fused)
    for i in (3,):   # a row alone (qmv) and among five (multirow): one tiling, the same bits
        alone = quantized_matmul_many(x[0, i:i + 1], qws, config=fused)
        for a, m in zip(alone, multi):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(m[i:i + 1]))


def test_quantized_matmul_many_falls_back_and_rejects_bad_input():
    rng = np.random.default_rng()
    (qa, qb), (wa, wb) = _weights(rng, (32, 40), 128)
    q8 = quantize(jnp.asarray(rng.standard_normal((24, 128)), jnp.bfloat16), bits=8)
    dense = jnp.asarray(rng.standard_normal((16, 128)), jnp.bfloat16)
    x = jnp.asarray(rng.standard_normal((3, 128)), jnp.bfloat16)
    fused = DispatchConfig(fused_launch=True)
    ws = (qa, q8, dense)   # mixed formats: one call per weight, the same results
    for y, w in zip(quantized_matmul_many(x[:1], ws, config=fused), ws):
        np.testing.assert_array_equal(np.asarray(y), np.asarray(quantized_matmul(x[:1], w, config=fused)))
    with pytest.raises(ValueError, match="K mismatch"):
        quantized_matmul_many(x, (qa, quantize(jnp.asarray(rng.standard_normal((8, 192)), jnp.bfloat16))),
                              config=fused)
    many = jnp.asarray(rng.standard_normal((17, 128)), jnp.bfloat16)   # forced multirow past 16 rows:
    with pytest.raises(ValueError, match="at most 16 rows"):             # refused where the kernel runs,
        quantized_matmul_many(many, (qa, qb), path="multirow", config=fused)
    xla = DispatchConfig(fused_launch=True, backend="xla")               # not where it does not
    assert quantized_matmul_many(many, (qa, qb), path="multirow", config=xla)[1].shape == (17, 40)
    with pytest.raises(ValueError, match="at least one weight"):
        quantized_matmul_many(x, (), config=fused)
    with pytest.raises(ValueError, match="differ in bits"):
        launch_many(x, (qa, q8), Tiling(block_n=32), interpret=True)


def test_target_forward_with_fused_launches_matches_separate():
    """q/k/v and gate/up in one launch each: the tiny target's logits agree with the unfused model
    (float32 activations: the fused launch's K split may differ, so not bitwise)."""
    cfg = models.TargetConfig.from_dict(presets.tiny_target_dict(
        num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"]))
    t = presets.random_model(cfg, jax.random.PRNGKey(0), dtype=jnp.float32, quantize={"bits": 4, "group_size": 32})
    ids = jnp.asarray(np.random.default_rng().integers(3, cfg.vocab_size, (1, 5)), jnp.int32)
    run = jax.jit(models.logits)
    base = run(t.replace(matmul=DispatchConfig(fused_launch=False)), ids)
    fused = run(t.replace(matmul=DispatchConfig(fused_launch=True)), ids)
    np.testing.assert_allclose(np.asarray(fused), np.asarray(base), rtol=1e-4, atol=1e-4)
