"""Parameter tables: every parameter of a target or assistant config, with its shape and kind.

A model's params are a flat dict keyed by the HF module path without the checkpoint prefix
("embed_tokens", "layers.3.self_attn.q_proj", "norm", "pre_projection", ...). The tables here are
the single statement of which names a config has and what shape each one takes; loading, saving,
random initialisation and `make_target` / `make_assistant` all check against them. Shapes are
logical: a linear weight is `[N, K]` whether it is stored as a float array or a QuantizedWeight.

This module depends only on the configs and pallas_kernels, so every other module of the package
can import it at the top.
"""
from __future__ import annotations

import numpy as np

from jaxspec.kernels import QuantizedWeight, quantize
from jaxspec.kernels.quant import SUPPORTED_BITS, SUPPORTED_GROUP_SIZES

from .config import AssistantConfig, TargetConfig

LINEAR, VECTOR, INDEX = "linear", "vector", "index"  # 2-D weight | float buffer | integer buffer
BUFFERS = ("layer_scalar", "token_ordering", "draft_vocab")  # stored without a ".weight" suffix
# The assistant's modules outside its inner text model (checkpoints name them without "model.").
TOP_LEVEL = ("pre_projection", "post_projection", "lm_head", "masked_embedding.centroids",
             "masked_embedding.token_ordering", "draft_vocab", "draft_head")
# Derived from the head's table and "draft_vocab" when loaded (`models.assistant.with_draft_vocab`),
# never saved: a 32k-token head is 21 MB at 8 bits, the ids 128 KB.
DERIVED = ("draft_head",)

Shapes = dict[str, tuple[tuple[int, ...], str]]


def _stack_shapes(cfg: TargetConfig, q_only: bool) -> Shapes:
    """The text stack's params. `q_only`: no K/V projections at all (the assistant's layers read
    the target's K/V); otherwise KV-shared layers have none and K=V layers no v_proj."""
    h, out = cfg.hidden_size, {}
    out["embed_tokens"] = ((cfg.vocab_size, h), LINEAR)
    out["norm"] = ((h,), VECTOR)
    if cfg.has_per_layer_inputs:
        n, pd = cfg.num_hidden_layers, cfg.hidden_size_per_layer_input
        out["embed_tokens_per_layer"] = ((cfg.vocab_size_per_layer_input, n * pd), LINEAR)
        out["per_layer_model_projection"] = ((n * pd, h), LINEAR)
        out["per_layer_projection_norm"] = ((pd,), VECTOR)
    for i in range(cfg.num_hidden_layers):
        pre, hd = f"layers.{i}.", cfg.layer_head_dims[i]
        nq, nkv, ff = cfg.num_attention_heads, cfg.layer_kv_heads[i], cfg.mlp_width(i)
        for norm in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm"):
            out[pre + norm] = ((h,), VECTOR)
        if cfg.layer_scalar:
            out[pre + "layer_scalar"] = ((1,), VECTOR)
        out[pre + "self_attn.q_proj"] = ((nq * hd, h), LINEAR)
        out[pre + "self_attn.q_norm"] = ((hd,), VECTOR)
        out[pre + "self_attn.o_proj"] = ((h, nq * hd), LINEAR)
        if not q_only and not cfg.kv_shared(i):
            out[pre + "self_attn.k_proj"] = ((nkv * hd, h), LINEAR)
            out[pre + "self_attn.k_norm"] = ((hd,), VECTOR)
            if not cfg.k_eq_v(i):
                out[pre + "self_attn.v_proj"] = ((nkv * hd, h), LINEAR)
        out[pre + "mlp.gate_proj"] = ((ff, h), LINEAR)
        out[pre + "mlp.up_proj"] = ((ff, h), LINEAR)
        out[pre + "mlp.down_proj"] = ((h, ff), LINEAR)
        if cfg.has_per_layer_inputs:
            pd = cfg.hidden_size_per_layer_input
            out[pre + "per_layer_input_gate"] = ((pd, h), LINEAR)
            out[pre + "per_layer_projection"] = ((h, pd), LINEAR)
            out[pre + "post_per_layer_input_norm"] = ((h,), VECTOR)
    return out


def target_shapes(cfg: TargetConfig) -> Shapes:
    """name -> (logical shape, kind) of every target parameter."""
    out = _stack_shapes(cfg, q_only=False)
    if not cfg.tie_word_embeddings:
        out["lm_head"] = ((cfg.vocab_size, cfg.hidden_size), LINEAR)
    return out


def assistant_shapes(cfg: AssistantConfig) -> Shapes:
    """name -> (logical shape, kind) of every assistant parameter (its stack plus TOP_LEVEL ones)."""
    a = cfg.text
    out = _stack_shapes(a, q_only=True)
    out["pre_projection"] = ((a.hidden_size, 2 * cfg.backbone_hidden_size), LINEAR)
    out["post_projection"] = ((cfg.backbone_hidden_size, a.hidden_size), LINEAR)
    if not cfg.tie_word_embeddings:
        out["lm_head"] = ((a.vocab_size, a.hidden_size), LINEAR)
    if cfg.use_ordered_embeddings:
        out["masked_embedding.centroids"] = ((cfg.num_centroids, a.hidden_size), LINEAR)
        out["masked_embedding.token_ordering"] = ((a.vocab_size,), INDEX)
    if cfg.draft_vocab_size:
        out["draft_vocab"] = ((cfg.draft_vocab_size,), INDEX)
        out["draft_head"] = ((cfg.draft_vocab_size, a.hidden_size), LINEAR)
    return out


def check_params(params: dict, shapes: Shapes, what: str) -> None:
    """ValueError naming every missing / unexpected param, every shape mismatch and every quantized
    param that is not a linear/embedding weight."""
    if not isinstance(params, dict):
        raise ValueError(f"{what} params must be a dict, got {type(params).__name__}")
    missing = sorted(set(shapes) - set(params))
    unexpected = sorted(set(params) - set(shapes))
    problems = []
    if missing:
        problems.append(f"missing params {missing}")
    if unexpected:
        problems.append(f"unexpected params {unexpected}")
    for name in sorted(set(shapes) & set(params)):
        want, kind = shapes[name]
        got = tuple(params[name].shape)
        if got != tuple(want):
            problems.append(f"param {name!r} has shape {got}, expected {tuple(want)}")
        if isinstance(params[name], QuantizedWeight) and kind != LINEAR:
            problems.append(f"param {name!r} is quantized but only linear/embedding weights may be")
    if problems:
        raise ValueError(f"{what} params do not match the config: " + "; ".join(problems))


def quant_spec(spec) -> tuple[int, int]:
    """Validate a `quantize=` argument: None -> (0, 0) (no quantization), else `{"bits": b,
    "group_size": g}` (either key may be left out: 4 and 64) -> (b, g)."""
    if spec is None:
        return 0, 0
    if not isinstance(spec, dict) or set(spec) - {"bits", "group_size"}:
        raise ValueError(f"quantize must be None or a dict with 'bits' and 'group_size', got {spec!r}")
    bits, gs = spec.get("bits", 4), spec.get("group_size", 64)
    for key, v in (("bits", bits), ("group_size", gs)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
            raise ValueError(f"quantize={spec!r}: {key} must be an integer, got {v!r} ({type(v).__name__})")
    bits, gs = int(bits), int(gs)
    if bits not in SUPPORTED_BITS or gs not in SUPPORTED_GROUP_SIZES:
        raise ValueError(f"quantize={spec!r}: bits must be in {SUPPORTED_BITS}, group_size in {SUPPORTED_GROUP_SIZES}")
    return bits, gs


def quantizable(shape: tuple[int, ...], kind: str, group_size: int) -> bool:
    """Whether a param of this shape and kind is quantized at `group_size`: linear/embedding weights
    whose K is a whole number of groups (the rest stay float)."""
    return kind == LINEAR and shape[-1] % group_size == 0


def quantize_params(params: dict, shapes: Shapes, *, bits: int = 4, group_size: int = 64) -> dict:
    """Swap every float linear/embedding leaf whose K is a multiple of group_size for a QuantizedWeight."""
    quant_spec({"bits": bits, "group_size": group_size})
    out = {}
    for name, w in params.items():
        kind = shapes.get(name, (None, None))[1]
        if not isinstance(w, QuantizedWeight) and quantizable(w.shape, kind, group_size):
            try:
                w = quantize(w, bits=bits, group_size=group_size)
            except ValueError as e:  # e.g. NaN / inf: say which param
                raise ValueError(f"param {name!r}: {e}") from None
        out[name] = w
    return out
