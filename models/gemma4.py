"""Gemma 4 (gemma4_text, gemma4_unified_text, and the text part of gemma4 / gemma4_unified): the
family jaxspec was written for, so TargetConfig's family fields default to its numerics (RMSNorm by
w, attention scale 1.0, v RMSNorm'd without a scale, a scalar per layer). Its parser and writer
stay in models/config.py (the assistant's config reuses the parser)."""
from __future__ import annotations

from .config import MULTIMODAL_TYPES, TARGET_TYPES, Family, TargetConfig

FAMILY = Family(name="gemma4", model_types=TARGET_TYPES + MULTIMODAL_TYPES, parse=TargetConfig._from_gemma4_dict,
                to_dict=TargetConfig._gemma4_dict, architecture="Gemma4ForCausalLM")
