"""jaxspec: speculative decoding (Gemma 4 MTP assistant) in JAX.

    result = jaxspec.generate(target, prompt_ids, assistant=assistant, max_new_tokens=64)
    result.tokens, result.stats

`make_generate(...)` returns the jitted function behind `generate` for reuse;
`jaxspec.engine.streaming.stream_generate` yields the tokens as rounds complete. `load_pair(NAME)` loads a
named (target, drafter) pair with its tokenizer ("default", "gemma-3-270m": jaxspec.pairs). The model families are
`jaxspec.models`, the quantized-matmul and attention kernels `jaxspec.kernels`.
"""
from jaxspec.engine.generate import GenerationResult, GenerationStats, Generator, generate, make_generate
from jaxspec.pairs import load_pair
from jaxspec.engine.sampling import SamplingParams

__all__ = ["GenerationResult", "GenerationStats", "Generator", "SamplingParams", "generate", "load_pair", "make_generate"]
