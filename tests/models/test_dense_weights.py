"""The CPU path: weights dequantized once at load (DenseWeight), the xla dot's row padding, and the
models the loaders prepare. References: float64 numpy for the matmul, the quantized weight's own xla
result (bitwise), classic decoding for the speculative loop."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxspec
from jaxspec import models
from jaxspec.kernels import (DenseWeight, DispatchConfig, Layer, QuantizedWeight, dequantize, prepare_dense,
                             quantize, quantized_matmul, take_rows)
from jaxspec.models import presets
from jaxspec.models.layer_scan import unstack_params
from support.seeds import seeded_int, seeded_rng

XLA = DispatchConfig(backend="xla")
ON_CPU = jax.default_backend() == "cpu"


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_dense_weight_rows_bitwise_whatever_the_row_count(dtype):
    """A row of the xla path is bitwise the same alone or among 2..16 rows (XLA's CPU dot sums one
    row in another order than several: one row is padded), for the quantized weight and its
    DenseWeight alike, which agree bitwise and with float64; a Layer of a stack gives the layer's."""
    rng = seeded_rng()
    w = rng.standard_normal((200, 320)).astype(np.float32) * 0.5
    qw = quantize(jnp.asarray(w, dtype), bits=4, group_size=64)
    dw = prepare_dense(qw)
    assert isinstance(dw, DenseWeight) and dw.dtype == dtype and dw.shape == (200, 320)
    assert dw.nbytes == 200 * 320 * jnp.dtype(dtype).itemsize
    x = jnp.asarray(rng.standard_normal((16, 320)), dtype)
    alone = np.stack([np.asarray(quantized_matmul(x[i:i + 1], dw, config=XLA))[0] for i in range(16)])
    for rows in (1, 2, 3, 5, 8, 16):
        for wt in (qw, dw):
            np.testing.assert_array_equal(np.asarray(quantized_matmul(x[:rows], wt, config=XLA)), alone[:rows],
                                          err_msg=f"{type(wt).__name__}, {rows} rows")
    ref = np.asarray(x.astype(jnp.float32), np.float64) @ np.asarray(dequantize(qw, jnp.float32), np.float64).T
    np.testing.assert_allclose(alone.astype(np.float64), ref, rtol=2e-2 if dtype == jnp.bfloat16 else 1e-5,
                               atol=2e-1 if dtype == jnp.bfloat16 else 1e-4)
    stack = DenseWeight.of(jnp.stack([dw.value() * 2, dw.value()]))
    np.testing.assert_array_equal(np.asarray(quantized_matmul(x[:3], Layer(stack, jnp.int32(1)), config=XLA)),
                                  alone[:3])
    ids = jnp.asarray(rng.integers(0, 200, (2, 5)), jnp.int32)
    np.testing.assert_array_equal(np.asarray(take_rows(dw, ids, dtype)), np.asarray(take_rows(qw, ids, dtype)))


def test_dense_config_and_bad_input(monkeypatch):
    assert XLA.dense_weights == ON_CPU and not DispatchConfig().dense_weights
    assert not DispatchConfig(backend="xla", dense=False).dense_weights
    assert DispatchConfig(backend="xla", dense=True).dense_weights
    assert not DispatchConfig(backend="pallas", dense=True).dense_weights  # the kernels read the quantized form
    monkeypatch.setenv("JAXSPEC_DENSE_WEIGHTS", "0")
    assert DispatchConfig.from_env(backend="xla").dense is False
    monkeypatch.setenv("JAXSPEC_DENSE_WEIGHTS", "maybe")
    with pytest.raises(ValueError, match="JAXSPEC_DENSE_WEIGHTS"):
        DispatchConfig.from_env()
    with pytest.raises(ValueError, match="dense=1 must be None or a bool"):
        DispatchConfig(dense=1)
    with pytest.raises(ValueError, match="float16/bfloat16/float32"):
        DenseWeight.of(jnp.zeros((2, 2), jnp.int32))


@pytest.fixture(scope="module")
def pairs():
    """The tiny pair on the xla backend, quantized (dense=False) and prepared at load (dense=True)."""
    seed = seeded_int(2**31)
    q = presets.tiny_pair(seed=seed, matmul=DispatchConfig(backend="xla", dense=False))
    d = presets.tiny_pair(seed=seed, matmul=DispatchConfig(backend="xla", dense=True))
    return q, d


def test_prepared_pair_decodes_bitwise_like_the_quantized_one(pairs, tmp_path):
    """The loader's dense model: no QuantizedWeight left, its weight bytes reported, forward logits
    bitwise those of the quantized model run the same way (layer by layer: the dense target is not
    scanned, and the scan's program rounds bf16 differently); greedy speculative decoding on it
    equals classic decoding (and the quantized model's), with no fallback; saving it is refused."""
    (tq, aq), (td, ad) = pairs
    tq = tq.replace(params=unstack_params(tq.config, tq.params))
    for m in (td, ad):
        assert not any(isinstance(w, QuantizedWeight) for w in m.params.values())
        assert any(isinstance(w, DenseWeight) for w in m.params.values())
    assert models.weight_bytes(td) > models.weight_bytes(tq) > 0
    rng = seeded_rng()
    ids = jnp.asarray(rng.integers(3, td.config.vocab_size, (1, 7)), jnp.int32)
    np.testing.assert_array_equal(np.asarray(models.logits(td, ids)), np.asarray(models.logits(tq, ids)))
    # A random pair can refuse every draft of one prompt (seed 3464132722: 0 of 69), so up to four
    # prompts (one program) until drafts were accepted: the exactness is checked on each.
    accepted = 0
    for prompt in [ids[0].tolist()] + rng.integers(3, td.config.vocab_size, (3, 7)).tolist():
        spec = jaxspec.generate(td, [prompt], assistant=ad, max_new_tokens=24, block_size=4, eos_token_ids=[])
        classic = jaxspec.generate(td, [prompt], max_new_tokens=24, eos_token_ids=[])
        quant = jaxspec.generate(tq, [prompt], max_new_tokens=24, eos_token_ids=[])
        assert spec.stats.fallback is None and spec.stats.block_size == 4
        assert spec.tokens == classic.tokens == quant.tokens
        accepted += spec.stats.accepted
        if accepted:
            break
    assert accepted > 0
    with pytest.raises(ValueError, match="dequantized for the CPU"):
        models.save(td, str(tmp_path / "t"))


@pytest.mark.skipif(not ON_CPU, reason="the dense default applies where JAX's default backend is the CPU")
def test_only_the_inference_loaders_make_dense_models(pairs, tmp_path):
    """Made to be saved, trained or sharded, a model keeps its quantized weights on a CPU: the
    presets with no config or an xla one whose `dense` is unset (None). Loaded for inference
    (`load_target` / `load_assistant` with their default config), the same files give a dense
    model whose logits are bitwise those of the one prepared from the preset (dense=True)."""
    (tq, aq), (td, ad) = pairs
    for made in (presets.tiny_pair(seed=1), presets.tiny_pair(seed=1, matmul=XLA),
                 (presets.random_model(tq.config, jax.random.PRNGKey(1)),)):
        for m in made:
            assert not m.matmul.dense_weights and not any(isinstance(w, DenseWeight) for w in m.params.values())
    models.save(tq, str(tmp_path / "target"))
    models.save(aq, str(tmp_path / "assistant"))
    t = models.load_target(str(tmp_path / "target"), dtype=tq.dtype)
    a = models.load_assistant(str(tmp_path / "assistant"), dtype=tq.dtype, target=t)
    for m in (t, a):
        assert m.matmul.backend == "xla" and not any(isinstance(w, QuantizedWeight) for w in m.params.values())
    ids = jnp.asarray(seeded_rng().integers(3, t.config.vocab_size, (1, 6)), jnp.int32)
    np.testing.assert_array_equal(np.asarray(models.logits(t, ids)), np.asarray(models.logits(td, ids)))
