"""Continuous batching: a fixed number of slots decoding together, requests admitted and retired
between rounds.

    engine = BatchEngine(target, assistant, slots=8, max_new_tokens=256, capacity=2048)
    slot = engine.admit(prompt_ids, max_new_tokens=64)   # a free slot and its KV blocks; prefilled by the steps
    while engine.live:
        for event in engine.step():                      # a round for every live slot; the last one's tokens
            print(event.slot, event.tokens, event.done)

The slots are the rows of one `loop.DecodeState` of static shapes `[slots, ...]`, so every step runs
one compiled program: the loop's own round (`loop.decode_round`), `rounds_per_step` times
(`Generator.compiled_rounds`). That program has no early exit: a loop condition would be read back
to the host every round, which makes a GPU call return only when its rounds are done. Without it the
call returns once queued, and the host reads the previous step's tokens (and admits, retires,
streams) while the device runs.

KV memory is per request, not per slot (`models.init_paged_cache`): the global layers' K/V live in
one pool of blocks shared by the slots, each row reads its blocks through its table row; the
sliding layers keep a ring per slot (its size is the window's, whatever the request). Admission takes
the blocks the request's prompt + budget + K can write, all at once (host bookkeeping: `free_blocks`,
`blocks`), so a running request never runs out and is never preempted; a request that does not fit
the free blocks waits (`can_admit`). Its end (finished, cancelled, failed) gives them back at once:
its table row points nowhere first, so what its row still computes in an in-flight step is dropped.
With prefix reuse (`prefix_cache`, jaxspec/engine/prefix_cache.py) the pool's blocks are counted
references: a prompt whose first chunks another prompt computed holds those blocks too and starts
its prefill after them (its rings from a snapshot); a block nobody holds stays cached until a
request needs it. Only prompt blocks are shared, and a row writes only at or past its own length, so
no row ever writes into a block it shares.

A prompt is prefilled in chunks of `prefill_chunk` tokens (the last one padded), as many chunks a
step as the step's budget has lanes left (see below), queued before the step's decode rounds, so a
long prompt delays the running streams by a step's chunks, not by its whole prefill. A step has one token budget (`step_tokens`): every
slot's decode rounds are counted first, what is left buys lanes (`lanes`, fixed per engine), and
the waiting prompts' next chunks fill them and run in one program (`packed_prefill`): every waiting
prompt one lane, then the long prompts' further chunks in the lanes left. The prompts
whose rest fits one chunk (they finish this step) take lanes before the ones with more left, each
class in admission order: a short request admitted behind a long prompt gets its first token after a
step or two, not after the whole long prefill. After a step whose lanes went to short ones while a
long prompt waited, the long ones go first, so the oldest long prompt advances at least every other
step however many short ones arrive. Where a prompt is cut depends on the prompt alone, and a lane
computes the same whatever the other lanes hold (its forward's shape is fixed: see packed_prefill),
so the budget and the order change when a request's tokens come, not which tokens. A prompt's last
chunk picks the first token as `loop.prefill` does and writes every per-row field of the slot
(`packed_prefill.put_lanes`), which makes the row live for that step's rounds. Nothing waits for the
device.
Until then the row is done: the rounds leave its outputs alone, and what they write into its cache
lies at or past its length, which the next chunk overwrites before reading (the rollback rule of
models/cache.py). A finished or cancelled row stays in the state, inactive and owning no block, until
a new request takes its slot; inactive rows cost compute, not correctness.

Rows never see each other: each keeps its own cache, lengths and budget, and the kernels compute a
row the same whatever the other rows hold. So a request's greedy output is what `jaxspec.generate`
gives it alone (tests/engine/test_batching.py checks it against generate, request by request). Each slot
draws its random numbers from its own key (`sampling.uniform`), so a sampled request with a seed is
also what generate gives it alone with that seed, on CPU. On the H200 it is an exact sample of the
same distribution but may leave its run alone after some tokens: XLA's fused softmax rounds a row
by how many rows share the call (tests/engine/test_batching_gpu.py; greedy rows are exact there too).

Each request brings its own sampling (temperature, top_k, top_p, logit_bias, penalties, logprobs): they are
rows of the state (`sampling.RowParams`), not part of a program. The engine compiles a short ladder
of programs over one state layout (`MODES`: greedy only; sampling with bias and penalties; sampling
with top-k/top-p and log-probabilities too) and each step runs the cheapest one that covers every live request, so a batch
of greedy requests pays for no distribution and a new setting never compiles. A row computes the
same whichever program runs it (a greedy row is an argmax either way; a sampled row's filter with
top_k and top_p off keeps every token), so its output does not depend on its batch mates (up to
the GPU softmax rounding above, for sampled rows).

On a CPU (the XLA path) a layer gathers each row's view of the pool (`models.paged_view`), and a
round's cost grows with the view's width. So a step reads only as many positions as its decoding
rows can touch: the host bounds each row's positions (its prompt, plus K a round since: a round
adds at most K to its length, and reads and writes at most a verify forward's width past it), and
the step runs on the table cut to the power-of-two bucket above the largest (`view_bucket`, from
VIEW_BUCKET up to the capacity; `models.narrow`; while the bucket is within the sliding layers'
rings, they are cut to it too, and `models.widen` puts the rounds' writes back), one program per
bucket and sampling mode, each compiled (or loaded from disk) on first use. Rows still prefilling
are left out of the bound: they are done, and what the rounds would write into their cache lies
past their length (the next chunk writes it again). A row reads what the whole table gives it,
bitwise (dense_attention's key blocks: tests/engine/test_view_buckets.py). Elsewhere (the attention
kernels, a GPU) every step reads the whole table, as before: their arithmetic over fewer keys is
not checked to be the same.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec import models
from jaxspec.kernels import EMPTY

from jaxspec.drafters import base as drafters
from jaxspec.engine import loop, packed_prefill, sampling
from jaxspec.engine.prefix_cache import (MAX_RING_SNAPSHOTS, BlockPool, RingSnapshots, default_snapshots, restore,
                                         root_key)
from jaxspec.engine.generate import (MAX_ROUNDS_PER_CHUNK, PROMPT_BUCKET, _as_batch, _default_stop_ids, check_block_size,
                       check_int, make_generate, stop_array)
from jaxspec.engine.loop_config import (MAX_PREFILL_CHUNK, MAX_STEP_TOKENS, PREFILL_CHUNK, STEP_TOKENS, VIEW_BUCKET,
                                        LoopConfig, round_up, view_bucket)
from jaxspec.kernels import ROW_TILE

log = logging.getLogger(__name__)  # warm_up's start and time (INFO: silent unless logging is configured)

# The programs an engine may run, cheapest first; the last covers every request (the state's layout).
# Penalties ride in the middle program (elementwise on the logits, no sort) so a penalised request
# without top-k / top-p does not pay for the full one.
MODES = (sampling.SamplingMode(), sampling.SamplingMode(sample=True, bias=True, penalties=True), sampling.FULL_MODE)


@dataclasses.dataclass
class SlotEvent:
    """What one step did to a live slot: `tokens` committed since the last step (a request's first
    event starts with its prefill's token), `done` when the request finished (budget or a
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


@functools.partial(jax.jit, donate_argnums=(0,), static_argnames=("entries",))
def _assign(state: loop.DecodeState, slot, table_row, length, snaps=None, at=None, *, entries=()) -> loop.DecodeState:
    """Give row `slot` its blocks (`table_row`) and a cache of `length` positions: 0 (no ring
    position), or a prefix hit's (its first blocks shared, its rings snapshot `at` of `snaps`,
    `prefix_cache.RingSnapshots.arrays`); done (no decode step emits for it) until its prompt's last
    chunk."""
    c = state.cache
    c = c.replace(table=c.table.at[slot].set(table_row), lengths=c.lengths.at[slot].set(length))
    if snaps is not None:
        c = restore(c, entries, snaps, slot, at, length > 0)
    elif c.pos is not None:
        c = c.replace(pos=c.pos.at[slot].set(EMPTY))
    return state.replace(cache=c, done=state.done.at[slot].set(True))


# The rings' cut prefixes back into the whole rings, in place (models.widen).
_widen = jax.jit(models.widen, donate_argnums=(0,))


@functools.partial(jax.jit, donate_argnums=(0,))
def _release(state: loop.DecodeState, slot) -> loop.DecodeState:
    """Row `slot` done and owning no block: what its decode steps still write is dropped, so its
    blocks can go to another request."""
    c = state.cache
    return state.replace(cache=c.replace(table=c.table.at[slot].set(c.num_blocks)), done=state.done.at[slot].set(True))


def narrow_views(target) -> bool:
    """Whether a batch engine's decode steps read bucketed row views (the module docstring): on the
    XLA path (no attention kernels) on a CPU, where `dense_attention`'s key blocks make a row's
    result independent of the slots past its keys."""
    return jax.devices()[0].platform == "cpu" and not target.matmul.attention_kernels


class BatchEngine:
    """`slots` requests decoding together (see the module docstring). `max_new_tokens`: the largest
    budget a request may ask; `capacity`: cache positions a request may hold (prompt + budget + K must
    fit; default: the target's context, capped at 8192), a multiple of `block_tokens`. The global
    layers' K/V live in a pool of `kv_blocks` blocks of `block_tokens` positions shared by the slots
    (default: `slots` full-capacity rows' worth): a request takes the blocks its prompt + budget + K
    need at admission and gives them back when it ends, so long and short requests share the pool
    (`can_admit` says whether one fits now). `prefill_chunk`: the chunk width (a multiple of
    PROMPT_BUCKET; at most the capacity is used): a prompt is prefilled a chunk a step, the step's
    chunks queued before its decode rounds. `step_tokens`: a step's token budget, the decode rounds'
    `slots x rounds_per_step x verify width` first, the rest in chunks (`lanes`, at least one).
    `prefill_group`: lanes per forward (default one: see packed_prefill; with more, a prompt takes
    at most one chunk a step).
    `block_size` is probed once at `slots` rows at T = 0 (`LoopConfig.for_slots`: the engine's K,
    verify width and capacity, in `config`), as generate does.
    params (a SamplingParams) or its keywords (temperature, top_k, top_p, ...): the request of an
    admission without its own (its budget, seed and logprobs fill what `admit` leaves open). `modes`: the
    program ladder (default MODES); only programs that a step needs are compiled (`warm_up`
    compiles them all)."""

    def __init__(self, target, assistant=None, *, slots: int, max_new_tokens: int, capacity: int | None = None,
                 block_size: int = 4, eos_token_ids=None, seed: int = 0, exactness_probe: bool = True,
                 rounds_per_step: int = 1, modes=MODES, params: sampling.SamplingParams | None = None,
                 kv_blocks: int | None = None, block_tokens: int = PROMPT_BUCKET, prefill_chunk: int = PREFILL_CHUNK,
                 step_tokens: int = STEP_TOKENS, prefill_group: int | None = None, drafter=None,
                 prefix_cache: bool = True, ring_snapshots: int | None = None, **knobs):
        check_int("slots", slots, 1)
        check_int("max_new_tokens", max_new_tokens, 1)
        check_block_size(block_size, target.config.max_position_embeddings)
        check_int("rounds_per_step", rounds_per_step, 1, MAX_ROUNDS_PER_CHUNK)
        check_int("block_tokens", block_tokens, 1, 1 << 16)
        check_int("prefill_chunk", prefill_chunk, PROMPT_BUCKET, MAX_PREFILL_CHUNK)
        if prefill_chunk % PROMPT_BUCKET:
            raise ValueError(f"prefill_chunk must be a multiple of {PROMPT_BUCKET}, got {prefill_chunk}")
        check_int("step_tokens", step_tokens, PROMPT_BUCKET, MAX_STEP_TOKENS)
        if step_tokens % PROMPT_BUCKET:
            raise ValueError(f"step_tokens must be a multiple of {PROMPT_BUCKET}, got {step_tokens}")
        if prefill_group is not None:
            check_int("prefill_group", prefill_group, 1, 1 << 12)
        if ring_snapshots is not None:
            check_int("ring_snapshots", ring_snapshots, 1, MAX_RING_SNAPSHOTS)
        if not isinstance(prefix_cache, bool):
            raise ValueError(f"prefix_cache must be True or False, got {prefix_cache!r}")
        self.default = sampling.SamplingParams.build(params, **knobs)
        if kv_blocks is not None:
            check_int("kv_blocks", kv_blocks, 1)
        # Greedy rows are exact only if the K-wide verify is: probed at T = 0 whatever the default.
        drafter = drafters.resolve(drafter, assistant)
        self.config = LoopConfig.for_slots(target, drafter, slots=slots, block_size=block_size,
                                           max_new_tokens=max_new_tokens, capacity=capacity,
                                           exactness_probe=exactness_probe, block_tokens=block_tokens)
        self.target, self.slots, self.capacity = target, slots, self.config.capacity
        self.max_new_tokens, self.rounds_per_step = max_new_tokens, rounds_per_step
        kv_blocks = slots * (self.capacity // block_tokens) if kv_blocks is None else kv_blocks
        # A chunk wider than a request's capacity would only compute padding.
        self.block_tokens, self.kv_blocks = block_tokens, kv_blocks
        self.prefill_chunk = min(prefill_chunk, round_up(self.capacity, PROMPT_BUCKET))
        k, self.fallback = self.config.block_size, self.config.fallback
        self.block_size = k
        self.modes = tuple(modes)
        self.gens = [make_generate(block_size=k, max_new_tokens=self.config.budget, cache_size=self.capacity, mode=m,
                                   drafter=drafter) for m in self.modes]
        self.drafter = self.gens[0].spec.drafter  # what runs (None: classic, also after a failed probe)
        self.params = self.gens[0].params(assistant)  # what its programs take (the MTP assistant, or None)
        self.gen = self.gens[-1]  # the layout of the state, and every admission's prefill
        if not self.gen.spec.sampling.covers(self.default):
            raise ValueError(f"the engine's modes cannot run its default sampling {self.default}")
        eos = _default_stop_ids(target) if eos_token_ids is None else tuple(eos_token_ids)
        self.eos = tuple(int(t) for t in eos)
        self.stop_ids = stop_array(self.eos)
        self.seeds = np.random.default_rng(sampling.validate_seed(seed))  # for requests without a seed
        keys = jax.random.split(sampling.seed_key(seed), slots)  # per-row keys; each admission sets its own
        self.pspec = self.gen.spec.prefill_spec(PROMPT_BUCKET, slots, target.matmul)
        cache = models.init_paged_cache(target.config, slots, self.capacity, kv_blocks, block_tokens,
                                        loop._cache_dtype(target), max_block=self.pspec.max_block)
        blank = loop.blank_state(self.gen.spec, target, slots, PROMPT_BUCKET, self.stop_ids, keys,
                                 self.gen.rows(slots), cache=cache)
        self.state = jax.tree.map(jnp.copy, blank)  # its zero fields share one buffer: steps donate each
        self.window = rounds_per_step * k + 1  # tokens a row gains per step, at most (+ the prefill's)
        # The step's budget: the decode rounds (every slot's verify rows, live or not) first, then lanes.
        self.step_tokens = step_tokens
        self.decode_tokens = slots * rounds_per_step * self.config.verify_width
        self.lanes = packed_prefill.lanes_for(step_tokens, self.prefill_chunk, self.decode_tokens)
        self.prefill_group = min(self.lanes, prefill_group or 1)
        self.lanes = round_up(self.lanes, self.prefill_group)  # whole groups (a group is padded anyway)
        self._decode: dict[tuple[int, int], object] = {}  # (mode index, view positions) -> compiled rounds
        # The row view a step reads (module docstring): bucketed on the XLA path on a CPU, else the capacity.
        self.view_floor = VIEW_BUCKET if narrow_views(target) else self.capacity
        self.reach = [0] * slots  # per slot: a bound on its cache length when the next step's rounds start
        self.view_steps: dict[int, int] = {}  # view positions -> steps run at it
        self._prefill = None  # the packed prefill's program (one shape per engine), built on first use
        self.seen = [0] * slots
        self.fresh: dict[int, tuple] = {}  # slot -> (its step's firsts (device arrays), its lane), not reported yet
        self.owner: list[object | None] = [None] * slots
        self.need: list[sampling.SamplingMode | None] = [None] * slots  # what each live request needs
        self.ticket = [0] * slots  # which admission holds the slot (a snapshot's rows belong to theirs)
        # Prefix reuse (jaxspec.engine.prefix_cache): a hit ends at a chunk boundary, so the chunks
        # after it are cut where a full prefill cuts them (the same programs on the same inputs).
        reuse = prefix_cache and self.prefill_chunk % block_tokens == 0
        root = root_key(target.config, str(cache.dtype), self.drafter and self.drafter.kind, block_tokens,
                        self.prefill_chunk)
        self.pool = BlockPool(kv_blocks, block_tokens, reuse=reuse, root=root)
        rings = cache.pos is not None and any(cache.is_ring(j) for j in range(len(cache.k)))
        self.snaps = (RingSnapshots(cache, ring_snapshots or default_snapshots(slots))
                      if reuse and rings else None)
        self.blocks: list[list[int]] = [[] for _ in range(slots)]  # the pool blocks each slot holds
        self.digests: dict[int, list[bytes]] = {}  # prefilling slot -> its prompt's block digests
        self.registered = [0] * slots  # a prefilling slot's first blocks already registered
        self.shared = [0] * slots  # a prefilling slot's first positions another prompt had computed
        self._memo = None  # (ids, their digests) of the last lookup
        self.prefilling: dict[int, packed_prefill.Prompt] = {}  # waiting prompts, in admission order
        self.long_passed = False  # the last step ran no chunk of a long prompt (short ones took the budget)
        self.admissions = 0
        self.steps = [0] * len(self.modes)  # steps run per program (what mixing costs)
        self.chunks = 0  # prefill chunks run
        self.prefill_steps = 0  # packed prefill programs run (one a step at most)
        self.pending = None  # (snapshot, tickets) of the last dispatched step, not read yet

    @property
    def live(self) -> int:
        """Slots holding a request (not yet reported finished)."""
        return sum(o is not None for o in self.owner)

    @property
    def free(self) -> int:
        return self.slots - self.live

    @property
    def free_blocks(self) -> list[int]:
        """The pool blocks a new request may take: never used, or cached and held by nobody."""
        return self.pool.free + list(self.pool.idle)

    def decode(self, mode_index: int, view: int | None = None):
        """The compiled step of `modes[mode_index]` reading `view` positions of each row (default: the
        capacity; compiled on first use). It takes a state whose table is cut to the view
        (`models.narrow`)."""
        view = self.capacity if view is None else view
        if (mode_index, view) not in self._decode:
            self._decode[mode_index, view] = self.gens[mode_index].compiled_rounds(
                self.target, self.params, self._narrowed(self.state, view), self.rounds_per_step)
        return self._decode[mode_index, view]

    def _narrowed(self, state: loop.DecodeState, view: int) -> loop.DecodeState:
        return state if view == self.capacity else state.replace(cache=models.narrow(state.cache, view))

    def _rounds(self, mode_index: int, view: int) -> loop.DecodeState:
        """The state after this step's rounds of `modes[mode_index]` at row view `view`: on the state's
        cut (`models.narrow`), their writes put back into the whole cache (`models.widen`). Dispatched,
        not waited for."""
        fn = self.decode(mode_index, view)
        if view == self.capacity:
            return fn(self.state)
        whole = self.state.cache
        rings = models.cuts_rings(whole, view)
        # What the rounds leave whole (they take cuts of it): the table, and the rings when cut. The
        # pools and lengths go to the rounds (donated) and come back written: not passed again.
        rest = whole.replace(k=tuple(x if rings and j not in whole.paged else None for j, x in enumerate(whole.k)),
                             v=tuple(x if rings and j not in whole.paged else None for j, x in enumerate(whole.v)),
                             pos=whole.pos if rings else None, lengths=None)
        out = fn(self._narrowed(self.state, view))
        return out.replace(cache=_widen(rest, out.cache))

    def view_for(self, slots) -> int:
        """The row view a step whose decoding rows are `slots` reads (the module docstring): the
        bucket above every position their rounds may touch, each row's bound by its blocks too."""
        grow = self.rounds_per_step * self.block_size + max(self.config.verify_width, ROW_TILE)
        need = max((min(self.reach[s] + grow, len(self.blocks[s]) * self.block_tokens) for s in slots), default=1)
        return view_bucket(need, self.capacity, self.block_tokens, self.view_floor)

    def warm_up(self) -> None:
        """Compile the programs a short request runs (each step's ladder at the narrowest row view,
        and the packed prefill, one program for every prompt length and load); a wider view's step
        compiles (or loads from disk) when a request first grows into it. Logs (INFO, logger
        jaxspec.engine.batching) when it starts and how long it took."""
        t0 = time.perf_counter()
        plural = lambda n: "s" * (n != 1)  # noqa: E731
        log.info("batch engine warm-up: %d step program%s and a prefill (%d slot%s, K=%d) ...", len(self.modes),
                 plural(len(self.modes)), self.slots, plural(self.slots), self.block_size)
        for i in range(len(self.modes)):
            self.decode(i, view_bucket(1, self.capacity, self.block_tokens, self.view_floor))
        slot = self.admit([0], 1, seed=0)
        self._prefill_step()
        self.cancel(slot)
        if self.snaps is not None:  # a chunk boundary's ring copy
            self.snaps.warm(self.state.cache)
        log.info("batch engine warm-up took %.1f s", time.perf_counter() - t0)

    def blocks_for(self, n_prompt: int, max_new_tokens: int) -> int:
        """Pool blocks a request holds: every cache position it may write (prompt + budget - 1 + the
        verify width, `LoopConfig.positions`)."""
        return -(-self.config.positions(n_prompt, max_new_tokens) // self.block_tokens)

    def fits(self, n_prompt: int, max_new_tokens: int) -> bool:
        """Whether a request of this prompt length and budget fits the engine at all (a slot's
        capacity, the budget, the whole pool); `can_admit`: whether it fits now."""
        return 1 <= max_new_tokens <= self.room(n_prompt)

    def room(self, n_prompt: int) -> int:
        """The largest budget a request of this prompt length fits the engine with (0: none does): a
        request's capacity and the whole pool bound what it may write (`LoopConfig.room`)."""
        held = min(self.capacity, self.kv_blocks * self.block_tokens)
        return max(0, min(self.max_new_tokens, self.config.room(n_prompt, held)))

    def can_admit(self, n_prompt: int, max_new_tokens: int, ids=None) -> bool:
        """Whether a slot and the request's blocks are free now. With the prompt's `ids`, the cached
        blocks it would share that a running request holds cost nothing (without: every block is
        counted, which may make it wait longer than it must)."""
        need = self.blocks_for(n_prompt, max_new_tokens) - (0 if ids is None else self._held_shared(list(ids)))
        return bool(self.free) and need <= self.pool.available

    def _held_shared(self, ids: list[int]) -> int:
        """Blocks a hit for `ids` would share that a running request holds (no free block pays for them)."""
        shared = self._lookup(ids)[0]
        return sum(self.pool.ref[b] > 0 for b in shared)

    def admit(self, prompt_ids, max_new_tokens: int | None = None, seed: int | None = None, owner: object = True,
              params: sampling.SamplingParams | None = None, logprobs: int | None = None) -> int:
        """Take a free slot and the request's pool blocks, queue its prompt for prefill (in chunks,
        by the next steps) and return the slot. `params`: the request (None:
        the engine's default); `max_new_tokens`, `seed`, `logprobs`, when given, override its own
        (a budget is needed; seed None: one drawn from the engine's seed; logprobs: None or the
        alternatives per token its events carry, 0..20).
        ValueError (before any compute) for bad ids, a budget or prompt that does not fit, a bad
        seed, sampling or bias, no free slot or too few free blocks (`can_admit`). Nothing waits
        for the device. Non-finite prefill logits (`loop.check_prefill`) come back as an event with
        `error` set."""
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
                             f"engine (budget 1..{self.max_new_tokens}, {self.capacity} cache positions per request, "
                             f"{self.kv_blocks * self.block_tokens} in the pool)")
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
        n_blocks = self.blocks_for(len(ids), max_new_tokens)
        held = self._held_shared(list(ids))  # shared with a running request: no free block needed
        if n_blocks - held > self.pool.available:
            raise ValueError(f"the KV pool has {self.pool.available} free blocks of {self.kv_blocks}, this request "
                             f"needs {n_blocks - held} ({self.block_tokens} positions each)")
        seed = params.seed if seed is None else seed
        if seed is None:
            seed = int(self.seeds.integers(0, 2**63))
        slot = self.owner.index(None)
        # host values only: reading a device array back here would wait for every step already queued
        # (the engine's pipelining lost at each admission; tests/engine/test_batching.py checks)
        key = sampling.seed_key_data(seed)
        rows_ = sampling.row_params([params.per_row()], self.gen.spec.sampling, xp=np)
        ids = list(ids)
        shared, found, digests, at = self._lookup(ids)
        self.blocks[slot] = self.pool.take(shared, n_blocks - len(shared))
        table = np.full((self.capacity // self.block_tokens,), self.kv_blocks, np.int32)
        table[:n_blocks] = self.blocks[slot]
        start = len(shared) * self.block_tokens
        snaps = None if self.snaps is None else self.snaps.arrays
        self.state = _assign(self.state, jnp.int32(slot), jnp.asarray(table), jnp.int32(start), snaps,
                             jnp.int32(at or 0), entries=() if self.snaps is None else self.snaps.entries)
        self.pool.queried += len(ids)
        self.pool.hit += start
        self.digests[slot], self.registered[slot] = digests, len(shared)
        self.shared[slot] = len(found) * self.block_tokens
        self.prefilling[slot] = packed_prefill.Prompt(ids, start, key, max_new_tokens, rows_)
        self.admissions += 1
        self.seen[slot], self.owner[slot], self.ticket[slot] = 1, owner, self.admissions
        self.need[slot] = need
        return slot

    def _lookup(self, ids: list[int]) -> tuple[list[int], list[int], list[bytes], int | None]:
        """(the pool blocks a prompt's prefill may start after, its first blocks found cached, its full
        blocks' digests, the ring snapshot to start from): the longest run of its first blocks that
        are cached, cut to a chunk boundary below its last token (that token's logits pick the first
        token, so it is computed) where a snapshot of the rings exists, when the engine has rings
        (prefix_cache: why). Any error here is a miss, and turns reuse off (`_reuse_failed`)."""
        try:
            return self._find(ids)
        except Exception as e:  # a cache never fails a request
            self._reuse_failed(e)
            return [], [], [], None

    def _find(self, ids: list[int]) -> tuple[list[int], list[int], list[bytes], int | None]:
        memo = self._memo  # can_admit and admit look the same prompt up: its digests once
        digests = memo[1] if memo is not None and memo[0] == ids else self.pool.digests(ids)
        self._memo = (ids, digests)
        if not digests:
            return [], [], [], None
        found = self.pool.match(ids, digests)
        per = self.prefill_chunk // self.block_tokens
        n = min(len(found), (len(ids) - 1) // self.prefill_chunk * per)
        n -= n % per
        while n and self.snaps is not None and digests[n - 1] not in self.snaps:
            n -= per
        at = self.snaps.find(digests[n - 1]) if n and self.snaps is not None else None
        return found[:n], found, digests, at

    def _stops(self) -> dict[int, int] | None:
        """Where each prefilling prompt's step must end, with ring snapshots on: a snapshot is read
        from the state after the step's program, so a prompt's several chunks a step stop at the next
        boundary `_snapshot_wanted` names: the same boundaries as at one chunk a step."""
        if self.snaps is None or not self.pool.reuse:
            return None
        c, stops = self.prefill_chunk, {}
        for slot, p in self.prefilling.items():
            stop = next((e for e in range(p.done + c, len(p.ids), c) if self._snapshot_wanted(slot, p, e)), None)
            if stop is not None:
                stops[slot] = stop
        return stops

    def _snapshot_wanted(self, slot: int, p: packed_prefill.Prompt, e: int) -> bool:
        """Whether the rings of `slot` at position `e` of its prompt `p` are worth a snapshot: at a
        chunk boundary within its full blocks, where its last chunk starts or it ends (a chat's next
        turn extends this prompt), the deepest one another prompt had computed too (a shared system
        prompt), any while the store has room. Not all: a long prompt's later boundaries would evict
        every earlier snapshot, the useful ones too."""
        c = self.prefill_chunk
        return (e % c == 0 and 0 < e <= len(self.digests.get(slot) or ()) * self.block_tokens
                and (len(p.ids) - e <= c or self.shared[slot] // c * c == e or self.snaps.has_room))

    def _computed(self, slot: int, p: packed_prefill.Prompt) -> None:
        """After a chunk of `slot`'s prompt is queued: its full blocks written so far are registered
        (a later prompt may share them), and at a chunk boundary the row's rings are copied into a
        snapshot (read after the chunk's program: the device runs them in order). An error here
        (e.g. no device memory for a snapshot) turns reuse off; the prompt runs on."""
        try:
            self._remember(slot, p)
        except Exception as e:
            self._reuse_failed(e)
        if not p.rest:
            self.digests.pop(slot, None)

    def _remember(self, slot: int, p: packed_prefill.Prompt) -> None:
        digests, b = self.digests.get(slot), self.block_tokens
        if not digests or not self.pool.reuse:
            return
        upto = min(p.done // b, len(digests))
        for i in range(self.registered[slot], upto):
            self.pool.register(self.blocks[slot][i], digests[i], p.ids[i * b:(i + 1) * b])
        self.registered[slot] = upto
        if self.snaps is not None and self._snapshot_wanted(slot, p, p.done):
            self.snaps.take(self.state.cache, slot, digests[p.done // b - 1])

    def _reuse_failed(self, e: Exception) -> None:
        """Prefix reuse off for the rest of this engine's life (no lookup, registration or snapshot;
        the blocks already cached are evicted as any idle block): a warning, no failed request."""
        log.warning("prefix reuse turned off after an error: %s: %s", type(e).__name__, e)
        self.pool.reuse, self.snaps, self.digests, self._memo = False, None, {}, None

    def _prefill_step(self) -> None:
        """Queue this step's packed prefill program: the next chunk of as many waiting prompts as
        there are lanes (`packed_prefill.plan`: short ones first, long ones first after a step that
        passed them over), in one program."""
        chosen, self.long_passed = packed_prefill.plan(self.prefilling, self.lanes, self.prefill_chunk,
                                                       self.long_passed, self.prefill_group, self._stops())
        lanes = packed_prefill.pack(self.prefilling, chosen, self.lanes, self.prefill_group, self.prefill_chunk,
                                    self.capacity, self.slots)
        if self._prefill is None:
            self._prefill = packed_prefill.compiled(self.state, self.target, lanes, spec=self.pspec,
                                                    loop_spec=self.gen.spec, group=self.prefill_group)
        self.state, firsts = self._prefill(self.state, self.target, lanes)
        self.chunks += len(chosen)
        self.prefill_steps += 1
        final = {slot: lane for lane, slot in enumerate(chosen)}  # each slot's last lane this step
        for lane, slot in enumerate(chosen):  # a slot's lanes in order: its last one reads its first token
            p = self.prefilling[slot]
            p.done += min(p.rest, self.prefill_chunk)
            if final[slot] == lane:  # the state after the program holds the rings at this boundary only
                self._computed(slot, p)
            if not p.rest:
                del self.prefilling[slot]
                self.fresh[slot] = (firsts, lane)
                self.reach[slot] = len(p.ids)  # its cache length now: the next rounds start there

    def _mode_index(self) -> int:
        """The cheapest program that covers every live request."""
        needs = [n for n, o in zip(self.need, self.owner) if o is not None]
        return next(i for i, m in enumerate(self.modes) if all(m.covers(n) for n in needs))

    def step(self) -> list[SlotEvent]:
        """Queue this step's prefill program (a chunk of as many waiting prompts as `lanes`), then
        `rounds_per_step` rounds for every slot, then report the previous step's: each
        live slot's new tokens (finished slots are freed). Pipelined: the device runs the new rounds
        while the host reads the last ones, so the host's work between steps costs no device time
        (a step's fixed host cost was ~1.5 ms on the H200 when each call waited for its rounds); the
        first step after an idle engine reports nothing from the device yet. A request's first
        token (its prefill's) is reported by the step that ran its last chunk when that step has
        nothing else to report; otherwise by the next step, with the tokens of its first rounds:
        reading it waits for the chunk just queued, and every other stream's tokens would wait with
        it (a 109 ms gap against 64 on the H200 at 512-token chunks). A slot admitted or cancelled
        after a step was dispatched is left out of that step's report."""
        due, self.fresh = self.fresh, {}  # first tokens of the last step's final chunks: done by now
        if self.prefilling:
            self._prefill_step()
        nxt = None
        decoding = [s for s, o in enumerate(self.owner) if o is not None and s not in self.prefilling]
        if decoding:
            i, view = self._mode_index(), self.view_for(decoding)
            self.state = self._rounds(i, view)
            for s in decoding:
                self.reach[s] += self.rounds_per_step * self.block_size
            self.steps[i] += 1
            self.view_steps[view] = self.view_steps.get(view, 0) + 1
            nxt = (loop.snapshot(self.state, self.window),
                   [None if s in self.prefilling else t for s, t in enumerate(self.ticket)])
        report, self.pending = self.pending, nxt
        if not due and not self._reported(report):
            due, self.fresh = self.fresh, {}  # nobody else's tokens would wait for these: read them now
        events, firsts = [], {}
        read = {}  # one read per prefill program
        for slot, (arrays, lane) in due.items():  # queued before this step's work: reading them does not wait for it
            got = read.setdefault(id(arrays), jax.device_get(arrays))
            first, done, finite = (x[lane] for x in got[:3])
            lps = None if got[3] is None else tuple(x[lane] for x in got[3])
            if not finite:
                self._free(slot)
                events.append(SlotEvent(slot=slot, tokens=[], done=True, rounds=0, drafted=0, accepted=0,
                                        error=loop.nonfinite_message(f"slot {slot}")))
                continue
            top = self.need[slot].logprobs
            first_lp = None if top < 0 else loop.logprob_entries(lps[0][None], lps[1][None], lps[2][None], top)
            ev = SlotEvent(slot=slot, tokens=[int(first)], done=bool(done), rounds=0, drafted=0, accepted=0,
                           logprobs=first_lp)
            if done:  # its first token ended it (a stop id or a budget of 1)
                self._free(slot)
                events.append(ev)
            else:
                firsts[slot] = ev  # goes out ahead of its first rounds' tokens, in their event
        if report is not None:
            got = loop.Snapshot.of(report[0])
            for slot in self._reported(report):  # after the first tokens: a request they ended is not in it
                n, seen = int(got.n_out[slot]), self.seen[slot]
                top = self.need[slot].logprobs
                lps = got.logprobs(slot, seen, n, top) if top >= 0 else None
                ev = SlotEvent(slot=slot, tokens=got.tokens(slot, seen, n), done=bool(got.done[slot]),
                               rounds=int(got.row_rounds[slot]), drafted=int(got.drafted[slot]),
                               accepted=int(got.accepted[slot]), logprobs=lps)
                head = firsts.pop(slot, None)
                if head is not None:  # one event per slot and step
                    ev.tokens = head.tokens + ev.tokens
                    ev.logprobs = None if lps is None else head.logprobs + lps
                events.append(ev)
                self.seen[slot] = n
                if got.done[slot]:
                    self._free(slot)
        return events + list(firsts.values())

    def _reported(self, report) -> list[int]:
        """The slots a dispatched step's (snapshot, tickets) reports: live, and still held by the
        admission that held them when it was dispatched."""
        if report is None:
            return []
        tickets = report[1]
        return [s for s, o in enumerate(self.owner) if o is not None and tickets[s] == self.ticket[s]]

    def _free(self, slot: int) -> None:
        """The slot and its blocks back to the free lists; its row writes nothing from now on."""
        self.state = _release(self.state, jnp.int32(slot))
        self.pool.release(self.blocks[slot])
        self.blocks[slot] = []
        self.digests.pop(slot, None)
        self.owner[slot] = None
        self.prefilling.pop(slot, None)
        self.fresh.pop(slot, None)

    def cancel(self, slot: int) -> None:
        """Stop the request in `slot` now (also mid-prefill) and free the slot and its blocks. `slot`:
        an integer, Python's or numpy's (as `admit` and the events give it), not a bool."""
        integer = isinstance(slot, (int, np.integer)) and not isinstance(slot, (bool, np.bool_))
        if not integer or not 0 <= slot < self.slots:
            raise ValueError(f"slot must be an integer in [0, {self.slots}), got {slot!r}")
        slot = int(slot)
        if self.owner[slot] is not None:
            self._free(slot)

