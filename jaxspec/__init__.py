"""jaxspec: speculative decoding (Gemma 4 MTP assistant) in JAX.

    result = jaxspec.generate(target, prompt_ids, assistant=assistant, max_new_tokens=64)
    result.tokens, result.stats

`make_generate(...)` returns the jitted function behind `generate` for reuse.
"""
from .generate import GenerationResult, GenerationStats, Generator, generate, make_generate
from .sampling import SamplingParams
from .verify import DEFAULT_VERIFY_PAD, VERIFY_PAD_ENV

__all__ = ["DEFAULT_VERIFY_PAD", "GenerationResult", "GenerationStats", "Generator", "SamplingParams",
           "VERIFY_PAD_ENV", "generate", "make_generate"]
