"""The default (target, assistant) pair shipped with jaxspec, and its tokenizer.

    target, assistant, tokenizer = load_default_pair()          # bf16; XLA matmuls on a CPU, Pallas on a GPU
    ids = tokenizer.encode("def fibonacci(n):").ids
    out = jaxspec.generate(target, ids, assistant=assistant, max_new_tokens=64)
    print(tokenizer.decode(out.tokens[0]))

A small Gemma-4-style target and its MTP assistant trained by `jaxspec.train.default_pair` on Python
source (the standard library and 27 installed packages, `corpus.py`), stored in the MLX 4-bit layout
(see docs/default-pair.md for sizes, training and measured quality). Files, in this package's
directory (`default_pair_path()`):

    target/{config.json, model.safetensors}      assistant/{config.json, model.safetensors}
    tokenizer.json                               metrics.json          heldout_prompts.json

Every function takes `path=None`, the packaged directory; pass another directory with the same layout
(e.g. the --out of a training run) to use that pair instead. This module stays light (json, os): the
training recipe lives in the `train` submodule and is imported only when run.
"""
from __future__ import annotations

import json
import os

# The files live in the package data folder jaxspec/data/default_pair/ (code and data in separate rooms).
_HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "default_pair")
REQUIRED = ("target/config.json", "target/model.safetensors", "assistant/config.json",
            "assistant/model.safetensors", "tokenizer.json")
PAD_ID, EOS_ID, BOS_ID = 0, 1, 2  # the tokenizer's first three tokens: <pad>, <eos>, <bos>
TRAIN_COMMAND = "python -m jaxspec.train.default_pair --out OUT"


def default_pair_path() -> str:
    """The packaged pair's directory (jaxspec/data/default_pair)."""
    return _HERE


def _resolve(path: str | None) -> str:
    return _HERE if path is None else os.fspath(path)


def missing_files(path: str | None = None) -> list[str]:
    """The REQUIRED files absent from `path` (default: the packaged pair)."""
    path = _resolve(path)
    return [f for f in REQUIRED if not os.path.isfile(os.path.join(path, f))]


def default_pair_available(path: str | None = None) -> bool:
    return not missing_files(path)


def _require(path: str) -> None:
    missing = missing_files(path)
    if missing:
        raise FileNotFoundError(
            f"the default model pair is not installed: {path!r} lacks {missing}. Train it with "
            f"`{TRAIN_COMMAND}` (about 18 minutes on an H200, or two ~9-minute --stage runs) and copy OUT's files to "
            f"{_HERE!r}, pass path=OUT, or pass your own checkpoints (models.load_target / "
            "models.load_assistant)")


def load_default_pair(dtype=None, *, matmul=None, path: str | None = None):
    """Load the pair in `path` (default: the packaged one) -> (models.Target, models.Assistant,
    tokenizers.Tokenizer).

    dtype: activation / scale dtype (default bfloat16); matmul: a jaxspec.kernels.DispatchConfig for
    both models (None: the loaders' rule, XLA's dense dot on a CPU and the Pallas kernels on a GPU;
    `DispatchConfig.from_env(backend="pallas")` runs the kernels anyway). Raises FileNotFoundError naming the
    missing files when the pair is not installed."""
    import jax.numpy as jnp
    from tokenizers import Tokenizer

    from jaxspec import models

    path = _resolve(path)
    _require(path)
    dtype = jnp.bfloat16 if dtype is None else dtype
    target = models.load_target(os.path.join(path, "target"), dtype=dtype, matmul=matmul)
    assistant = models.load_assistant(os.path.join(path, "assistant"), dtype=dtype, matmul=matmul, target=target)
    tokenizer = Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
    if tokenizer.get_vocab_size() > target.config.vocab_size:
        raise ValueError(f"default pair tokenizer has {tokenizer.get_vocab_size()} tokens but the target's "
                         f"vocabulary is {target.config.vocab_size}")
    return target, assistant, tokenizer


def default_pair_metrics(path: str | None = None) -> dict:
    """metrics.json written by the training script (corpus, sizes, steps, losses, measured quality)."""
    with open(os.path.join(_resolve(path), "metrics.json")) as f:
        return json.load(f)


def heldout_prompts(path: str | None = None) -> list[dict]:
    """The held-out evaluation prompts shipped with the pair: dicts with file, offset, ids, text."""
    with open(os.path.join(_resolve(path), "heldout_prompts.json")) as f:
        return json.load(f)["prompts"]


__all__ = ["BOS_ID", "EOS_ID", "PAD_ID", "REQUIRED", "TRAIN_COMMAND", "default_pair_available",
           "default_pair_metrics", "default_pair_path", "heldout_prompts", "load_default_pair", "missing_files"]
