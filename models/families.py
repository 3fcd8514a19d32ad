"""The model families jaxspec computes, keyed by `model_type` (and GGUF `general.architecture`).

Each family is one module holding what is its own: which config.json `model_type`s it reads, its
parser into the shared `TargetConfig` (whose family fields say how models/target.py computes it:
the RMSNorm offset, the attention scale, whether v is normed, whether layers carry a scalar), its
config.json writer and the HF class a saved checkpoint names. Everything else (the KV cache and
its rings, the layer scan, the attention and matmul kernels, `models.forward`) is shared.

A third family: its module, with a `FAMILY`, plus one line in FAMILIES below.
"""
from __future__ import annotations

from . import gemma3, gemma4
from .config import ASSISTANT_TYPES, Family, _short

FAMILIES: tuple[Family, ...] = (
    gemma4.FAMILY,
    gemma3.FAMILY,
)


def target_types() -> tuple[str, ...]:
    """Every `model_type` a target config may have."""
    return tuple(t for f in FAMILIES for t in f.model_types)


def family_of(model_type) -> Family:
    """The family that reads `model_type`; ValueError naming the known types otherwise."""
    for f in FAMILIES:
        if isinstance(model_type, str) and model_type in f.model_types:
            return f
    if isinstance(model_type, str) and model_type in ASSISTANT_TYPES:
        raise ValueError(f"model_type={model_type!r} is an assistant (drafter) config: load it with "
                         "models.load_assistant / AssistantConfig.from_dict")
    raise ValueError(f"unsupported model_type={_short(model_type)}: expected one of {target_types()} for a target")


def family_of_gguf(architecture) -> Family:
    """The family of a GGUF file's `general.architecture`; ValueError naming the known ones otherwise."""
    for f in FAMILIES:
        if isinstance(architecture, str) and architecture in f.gguf_architectures:
            return f
    known = tuple(a for f in FAMILIES for a in f.gguf_architectures)
    raise ValueError(f"unsupported GGUF architecture={_short(architecture)}: expected one of {known}")
