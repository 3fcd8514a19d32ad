"""Named (target, drafter) pairs: `jaxspec generate "..." --pair NAME` and `jaxspec.load_pair(NAME)`.

    target, assistant, tok = jaxspec.load_pair("gemma-3-270m")   # tok: a jaxspec.text.tokenizer.Tokenizer
    out = jaxspec.generate(target, tok.encode("The capital of France is"), assistant=assistant,
                           max_new_tokens=32, eos_token_ids=tok.eos_token_ids)
    print(tok.decode(out.tokens[0]))

The pairs:

* "default": the embedded toy pair (jaxspec.default_pair: a 39.6M Gemma-4-style target trained on
  Python sources and its MTP assistant). Offline, what the tests run.
* "gemma-3-270m": Gemma 3 270M from its GGUF (the `gemma3` extra, `models.load_target("gemma-3-270m")`)
  and the drafter shipped in `jaxspec/data/drafters/gemma-3-270m/` (`jaxspec.train.ttt`: one layer,
  an 8,192-token draft head, 8-bit; docs/benchmark_results/drafter-ttt2-h100-2026-12-05.md), laid out
  as `jaxspec.train.ttt` writes it: `config.json` naming the target it was trained for
  (`"target"`, `"target_fingerprint"`), `model.safetensors` without an embedding table (the drafter
  uses the target's), `NOTICE` (the Gemma terms: a drafter distilled from Gemma is a model
  derivative). `assistant=` / `--assistant DIR` runs another drafter made for the same target.

What is missing or wrong is one ValueError line, found before any weight is read: an unknown name,
the target's package not installed, the drafter directory absent or incomplete, a drafter whose
config names another target. (The loader then checks the drafter's fingerprint against the loaded
target.) This module stays light (json, os): nothing is loaded until `load_pair`.
"""
from __future__ import annotations

import dataclasses
import json
import os

_HERE = os.path.dirname(os.path.abspath(__file__))
DRAFTERS = os.path.join(_HERE, "data", "drafters")  # package data: one directory per target name
DRAFTER_FILES = ("config.json", "model.safetensors")
DEFAULT = "default"
REAL = ("gemma-3-270m",)  # targets known by name (models.gguf.KNOWN) with a drafter folder
NAMES = (DEFAULT, *REAL)
TRAIN_COMMAND = ("python -m jaxspec.train.onpolicy_data --target {name} --work DATA, then python -m jaxspec.train.ttt "
                 "--target {name} --data DATA --out DIR")


@dataclasses.dataclass(frozen=True)
class Pair:
    """Where a pair's parts are: `target` a model directory or a .gguf file, `assistant` the drafter's
    directory, `tokenizer` a tokenizer.json to use instead of the target's own (None: the target's)."""

    name: str
    target: str
    assistant: str
    tokenizer: str | None = None


def drafter_dir(name: str) -> str:
    """The shipped drafter's directory for target `name` (it may not exist)."""
    return os.path.join(DRAFTERS, name)


def check_drafter(path: str, name: str) -> None:
    """ValueError (one line) unless `path` is a drafter directory trained for target `name`: its files
    present and its config's "target" naming it. The weights are the loader's to check."""
    hint = f"train one with `{TRAIN_COMMAND.format(name=name)}` and pass --assistant DIR"
    if not os.path.isdir(path):
        raise ValueError(f"no drafter for {name!r}: {path!r} is not a directory ({hint})")
    missing = [f for f in DRAFTER_FILES if not os.path.isfile(os.path.join(path, f))]
    if missing:
        raise ValueError(f"the drafter for {name!r} in {path!r} is incomplete: it lacks {', '.join(missing)} ({hint})")
    try:
        with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
            trained_for = json.load(f).get("target")
    except (OSError, ValueError, AttributeError) as e:
        raise ValueError(f"the drafter config {os.path.join(path, 'config.json')!r} cannot be read: "
                         f"{' '.join(str(e).split()) or type(e).__name__}") from None
    if trained_for != name:
        raise ValueError(f"the drafter in {path!r} was trained for target {trained_for!r}, not {name!r}"
                         if trained_for else f"the drafter config in {path!r} names no target (its \"target\" key): "
                         f"not a drafter made for {name!r} ({hint})")


def resolve(name: str, assistant: str | None = None) -> Pair:
    """The named pair's parts (`assistant`: a drafter directory to use instead of the shipped one; not
    for the default pair). ValueError (one line) when the name is unknown or a part is missing."""
    if name == DEFAULT:
        if assistant is not None:
            raise ValueError("the default pair ships its own assistant: --assistant goes with --model or a real "
                             f"pair ({', '.join(REAL)})")
        from jaxspec import default_pair

        missing = default_pair.missing_files()
        if missing:
            raise ValueError(f"the embedded default pair is not installed: it lacks {', '.join(missing)}")
        root = default_pair.default_pair_path()
        return Pair(name, os.path.join(root, "target"), os.path.join(root, "assistant"),
                    os.path.join(root, "tokenizer.json"))
    if name not in REAL:
        raise ValueError(f"unknown pair {name!r}: the named pairs are {', '.join(NAMES)} (or a pair directory)")
    drafter = drafter_dir(name) if assistant is None else os.fspath(assistant)
    if assistant is None and not any(os.path.isfile(os.path.join(drafter, f)) for f in DRAFTER_FILES):
        raise ValueError(f"no drafter for {name!r} is installed ({drafter!r} holds none): run the target alone "
                         f"(--model {name} --draft ngram: prompt lookup; --model {name}: classic) or pass "
                         "--assistant DIR (a drafter trained with python -m jaxspec.train.ttt)")
    check_drafter(drafter, name)  # before the target's package: cheap, and names the real gap first
    from jaxspec.models import gguf

    return Pair(name, gguf.by_name(name), drafter)


def load_pair(name: str = DEFAULT, dtype=None, *, assistant: str | None = None, matmul=None):
    """Load a named pair -> (models.Target, models.Assistant, jaxspec.text.tokenizer.Tokenizer).

    dtype: activation / scale dtype (default bfloat16); matmul: a jaxspec.kernels.DispatchConfig for both
    models (None: the loaders' rule, XLA on a CPU, the Pallas kernels on a GPU); assistant: a drafter
    directory instead of the shipped one (e.g. the --out of a training run). ValueError (one line) as
    `resolve`, and from the loader for a drafter whose fingerprint is another target's."""
    import jax.numpy as jnp

    from jaxspec import models

    from jaxspec.text import load_tokenizer

    pair = resolve(name, assistant)
    if name == DEFAULT:  # its own loader (and its checks), with the pair's tokenizer as jaxspec's Tokenizer
        from jaxspec import default_pair

        target, drafter, _ = default_pair.load_default_pair(dtype, matmul=matmul)
        return target, drafter, load_tokenizer(pair.target, pair.tokenizer)
    dtype = jnp.bfloat16 if dtype is None else dtype
    target = models.load_target(pair.target, dtype=dtype, matmul=matmul)
    drafter = models.load_assistant(pair.assistant, dtype=dtype, matmul=matmul, target=target)
    tok = load_tokenizer(pair.target, pair.tokenizer)
    return target, drafter, tok


def unavailable(name: str) -> str | None:
    """Why the named pair cannot be loaded (`resolve`'s one line), or None when its parts are there:
    make demo asks before it runs."""
    try:
        resolve(name)
    except ValueError as e:
        return " ".join(str(e).split())
    return None


__all__ = ["DEFAULT", "DRAFTERS", "DRAFTER_FILES", "NAMES", "Pair", "REAL", "check_drafter", "drafter_dir",
           "load_pair", "resolve", "unavailable"]
