"""Shared by the tests (moved from tests/engine/test_generate.py: no test module imports another)."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jaxspec import models
from jaxspec.models import presets
from jaxspec.kernels import DispatchConfig


XLA = DispatchConfig(backend="xla")


def make_pair(seed=0, vocab=256, dtype=jnp.float32, matmul=XLA, target_damp=0.2, assistant_damp=0.03,
              layers=4, **target):
    """`target`: more fields of the target's config (e.g. hidden_size); the assistant fits it."""
    td = presets.tiny_target_dict(vocab_size=vocab, num_hidden_layers=layers,
                                  layer_types=["sliding_attention", "full_attention"] * (layers // 2), **target)
    tcfg = models.TargetConfig.from_dict(td)
    acfg = models.AssistantConfig.from_dict(presets.tiny_assistant_dict(td, text=dict(hidden_size=tcfg.hidden_size)))
    k1, k2 = jax.random.split(jax.random.key(seed))
    t = presets.random_model(tcfg, k1, dtype=dtype, matmul=matmul)
    a = presets.random_model(acfg, k2, dtype=dtype, matmul=matmul)
    rng = np.random.default_rng(seed)
    h = tcfg.hidden_size
    tp = dict(t.params)
    tp["norm"] = jnp.asarray(rng.choice([-1, 1], h) * rng.uniform(0.5, 1.5, h), dtype)
    post = ("post_attention_layernorm", "post_feedforward_layernorm")
    for k in tp:
        if k.endswith(post):
            tp[k] = tp[k] * target_damp
    ap = dict(a.params)
    ap["embed_tokens"], ap["norm"] = tp["embed_tokens"], tp["norm"]
    mix = assistant_damp * rng.normal(size=(h, h)) / np.sqrt(h)
    ap["pre_projection"] = jnp.asarray(np.concatenate([np.eye(h), mix], 1), dtype)
    for k in ap:
        if k.endswith(post):
            ap[k] = ap[k] * assistant_damp
    return t.replace(params=tp), a.replace(params=ap)


@functools.lru_cache(maxsize=None)
def pair(**kw):
    return make_pair(**kw)
