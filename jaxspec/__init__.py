"""jaxspec: speculative decoding (Gemma 4 MTP assistant) in JAX.

    result = jaxspec.generate(target, prompt_ids, assistant=assistant, max_new_tokens=64)
    result.tokens, result.stats

`make_generate(...)` returns the jitted function behind `generate` for reuse;
`jaxspec.streaming.stream_generate` yields the tokens as rounds complete. The model families are
`jaxspec.models`, the quantized-matmul and attention kernels `jaxspec.kernels`.
"""
from .generate import GenerationResult, GenerationStats, Generator, generate, make_generate
from .sampling import SamplingParams

__all__ = ["GenerationResult", "GenerationStats", "Generator", "SamplingParams", "generate", "make_generate"]
