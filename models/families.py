"""The model families jaxspec computes, keyed by config.json's `model_type`: the registry.

Each family is one module holding all that is its own, in its `FAMILY` record (models/family_spec.py):
which config.json `model_type`s it reads, its parser into the fields of the shared `TargetConfig`
(whose family fields say how models/target.py computes it: the RMSNorm offset, the attention scale,
whether v is normed, whether layers carry a scalar) and its config.json writer, the HF class a saved
checkpoint names, its assistants' `model_type`s, where its checkpoints put the text model's weights,
and the GGUF architectures it reads (`GGUFArchitecture`: config, tensor names, fix-up). Everything
else (the params tables, the KV cache and its rings, the layer scan, the attention and matmul
kernels, `models.forward`) is shared.

Adding a family: its module (models/<family>.py, importing only config_fields and family_spec of
the package), plus its `FAMILY` in FAMILIES below. `TargetConfig.from_dict` / `.family` /
`.to_dict`, the checkpoint loader and saver, and models/gguf.py all reach it from here.

Imports run one way: config -> families -> each family module -> family_spec, config_fields.
"""
from __future__ import annotations

from . import gemma3, gemma4
from .config_fields import short
from .family_spec import Family, GGUFArchitecture

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
    if isinstance(model_type, str) and any(model_type in f.assistant_types for f in FAMILIES):
        raise ValueError(f"model_type={model_type!r} is an assistant (drafter) config: load it with "
                         "models.load_assistant / AssistantConfig.from_dict")
    raise ValueError(f"unsupported model_type={short(model_type)}: expected one of {target_types()} for a target")


def gguf_architectures() -> dict[str, GGUFArchitecture]:
    """{GGUF `general.architecture`: how it maps onto HF} over every family."""
    return {a.name: a for f in FAMILIES for a in f.gguf}
