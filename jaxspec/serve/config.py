"""`jaxspec serve`'s own knobs: `ServeConfig`, each knob under one name (the CLI flag's, without the
dashes) with one range (`RANGES`). The CLI's flags, `app.Server` and its `scheduler.Scheduler` all
read them from here, so a value one of them takes the others take too; and the sizes the server
derives from a model's context (a request's positions and budget, the slots' KV pool).
"""
from __future__ import annotations

import dataclasses
import numbers

from jaxspec.engine.generate import BLOCK_SIZE_WHY, MAX_BLOCK_SIZE, MAX_ROUNDS_PER_CHUNK
from jaxspec.engine.loop_config import (BUDGET_BUCKET, MAX_PREFILL_CHUNK, MAX_STEP_TOKENS, PREFILL_CHUNK,
                                        PROMPT_BUCKET, STEP_TOKENS, slot_capacity)
from jaxspec.engine.prefix_cache import MAX_RING_SNAPSHOTS

BATCH_CONTEXT = 4096  # KV pool positions per slot (the pool: max_batch x this, shared by the slots)
REQUEST_CONTEXT = 32768  # cache positions one request may hold at most (its prompt and output)

# The knobs a config leaves None take the machine's defaults (`ServeConfig.resolved`). On a CPU: one
# slot, since XLA computes every row of a step's row bucket (16 rows from 2 slots on: one client's
# step at 4 slots did ~4x the work of 1), and 4,096 positions a request, what the default pool holds
# a slot. (A decode round used to read a row's whole table, so 32,768 made the 270M's 1-slot step 2.3x
# slower than 4,096, docs/benchmark_results/first-impression-cpu-2026-12-05.md; on a CPU a step now
# reads only a bucket of the positions its rows touch, jaxspec.engine.batching.)
PLATFORM_DEFAULTS = {"cpu": dict(max_batch=1, max_context=BATCH_CONTEXT)}
DEFAULTS = dict(max_batch=4, max_context=REQUEST_CONTEXT)  # a GPU (or any other device)


@dataclasses.dataclass(frozen=True)
class Knob:
    """An integer knob's bounds: lo..hi and a multiple of `multiple`; `note` is said after the range
    (why it is so)."""

    lo: int
    hi: int
    multiple: int = 1
    note: str = ""

    @property
    def span(self) -> str:
        return f"{self.lo}..{self.hi}"

    def holds(self, v) -> bool:
        return (isinstance(v, numbers.Integral) and not isinstance(v, bool) and self.lo <= v <= self.hi
                and v % self.multiple == 0)

    def describe(self) -> str:
        every = f" and a multiple of {self.multiple}" if self.multiple > 1 else ""
        return f"an integer in {self.span}{every}{self.note}"


# Each serving knob's range, stated once. The CLI names a knob `--max-queue` for `max_queue`.
RANGES = {
    "block_size": Knob(1, MAX_BLOCK_SIZE, note=BLOCK_SIZE_WHY),
    # The real limit is the device's memory, which the CLI checks at start (jaxspec.engine.memory);
    # this bound refuses a typo before that.
    "max_batch": Knob(1, 1 << 12),
    "rounds_per_chunk": Knob(1, MAX_ROUNDS_PER_CHUNK),
    # Each waiting request holds its prompt in host memory and waits for every one ahead of it: the
    # 100,000th waits for 100,000 requests (of 100 tokens each: over an hour at the ~2,000 tokens/s
    # of docs/benchmark_results/serve-h200-2026-12-03.md); a 429 with Retry-After serves it better.
    "max_queue": Knob(1, 100_000),
    # Positions one request may hold (prompt + output), at most the model's context.
    "max_context": Knob(PROMPT_BUCKET, 1 << 20, PROMPT_BUCKET),
    # The pool is blocks of PROMPT_BUCKET positions; 64 Mi positions is 4096 slots x 16,384.
    "kv_positions": Knob(PROMPT_BUCKET, 1 << 26, PROMPT_BUCKET, " (the KV pool's blocks)"),
    # BatchEngine checks the same bounds (a chunk's rows are whole row tiles).
    "prefill_chunk": Knob(PROMPT_BUCKET, MAX_PREFILL_CHUNK, PROMPT_BUCKET),
    # BatchEngine checks the same bounds; below a chunk (with the decode rounds) a step still runs one.
    "step_tokens": Knob(PROMPT_BUCKET, MAX_STEP_TOKENS, PROMPT_BUCKET),
    # Prefix reuse's copies of a slot's sliding-layer rings (341 MB each at 12B shapes); the memory
    # check counts them. BatchEngine checks the same bounds.
    "ring_snapshots": Knob(1, MAX_RING_SNAPSHOTS),
}


@dataclasses.dataclass(frozen=True)
class ServeConfig:
    """How the server batches and queues, checked once, here (ValueError naming the field and its
    range, `RANGES`). `block_size`: K, the verify width (1 decodes classically); `max_batch`: slots
    decoding together; `rounds_per_chunk`: rounds between two reads of the new tokens (and two
    admissions); `max_queue`: requests waiting for a slot at most (more are refused with a 429);
    `kv_positions`: the KV pool the slots share, in cache positions (None: `kv_pool`'s default);
    `prefill_chunk`: the chunk width a prompt is cut into (one chunk of a prompt a step);
    `step_tokens`: the target tokens a step computes at most, the decode rounds' first, then one
    chunk of as many waiting prompts as fit (at least one); `max_context`: positions one request
    may hold, its prompt and output (at most the model's context). `max_batch` and `max_context`
    None: the machine's (`resolved`: 1 and 4,096 on a CPU, 4 and 32,768 elsewhere). `prefix_cache`:
    a prompt's full blocks that an earlier prompt computed (the same tokens from position 0) are
    shared, not prefilled again (`jaxspec.engine.prefix_cache`; the output is the same either way);
    `ring_snapshots`: the copies of a slot's sliding-layer rings reuse keeps (a hit ends where one
    exists; None: `prefix_cache.default_snapshots`, one per two slots, at least 4)."""

    block_size: int = 4
    max_batch: int | None = None
    rounds_per_chunk: int = 4
    max_queue: int = 64
    kv_positions: int | None = None
    prefill_chunk: int = PREFILL_CHUNK
    step_tokens: int = STEP_TOKENS
    max_context: int | None = None
    prefix_cache: bool = True
    ring_snapshots: int | None = None

    def __post_init__(self):
        if not isinstance(self.prefix_cache, bool):
            raise ValueError(f"prefix_cache must be True or False, got {self.prefix_cache!r}"[:300])
        for name, knob in RANGES.items():
            v = getattr(self, name)
            if v is None and name in OPTIONAL:
                continue
            if not knob.holds(v):
                none = "None or " if name in OPTIONAL else ""
                raise ValueError(f"{name} must be {none}{knob.describe()}, got {v!r}"[:300])
            object.__setattr__(self, name, int(v))  # a numpy integer is kept as a Python int

    def resolved(self, platform: str | None = None) -> ServeConfig:
        """This config with the knobs it leaves None set to `platform`'s defaults (None: JAX's
        default backend; `PLATFORM_DEFAULTS`); kv_positions stays None (`kv_pool`)."""
        if platform is None:
            import jax

            platform = jax.default_backend()
        defaults = PLATFORM_DEFAULTS.get(platform, DEFAULTS)
        return dataclasses.replace(self, **{k: v for k, v in defaults.items() if getattr(self, k) is None})

    @classmethod
    def build(cls, config: ServeConfig | None = None, **knobs) -> ServeConfig:
        """`config` with the keyword knobs a caller passed in place of its fields (`Server`'s
        convenience), or a config built from the knobs alone."""
        if config is None:
            return cls(**knobs)
        if not isinstance(config, cls):
            raise ValueError(f"config must be a jaxspec.serve.config.ServeConfig, got {type(config).__name__}")
        return dataclasses.replace(config, **knobs) if knobs else config

    def kv_pool(self, context: int | None) -> int:
        """The KV pool's positions: `kv_positions`, else max_batch x the context at most
        BATCH_CONTEXT (what the CLI's memory check counts). A resolved config's."""
        if self.kv_positions is not None:
            return self.kv_positions
        return self._set("max_batch") * slot_capacity(context, BATCH_CONTEXT)

    def request_capacity(self, context: int | None) -> int:
        """Cache positions one request may hold (its prompt and output): the context, at most
        max_context. A resolved config's."""
        return slot_capacity(context, self._set("max_context"))

    def request_tokens(self, context: int | None) -> int:
        """New tokens one request may ask at most: half its positions (at most BATCH_CONTEXT's
        half), in whole budget buckets. A resolved config's."""
        return max(1, min(self.request_capacity(context), BATCH_CONTEXT) // 2 // BUDGET_BUCKET * BUDGET_BUCKET)

    def _set(self, name: str) -> int:
        v = getattr(self, name)
        if v is None:
            raise ValueError(f"{name} is None: resolve the config first (ServeConfig.resolved)")
        return v


OPTIONAL = ("kv_positions", "max_batch", "max_context", "ring_snapshots")  # None: a default (`resolved`, `kv_pool`)
