"""`load_tokenizer`: a model directory's tokenizer.json, or the tokenizer a GGUF file carries in its
metadata (a .gguf path, or a directory holding one and no tokenizer.json)."""
from __future__ import annotations

import os

from jaxspec.models.checkpoint_files import FileProblem, list_dir
from jaxspec.text.gguf import tokenizer_from_gguf
from jaxspec.text.tokenizer import TOKENIZER_FILE, Tokenizer, TokenizerError, _find_tokenizer_file, is_gguf


def load_tokenizer(model_dir: str, tokenizer_file: str | None = None) -> Tokenizer:
    """`Tokenizer.from_dir(model_dir, tokenizer_file)`; `model_dir` (or `tokenizer_file`) may be
    a GGUF file, and a directory with no tokenizer.json may hold one."""
    model_dir = os.fspath(model_dir)  # a pathlib.Path too
    tokenizer_file = None if tokenizer_file is None else os.fspath(tokenizer_file)
    gguf = _gguf_source(model_dir, tokenizer_file)
    if gguf is not None:
        return tokenizer_from_gguf(gguf)
    return Tokenizer.from_dir(model_dir, tokenizer_file)


def _gguf_source(model_dir: str, tokenizer_file: str | None) -> str | None:
    """The GGUF file to read the tokenizer from, or None for tokenizer.json: `tokenizer_file` or
    `model_dir` naming a .gguf file, or a directory with no tokenizer.json holding one .gguf."""
    if tokenizer_file is not None:
        return tokenizer_file if is_gguf(tokenizer_file) else None
    if is_gguf(model_dir) and not os.path.isdir(model_dir):
        return model_dir
    if not os.path.isdir(model_dir) or os.path.lexists(_find_tokenizer_file(model_dir)):
        return None
    try:
        found = [n for n in list_dir(model_dir) if is_gguf(n)]
    except FileProblem as e:
        raise TokenizerError(str(e)) from None
    if len(found) > 1:
        raise TokenizerError(f"{model_dir!r} holds {len(found)} GGUF files ({', '.join(found)}) and no "
                             f"{TOKENIZER_FILE}: name one")
    return os.path.join(model_dir, found[0]) if found else None
