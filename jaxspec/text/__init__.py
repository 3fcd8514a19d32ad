"""Text in and out: tokenizers (a model directory's tokenizer.json, or a GGUF file's metadata), chat
templates, incremental detokenization for streaming.

    from jaxspec.text import load_tokenizer
    tok = load_tokenizer("path/to/model")          # or a .gguf file
"""
from jaxspec.text.load import load_tokenizer
from jaxspec.text.tokenizer import IncrementalDecoder, Tokenizer, TokenizerError

__all__ = ["IncrementalDecoder", "Tokenizer", "TokenizerError", "load_tokenizer"]
