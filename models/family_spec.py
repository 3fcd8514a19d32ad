"""What a model family declares: one `Family` record in each family module (models/gemma4.py,
models/gemma3.py), listed by the registry models/families.py; and `GGUFArchitecture`, how one GGUF
`general.architecture` maps onto the family's HF names (models/gguf.py reads through it).

A family's `parse` returns the fields of the one `TargetConfig` as a dict (`TargetConfig.from_dict`
builds and validates the config from it) and its `to_dict` reads a config's attributes: so a family
module imports neither models/config.py nor the registry, and config.py reaches the registry with a
plain import, no circle (tests/test_import_graph.py).
"""
from __future__ import annotations

import dataclasses
from typing import Any

# Where HF's and mlx's multimodal Gemma wrappers put the text model's modules (tried in order: the
# first that names a parameter wins; "" is bare names), and the wrappers' other modules, which a
# text model does not read (their tensors are skipped at load). A family whose checkpoints name
# things otherwise gives its own.
MULTIMODAL_PREFIXES = ("model.language_model.", "language_model.model.", "model.", "language_model.", "")
MULTIMODAL_MODULES = frozenset({"vision_tower", "audio_tower", "embed_vision", "embed_audio", "multi_modal_projector",
                                "vision_model", "audio_model", "rotary_emb"})


@dataclasses.dataclass(frozen=True)
class GGUFArchitecture:
    """How a GGUF whose `general.architecture` is `name` maps onto HF: config(meta, tensor table) ->
    config.json dict (the table's entries have `.name`; a missing metadata key is a KeyError naming
    it, a wrong value a TypeError: `gguf_value` raises both), names(config) -> {GGUF tensor name:
    (HF name, HF shape)}, and `fixup(hf_name, w)`, the float32 fix-up a float tensor needs after
    decoding (Gemma's `1 + w` norms), or None."""

    name: str
    config: Any
    names: Any
    fixup: Any = None


def gguf_value(meta: dict, key: str, kind=int):
    """GGUF metadata `key`, an integer (`kind=int`) or a number (`kind=float`): KeyError when absent,
    TypeError naming it when of another type (models/gguf.py words both as one line naming the file)."""
    if key not in meta:
        raise KeyError(key)
    v = meta[key]
    if kind is int and (isinstance(v, bool) or not isinstance(v, int)):
        raise TypeError(f"{key} must be an integer, got {v!r}")
    if kind is float and (isinstance(v, bool) or not isinstance(v, (int, float))):
        raise TypeError(f"{key} must be a number, got {v!r}")
    return v


@dataclasses.dataclass(frozen=True)
class Family:
    """A model family: the config.json `model_type`s it reads, how it parses such a dict (into
    TargetConfig fields) and writes a config back, the HF class a saved checkpoint names, the
    `model_type`s of its drafter (assistant) configs, where its checkpoints put the text model's
    weights, and the GGUF architectures it reads."""

    name: str
    model_types: tuple[str, ...]     # config.json model_type values (text configs and their wrappers)
    parse: Any                       # config.json dict -> {TargetConfig field: value}
    to_dict: Any                     # TargetConfig -> config.json dict that `parse` reads back
    architecture: str                # `architectures` of a saved checkpoint
    assistant_types: tuple[str, ...] = ()  # models.load_assistant reads these (a target load points there)
    weight_prefixes: tuple[str, ...] = MULTIMODAL_PREFIXES  # checkpoint tensor name = prefix + param name
    ignored_modules: frozenset[str] = MULTIMODAL_MODULES    # a tensor with one of these in its name is skipped
    gguf: tuple[GGUFArchitecture, ...] = ()
