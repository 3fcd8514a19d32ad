"""One loop configuration: K, the verify width and the KV cache capacity of a run, resolved in one place.

The three sizes depend on each other and on the model:

- K (block_size): the K asked, or 1 without an assistant (classic decoding); at T = 0 the exactness
  probe may lower it, to the row bucket or to 1 (`LoopConfig.probed`).
- the verify width: the rows one verify forward runs, K or padded up to the tiled matmul
  (`verify.verify_width` is the padding rule; verify_pad None reads the target's `matmul.verify_pad`).
- the capacity: KV positions per row. A round writes `width` positions from the cache length,
  which is at most prompt + N - 1 (every token but the bonus), so a derived capacity is
  prompt width + budget - 1 + width, rounded up to CAPACITY_ROUND (one prefill serves many K); an
  explicit `cache_size` is the capacity, checked against the same rule (`room`).

A request's prompt width and budget (`resolve`) are buckets (`size_bucket`): the next power of two, at
least PROMPT_BUCKET / BUDGET_BUCKET, and past BUCKET_STEP the next multiple of it. Each new bucket
compiles a prefill and a decode program (20-26 s each for the real 270M on a 2-core CPU), so
`--max-tokens` 65..128 or prompts of 129..256 tokens share theirs; the step bounds what the padding
costs a long prompt (a 5,000-token prompt pads to 5,120, not 8,192).

`LoopConfig.derive` is the one computation. `resolve` (generate, stream_generate, the CLI's memory
check: bucketed, validated), `for_slots` (BatchEngine) and `loop.LoopSpec.config` (a compiled
program, which serves any batch and prompt width) build through it; every other site reads fields.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from jaxspec import models
from jaxspec.kernels import ROW_TILE

from jaxspec.engine import verify

CAPACITY_ROUND = 64  # derived cache sizes are rounded up to this (one prefill serves many K)
PROMPT_BUCKET = ROW_TILE  # the narrowest prompt width: whole row tiles (the prefill's matmul rows)
BUDGET_BUCKET = 32  # the smallest static output buffer (max_new_tokens' bucket)
BUCKET_STEP = 1024  # buckets are powers of two up to this, then its multiples
SLOT_CAPACITY = 8192  # BatchEngine's default cache positions per request (the context, capped)
# BatchEngine's default chunk width: a prompt advances one chunk a step, so it sets how fast a long
# prompt prefills and how long a step with chunks takes. H200, 12B, a 16K-token prompt beside 8 streams
# (one chunk a step): 128 -> their p99 gap 1.8x, the long request's first token after 3.1 s; 256 -> 2.7x,
# 2.7 s; 512 -> 1.75 s, 64 ms chunk steps (docs/benchmark_results/serve-long-2026-12-04.md).
PREFILL_CHUNK = 128
# BatchEngine's default token budget a step (decode rounds first, then prefill chunks), from the H200
# sweep of 2026-12-05 (12B shapes, docs/benchmark_results/serve-h200-2026-12-05.md): at 32 clients
# 512 gave 1,572 tok/s over HTTP and 2,048 1,623 (-3%), but beside a 16K prompt the streams' p99 gap
# was 60 ms at 512 and 268 ms at 2,048 (the long prompt takes every lane left: 15 chunks a step).
STEP_TOKENS = 512
MAX_STEP_TOKENS = 1 << 20  # a typo's bound: the lanes are host arrays built every step
# prefill_chunk at most (BatchEngine and `jaxspec serve`): a prompt's last chunk is its rest, so a chunk
# wider than the prompt changes nothing; this is past the longest request the server holds (32,768
# positions) and keeps a typo from compiling a prefill program a million rows wide.
MAX_PREFILL_CHUNK = 1 << 16
# The narrowest row view a batch engine's decode reads on a CPU (`view_bucket`): a round there reads
# every position of its view, and one at 4,096 took about twice one at 256 (the 270M, 1 slot;
# docs/benchmark_results/first-impression-cpu-2026-12-05.md). Narrower saves little (the round's
# weights dominate) and would compile a program for every doubling from a few positions up.
VIEW_BUCKET = 256


def round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def size_bucket(n: int, floor: int) -> int:
    """The size a program is compiled for to hold `n`: the next power of two, at least `floor`;
    past BUCKET_STEP, `n` rounded up to a multiple of BUCKET_STEP (`floor` divides both)."""
    if n > BUCKET_STEP:
        return round_up(n, BUCKET_STEP)
    return max(floor, 1 << max(0, int(n) - 1).bit_length())


def view_bucket(n: int, capacity: int, block: int, floor: int = VIEW_BUCKET) -> int:
    """The row view (positions, whole blocks) a decode step that touches positions below `n` runs
    at: the next power of two, at least `floor`, at most `capacity`. Powers of two keep the programs
    few (one per doubling: 5 up to 4,096) and a view at most twice what the rows need."""
    v = max(floor, 1 << max(0, int(n) - 1).bit_length())
    return min(int(capacity), round_up(v, block))


def asked_k(block_size: int, drafting: bool) -> int:
    """The K a run asks for: block_size with an assistant, else 1 (classic decoding)."""
    return int(block_size) if drafting else 1


def slot_capacity(context: int | None, most: int = SLOT_CAPACITY) -> int:
    """Cache positions per batch slot (a request's, in the paged engine) by default: the model's
    context, at most `most`."""
    return min(context or most, most)


def _written(prompt_len: int, budget: int, width: int) -> int:
    """Cache positions a run may write per row: a round writes `width` positions from the cache
    length, which is at most prompt + budget - 1 (every token but the bonus)."""
    return prompt_len + budget - 1 + width


@dataclasses.dataclass(frozen=True)
class LoopConfig:
    block_size: int                 # K to run; 1 is classic decoding
    verify_width: int               # rows one verify forward runs: K, or padded
    capacity: int                   # KV cache positions per row
    batch: int
    prompt_width: int               # the prompt buffer's width
    budget: int                     # N: the output buffer, the largest per-row budget
    verify_pad: bool | int          # resolved (verify.resolve_verify_pad)
    cache_size: int | None = None   # the caller's fixed capacity; None: derived from the prompt width
    matmul: Any = None              # the target's DispatchConfig (the qmm threshold of verify_pad=True)
    asked: int = 0                  # K asked (1 without an assistant); > block_size after a failed probe
    drafting: bool = False          # an assistant was given
    fallback: str | None = None     # why speculation was dropped or K shrunk
    probe_logit_diff: float | None = None

    @classmethod
    def derive(cls, block_size: int, batch: int, prompt_width: int, budget: int, verify_pad, matmul,
               cache_size: int | None = None, **rest) -> LoopConfig:
        """The computation, unchecked and unbucketed: a compiled program's sizes for its shapes."""
        pad = verify.resolve_verify_pad(verify_pad, matmul)
        width = verify.verify_width(int(block_size), batch, pad, matmul)
        capacity = cache_size if cache_size is not None else round_up(_written(prompt_width, budget, width),
                                                                      CAPACITY_ROUND)
        return cls(block_size=int(block_size), verify_width=width, capacity=capacity, batch=batch,
                   prompt_width=prompt_width, budget=budget, verify_pad=pad, cache_size=cache_size,
                   matmul=matmul, **rest)

    @classmethod
    def resolve(cls, *, block_size: int, batch: int, prompt_len: int, max_new_tokens: int, drafting: bool = True,
                verify_pad=None, matmul=None, cache_size: int | None = None) -> LoopConfig:
        """A request's sizes (generate, stream_generate): the longest prompt and the budget padded to
        their buckets (`size_bucket`; the prompt at most to an explicit cache_size). ValueError when
        an explicit cache_size is not an integer >= 1 or cannot hold the prompt, its max_new_tokens
        and the last round's verify width."""
        if cache_size is not None:
            if isinstance(cache_size, bool) or not _is_int(cache_size) or cache_size < 1:
                raise ValueError(f"cache_size must be None or an integer >= 1, got {cache_size!r}")
            if prompt_len > cache_size:
                raise ValueError(f"prompt is longer than the cache: {prompt_len} tokens, cache_size={cache_size}")
        k = asked_k(block_size, drafting)
        prompt_width = size_bucket(prompt_len, PROMPT_BUCKET)
        if cache_size is not None:
            prompt_width = min(prompt_width, cache_size)
        cfg = cls.derive(k, batch, prompt_width, size_bucket(max_new_tokens, BUDGET_BUCKET), verify_pad, matmul,
                         cache_size, asked=k, drafting=drafting)
        if cache_size is not None and max_new_tokens > cfg.room(prompt_len):
            width = cfg.verify_width
            what = f"block_size={block_size}" + (f" (verify width {width})" if width != block_size else "")
            raise ValueError(f"{what} is larger than the cache allows: prompt {prompt_len} + "
                             f"max_new_tokens {max_new_tokens} - 1 + {width} > cache_size {cache_size}")
        return cfg

    @classmethod
    def for_slots(cls, target, drafter, *, slots: int, block_size: int, max_new_tokens: int,
                  capacity: int | None, exactness_probe: bool = True, block_tokens: int = 1) -> LoopConfig:
        """A BatchEngine's sizes (`drafter`: what drafts, None: classic): `slots` rows of up to `capacity` positions each (default: the
        target's context, capped at SLOT_CAPACITY, rounded up to `block_tokens`), prompts of any
        width up to it; K probed at T = 0 whatever the requests' sampling (greedy rows are exact
        only if the K-wide verify is). ValueError when the capacity cannot hold max_new_tokens + K + 1
        or is not a multiple of `block_tokens` (a paged cache's block: a row's table maps whole blocks)."""
        k = asked_k(block_size, drafter is not None)
        if capacity is None:
            capacity = round_up(slot_capacity(target.config.max_position_embeddings), block_tokens)
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < max_new_tokens + k + 1:
            raise ValueError(f"capacity must be an integer >= max_new_tokens + block_size + 1 = "
                             f"{max_new_tokens + k + 1}, got {capacity!r}")
        if capacity % block_tokens:
            raise ValueError(f"capacity {capacity} must be a multiple of block_tokens {block_tokens}")
        cfg = cls.derive(k, slots, PROMPT_BUCKET, round_up(max_new_tokens, BUDGET_BUCKET), None, target.matmul,
                         capacity, asked=k, drafting=drafter is not None)
        return cfg.probed(target, 0.0, exactness_probe)

    def with_block_size(self, k: int, **rest) -> LoopConfig:
        """The same run at K = k (its width, and a derived capacity, follow)."""
        return LoopConfig.derive(k, self.batch, self.prompt_width, self.budget, self.verify_pad, self.matmul,
                                 self.cache_size, asked=self.asked, drafting=self.drafting, **rest)

    def positions(self, prompt_len: int, max_new_tokens: int) -> int:
        """Cache positions a request of this prompt length and budget may write (a paged engine's
        blocks hold them all)."""
        return _written(prompt_len, max_new_tokens, self.verify_width)

    def room(self, prompt_len: int, capacity: int | None = None) -> int:
        """The largest budget a prompt of this length fits `capacity` positions with (default: the
        cache's; <= 0: none)."""
        return (self.capacity if capacity is None else capacity) - self.positions(prompt_len, 0)

    def probes(self, temperature, exactness_probe: bool) -> bool:
        """Whether `probed` runs the exactness probe (speculative, T = 0, not turned off)."""
        return self.asked > 1 and temperature == 0 and exactness_probe

    def probed(self, target, temperature, exactness_probe: bool) -> LoopConfig:
        """The K to run, why speculation was dropped or shrunk, and the probe's logit diff. At T = 0
        the exactness probe checks once per shape that a K-wide verify is bit-identical to K single
        steps. When it is not (on the H200 at B = 8, K = 4 the verify's 32 rows leave the multirow
        window that decode's [8, 2] row bucket stays in), K drops to the row bucket, where verify
        and decode are one computation, if that still drafts (K >= 2) and passes; else decoding
        falls back to classic (K = 1). Either way with a warning."""
        k, fallback, diff = self.asked, None, None
        if self.drafting and k == 1:
            fallback = "block_size=1: nothing to draft"
        if self.probes(temperature, exactness_probe):
            width = self.verify_width
            exact, diff = verify.exactness_probe(target, self.batch, k, width)
            if not exact:
                first_diff, bucket = diff, models.row_bucket(target, self.batch)
                if 2 <= bucket < k:
                    exact, diff = verify.exactness_probe(target, self.batch, bucket,
                                                         self.with_block_size(bucket).verify_width)
                if exact:
                    verify.warn_inexact(k, width, first_diff, instead=bucket)
                    fallback = (f"exactness probe failed at K={k} (max |logit diff| {first_diff:.3g}): "
                                f"ran K={bucket}, the row bucket at B={self.batch}")
                    k = bucket
                else:
                    verify.warn_inexact(k, width, first_diff)
                    fallback = f"exactness probe failed (max |logit diff| {first_diff:.3g})"
                    k, diff = 1, first_diff
        return self.with_block_size(k, fallback=fallback, probe_logit_diff=diff)


def _is_int(t) -> bool:
    return isinstance(t, (int, np.integer)) and not isinstance(t, (bool, np.bool_))
