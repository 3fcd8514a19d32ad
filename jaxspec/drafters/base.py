"""The drafter protocol and the registry of drafter kinds.

A drafter proposes the K-1 tokens a round verifies. The decode loop (`jaxspec.engine.loop`), generate,
streaming, the batch engine, the server and the CLI ask the drafter what they need (its state, its
proposal, its counters) and never look at its type, so a new kind is one module here plus one line
in `_MODULES`.

A drafter is a frozen, hashable dataclass: its fields are static (part of the compiled loop's
`LoopSpec`; two equal drafters share programs). What it computes with at run time comes in two parts:
- `params`: arrays passed to the compiled programs beside the target (the MTP assistant's weights;
  None for a drafter that needs none, `needs_params` False);
- its per-row state, `DecodeState.draft` (a pytree whose leaves all have the batch as their leading
  axis: the batch engine writes a slot's row of it when it admits a request). `init` builds it from
  the prefill's `Seed`, `advance` updates it after each round.

The protocol (methods of a drafter object):
    kind: str                                  class attribute, the registry name
    needs_params: bool                         class attribute
    init(seed) -> state                        from what the prefill leaves (`Seed`)
    propose(params, target, state, k, key, mode) -> (drafts [B, K-1] int32, q, info)
        `state` is the whole loop state (`DecodeState`, its drafter state in `.draft`); q the
        distributions [B, K-1, V] the drafts were drawn from, or None for point-mass drafts (the
        token itself: accepted with probability p(d)); `info` anything `advance` needs of this round
    advance(state, info, rnd: Round) -> state  after the verify and the walk, the rows' new state
    counters(state) -> dict[str, int]          host-side totals of its own statistics (summed over
                                               rows), for GenerationStats.draft_stats
"""
from __future__ import annotations

import importlib
from typing import Any

import jax
from flax import struct

# kind -> the module that defines it (its `Drafter` class and `DEFAULT`). One line per kind.
_MODULES = {
    "mtp": "jaxspec.drafters.mtp",      # the MTP assistant: a small model over the target's hidden state
    "ngram": "jaxspec.drafters.ngram",  # prompt lookup: the continuation of the last n-gram's latest match
    "hybrid": "jaxspec.drafters.hybrid",  # prompt lookup where the row's last n-gram matches, else the assistant
}
KINDS = tuple(_MODULES)


def get(kind: str):
    """The module of drafter kind `kind` (its `Drafter` class, `DEFAULT` instance); ValueError
    naming the kinds otherwise."""
    if kind not in _MODULES:
        raise ValueError(f"unknown drafter {kind!r}: expected one of {', '.join(KINDS)}")
    return importlib.import_module(_MODULES[kind])


def resolve(drafter, assistant) -> Any:
    """The drafter a call runs (None: classic decoding) from what the caller named: `drafter` None
    (the MTP assistant when one is given, else none), a kind in KINDS (its default settings) or a
    drafter object. ValueError for an unknown kind, an MTP drafter without an assistant, or an
    assistant given to a drafter that does not use one."""
    if drafter is None:
        return None if assistant is None else get("mtp").DEFAULT
    if isinstance(drafter, str):
        drafter = get(drafter).DEFAULT
    elif getattr(drafter, "kind", None) not in _MODULES:
        raise ValueError(f"drafter must be None, one of {', '.join(KINDS)} or a drafter object, got {drafter!r}"[:300])
    if drafter.needs_params and assistant is None:
        raise ValueError(f"drafter {drafter.kind!r} needs an assistant (the MTP drafter's weights)")
    if not drafter.needs_params and assistant is not None:
        raise ValueError(f"drafter {drafter.kind!r} drafts without an assistant: pass assistant=None")
    return drafter


@struct.dataclass
class Seed:
    """What the prefill leaves for any drafter (`Drafter.init` keeps what it uses; the rest is
    dropped before decoding, so a drafter pays only for its own):
    h_last [B, H]: the target's post-norm hidden at each row's last prompt position;
    history int32 [B, C]: the row's prompt, then its first token (C = the cache capacity, which
    bounds prompt + every emitted token); n_prompt int32 [B]: the prompt's length."""

    h_last: jax.Array
    history: jax.Array
    n_prompt: jax.Array


@struct.dataclass
class Round:
    """One round's outcome, per row, as `Drafter.advance` sees it. emitted int32 [B, K] (the first
    `count` are new tokens), count [B], n_acc [B] (drafts accepted by the walk, before budget/stop
    truncation), hidden [B, K, H] (the verify forward's post-norm hidden), last [B] (the index of
    the last emitted token in the block), n_out [B] (tokens emitted before this round), active [B]."""

    emitted: jax.Array
    count: jax.Array
    n_acc: jax.Array
    hidden: jax.Array
    last: jax.Array
    n_out: jax.Array
    active: jax.Array
