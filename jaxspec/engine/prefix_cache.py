"""Prefix reuse for the batch engine (issue 70): the KV pool's block bookkeeping, with the full blocks
of computed prompts kept, shared and reference-counted, and the sliding layers' ring snapshots.

Host side only: which pool block holds what, who holds it, which a new request may take. The device
programs are the engine's (its prefill reads and writes a row's blocks through its table row); a hit
only changes a row's table, its starting length and (with rings) its ring's contents.

Blocks. A prompt's full blocks (positions [i B, (i + 1) B) of the prompt, B = `block_tokens`) are
named by a chain digest: sha256 of (the previous block's digest, the block's token ids), rooted in the
engine's key (`root`: the model, dtype and drafter an engine runs, the same for all its blocks), so
a digest names every token from position 0 to the block's end. Once a prefill chunk has written a
block, `register` maps its digest to it; a later prompt whose first blocks have the same digests
(`match`) takes those blocks (its table row points at them, their count goes up) and starts its
prefill after them. A block whose count falls to 0 stays cached and is reused by a hit until a
request needs a block and no never-used one is left: the least recently released cached block is
then evicted (its digest forgotten) and handed out. A block held by a running request (count > 0) is
never handed out. Only blocks a prefill chunk wrote are registered, never the ones a decode round
wrote: a verify's K/V come from a forward of another width, whose bits need not be a chunk's.

Rings. A sliding layer's ring (models/cache.py) is per row and not paged: a row that starts at
position P needs the ring a prefill would hold at P, or the keys of its first W positions would miss
their window. Recomputing the last window's tokens is not exact (their own sliding layers would read
an empty ring, and every layer above reads what they write), so the engine keeps snapshots: after a
prefill chunk ends at a chunk boundary, the row's rings (K, V, positions) may be copied into one of
`RingSnapshots.size` device slots, named by the digest of the block ending there, least recently
used evicted; a hit ends where a snapshot exists and copies it into the row. Which boundaries is the
engine's choice (`BatchEngine._computed`: a prompt's last, the deepest shared one, any while there is
room). The cost: a device copy of a row's rings per snapshot taken, and `size` rows of ring memory.
"""
from __future__ import annotations

import collections
import functools
import hashlib

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.kernels import EMPTY


MAX_RING_SNAPSHOTS = 1 << 12  # refuses a typo; the memory check is the real bound (serve's config checks it too)


def default_snapshots(slots: int) -> int:
    """Ring snapshots an engine keeps by default: one per two slots, at least 4. A snapshot is a
    slot's rings, as large as a slot's share of the KV pool at 12B shapes (341 MB); two per slot
    took 20.3 GiB at 32 slots, more than the pool's 12.2, and put `serve --max-batch 32` past an
    80 GB H100's limit (docs/design.md, "Prefix reuse")."""
    return max(4, slots // 2)


def root_key(*parts) -> bytes:
    """The digest every chain of an engine starts from: what its blocks' K/V depend on besides the
    tokens (the model, dtype, drafter), so blocks never match across engines that differ in them."""
    return hashlib.sha256(repr(parts).encode()).digest()


class BlockPool:
    """The KV pool's `num_blocks` blocks: free (never used or evicted), held (a count per block), or
    cached (count 0, named by a digest, reusable until evicted, least recently released first).
    `reuse` False: no block is ever registered (every released block is free at once)."""

    def __init__(self, num_blocks: int, block_tokens: int, *, reuse: bool = True, root: bytes = b""):
        self.num_blocks, self.block_tokens, self.reuse, self.root = num_blocks, block_tokens, reuse, root
        self.free = list(range(num_blocks - 1, -1, -1))  # a stack: the lowest block ids first
        self.ref = [0] * num_blocks
        self.name: dict[int, bytes] = {}  # block -> its digest (registered blocks)
        self.block: dict[bytes, int] = {}  # digest -> block
        self.tokens: dict[int, tuple] = {}  # block -> its token ids (a digest that matches but they do not: a miss)
        self.idle: collections.OrderedDict[int, None] = collections.OrderedDict()  # cached, count 0: oldest first
        self.queried = self.hit = self.evicted = 0  # prompt tokens looked up, of them found; blocks evicted

    @property
    def available(self) -> int:
        """Blocks a new request may take now: free ones and cached ones nobody holds."""
        return len(self.free) + len(self.idle)

    @property
    def used(self) -> int:
        return self.num_blocks - self.available

    @property
    def cached(self) -> int:
        """Registered blocks (held or idle): what a hit may find."""
        return len(self.name)

    def digests(self, ids) -> list[bytes]:
        """The chain digest of each full block of `ids` (empty when reuse is off)."""
        if not self.reuse:
            return []
        b, out, parent = self.block_tokens, [], self.root
        arr = np.asarray(ids, np.int64)
        for i in range(len(ids) // b):
            parent = hashlib.sha256(parent + arr[i * b:(i + 1) * b].tobytes()).digest()
            out.append(parent)
        return out

    def match(self, ids, digests: list[bytes]) -> list[int]:
        """The registered blocks of the longest run of `digests` from the first, each checked against
        its tokens (a mismatch ends the run)."""
        got, b = [], self.block_tokens
        for i, d in enumerate(digests):
            blk = self.block.get(d)
            if blk is None or self.tokens[blk] != tuple(ids[i * b:(i + 1) * b]):
                break
            got.append(blk)
        return got

    def take(self, shared: list[int], n_new: int) -> list[int]:
        """Hold `shared` (registered blocks a hit found) and `n_new` fresh ones: never-used blocks
        first, then idle cached ones, least recently released first (evicted: their digests
        forgotten). ValueError, nothing taken, when too few are available."""
        idle_shared = sum(self.ref[b] == 0 for b in shared)
        if n_new > self.available - idle_shared:
            raise ValueError(f"the KV pool has {self.available - idle_shared} free blocks of {self.num_blocks}, "
                             f"this request needs {n_new} ({self.block_tokens} positions each)")
        for b in shared:
            self.idle.pop(b, None)
            self.ref[b] += 1
        fresh = []
        for _ in range(n_new):
            if self.free:
                b = self.free.pop()
            else:  # the least recently released cached block
                b, _ = self.idle.popitem(last=False)
                self._forget(b)
                self.evicted += 1
            self.ref[b] = 1
            fresh.append(b)
        return list(shared) + fresh

    def release(self, blocks: list[int]) -> None:
        """A request's blocks back: each one's count down; at 0 a registered block turns idle (the
        request's last blocks first in line for eviction: its head is what others share), another
        block free."""
        for b in reversed(blocks):
            if self.ref[b] <= 0:
                raise RuntimeError(f"KV block {b} released while no request holds it")
            self.ref[b] -= 1
            if self.ref[b] == 0:
                if b in self.name:
                    self.idle[b] = None
                else:
                    self.free.append(b)

    def register(self, block: int, digest: bytes, tokens) -> None:
        """`block` (held, written by a prefill chunk) holds the block named `digest`: a later prompt may
        share it. A digest already registered to a held block keeps it (this one stays private); one
        registered to an idle block moves to this one (the idle copy is freed): a prompt that shares a
        held block costs no free block."""
        if not self.reuse or block in self.name:
            return
        old = self.block.get(digest)
        if old is not None:
            if self.ref[old] > 0:
                return
            self._forget(old)
            del self.idle[old]
            self.free.append(old)
        self.block[digest], self.name[block], self.tokens[block] = block, digest, tuple(tokens)

    def _forget(self, block: int) -> None:
        d = self.name.pop(block)
        del self.block[d]
        del self.tokens[block]

    def check(self) -> None:
        """The bookkeeping's invariants (tests): every block exactly once free, idle or held."""
        held = [b for b in range(self.num_blocks) if self.ref[b] > 0]
        assert sorted(held + self.free + list(self.idle)) == list(range(self.num_blocks))
        assert all(b in self.name for b in self.idle) and not set(self.free) & set(self.name)


def _ring_entries(cache) -> tuple[int, ...]:
    return tuple(j for j in range(len(cache.k)) if cache.is_ring(j))


class RingSnapshots:
    """`size` device copies of a row's rings (each ring buffer's K and V, the ring positions), named
    by the digest of the block that ends where they were taken, least recently used evicted.
    `take` copies a row in; `restore` (traced in the engine's admission program) copies one into a
    row. A slot is overwritten only by a later `take`, queued after every read of it."""

    def __init__(self, cache, size: int):
        self.entries, self.size = _ring_entries(cache), size
        ax = lambda x: x.ndim - 4  # noqa: E731  the rows' axis of a [(G,) B, S, H, D] buffer
        shape = lambda x: x.shape[:ax(x)] + (size,) + x.shape[ax(x) + 1:]  # noqa: E731
        self.k = tuple(jnp.zeros(shape(cache.k[j]), cache.k[j].dtype) for j in self.entries)
        self.v = tuple(jnp.zeros(shape(cache.v[j]), cache.v[j].dtype) for j in self.entries)
        self.pos = jnp.zeros((size,) + cache.pos.shape[1:], cache.pos.dtype)
        self.at: collections.OrderedDict[bytes, int] = collections.OrderedDict()  # digest -> slot, oldest first
        self.taken = 0

    @property
    def has_room(self) -> bool:
        return len(self.at) < self.size

    def __contains__(self, digest: bytes) -> bool:
        return digest in self.at

    def find(self, digest: bytes) -> int:
        self.at.move_to_end(digest)
        return self.at[digest]

    def take(self, cache, row: int, digest: bytes) -> None:
        """Copy `cache`'s row `row` rings into a slot named `digest` (the least recently used one)."""
        if digest in self.at:
            self.at.move_to_end(digest)
            return
        if len(self.at) < self.size:
            slot = len(self.at)
        else:
            _, slot = self.at.popitem(last=False)
        self.at[digest] = slot
        self.k, self.v, self.pos = _copy_in((self.k, self.v, self.pos), tuple(cache.k[j] for j in self.entries),
                                            tuple(cache.v[j] for j in self.entries), cache.pos, jnp.int32(row),
                                            jnp.int32(slot))
        self.taken += 1

    def warm(self, cache) -> None:
        """Compile the copy (an engine's warm-up) into a slot no digest names yet, if one is left."""
        if len(self.at) < self.size:
            self.k, self.v, self.pos = _copy_in((self.k, self.v, self.pos), tuple(cache.k[j] for j in self.entries),
                                                tuple(cache.v[j] for j in self.entries), cache.pos, jnp.int32(0),
                                                jnp.int32(len(self.at)))

    @property
    def arrays(self):
        return self.k, self.v, self.pos


def restore(cache, entries: tuple[int, ...], arrays, row, slot, hit):
    """`cache` with snapshot `slot` of `arrays` (`RingSnapshots.arrays`) copied into row `row`'s rings
    when `hit`, else that row's ring positions emptied (traced in the engine's admission program)."""
    sk, sv, sp = arrays
    k, v = list(cache.k), list(cache.v)
    for j, a, b in zip(entries, sk, sv):
        k[j] = _set_row(k[j], row, _row(a, slot))
        v[j] = _set_row(v[j], row, _row(b, slot))
    pos = cache.pos.at[row].set(jnp.where(hit, sp[slot], EMPTY))
    return cache.replace(k=tuple(k), v=tuple(v), pos=pos)


def _row(x, i):
    return jax.lax.dynamic_index_in_dim(x, i, x.ndim - 4, keepdims=True)


def _set_row(x, i, r):
    return jax.lax.dynamic_update_index_in_dim(x, r, i, x.ndim - 4)


@functools.partial(jax.jit, donate_argnums=(0,))
def _copy_in(snaps, ks, vs, pos, row, slot):
    """Row `row` of the ring buffers into snapshot `slot`."""
    sk, sv, sp = snaps
    sk = tuple(_set_row(s, slot, _row(b, row)) for s, b in zip(sk, ks))
    sv = tuple(_set_row(s, slot, _row(b, row)) for s, b in zip(sv, vs))
    return sk, sv, sp.at[slot].set(pos[row])
