"""Continuous batching: a fixed number of slots decoding together, requests admitted and retired
between rounds.

    engine = BatchEngine(target, assistant, slots=8, max_new_tokens=256, capacity=2048)
    slot = engine.admit(prompt_ids, max_new_tokens=64)   # its prefill, into a free slot
    while engine.live:
        for event in engine.step():                      # a round for every live slot; the last one's tokens
            print(event.slot, event.tokens, event.done)

The slots are the rows of one `loop.DecodeState` of static shapes `[slots, ...]` and a cache of
`capacity` positions per row, so every step runs one compiled program: the loop's own round
(`loop.decode_round`), `rounds_per_step` times (`Generator.compiled_rounds`). That program has no
early exit: a loop condition would be read back to the host every round, which makes a GPU call
return only when its rounds are done. Without it the call returns once queued, and the host reads
the previous step's tokens (and admits, retires, streams) while the device runs. Admitting a
request runs the loop's prefill on it alone (batch 1, its prompt width bucketed, the engine's cache
capacity) and copies that row into the free slot (one jitted, in-place insert). A finished or
cancelled row stays in the state, inactive, until a new request takes its slot; inactive rows cost
compute, not correctness.

Rows never see each other: each keeps its own cache, lengths and budget, and the kernels compute a
row the same whatever the other rows hold. So a request's greedy output is what `jaxspec.generate`
gives it alone (tests/test_batching.py checks it against generate, request by request). Each slot
draws its random numbers from its own key (`sampling.uniform`), so a sampled request with a seed is
also what generate gives it alone with that seed. The sampling setting (temperature, top_k, top_p)
is one per engine, static like every LoopSpec's.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from . import loop, sampling
from .generate import (BUDGET_BUCKET, PROMPT_BUCKET, _default_stop_ids, _is_int, _round_up, effective_block_size,
                       make_generate, stop_array)


@dataclasses.dataclass
class SlotEvent:
    """What one step did to a live slot: `tokens` committed since the last step (the first step
    after admission includes the prefill's token), `done` when the request finished (budget or a
    stop token; the slot is free again). `drafted` / `accepted`: the request's totals so far."""

    slot: int
    tokens: list[int]
    done: bool
    rounds: int
    drafted: int
    accepted: int


@functools.partial(jax.jit, donate_argnums=(0,))
def _insert(state: loop.DecodeState, one: loop.DecodeState, slot) -> loop.DecodeState:
    """`state` with row `slot` replaced by `one`'s only row (its cache, tokens, budget, counters,
    key); the shared fields (stop ids, round count, histogram) stay the state's."""
    def put(big, row, axis=0):
        return jax.lax.dynamic_update_slice_in_dim(big, row.astype(big.dtype), slot, axis)

    c, oc = state.cache, one.cache
    cache = c.replace(k=tuple(put(b, o, b.ndim - 4) for b, o in zip(c.k, oc.k)),  # [(G,) B, L, H, D]
                      v=tuple(put(b, o, b.ndim - 4) for b, o in zip(c.v, oc.v)),
                      lengths=put(c.lengths, oc.lengths), pos=None if c.pos is None else put(c.pos, oc.pos))
    rows = {f: put(getattr(state, f), getattr(one, f)) for f in
            ("bonus", "h_prev", "out", "n_out", "limit", "done", "row_rounds", "drafted", "accepted", "finite")}
    return state.replace(cache=cache, key=state.key.at[slot].set(one.key), **rows)


@functools.partial(jax.jit, donate_argnums=(0,))
def _retire(state: loop.DecodeState, slot) -> loop.DecodeState:
    return state.replace(done=state.done.at[slot].set(True))


class BatchEngine:
    """`slots` requests decoding together (see the module docstring). `max_new_tokens`: the largest
    budget a request may ask; `capacity`: cache positions per slot (prompt + budget + K must fit;
    default: the target's context, capped at 8192 so the default cache stays small). `block_size`
    is probed once at `slots` rows at T = 0 (`generate.effective_block_size`), as generate does."""

    def __init__(self, target, assistant=None, *, slots: int, max_new_tokens: int, capacity: int | None = None,
                 block_size: int = 4, temperature: float = 0.0, top_k: int | None = None,
                 top_p: float | None = None, eos_token_ids=None, seed: int = 0, exactness_probe: bool = True,
                 rounds_per_step: int = 1):
        for name, v in (("slots", slots), ("max_new_tokens", max_new_tokens), ("block_size", block_size),
                        ("rounds_per_step", rounds_per_step)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
        sampling.validate_sampling(temperature, top_k, top_p)
        if block_size > 1 and assistant is None:
            block_size = 1
        context = target.config.max_position_embeddings
        if capacity is None:
            capacity = min(context or 8192, 8192)
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < max_new_tokens + block_size + 1:
            raise ValueError(f"capacity must be an integer >= max_new_tokens + block_size + 1 = "
                             f"{max_new_tokens + block_size + 1}, got {capacity!r}")
        self.target, self.slots, self.capacity = target, slots, capacity
        self.max_new_tokens, self.rounds_per_step = max_new_tokens, rounds_per_step
        k, self.fallback, _ = effective_block_size(target, assistant, slots, block_size, temperature, None,
                                                   exactness_probe)
        self.block_size = k
        self.drafter = assistant if k > 1 else None
        self.gen = make_generate(block_size=k, max_new_tokens=_round_up(max_new_tokens, BUDGET_BUCKET),
                                 temperature=float(temperature), top_k=top_k, top_p=top_p, cache_size=capacity)
        eos = _default_stop_ids(target) if eos_token_ids is None else tuple(eos_token_ids)
        self.eos = tuple(int(t) for t in eos)
        self.stop_ids = stop_array(self.eos)
        self.seeds = np.random.default_rng(sampling.validate_seed(seed))  # for requests without a seed
        keys = jax.random.split(sampling.seed_key(seed), slots)  # per-row keys; each admission sets its own
        blank = loop.blank_state(self.gen.spec, target, slots, PROMPT_BUCKET, self.stop_ids, keys)
        self.state = jax.tree.map(jnp.copy, blank)  # its zero fields share one buffer: steps donate each
        self.decode = self.gen.compiled_rounds(target, self.drafter, self.state, rounds_per_step)
        self.seen = [0] * slots
        self.fresh: dict[int, tuple[int, bool]] = {}  # slot -> (the prefill's token, done), not reported yet
        self.owner: list[object | None] = [None] * slots
        self.ticket = [0] * slots  # which admission holds the slot (a snapshot's rows belong to theirs)
        self.admissions = 0
        self.pending = None  # (snapshot, tickets) of the last dispatched step, not read yet

    @property
    def live(self) -> int:
        """Slots holding a request (not yet reported finished)."""
        return sum(o is not None for o in self.owner)


    @property
    def free(self) -> int:
        return self.slots - self.live

    def fits(self, n_prompt: int, max_new_tokens: int) -> bool:
        """Whether a request of this prompt length and budget fits a slot's cache and the budget."""
        return (1 <= max_new_tokens <= self.max_new_tokens
                and n_prompt + max_new_tokens - 1 + self.gen.spec.width(self.slots, self.target.matmul) <= self.capacity)

    def admit(self, prompt_ids, max_new_tokens: int, seed: int | None = None, owner: object = True) -> int:
        """Prefill one request into a free slot and return the slot. `seed`: its sampling seed
        (None: one drawn from the engine's seed). ValueError (before any compute) for bad ids, a
        budget or prompt that does not fit, a bad seed or no free slot; after the prefill for
        non-finite logits (`loop.check_prefill`, the slot stays free)."""
        ids = [int(t) for t in prompt_ids] if _int_list(prompt_ids) else None
        vocab = self.target.config.vocab_size
        if not ids or min(ids) < 0 or max(ids) >= vocab:
            raise ValueError(f"prompt_ids must be a non-empty list of token ids in [0, {vocab})")
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or \
                not self.fits(len(ids), max_new_tokens):
            raise ValueError(f"a {len(ids)}-token prompt with max_new_tokens={max_new_tokens!r} does not fit this "
                             f"engine (budget 1..{self.max_new_tokens}, {self.capacity} cache positions per slot)")
        if not self.free:
            raise ValueError(f"all {self.slots} slots are taken")
        if seed is None:
            seed = int(self.seeds.integers(0, 2**63))
        slot = self.owner.index(None)
        prompt, lengths, key, limit, stop = self.gen.inputs([ids], max_new_tokens=max_new_tokens,
                                                            eos_token_ids=self.eos, seed=seed)
        one = self.gen.compiled_prefill(self.target, prompt, lengths, key, limit, stop)()
        loop.check_prefill(one)  # waits for the prefill: reading its token as well costs no extra wait
        first, done = jax.device_get((one.bonus[0], one.done[0]))
        self.state = _insert(self.state, one, jnp.int32(slot))
        self.admissions += 1
        self.seen[slot], self.owner[slot], self.ticket[slot] = 1, owner, self.admissions
        self.fresh[slot] = (int(first), bool(done))
        return slot

    def step(self) -> list[SlotEvent]:
        """Dispatch `rounds_per_step` rounds for every slot, then report the previous step's: each
        live slot's new tokens (finished slots are freed). Pipelined: the device runs the new rounds
        while the host reads the last ones, so the host's work between steps costs no device time
        (a step's fixed host cost was ~1.5 ms on the H200 when each call waited for its rounds); the
        first step after an idle engine reports nothing from the device yet. A request's first
        token (its prefill's) is reported by the first step after its admission. A slot admitted
        or cancelled after a step was dispatched is left out of that step's report."""
        nxt = None
        if self.live:
            self.state = self.decode(self.state)
            nxt = (loop.snapshot(self.state), list(self.ticket))
        report, self.pending = self.pending, nxt
        events = []
        for slot, (first, done) in self.fresh.items():  # a request's first token, as soon as it exists
            events.append(SlotEvent(slot=slot, tokens=[first], done=done, rounds=0, drafted=0, accepted=0))
            if done:  # its first token ended it (a stop id or a budget of 1)
                self.owner[slot] = None
        self.fresh.clear()
        if report is None:
            return events
        snap, tickets = report
        n_out, done, row_rounds, drafted, accepted, out = loop.unpack_snapshot(snap)
        for slot, owner in enumerate(self.owner):
            if owner is None or tickets[slot] != self.ticket[slot]:
                continue
            n = int(n_out[slot])
            events.append(SlotEvent(slot=slot, tokens=out[slot, self.seen[slot]:n].tolist(), done=bool(done[slot]),
                                    rounds=int(row_rounds[slot]), drafted=int(drafted[slot]),
                                    accepted=int(accepted[slot])))
            self.seen[slot] = n
            if done[slot]:
                self.owner[slot] = None
        return events

    def cancel(self, slot: int) -> None:
        """Stop the request in `slot` now and free the slot (its row goes inactive)."""
        if self.owner[slot] is not None:
            self.state = _retire(self.state, jnp.int32(slot))
            self.owner[slot] = None
            self.fresh.pop(slot, None)


def _int_list(x) -> bool:
    return isinstance(x, (list, tuple, np.ndarray)) and all(_is_int(t) for t in x)
