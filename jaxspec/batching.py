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
capacity) and copies that row into the free slot (one jitted, in-place insert), both queued without
waiting: the next step queues its rounds before it reads the prefill's token, so admissions do not
drain the pipeline. The prefill stays batch 1 on purpose: a [B, P] prefill's logits differ in the
last bits from a [1, P] one on CPU (XLA blocks its dot by row count), and a request's output must
not depend on what it was admitted with. A finished or cancelled row stays in the state, inactive,
until a new request takes its slot; inactive rows cost compute, not correctness.

Rows never see each other: each keeps its own cache, lengths and budget, and the kernels compute a
row the same whatever the other rows hold. So a request's greedy output is what `jaxspec.generate`
gives it alone (tests/test_batching.py checks it against generate, request by request). Each slot
draws its random numbers from its own key (`sampling.uniform`), so a sampled request with a seed is
also what generate gives it alone with that seed, on CPU. On the H200 it is an exact sample of the
same distribution but may leave its run alone after some tokens: XLA's fused softmax rounds a row
by how many rows share the call (tests/test_batching_gpu.py; greedy rows are exact there too).

Each request brings its own sampling (temperature, top_k, top_p, logit_bias, logprobs): they are
rows of the state (`sampling.RowParams`), not part of a program. The engine compiles a short ladder
of programs over one state layout (`MODES`: greedy only; sampling; sampling with top-k/top-p and
log-probabilities) and each step runs the cheapest one that covers every live request, so a batch
of greedy requests pays for no distribution and a new setting never compiles. A row computes the
same whichever program runs it (a greedy row is an argmax either way; a sampled row's filter with
top_k and top_p off keeps every token), so its output does not depend on its batch mates (up to
the GPU softmax rounding above, for sampled rows).
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import time

import jax
import jax.numpy as jnp
import numpy as np

from . import loop, sampling
from .generate import (MAX_ROUNDS_PER_CHUNK, PROMPT_BUCKET, _as_batch, _default_stop_ids, check_block_size,
                       check_int, make_generate, stop_array)
from .loop_config import LoopConfig

log = logging.getLogger(__name__)  # warm_up's start and time (INFO: silent unless logging is configured)

# The programs an engine may run, cheapest first; the last covers every request (the state's layout).
MODES = (sampling.SamplingMode(), sampling.SamplingMode(sample=True, bias=True), sampling.FULL_MODE)


@dataclasses.dataclass
class SlotEvent:
    """What one step did to a live slot: `tokens` committed since the last step (the first step
    after admission includes the prefill's token), `done` when the request finished (budget or a
    stop token; the slot is free again). `drafted` / `accepted`: the request's totals so far.
    `logprobs`: for a request admitted with logprobs, one (logprob, [(id, logprob), ...]) per token.
    `error`: the request failed (its prefill's logits were not finite); the slot is free again."""

    slot: int
    tokens: list[int]
    done: bool
    rounds: int
    drafted: int
    accepted: int
    logprobs: list[tuple] | None = None
    error: str | None = None


@functools.partial(jax.jit, donate_argnums=(0,))
def _insert(state: loop.DecodeState, one: loop.DecodeState, slot) -> loop.DecodeState:
    """`state` with row `slot` replaced by `one`'s only row: every per-row field (`loop.row_fields`:
    its cache, tokens, budget, counters, key, sampling values, log-probabilities, and any field
    added later), so nothing of the slot's previous request survives; the shared fields (stop ids,
    round count, histogram) stay the state's."""
    def put(big, row, axis=0):
        return jax.lax.dynamic_update_slice_in_dim(big, row.astype(big.dtype), slot, axis)

    def cache(c, oc):  # the K/V buffers are [(G,) B, L, H, D]: rows on axis ndim - 4
        return c.replace(k=tuple(put(b, o, b.ndim - 4) for b, o in zip(c.k, oc.k)),
                         v=tuple(put(b, o, b.ndim - 4) for b, o in zip(c.v, oc.v)),
                         lengths=put(c.lengths, oc.lengths), pos=None if c.pos is None else put(c.pos, oc.pos))

    special = {"cache": cache, "key": lambda k, ok: k.at[slot].set(ok)}  # one's key is the row's own (scalar)
    return state.replace(**{f: special.get(f, lambda a, b: jax.tree.map(put, a, b))(getattr(state, f), getattr(one, f))
                            for f in loop.row_fields()})


@jax.jit
def _first(one: loop.DecodeState):
    """What the host reads of an admitted request's prefill: its token, done, finite and the token's
    logprobs (one dispatch; read after the next step is queued, so the read does not stall the device)."""
    lps = None if one.lp is None else (one.lp[0, 0], one.top_ids[0, 0], one.top_lp[0, 0])
    return one.bonus[0], one.done[0], one.finite[0], lps


@functools.partial(jax.jit, donate_argnums=(0,))
def _retire(state: loop.DecodeState, slot) -> loop.DecodeState:
    return state.replace(done=state.done.at[slot].set(True))


class BatchEngine:
    """`slots` requests decoding together (see the module docstring). `max_new_tokens`: the largest
    budget a request may ask; `capacity`: cache positions per slot (prompt + budget + K must fit;
    default: the target's context, capped at 8192 so the default cache stays small). `block_size`
    is probed once at `slots` rows at T = 0 (`LoopConfig.for_slots`: the engine's K, verify width
    and capacity, in `config`), as generate does.
    params (a SamplingParams) or its keywords (temperature, top_k, top_p, ...): the request of an
    admission without its own (its budget, seed and logprobs fill what `admit` leaves open). `modes`: the
    program ladder (default MODES); only programs that a step needs are compiled (`warm_up`
    compiles them all)."""

    def __init__(self, target, assistant=None, *, slots: int, max_new_tokens: int, capacity: int | None = None,
                 block_size: int = 4, eos_token_ids=None, seed: int = 0, exactness_probe: bool = True,
                 rounds_per_step: int = 1, modes=MODES, params: sampling.SamplingParams | None = None, **knobs):
        check_int("slots", slots, 1)
        check_int("max_new_tokens", max_new_tokens, 1)
        check_block_size(block_size, target.config.max_position_embeddings)
        check_int("rounds_per_step", rounds_per_step, 1, MAX_ROUNDS_PER_CHUNK)
        self.default = sampling.SamplingParams.build(params, **knobs)
        # Greedy rows are exact only if the K-wide verify is: probed at T = 0 whatever the default.
        self.config = LoopConfig.for_slots(target, assistant, slots=slots, block_size=block_size,
                                           max_new_tokens=max_new_tokens, capacity=capacity,
                                           exactness_probe=exactness_probe)
        self.target, self.slots, self.capacity = target, slots, self.config.capacity
        self.max_new_tokens, self.rounds_per_step = max_new_tokens, rounds_per_step
        k, self.fallback = self.config.block_size, self.config.fallback
        self.block_size = k
        self.drafter = assistant if k > 1 else None
        self.modes = tuple(modes)
        self.gens = [make_generate(block_size=k, max_new_tokens=self.config.budget, cache_size=self.capacity, mode=m)
                     for m in self.modes]
        self.gen = self.gens[-1]  # the layout of the state, and every admission's prefill
        if not self.gen.spec.sampling.covers(self.default):
            raise ValueError(f"the engine's modes cannot run its default sampling {self.default}")
        eos = _default_stop_ids(target) if eos_token_ids is None else tuple(eos_token_ids)
        self.eos = tuple(int(t) for t in eos)
        self.stop_ids = stop_array(self.eos)
        self.seeds = np.random.default_rng(sampling.validate_seed(seed))  # for requests without a seed
        keys = jax.random.split(sampling.seed_key(seed), slots)  # per-row keys; each admission sets its own
        blank = loop.blank_state(self.gen.spec, target, slots, PROMPT_BUCKET, self.stop_ids, keys,
                                 self.gen.rows(slots))
        self.state = jax.tree.map(jnp.copy, blank)  # its zero fields share one buffer: steps donate each
        self.window = rounds_per_step * k + 1  # tokens a row gains per step, at most (+ the prefill's)
        self._decode: dict[int, object] = {}  # mode index -> compiled rounds
        self.seen = [0] * slots
        self.fresh: dict[int, object] = {}  # slot -> its prefill's `_first` (device arrays), not reported yet
        self.owner: list[object | None] = [None] * slots
        self.need: list[sampling.SamplingMode | None] = [None] * slots  # what each live request needs
        self.ticket = [0] * slots  # which admission holds the slot (a snapshot's rows belong to theirs)
        self.admissions = 0
        self.steps = [0] * len(self.modes)  # steps run per program (what mixing costs)
        self.pending = None  # (snapshot, tickets) of the last dispatched step, not read yet

    @property
    def live(self) -> int:
        """Slots holding a request (not yet reported finished)."""
        return sum(o is not None for o in self.owner)

    @property
    def free(self) -> int:
        return self.slots - self.live

    def decode(self, mode_index: int):
        """The compiled step of `modes[mode_index]` (compiled on first use)."""
        if mode_index not in self._decode:
            self._decode[mode_index] = self.gens[mode_index].compiled_rounds(
                self.target, self.drafter, self.state, self.rounds_per_step)
        return self._decode[mode_index]

    def warm_up(self) -> None:
        """Compile every program the engine may run (each step's ladder and the prefill of a
        PROMPT_BUCKET-token prompt), so no request waits for a compile. Logs (INFO, logger
        jaxspec.batching) when it starts and how long it took."""
        t0 = time.perf_counter()
        log.info("batch engine warm-up: %d step programs and a prefill (%d slots, K=%d) ...", len(self.modes),
                 self.slots, self.block_size)
        for i in range(len(self.modes)):
            self.decode(i)
        prompt, lengths, key, limit, stop, rows = self.gen.inputs([[0]], max_new_tokens=1, eos_token_ids=self.eos)
        self.gen.compiled_prefill(self.target, prompt, lengths, key, limit, stop, rows)
        log.info("batch engine warm-up took %.1f s", time.perf_counter() - t0)

    def fits(self, n_prompt: int, max_new_tokens: int) -> bool:
        """Whether a request of this prompt length and budget fits a slot's cache and the budget."""
        return 1 <= max_new_tokens <= self.room(n_prompt)

    def room(self, n_prompt: int) -> int:
        """The largest budget a request of this prompt length fits a slot with (0: none does)."""
        return max(0, min(self.max_new_tokens, self.config.room(n_prompt)))

    def admit(self, prompt_ids, max_new_tokens: int | None = None, seed: int | None = None, owner: object = True,
              params: sampling.SamplingParams | None = None, logprobs: int | None = None) -> int:
        """Prefill one request into a free slot and return the slot. `params`: the request (None:
        the engine's default); `max_new_tokens`, `seed`, `logprobs`, when given, override its own
        (a budget is needed; seed None: one drawn from the engine's seed; logprobs: None or the
        alternatives per token its events carry, 0..20).
        ValueError (before any compute) for bad ids, a budget or prompt that does not fit, a bad
        seed, sampling or bias or no free slot. Nothing waits for the device: the prefill and the
        copy into the slot are queued, and the next `step` queues its rounds before it reads the
        prefill's token, so admitting never drains the pipeline. Non-finite prefill logits
        (`loop.check_prefill`) come back as that step's event with `error` set."""
        rows = _as_batch(prompt_ids)  # generate's rule: a sequence of ints or a 1-D int array
        if len(rows) != 1:
            raise ValueError(f"prompt_ids must be one request's token ids, got {len(rows)} rows")
        ids, vocab = rows[0], self.target.config.vocab_size
        if min(ids) < 0 or max(ids) >= vocab:
            raise ValueError(f"prompt_ids must be a non-empty list of token ids in [0, {vocab})")
        params = self.default if params is None else params
        if not isinstance(params, sampling.SamplingParams):
            raise ValueError(f"params must be a sampling.SamplingParams, got {type(params).__name__}")
        max_new_tokens = params.max_new_tokens if max_new_tokens is None else max_new_tokens
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or \
                not self.fits(len(ids), max_new_tokens):
            raise ValueError(f"a {len(ids)}-token prompt with max_new_tokens={max_new_tokens!r} does not fit this "
                             f"engine (budget 1..{self.max_new_tokens}, {self.capacity} cache positions per slot)")
        if any(t >= vocab for t, _ in params.logit_bias):
            raise ValueError(f"logit_bias token ids must be in [0, {vocab})")
        if params.stop_token_ids:  # the state's stop ids are shared by every slot (stop strings: the caller's)
            raise ValueError("a batch engine's stop ids are its own (eos_token_ids), for every slot: a request "
                             "cannot bring stop_token_ids")
        if logprobs is not None:  # the keyword's range: a request's own was checked when it was built
            logprobs = dataclasses.replace(params, logprobs=logprobs).logprobs
        need = params.mode(logprobs)
        if not self.modes[-1].covers(need):
            raise ValueError(f"no program of this engine runs {params} with logprobs={logprobs}")
        if not self.free:
            raise ValueError(f"all {self.slots} slots are taken")
        seed = params.seed if seed is None else seed
        if seed is None:
            seed = int(self.seeds.integers(0, 2**63))
        slot = self.owner.index(None)
        inputs = self.gen.inputs([ids], max_new_tokens=max_new_tokens, eos_token_ids=self.eos, seed=seed,
                                 params=params.per_row())
        one = self.gen.compiled_prefill(self.target, *inputs)()
        self.state = _insert(self.state, one, jnp.int32(slot))
        self.admissions += 1
        self.seen[slot], self.owner[slot], self.ticket[slot] = 1, owner, self.admissions
        self.need[slot] = need
        self.fresh[slot] = _first(one)
        return slot

    def _mode_index(self) -> int:
        """The cheapest program that covers every live request."""
        needs = [n for n, o in zip(self.need, self.owner) if o is not None]
        return next(i for i, m in enumerate(self.modes) if all(m.covers(n) for n in needs))

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
            i = self._mode_index()
            self.state = self.decode(i)(self.state)
            self.steps[i] += 1
            nxt = (loop.snapshot(self.state, self.window), list(self.ticket))
        report, self.pending = self.pending, nxt
        events = []
        for slot, arrays in self.fresh.items():  # a request's first token, as soon as it exists
            first, done, finite, lps = jax.device_get(arrays)
            if not finite:
                self.state = _retire(self.state, jnp.int32(slot))
                self.owner[slot] = None
                events.append(SlotEvent(slot=slot, tokens=[], done=True, rounds=0, drafted=0, accepted=0,
                                        error=loop.nonfinite_message(f"slot {slot}")))
                continue
            top = self.need[slot].logprobs
            first_lp = None if top < 0 else loop.logprob_entries(lps[0][None], lps[1][None], lps[2][None], top)
            events.append(SlotEvent(slot=slot, tokens=[int(first)], done=bool(done), rounds=0, drafted=0, accepted=0,
                                    logprobs=first_lp))
            if done:  # its first token ended it (a stop id or a budget of 1)
                self.owner[slot] = None
        self.fresh.clear()
        if report is None:
            return events
        snap, tickets = report
        got = loop.Snapshot.of(snap)
        for slot, owner in enumerate(self.owner):
            if owner is None or tickets[slot] != self.ticket[slot]:
                continue
            n, seen = int(got.n_out[slot]), self.seen[slot]
            top = self.need[slot].logprobs
            lps = got.logprobs(slot, seen, n, top) if top >= 0 else None
            events.append(SlotEvent(slot=slot, tokens=got.tokens(slot, seen, n), done=bool(got.done[slot]),
                                    rounds=int(got.row_rounds[slot]), drafted=int(got.drafted[slot]),
                                    accepted=int(got.accepted[slot]), logprobs=lps))
            self.seen[slot] = n
            if got.done[slot]:
                self.owner[slot] = None
        return events

    def cancel(self, slot: int) -> None:
        """Stop the request in `slot` now and free the slot (its row goes inactive)."""
        if isinstance(slot, bool) or not isinstance(slot, int) or not 0 <= slot < self.slots:
            raise ValueError(f"slot must be an integer in [0, {self.slots}), got {slot!r}")
        if self.owner[slot] is not None:
            self.state = _retire(self.state, jnp.int32(slot))
            self.owner[slot] = None
            self.fresh.pop(slot, None)

