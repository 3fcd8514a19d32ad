"""Tiny HF transformers reference models (torch, float32, eager attention) for the model tests.

Needs the dev extras (torch, transformers >= 5.24): import it after `pytest.importorskip` of both.
"""
from __future__ import annotations

import math

import torch
from transformers import (Gemma4AssistantConfig, Gemma4AssistantForCausalLM, Gemma4Config, Gemma4ForCausalLM,
                          Gemma4ForConditionalGeneration, Gemma4TextConfig)


def _randomize(model, seed: int) -> None:
    """Fresh random weights of realistic scale (HF's 0.02-std init makes every logit ~0):
    matrices ~ N(0, 1/fan_in), norm weights ~ 1 + N(0, 0.2^2), layer_scalar ~ U(0.5, 1.5),
    token_ordering a random permutation."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim >= 2:
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]))
            else:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):
                b.copy_(0.5 + torch.rand(b.shape, generator=g))
            elif name.endswith("token_ordering"):
                b.copy_(torch.randperm(b.shape[0], generator=g))


def hf_target(cfg_dict: dict, seed: int = 0, multimodal: bool = False):
    """A random-weight HF Gemma4ForCausalLM (or Gemma4ForConditionalGeneration when multimodal)."""
    d = {k: v for k, v in cfg_dict.items() if k != "model_type"}
    text = Gemma4TextConfig(**d, attn_implementation="eager")
    if multimodal:
        cfg = Gemma4Config(text_config=text.to_dict(), vision_config=None, audio_config=None,
                           tie_word_embeddings=cfg_dict.get("tie_word_embeddings", True))
        cfg._attn_implementation = "eager"
        model = Gemma4ForConditionalGeneration(cfg)
    else:
        model = Gemma4ForCausalLM(text)
    model = model.to(torch.float32).eval()
    _randomize(model, seed)
    return model


def hf_assistant(cfg_dict: dict, seed: int = 1):
    """A random-weight HF Gemma4AssistantForCausalLM."""
    d = {k: v for k, v in cfg_dict.items() if k != "model_type"}
    cfg = Gemma4AssistantConfig(**d)
    cfg._attn_implementation = "eager"
    cfg.text_config._attn_implementation = "eager"
    model = Gemma4AssistantForCausalLM(cfg).to(torch.float32).eval()
    _randomize(model, seed)
    return model


def hf_gemma3(cfg_dict: dict, seed: int = 0):
    """A random-weight HF Gemma3ForCausalLM (float32, eager attention). Norm weights as _randomize
    draws them (~1 + N(0, 0.2^2)): Gemma 3 scales by 1 + w, so a norm computed as w is off by ~2x."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    d = {k: v for k, v in cfg_dict.items() if k != "model_type"}
    model = Gemma3ForCausalLM(Gemma3TextConfig(**d, attn_implementation="eager")).to(torch.float32).eval()
    _randomize(model, seed)
    return model
