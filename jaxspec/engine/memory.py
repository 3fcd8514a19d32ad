"""The memory `jaxspec serve --max-batch N` needs, estimated from the configs before anything loads
(so a batch that cannot fit is refused in a second, not after minutes of warm-up).

    need = batch_memory(tcfg, max_batch=256, block_size=4, dtype=jnp.bfloat16, weight_bytes=27 << 20,
                        capacity=256, host=True)
    need.total, need.describe()

The batch engine (jaxspec.engine.batching) keeps one decode state of `max_batch` rows and runs one
compiled step over it. Its peak, per term (XLA's `memory_analysis` of the step program and the
process's peak RSS, default pair on CPU, K = 4 and K = 1):
- the KV cache (`models.cache_bytes`; given `kv_positions`, `serve --kv-positions`, the paged
  engine's pool of that many positions and the slots' sliding rings) and the rest of the state
  (output tokens, their logprobs and top-20 alternatives, the sampling rows, the penalties' token
  counts): the step's
  arguments, donated;
- the step's temporaries: 1.8x to 1.9x the KV cache per slot on the default pair (K = 1 and K = 4:
  2.29 to 2.37 MB per slot for a 1.27 MB bfloat16 cache, B = 8..4096), 2.5x on a tiny float32
  pair at B = 16, K = 4 (its activations weigh more beside its cache): counted as 2.5 caches;
- the verify's float32 logits [B, K + 1, V], four copies (K = 4 adds at most 3.9 copies' worth
  of temporaries per slot over K = 1 on the default pair): a large vocabulary's slots are heavy;
- the paged cache's views (jaxspec.engine.batching: a global layer gathers its rows' K and V, up to a
  request's capacity each, from the shared pool): two K/V pairs of the widest global layer alive;
- the weights, and on a CPU (host memory) the process itself: the runtime and the compiler
  (1.2 GB at B = 8 above the buffers) and XLA's dequantized weights (the step's temporaries at
  B -> 0 hold ~2x the weight files).
The estimate is an upper bound within 1.35x of the measured peak on CPU: B = 8, 64, 256, 1024 peaked
at 1.35, 1.58, 2.16, 5.03 GB (estimated 1.73, 2.00, 2.92, 6.62); at 4096 XLA's buffers plus the
runtime come to ~16.2 GB (estimated 21.4; the old estimate said 6.2 and the warm-up passed 12). On a
GPU the runtime reserve is not counted (the device's limit leaves the runtime's own memory out).
The whole warm-up stays under it (peak RSS through Server.warm_up, bfloat16, 2026-12-04: the default
pair at B = 64 and 1024, 1.69 and 5.58 GiB, estimated 1.9 and 6.7; the tiny pair at B = 4096, 2.34
GiB, estimated 3.3).

On a CPU the estimate is checked against what the run may fill (`host_usable`): the host's memory
less SYSTEM_SHARE, no more than the memory cgroup's limit, nor than what is available now. Against
the whole of it, --max-batch 4096 (estimated 21.9 GiB) passed on a 23.5 GiB host, and its warm-up
then grew past what the machine could spare.
"""
from __future__ import annotations

import dataclasses
import os

import numpy as np

from jaxspec.engine.loop_config import PROMPT_BUCKET

SYSTEM_SHARE = 0.1        # of the host's memory, left to the system (kernel, page cache, other processes)
STEP_CACHE_COPIES = 2.5   # the step's temporaries, in KV caches (measured 1.8 to 2.5 on CPU)
LOGIT_COPIES = 4          # float32 [B, K + 1, V] arrays alive at once in a verify round
HOST_RUNTIME = 3 << 29    # 1.5 GiB: the process, the runtime and the compiler on a CPU (1.2 GB measured)
HOST_WEIGHT_COPIES = 2    # XLA's dequantized weights on a CPU, in weight files
POOL_BLOCK = PROMPT_BUCKET  # positions per block of the server's KV pool (the scheduler's block_tokens)


@dataclasses.dataclass(frozen=True)
class BatchMemory:
    """Bytes per term (see the module docstring); `total` is what is checked."""

    max_batch: int
    capacity: int
    cache: int
    state: int
    step: int
    logits: int
    weights: int
    runtime: int
    views: int = 0
    kv_positions: int | None = None  # the shared pool's positions, when set apart from the slots'
    snapshots: int = 0  # prefix reuse's ring snapshots (jaxspec.engine.prefix_cache)
    snapshot_bytes: int = 0  # one of them: a slot's rings

    @property
    def total(self) -> int:
        return (self.cache + self.state + self.step + self.logits + self.weights + self.runtime + self.views
                + self.snapshots)

    def describe(self) -> str:
        """The terms, for a one-line error."""
        pool = (f"a pool of {self.kv_positions} positions for {self.max_batch} slots" if self.kv_positions
                else f"{self.capacity} positions" if self.max_batch == 1
                else f"{self.max_batch} slots x {self.capacity} positions")
        parts = [f"KV cache {_fmt(self.cache)} ({pool})",
                 f"step temporaries {_fmt(self.step)}", f"logits {_fmt(self.logits)}",
                 f"outputs {_fmt(self.state)}", f"weights {_fmt(self.weights)}"]
        if self.views:
            parts.append(f"paged cache views {_fmt(self.views)}")
        if self.snapshots >= self.total // 100:  # in the total always; named where it matters (one line)
            parts.append(f"prefix ring snapshots {_fmt(self.snapshots)}")
        if self.runtime:
            parts.append(f"runtime and compiler {_fmt(self.runtime)}")
        return f"about {_fmt(self.total)}: " + ", ".join(parts)


def batch_memory(tcfg, max_batch: int, block_size: int, dtype, weight_bytes: int, *, capacity: int,
                 host: bool, request_capacity: int | None = None, kv_positions: int | None = None,
                 prefix_cache: bool = False, ring_snapshots: int | None = None) -> BatchMemory:
    """The estimate for `max_batch` slots of `capacity` cache positions each, verify width
    `block_size` (1: classic), weights of `weight_bytes` (the files); `host`: the memory is the
    CPU's, shared with the process and the compiler. `request_capacity`: positions one request may
    hold (the paged engine's views; None: no views counted). `kv_positions`: the global layers' pool
    shared by the slots, in positions (a multiple of POOL_BLOCK; `serve --kv-positions`): the KV
    cache is then the paged engine's (`models.paged_cache_bytes`: that pool, each slot's sliding
    rings and block table), not `max_batch` x `capacity` positions; the other terms are the same.
    `prefix_cache`: the engine keeps `ring_snapshots` (None: `prefix_cache.default_snapshots(max_batch)`)
    copies of a slot's sliding rings (none when the model has no ring)."""
    from jaxspec import models
    from jaxspec.engine.sampling import BIAS_SLOTS, TOP_LOGPROBS

    b = max_batch
    if kv_positions is None:
        cache = models.cache_bytes(tcfg, b, capacity, dtype)
    else:
        per_request = -(-(request_capacity or capacity) // POOL_BLOCK) * POOL_BLOCK  # the engine's capacity
        cache = models.paged_cache_bytes(tcfg, b, per_request, max(1, kv_positions // POOL_BLOCK), POOL_BLOCK,
                                         dtype)
    width = capacity + block_size + 16  # the output buffer's positions, at most (a budget < capacity)
    per_row = (width * (4 + 4 + 2 * 4 * TOP_LOGPROBS)  # out, lp, top_ids, top_lp
               + BIAS_SLOTS * 8 + 4 * tcfg.hidden_size + 64  # bias rows, h_prev, the counters
               + 4 * capacity  # a prompt-lookup drafter's token history (int32 per cache position)
               + 5 * tcfg.vocab_size)  # the penalties' counts (int32) and prompt mask (bool) per token
    logits = LOGIT_COPIES * 4 * b * (block_size + 1) * tcfg.vocab_size
    weights = weight_bytes * (1 + (HOST_WEIGHT_COPIES if host else 0))
    views = 0
    if request_capacity:
        full = [i for i in tcfg.cache_layers if not tcfg.is_sliding(i)] or list(tcfg.cache_layers)
        widest = max(tcfg.layer_kv_heads[i] * tcfg.layer_head_dims[i] for i in full)
        views = 2 * 2 * b * request_capacity * widest * np.dtype(dtype).itemsize  # K and V, two alive
    snapshots = row = 0
    if prefix_cache:
        from jaxspec.engine.prefix_cache import default_snapshots

        per_request = -(-(request_capacity or capacity) // POOL_BLOCK) * POOL_BLOCK
        if (any(tcfg.is_sliding(i) for i in tcfg.cache_layers)
                and models.ring_size(tcfg, per_request) < per_request):  # else every layer is paged: no ring
            row = (models.paged_cache_bytes(tcfg, 2, per_request, 1, POOL_BLOCK, dtype)
                   - models.paged_cache_bytes(tcfg, 1, per_request, 1, POOL_BLOCK, dtype))  # a slot's rings (+ table)
            snapshots = (ring_snapshots or default_snapshots(b)) * row
    return BatchMemory(max_batch=b, capacity=capacity, cache=cache, state=b * per_row,
                       step=int(STEP_CACHE_COPIES * cache), logits=logits, weights=weights,
                       runtime=HOST_RUNTIME if host else 0, views=views, kv_positions=kv_positions,
                       snapshots=snapshots, snapshot_bytes=row)


def largest_batch(limit: int, tcfg, block_size: int, dtype, weight_bytes: int, *, capacity: int, host: bool,
                  most: int, request_capacity: int | None = None, prefix_cache: bool = False,
                  ring_snapshots: int | None = None) -> int:
    """The largest batch in 0..most whose estimate fits `limit` bytes (0: not even one slot)."""
    lo, hi = 0, most
    while lo < hi:  # the estimate grows with the batch
        mid = (lo + hi + 1) // 2
        if batch_memory(tcfg, mid, block_size, dtype, weight_bytes, capacity=capacity, host=host,
                        request_capacity=request_capacity, prefix_cache=prefix_cache,
                        ring_snapshots=ring_snapshots).total <= limit:
            lo = mid
        else:
            hi = mid - 1
    return lo


def largest_pool(limit: int, tcfg, max_batch: int, block_size: int, dtype, weight_bytes: int, *, capacity: int,
                 host: bool, most: int, request_capacity: int | None = None, prefix_cache: bool = False,
                 ring_snapshots: int | None = None) -> int:
    """The largest `kv_positions` in 0..most, a multiple of POOL_BLOCK, whose estimate at `max_batch`
    slots fits `limit` bytes (0: not even one block)."""
    lo, hi = 0, most // POOL_BLOCK
    while lo < hi:  # the estimate grows with the pool
        mid = (lo + hi + 1) // 2
        if batch_memory(tcfg, max_batch, block_size, dtype, weight_bytes, capacity=capacity, host=host,
                        request_capacity=request_capacity, kv_positions=mid * POOL_BLOCK,
                        prefix_cache=prefix_cache, ring_snapshots=ring_snapshots).total <= limit:
            lo = mid
        else:
            hi = mid - 1
    return lo * POOL_BLOCK


def _fmt(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB" if n >= 2**20 else f"{n / 2**10:.0f} KiB"



def host_usable(physical: int) -> tuple[int, str]:
    """(bytes, what they are) of host memory a run may plan to fill, for a host of `physical` bytes:
    that less SYSTEM_SHARE for the system, no more than this process's memory cgroup allows
    (`cgroup_limit`), nor than what is available now (`available_now`: other processes' memory is
    not there to take)."""
    usable = int(physical * (1 - SYSTEM_SHARE))
    what = f"host memory ({_fmt(physical)} less a tenth for the system)"
    limit = cgroup_limit()
    if limit is not None and limit < usable:
        usable, what = limit, "host memory (this process's memory cgroup limit)"
    now = available_now()
    if now is not None and now < usable:
        usable, what = now, f"host memory available now (of {_fmt(physical)}; other processes hold the rest)"
    return usable, what


def cgroup_limit(proc: str = "/proc/self/cgroup", fs: str = "/sys/fs/cgroup") -> int | None:
    """The memory limit of this process's cgroup (v2 `memory.max`, v1 `memory.limit_in_bytes`, the
    lowest on its path), or None when there is none or it cannot be read. `proc`, `fs`: where the
    process's cgroup list and the cgroup file system are (tests)."""
    try:
        with open(proc) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    found = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2
            root, name = fs, "memory.max"
        elif "memory" in controllers.split(","):
            root, name = os.path.join(fs, "memory"), "memory.limit_in_bytes"
        else:
            continue
        parts = [p for p in path.split("/") if p]
        for i in range(len(parts), -1, -1):
            try:
                with open(os.path.join(root, *parts[:i], name)) as f:
                    text = f.read().strip()
            except OSError:
                continue
            if text.isdigit() and int(text) < 1 << 60:  # "max", or v1's page-rounded 2**63: no limit
                found.append(int(text))
    return min(found) if found else None


def available_now() -> int | None:
    """The host memory this process could fill now: MemAvailable (/proc/meminfo) and what it
    already holds (its resident set); None where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            avail = next(int(line.split()[1]) << 10 for line in f if line.startswith("MemAvailable:"))
        with open("/proc/self/status") as f:
            rss = next(int(line.split()[1]) << 10 for line in f if line.startswith("VmRSS:"))
    except (OSError, StopIteration, ValueError, IndexError):
        return None
    return avail + rss
