"""Parity with HF transformers (torch float32, eager attention) on tiny random configs saved with
save_pretrained and loaded with models.load_*: target logits / hidden, assistant logits / next hidden."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers", minversion="5.24")

from jaxspec import models  # noqa: E402
from jaxspec.models import presets  # noqa: E402
from jaxspec.models.config import FULL, SLIDING  # noqa: E402
from support.hf_models import hf_assistant, hf_target  # noqa: E402
from jaxspec.kernels import DispatchConfig  # noqa: E402
from jaxspec.kernels.stack import take  # noqa: E402

XLA = DispatchConfig(backend="xla")
S, F = SLIDING, FULL
SEQ = 12

# Each feature on in one config and off in another: window < SEQ (base) vs > SEQ; softcap on vs off;
# K=V, per-layer inputs, KV sharing (+ double-wide MLP), untied head; the multimodal `gemma4` wrapper.
CONFIGS = {
    "base": dict(target=presets.tiny_target_dict(), multimodal=False, ordered=False),
    "kv_ple": dict(target=presets.tiny_target_dict(
        num_hidden_layers=5, layer_types=[S, F, S, S, F], attention_k_eq_v=True, hidden_size_per_layer_input=8,
        vocab_size_per_layer_input=256, num_kv_shared_layers=2, use_double_wide_mlp=True,
        final_logit_softcapping=None, sliding_window=16, tie_word_embeddings=False), multimodal=False, ordered=True),
    "multimodal_keqv": dict(target=presets.tiny_target_dict(attention_k_eq_v=True, sliding_window=3,
                                                            layer_types=[S, S, F, F]),
                            multimodal=True, ordered=False),
}


def rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


@pytest.fixture(scope="module", params=list(CONFIGS))
def case(request, tmp_path_factory):
    spec = CONFIGS[request.param]
    tdict = spec["target"]
    seed = sum(map(ord, request.param))
    hf_t = hf_target(tdict, seed=seed, multimodal=spec["multimodal"])
    tdir = tmp_path_factory.mktemp(request.param + "_target")
    hf_t.save_pretrained(tdir)
    adict = presets.tiny_assistant_dict(tdict, use_ordered_embeddings=spec["ordered"])
    hf_a = hf_assistant(adict, seed=seed + 1)
    adir = tmp_path_factory.mktemp(request.param + "_assistant")
    hf_a.save_pretrained(adir)
    target = models.load_target(str(tdir), dtype=jnp.float32, matmul=XLA)
    assistant = models.load_assistant(str(adir), dtype=jnp.float32, matmul=XLA, target=target)
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, tdict["vocab_size"], size=(2, SEQ))
    with torch.no_grad():
        out = hf_t(torch.as_tensor(ids), output_hidden_states=True, return_shared_kv_states=True)
    # one cached forward shared by the tests (capacity > SEQ: the draft test reads this cache)
    fwd = jax.jit(models.forward)(target, jnp.asarray(ids, jnp.int32), models.init_cache(target.config, 2, SEQ + 4,
                                                                                         jnp.float32))
    return dict(name=request.param, hf_t=hf_t, hf_a=hf_a, target=target, assistant=assistant, ids=ids, out=out,
                rng=rng, fwd=fwd)


def test_config_parsed_from_saved_json(case):
    cfg = case["target"].config
    hf_cfg = case["hf_t"].config.get_text_config()
    assert cfg.layer_types == tuple(hf_cfg.layer_types)
    for i in range(cfg.num_hidden_layers):
        attn = (case["hf_t"].model.language_model if CONFIGS[case["name"]]["multimodal"]
                else case["hf_t"].model).layers[i].self_attn
        assert cfg.layer_head_dims[i] == attn.head_dim
        assert cfg.kv_shared(i) == attn.is_kv_shared_layer


def test_target_logits_and_hidden_match_hf(case):
    logits, hidden, cache = case["fwd"]
    ref = case["out"].logits.numpy()
    assert logits.shape == ref.shape and logits.dtype == jnp.float32
    assert rel_err(logits, ref) < 1e-4
    assert rel_err(hidden, case["out"].hidden_states[-1].numpy()) < 1e-4
    assert np.array_equal(np.asarray(cache.lengths), [SEQ, SEQ])
    ours = models.shared_kv(case["target"].config, cache)
    for kind, (k_ref, v_ref) in case["out"].shared_kv_states.items():  # HF: [B, heads, T, D]
        assert rel_err(take(ours[kind][0])[:, :SEQ], k_ref.transpose(1, 2).numpy()) < 1e-4
        assert rel_err(take(ours[kind][1])[:, :SEQ], v_ref.transpose(1, 2).numpy()) < 1e-4
    if case["name"] == "base":  # the cache-free scoring call, and Target.__call__
        assert rel_err(jax.jit(models.logits)(case["target"], jnp.asarray(case["ids"], jnp.int32)), ref) < 1e-4
        assert rel_err(case["target"](jnp.asarray(case["ids"][:1, :5], jnp.int32)), ref[:1, :5]) < 1e-4


def _hf_draft(hf_a, hf_t, token, h_prev, position, shared):
    emb = hf_t.get_input_embeddings()(torch.as_tensor(token)[:, None])
    x = torch.cat([emb, torch.as_tensor(np.asarray(h_prev))[:, None]], dim=-1)
    with torch.no_grad():
        o = hf_a(inputs_embeds=x, position_ids=torch.as_tensor(position)[:, None], shared_kv_states=shared)
    return o.logits[:, 0].numpy(), o.last_hidden_state[:, 0].numpy()


def test_assistant_matches_hf(case):
    """Two chained draft steps after a prefill of SEQ tokens, query position = SEQ (HF's convention),
    reading the full shared K/V (longer than the sliding window + 1 in `base`)."""
    target, assistant = case["target"], case["assistant"]
    _, hidden, cache = case["fwd"]
    shared = {k: (v[0], v[1]) for k, v in case["out"].shared_kv_states.items()}
    token = case["rng"].integers(0, target.config.vocab_size, size=(2,))
    position = np.full((2,), SEQ)
    h_ours, h_ref = hidden[:, -1], case["out"].hidden_states[-1][:, -1].numpy()
    step = jax.jit(models.draft_step)
    for _ in range(2):
        logits, h_next = step(assistant, target, cache, jnp.asarray(token, jnp.int32), h_ours,
                              jnp.asarray(position, jnp.int32))
        # one HF call per row: HF's ordered-embeddings filler is the min over the whole batch
        refs = [_hf_draft(case["hf_a"], case["hf_t"], token[r:r + 1], h_ref[r:r + 1], position[r:r + 1],
                          {k: (v[0][r:r + 1], v[1][r:r + 1]) for k, v in shared.items()}) for r in range(2)]
        ref_logits = np.concatenate([r[0] for r in refs]); ref_h = np.concatenate([r[1] for r in refs])
        assert rel_err(logits, ref_logits) < 1e-4
        assert rel_err(h_next, ref_h) < 1e-4
        token = np.asarray(jnp.argmax(logits, -1))
        h_ours, h_ref = h_next, ref_h
