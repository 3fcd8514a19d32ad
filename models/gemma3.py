"""Gemma 3 (text): `gemma3_text`, the text part of `gemma3` (its `text_config`); a GGUF `gemma3`
reaches it as the gemma3_text dict `gguf_config` below makes of the file (models/gguf.py reads it,
through this family's `GGUF` entry, with `gguf_names` and Gemma's norm fix-up `gguf_norm`).

Computed as transformers 5.25 computes it (models/gemma3/modeling_gemma3.py); what differs from
Gemma 4, all carried by the parsed TargetConfig's family fields:
* every RMSNorm (the four per layer, q_norm, k_norm, the final norm) scales by (1 + w)
  (`norm_offset=1`); v is not normed at all (`value_norm=False`); no layer_scalar;
* attention scores are scaled by `query_pre_attn_scalar ** -0.5` (Gemma 4: 1.0);
* one head_dim and one KV head count for every layer; no K=V, no per-layer inputs, no KV sharing;
* rotate-half RoPE over the whole head: base `rope_local_base_freq` (1e4) on sliding layers,
  `rope_theta` (1e6) on full ones; "linear" scaling (the bigger models' full layers) divides the
  frequencies by its factor; other scalings are refused;
* `layer_types`, when absent, is `sliding_window_pattern` (6) - 1 sliding layers then a full one,
  repeated, and the last layer is NOT forced to be full (Gemma 4's config does that);
* the sliding window, the embedding scale sqrt(hidden) (rounded to the activation dtype), the tied
  head, final_logit_softcapping (usually None), the gelu_pytorch_tanh MLP and the sandwich norms
  are as Gemma 4's.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from .config_fields import (ACTIVATIONS, FULL, LAYER_TYPES, SLIDING, RopeConfig, choice, eos_ids, flag, int_field, join,
                            number, short)
from .family_spec import Family, GGUFArchitecture, gguf_value

TEXT_TYPE, WRAPPER_TYPE = "gemma3_text", "gemma3"
ROPE_TYPES = ("default", "linear")

# HF 5.25 Gemma3TextConfig defaults (used where a field is absent)
_DEFAULTS = dict(
    vocab_size=262_208, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26, num_attention_heads=8,
    num_key_value_heads=4, head_dim=256, hidden_activation="gelu_pytorch_tanh", max_position_embeddings=131_072,
    rms_norm_eps=1e-6, eos_token_id=1, tie_word_embeddings=True, attention_bias=False, query_pre_attn_scalar=256,
    sliding_window=4096, final_logit_softcapping=None, attn_logit_softcapping=None,
    use_bidirectional_attention=False, sliding_window_pattern=6,
)
_THETA = {FULL: ("rope_theta", 1_000_000.0), SLIDING: ("rope_local_base_freq", 10_000.0)}


def parse(d: dict[str, Any]) -> dict[str, Any]:
    """The TargetConfig fields of a gemma3_text config dict, or of a gemma3 one (its `text_config`)."""
    if d.get("model_type") == WRAPPER_TYPE:
        text = d.get("text_config")
        if not isinstance(text, dict):
            raise ValueError(f"model_type={WRAPPER_TYPE!r} config has no 'text_config' dict")
        text = dict(text)
        text.setdefault("model_type", TEXT_TYPE)
        if "tie_word_embeddings" in d:  # the top-level flag decides the multimodal model's head
            text["tie_word_embeddings"] = d["tie_word_embeddings"]
        for key in ("eos_token_id", "max_position_embeddings"):  # often only at the top level
            if text.get(key) is None and d.get(key) is not None:
                text[key] = d[key]
        d = text
    if d.get("model_type", TEXT_TYPE) != TEXT_TYPE:
        raise ValueError(f"unsupported text_config model_type={short(d.get('model_type'))}: expected {TEXT_TYPE!r}")

    def get(key):
        return d.get(key, _DEFAULTS.get(key))

    if get("attn_logit_softcapping") is not None:
        raise NotImplementedError(f"attn_logit_softcapping={short(get('attn_logit_softcapping'))} is not supported "
                                  "(attention logits are not softcapped here; Gemma 3 checkpoints leave it null)")
    if flag("use_bidirectional_attention", get("use_bidirectional_attention")):
        raise NotImplementedError("use_bidirectional_attention=true is not supported (causal LM only)")
    if flag("attention_bias", get("attention_bias")):
        raise NotImplementedError("attention_bias=true is not supported (Gemma 3 has no attention bias)")

    n = int_field(d, "num_hidden_layers", get("num_hidden_layers"))
    layer_types = d.get("layer_types")
    if layer_types is None:  # HF: the old int pattern, sliding unless (i + 1) is a multiple of it
        every = number("sliding_window_pattern", get("sliding_window_pattern"), "num_hidden_layers")
        layer_types = [SLIDING if (i + 1) % every else FULL for i in range(n)]
    if not isinstance(layer_types, (list, tuple)):
        raise ValueError(f"config field 'layer_types' must be a list of {LAYER_TYPES}, got {short(layer_types)}")
    if len(layer_types) != n:
        raise ValueError(f"layer_types has {len(layer_types)} entries but num_hidden_layers={n}")
    bad = sorted({short(t) for t in layer_types if not isinstance(t, str) or t not in LAYER_TYPES})
    if bad:
        raise ValueError(f"unsupported layer_types [{join(bad)}]: expected {LAYER_TYPES}")

    head_dim = int_field(d, "head_dim", get("head_dim"))
    kv_heads = int_field(d, "num_key_value_heads", get("num_key_value_heads"))
    ropes = _ropes(d)
    softcap = get("final_logit_softcapping")
    vocab = int_field(d, "vocab_size", get("vocab_size"))
    max_pos = get("max_position_embeddings")
    return dict(
        vocab_size=vocab,
        hidden_size=int_field(d, "hidden_size", get("hidden_size")),
        intermediate_size=int_field(d, "intermediate_size", get("intermediate_size")),
        num_hidden_layers=n,
        num_attention_heads=int_field(d, "num_attention_heads", get("num_attention_heads")),
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        layer_types=tuple(layer_types),
        layer_head_dims=(head_dim,) * n,
        layer_kv_heads=(kv_heads,) * n,
        sliding_window=int_field(d, "sliding_window", get("sliding_window")),
        rope_sliding=ropes[SLIDING],
        rope_full=ropes[FULL],
        rms_norm_eps=number("rms_norm_eps", get("rms_norm_eps")),
        hidden_activation=choice("hidden_activation", get("hidden_activation") or d.get("hidden_act")
                                 or "gelu_pytorch_tanh", ACTIVATIONS),
        final_logit_softcapping=None if softcap is None else number("final_logit_softcapping", softcap),
        tie_word_embeddings=flag("tie_word_embeddings", get("tie_word_embeddings")),
        model_type=TEXT_TYPE,
        eos_token_ids=eos_ids(get("eos_token_id"), vocab),
        max_position_embeddings=None if max_pos is None else number("max_position_embeddings", max_pos),
        norm_offset=1.0,
        query_pre_attn_scalar=number("query_pre_attn_scalar", get("query_pre_attn_scalar")),
        value_norm=False,
        layer_scalar=False,
    )


def _ropes(d: dict) -> dict[str, RopeConfig]:
    """RoPE per layer type, from `rope_parameters` ({layer type: {rope_type, rope_theta, factor}},
    HF 5.x) or the older flat fields (`rope_theta`, `rope_local_base_freq`, and `rope_scaling`,
    which applies to the full layers only), with HF's bases where neither gives one."""
    rope = d.get("rope_parameters")
    if rope is not None and not (isinstance(rope, dict) and set(rope) <= set(LAYER_TYPES)):
        raise ValueError(f"config field 'rope_parameters' must map layer types {LAYER_TYPES} to their RoPE, "
                         f"got {short(rope)}")
    rope = {t: dict((rope or {}).get(t) or {"rope_type": "default"}) for t in LAYER_TYPES}
    scaling = d.get("rope_scaling")
    if scaling is not None:
        if not isinstance(scaling, dict):
            raise ValueError(f"config field 'rope_scaling' must be a dict, got {short(scaling)}")
        rope[FULL].update(scaling)
    out = {}
    for t in LAYER_TYPES:
        p, where = rope[t], f"rope_parameters.{t}"
        key, default = _THETA[t]
        theta = p.get("rope_theta", d.get(key, default))
        rt = p.get("rope_type", p.get("type", "default"))
        if rt not in ROPE_TYPES:
            raise NotImplementedError(f"config field '{where}.rope_type'={short(rt)} is not supported for "
                                      f"Gemma 3: expected one of {ROPE_TYPES}")
        factor = number(f"{where}.factor", p.get("factor")) if rt == "linear" else 1.0
        out[t] = RopeConfig(rope_type=rt, theta=number(f"{where}.rope_theta", theta), factor=factor)
    return out


def to_dict(cfg) -> dict[str, Any]:
    """A gemma3_text config.json dict that transformers' Gemma3TextConfig and `parse` read back."""
    def rope(r: RopeConfig) -> dict:
        return {"rope_type": r.rope_type, "rope_theta": r.theta, **({"factor": r.factor} if r.rope_type == "linear"
                                                                     else {})}

    d = dict(model_type=TEXT_TYPE, vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
             intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_hidden_layers,
             num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.num_key_value_heads,
             head_dim=cfg.head_dim, layer_types=list(cfg.layer_types), sliding_window=cfg.sliding_window,
             rope_parameters={SLIDING: rope(cfg.rope_sliding), FULL: rope(cfg.rope_full)},
             rms_norm_eps=cfg.rms_norm_eps, hidden_activation=cfg.hidden_activation,
             final_logit_softcapping=cfg.final_logit_softcapping, attn_logit_softcapping=None,
             query_pre_attn_scalar=cfg.query_pre_attn_scalar, tie_word_embeddings=cfg.tie_word_embeddings,
             attention_bias=False, use_bidirectional_attention=False)
    ids = cfg.eos_token_ids
    d["eos_token_id"] = (list(ids) if len(ids) > 1 else ids[0]) if ids else None
    if cfg.max_position_embeddings is not None:
        d["max_position_embeddings"] = cfg.max_position_embeddings
    return d


# ---- GGUF (llama.cpp's `gemma3` architecture; models/gguf.py reads the file) --------------------------
# Gemma 3's constants that the GGUF does not carry (transformers' Gemma3TextConfig defaults):
GGUF_LOCAL_ROPE_THETA = 10_000.0
GGUF_SLIDING_PATTERN = 6  # five sliding layers, then a full one
GGUF_QUERY_PRE_ATTN_SCALAR = 256


def gguf_config(meta: dict, infos) -> dict:
    """config.json of a `gemma3` GGUF as transformers reads it (AutoConfig.from_pretrained with
    gguf_file): the file's sizes, its one rope base (the full layers'), the family's constants."""
    a = "gemma3."
    layers = gguf_value(meta, a + "block_count")
    theta = float(gguf_value(meta, a + "rope.freq_base", float))
    tokens = meta.get("tokenizer.ggml.tokens")
    vocab = meta[a + "vocab_size"] if a + "vocab_size" in meta else len(tokens) if isinstance(tokens, list) else None
    if vocab is None:
        raise KeyError("tokenizer.ggml.tokens")
    d = dict(
        architectures=["Gemma3ForCausalLM"], model_type="gemma3_text",
        vocab_size=vocab, hidden_size=gguf_value(meta, a + "embedding_length"),
        intermediate_size=gguf_value(meta, a + "feed_forward_length"), num_hidden_layers=layers,
        num_attention_heads=gguf_value(meta, a + "attention.head_count"),
        num_key_value_heads=gguf_value(meta, a + "attention.head_count_kv"),
        head_dim=gguf_value(meta, a + "attention.key_length"), hidden_activation="gelu_pytorch_tanh",
        max_position_embeddings=gguf_value(meta, a + "context_length"),
        rms_norm_eps=float(gguf_value(meta, a + "attention.layer_norm_rms_epsilon", float)),
        sliding_window=gguf_value(meta, a + "attention.sliding_window"),
        layer_types=["full_attention" if (i + 1) % GGUF_SLIDING_PATTERN == 0 else "sliding_attention"
                     for i in range(layers)],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": GGUF_LOCAL_ROPE_THETA},
                         "full_attention": {"rope_type": "default", "rope_theta": theta}},
        # transformers 4's spelling of the same two bases (Gemma3TextConfig reads either)
        rope_theta=theta, rope_local_base_freq=GGUF_LOCAL_ROPE_THETA,
        query_pre_attn_scalar=GGUF_QUERY_PRE_ATTN_SCALAR, final_logit_softcapping=None,
        attn_logit_softcapping=None, attention_bias=False, attention_dropout=0.0,
        use_bidirectional_attention=False,
        tie_word_embeddings=all(t.name != "output.weight" for t in infos),
    )
    for key, hf in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                    ("padding_token_id", "pad_token_id"), ("unknown_token_id", "unk_token_id")):
        if "tokenizer.ggml." + key in meta:
            d[hf] = meta["tokenizer.ggml." + key]
    return d


_GGUF_LAYER = {  # GGUF name in block i -> (HF module, shape from the config)
    "attn_norm": ("input_layernorm", lambda c: (c["hidden_size"],)),
    "attn_q": ("self_attn.q_proj", lambda c: (c["num_attention_heads"] * c["head_dim"], c["hidden_size"])),
    "attn_k": ("self_attn.k_proj", lambda c: (c["num_key_value_heads"] * c["head_dim"], c["hidden_size"])),
    "attn_v": ("self_attn.v_proj", lambda c: (c["num_key_value_heads"] * c["head_dim"], c["hidden_size"])),
    "attn_output": ("self_attn.o_proj", lambda c: (c["hidden_size"], c["num_attention_heads"] * c["head_dim"])),
    "attn_q_norm": ("self_attn.q_norm", lambda c: (c["head_dim"],)),
    "attn_k_norm": ("self_attn.k_norm", lambda c: (c["head_dim"],)),
    "post_attention_norm": ("post_attention_layernorm", lambda c: (c["hidden_size"],)),
    "ffn_norm": ("pre_feedforward_layernorm", lambda c: (c["hidden_size"],)),
    "ffn_gate": ("mlp.gate_proj", lambda c: (c["intermediate_size"], c["hidden_size"])),
    "ffn_up": ("mlp.up_proj", lambda c: (c["intermediate_size"], c["hidden_size"])),
    "ffn_down": ("mlp.down_proj", lambda c: (c["hidden_size"], c["intermediate_size"])),
    "post_ffw_norm": ("post_feedforward_layernorm", lambda c: (c["hidden_size"],)),
}


def gguf_names(c: dict) -> dict:
    """{GGUF tensor name: (HF name, HF shape)} of a gemma3 GGUF whose config.json dict is `c`."""
    out = {"token_embd.weight": ("model.embed_tokens.weight", (c["vocab_size"], c["hidden_size"])),
           "output_norm.weight": ("model.norm.weight", (c["hidden_size"],))}
    if not c["tie_word_embeddings"]:
        out["output.weight"] = ("lm_head.weight", (c["vocab_size"], c["hidden_size"]))
    for i in range(c["num_hidden_layers"]):
        for g, (hf, shape) in _GGUF_LAYER.items():
            out[f"blk.{i}.{g}.weight"] = (f"model.layers.{i}.{hf}.weight", shape(c))
    return out


def gguf_norm(hf_name: str, w):
    """llama.cpp stores Gemma's norm weights as `1 + w`; HF's convention is `w` (transformers
    subtracts 1 in float32 on load)."""
    if hf_name.endswith("norm.weight"):
        return w - np.float32(1)
    return w


GGUF = GGUFArchitecture("gemma3", gguf_config, gguf_names, gguf_norm)
FAMILY = Family(name="gemma3", model_types=(TEXT_TYPE, WRAPPER_TYPE), parse=parse, to_dict=to_dict,
                architecture="Gemma3ForCausalLM", gguf=(GGUF,))
