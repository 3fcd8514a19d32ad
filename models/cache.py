"""A static-shape KV cache: one K and one V buffer per layer that owns K/V, plus per-row lengths.

Global (full-attention) layers keep `capacity` positions, slot = absolute position. Sliding layers
keep a ring of `ring_size(config, capacity, max_block)` slots (`window + max_block + 1`, or the plain
capacity buffer when that is not smaller): position p lives in slot `p mod S`, and `pos [B, S]`
records which absolute position each ring slot holds (shared by every sliding layer: they write the
same positions; `EMPTY` where nothing was written). Slots are fixed per absolute position, so a
[B, 1] decode step and a [B, K] verify read the same key layout (row invariance).

Rows of a batch may hold different lengths. Rolling back is `cache.replace(lengths=new_lengths)`:
stale entries past a row's length are never visible (a query at position p only sees keys <= p,
every key in [length, p] was written by the call that owns p, and ring reads of older contents
take only slots whose position is below the call's start) and are overwritten later.

The ring rule (sliding layers, ring caches only): after a forward of T <= max_block tokens that
started at length n, the lengths may be set to anything in [n, n + T] (rollback never goes below the
start of the last call): a write of position p clobbers p - S, and S = W + max_block + 1 keeps the
last W + 1 positions below any such length (the target's window needs W - 1 of them, the
assistant's W + 1). A forward of T > max_block tokens (a prefill) writes, per row, only its newest
S valid positions (`valid` True; pass the true lengths as `valid` for a ragged prefill), so its
lengths may only be set to that row's valid end (or up to max_block + 1 below it).

Paged (`init_paged_cache`, continuous batching): the buffers that would hold `capacity` positions
per row (the global layers; every layer when there is no ring) become pools of fixed-size blocks
shared by all rows, `[(G,) num_blocks, block, H, D]`, and `table [B, capacity // block]` maps each
row's logical block (position // block) to a pool block (`num_blocks`: none; a write there is dropped,
a read gives zeros). A layer gathers its row view `[B, capacity, H, D]` through the table
(`paged_view`), reads and writes it exactly as a contiguous buffer, and scatters the new positions back
into the pool (`paged_write`): the attention sees the array a contiguous cache would hold, so the
results are bitwise a contiguous cache's. A decode or verify on the attention kernels instead writes
into the pool and reads each row's blocks in place (`models.target.reads_pool`,
`pallas_kernels.paged_attention`: decode_attention's arithmetic on the same keys; bitwise the same
in Pallas' interpreter, tests/models/test_paged_cache.py). The rings stay per row: their size is the
window's, not the context's. Who owns a block is the host's business (`jaxspec.batching`).
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import struct

from jaxspec.kernels import EMPTY, ROW_TILE  # EMPTY: the position of a slot nothing was written to

from .config import TargetConfig
from .layer_scan import cache_entries, stacked_entries


@struct.dataclass
class KVCache:
    """k[j], v[j]: `[B, L_j, num_kv_heads, head_dim]` (RoPE'd, normed keys; normed values) of the
    layers `layer_scan.cache_entries(config)[j]`, with a leading `[G]` axis for the G layers of a scan
    position (`layer_scan.cache_entry` maps a layer to its buffer and index); L_j = capacity (full
    layers, or every layer without a ring) or the ring size. lengths: int32 `[B]`, the number of valid positions per row. pos: int32 `[B, S]` the
    absolute position in each ring slot (None when no layer has a ring). capacity (static): the
    largest number of positions a row may hold."""

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]
    lengths: jax.Array
    pos: jax.Array | None = None
    capacity: int = struct.field(pytree_node=False, default=0)
    table: jax.Array | None = None  # int32 [B, capacity // block] pool block of each logical block (paged)
    paged: tuple[int, ...] = struct.field(pytree_node=False, default=())  # the buffers that are block pools

    def __post_init__(self):
        if not self.capacity:  # built without one (a plain cache): every buffer is the capacity
            object.__setattr__(self, "capacity", max(int(x.shape[-3]) for x in self.k))

    @property
    def batch(self) -> int:
        return self.lengths.shape[0]

    @property
    def dtype(self):
        return self.k[0].dtype

    @property
    def ring_size(self) -> int | None:
        return None if self.pos is None else int(self.pos.shape[1])

    def is_ring(self, j: int) -> bool:
        """Whether buffer j is a ring (fewer slots than the capacity)."""
        return j not in self.paged and self.pos is not None and self.k[j].shape[-3] == self.pos.shape[1] < self.capacity

    @property
    def num_blocks(self) -> int:
        """Blocks in each pool (paged caches; also the table's "no block" value)."""
        return int(self.k[self.paged[0]].shape[-4])

    @property
    def block(self) -> int:
        """Positions per block (paged caches)."""
        return int(self.k[self.paged[0]].shape[-3])

    @property
    def view_positions(self) -> int:
        """Positions of a row that a forward reads and writes: a paged cache's table columns times
        the block (the capacity, unless `narrow` cut the table), else the capacity."""
        return int(self.table.shape[1]) * self.block if self.paged else self.capacity


def ring_size(config: TargetConfig, capacity: int, max_block: int = ROW_TILE) -> int:
    """Slots of a sliding layer's buffer: min(capacity, sliding_window + max(max_block, ROW_TILE) + 1)."""
    if config.sliding_window is None:
        return capacity
    return min(capacity, int(config.sliding_window) + max(int(max_block), ROW_TILE) + 1)


def init_cache(config: TargetConfig, batch: int, capacity: int, dtype=jnp.bfloat16, *,
               max_block: int = ROW_TILE, ring: bool = True) -> KVCache:
    """An empty cache (lengths 0) for `batch` rows of up to `capacity` positions each.

    `max_block`: the widest forward that may be rolled back (decode, verify: both padded to at most
    ROW_TILE by `models.row_bucket` / `jaxspec.verify` unless a verify width says more); it sizes the
    sliding layers' rings. `ring=False` keeps full-capacity sliding buffers (a consumer that reads
    keys older than the window, e.g. the assistant's teacher-forced training over a whole sequence)."""
    if batch < 1 or capacity < 1:
        raise ValueError(f"init_cache needs batch >= 1 and capacity >= 1, got batch={batch}, capacity={capacity}")
    if not config.cache_layers:
        raise ValueError("config has no layer that owns K/V (num_kv_shared_layers == num_hidden_layers): "
                         "that is an assistant config, not a target")
    shapes, ring_slots = _layout(config, batch, capacity, max_block, ring)
    return KVCache(k=tuple(jnp.zeros(x, dtype) for x in shapes),
                   v=tuple(jnp.zeros(x, dtype) for x in shapes),
                   lengths=jnp.zeros((batch,), jnp.int32),
                   pos=jnp.full((batch, ring_slots), EMPTY, jnp.int32) if ring_slots else None,
                   capacity=int(capacity))


def init_paged_cache(config: TargetConfig, batch: int, capacity: int, num_blocks: int, block: int,
                     dtype=jnp.bfloat16, *, max_block: int = ROW_TILE) -> KVCache:
    """An empty paged cache: `batch` rows of up to `capacity` positions (a multiple of `block`), the
    global layers' K/V in pools of `num_blocks` blocks of `block` positions (no row owns any: every
    table entry is `num_blocks`), the sliding layers' rings per row as `init_cache` makes them."""
    if block < 1 or capacity % block or num_blocks < 1:
        raise ValueError(f"a paged cache needs block >= 1, capacity a multiple of it and num_blocks >= 1, got "
                         f"block={block}, capacity={capacity}, num_blocks={num_blocks}")
    if not config.cache_layers:
        raise ValueError("config has no layer that owns K/V: that is an assistant config, not a target")
    pools, paged, ring_slots = _paged_layout(config, batch, capacity, num_blocks, block, max_block)
    return KVCache(k=tuple(jnp.zeros(x, dtype) for x in pools), v=tuple(jnp.zeros(x, dtype) for x in pools),
                   lengths=jnp.zeros((batch,), jnp.int32),
                   pos=jnp.full((batch, ring_slots), EMPTY, jnp.int32) if ring_slots else None,
                   capacity=int(capacity), table=jnp.full((batch, capacity // block), num_blocks, jnp.int32),
                   paged=paged)


def paged_cache_bytes(config: TargetConfig, batch: int, capacity: int, num_blocks: int, block: int,
                      dtype=jnp.bfloat16, *, max_block: int = ROW_TILE) -> int:
    """Bytes of `init_paged_cache(config, batch, capacity, num_blocks, block, dtype, ...)`: the pools,
    the rings per row, the lengths, the rings' positions and the block tables (int32)."""
    pools, _, ring_slots = _paged_layout(config, batch, capacity, num_blocks, block, max_block)
    kv = sum(2 * math.prod(x) for x in pools) * jnp.dtype(dtype).itemsize
    return kv + 4 * batch * (1 + ring_slots + capacity // block)


def narrow(cache: KVCache, positions: int) -> KVCache:
    """A paged cache whose forward reads and writes each row's first `positions` (whole blocks) only,
    for rows all of whose positions a forward touches lie below it: its table cut to those columns
    (the view a layer gathers, `paged_view`, is that wide; writes past it are dropped) and, when the
    rings hold at least as many slots, the rings cut to those slots and made plain buffers (no
    `pos`): below its ring's size a row's position p sits in slot p, as in a plain buffer. Such a
    row gets what the whole cache gives it, bitwise, on the XLA path: the same keys in the same
    slots, and the cut-off slots, hidden from its queries, added exact zeros (`dense_attention`'s
    fixed key blocks). Its capacity stays. `widen` puts a forward's writes back into the whole
    cache. The batch engine's decode on a CPU runs on it (`jaxspec.engine.batching`): at the 270M's
    4,096 positions a round took twice one at 256, and its 529-slot rings ~15% of a round."""
    if not cache.paged:
        raise ValueError("narrow needs a paged cache (init_paged_cache)")
    cols = min(int(cache.table.shape[1]), max(1, -(-int(positions) // cache.block)))
    view = cols * cache.block
    out = cache if cols == cache.table.shape[1] else cache.replace(table=cache.table[:, :cols])
    if cuts_rings(cache, view):
        cut = lambda x, j: x if j in cache.paged else x[..., :view, :, :]  # noqa: E731
        out = out.replace(k=tuple(cut(x, j) for j, x in enumerate(cache.k)),
                          v=tuple(cut(x, j) for j, x in enumerate(cache.v)), pos=None)
    return out


def cuts_rings(cache: KVCache, view: int) -> bool:
    """Whether `narrow(cache, view)` makes its rings plain buffers of `view` slots (they hold that many)."""
    return cache.pos is not None and view <= cache.pos.shape[1] and view < cache.capacity


def widen(cache: KVCache, cut: KVCache) -> KVCache:
    """The whole cache `cache` (as `narrow` cut it) with what forwards on the cut `cut` wrote: its
    pools and lengths, and the prefix of the rings it cut, their positions recorded for the rows
    whose length is within the cut (slot p holds position p below it); a row past it wrote nothing
    there (its forwards' positions were past the cut: dropped) and keeps its ring as it was."""
    out = cut.replace(table=cache.table)
    if cut.pos is None and cache.pos is not None:
        view = cut.view_positions
        put = lambda whole, part, j: part if j in cache.paged else jax.lax.dynamic_update_slice_in_dim(  # noqa: E731
            whole, part, 0, whole.ndim - 3)
        slots = jnp.arange(view, dtype=jnp.int32)[None, :]
        n = cut.lengths.astype(jnp.int32)[:, None]
        head = jnp.where((n <= view) & (slots < n), slots, cache.pos[:, :view])
        out = out.replace(k=tuple(put(w, c, j) for j, (w, c) in enumerate(zip(cache.k, cut.k))),
                          v=tuple(put(w, c, j) for j, (w, c) in enumerate(zip(cache.v, cut.v))),
                          pos=cache.pos.at[:, :view].set(head))
    return out


def _paged_layout(config: TargetConfig, batch: int, capacity: int, num_blocks: int, block: int, max_block: int):
    """(each cache entry's K (= V) shape, the paged entries' indices, the ring's slot count): the
    full-capacity entries (the global layers) become pools of `num_blocks` blocks of `block`."""
    shapes, ring_slots = _layout(config, batch, capacity, max_block, True)
    paged = tuple(j for j, x in enumerate(shapes) if x[-3] == capacity)  # the rings stay per row
    pools = tuple(x[:-4] + (num_blocks, block) + x[-2:] if j in paged else x for j, x in enumerate(shapes))
    return pools, paged, ring_slots


def paged_block_bytes(config: TargetConfig, block: int, dtype=jnp.bfloat16) -> int:
    """Bytes of one block across every pool of a paged cache (K and V)."""
    shapes, _ = _layout(config, 1, 1 << 30, ROW_TILE, True)  # a capacity past any ring: pools are the full ones
    per = sum(2 * math.prod(x[:-4]) * x[-2] * x[-1] for x in shapes if x[-3] == 1 << 30)
    return per * block * jnp.dtype(dtype).itemsize


def _moved_as_bits(x: jax.Array) -> bool:
    """Whether a gather or scatter moves `x`'s values as uint16: XLA's CPU backend has no bfloat16
    (or float16) gather or scatter, so it converts the whole operand to float32 and back around each
    one: for a paged cache, every global layer's whole pool, every round (a 270M decode step at 4,096
    positions per slot spent most of its time there, and more with the pool). The same 16 bits as
    uint16 move without a conversion. Elsewhere the values move as they are."""
    return x.dtype.itemsize == 2 and jnp.issubdtype(x.dtype, jnp.floating) and jax.default_backend() == "cpu"


def _bits(x: jax.Array) -> jax.Array:
    return jax.lax.bitcast_convert_type(x, jnp.uint16)


def paged_view(pool: jax.Array, table: jax.Array, layer=None) -> jax.Array:
    """`[B, capacity, H, D]`: each row's positions gathered from `pool [(G,) N, block, H, D]` (layer
    `layer` of a stack) through `table [B, capacity // block]`; zeros where a row has no block."""
    if _moved_as_bits(pool):
        return jax.lax.bitcast_convert_type(paged_view(_bits(pool), table, layer), pool.dtype)
    b, nb = table.shape
    if layer is None:
        got = pool.at[table].get(mode="fill", fill_value=0)
    else:
        got = pool.at[jnp.asarray(layer, jnp.int32), table].get(mode="fill", fill_value=0)
    return got.reshape((b, nb * pool.shape[-3]) + pool.shape[-2:])


def paged_write(pool: jax.Array, table: jax.Array, new: jax.Array, start: jax.Array, layer=None) -> jax.Array:
    """`pool` with `new [B, T, H, D]` written at positions `start [B] + arange(T)` of each row (through
    its table); positions in no block of the row (or past the capacity) are dropped."""
    if _moved_as_bits(pool):
        return jax.lax.bitcast_convert_type(
            paged_write(_bits(pool), table, _bits(new.astype(pool.dtype)), start, layer), pool.dtype)
    b, t = new.shape[:2]
    nb, block, n = table.shape[1], pool.shape[-3], pool.shape[-4]
    p = start.astype(jnp.int32)[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
    logical = p // block
    blk = jnp.where(logical < nb, jnp.take_along_axis(table, jnp.clip(logical, 0, nb - 1), axis=1), n)
    blk = jnp.where(p >= 0, blk, n)
    off = p % block
    if layer is None:
        return pool.at[blk, off].set(new.astype(pool.dtype), mode="drop")
    return pool.at[jnp.full((b, t), layer, jnp.int32), blk, off].set(new.astype(pool.dtype), mode="drop")


def _layout(config: TargetConfig, batch: int, capacity: int, max_block: int, ring: bool):
    """(the K (= V) buffer shape of each cache entry, the ring's slot count or 0 without a ring)."""
    s = ring_size(config, capacity, max_block) if ring else capacity
    has_ring = s < capacity and any(config.is_sliding(i) for i in config.cache_layers)
    stacks, shapes = stacked_entries(config), []
    for j, layers in enumerate(cache_entries(config)):
        i = layers[0]
        one = (batch, s if has_ring and config.is_sliding(i) else capacity, config.layer_kv_heads[i],
               config.layer_head_dims[i])
        shapes.append(((len(layers),) if j < stacks else ()) + one)
    return shapes, (s if has_ring else 0)


def cache_bytes(config: TargetConfig, batch: int, capacity: int, dtype=jnp.bfloat16, *,
                max_block: int = ROW_TILE, ring: bool = True) -> int:
    """The formula of docs/models.md: bytes of `init_cache(config, batch, capacity, dtype, ...)`."""
    shapes, ring_slots = _layout(config, batch, capacity, max_block, ring)
    kv = sum(2 * math.prod(x) for x in shapes) * jnp.dtype(dtype).itemsize
    return kv + 4 * batch + 4 * batch * ring_slots  # + lengths and the ring's positions (int32)


def write_rows(buf: jax.Array, new: jax.Array, start: jax.Array, layer=None) -> jax.Array:
    """Write `new [B, T, ...]` into `buf [B, C, ...]` at per-row offsets `start [B]`.

    Positions at or past C are dropped (a scatter, not dynamic_update_slice, which would clamp and
    so shift the whole write onto valid entries): the padding rows of a bucketed decode step may run
    past the end of a full cache, the real rows never do."""
    b, t = new.shape[:2]
    cols = start.astype(jnp.int32)[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
    return write_cols(buf, new, cols, layer)


def write_cols(buf: jax.Array, new: jax.Array, cols: jax.Array, layer=None) -> jax.Array:
    """`buf[b, cols[b, t]] = new[b, t]` for every (b, t); columns outside the buffer are dropped.
    `layer`: buf is a stack `[G, B, C, ...]`, written at that layer in place."""
    if _moved_as_bits(buf):
        return jax.lax.bitcast_convert_type(write_cols(_bits(buf), _bits(new.astype(buf.dtype)), cols, layer),
                                            buf.dtype)
    b, t = new.shape[:2]
    rows = jnp.broadcast_to(jnp.arange(b, dtype=jnp.int32)[:, None], (b, t))
    if layer is None:
        return buf.at[rows, cols].set(new.astype(buf.dtype), mode="drop")
    return buf.at[jnp.full((b, t), layer, jnp.int32), rows, cols].set(new.astype(buf.dtype), mode="drop")


def ring_cols(start: jax.Array, t: int, ring: int, capacity: int, valid: jax.Array | None) -> jax.Array:
    """`[B, T]` ring slots for the new positions `start + arange(T)`: `p mod ring` for the newest
    `ring` valid positions of each row below the capacity, `ring` (dropped) for the others."""
    pos = start.astype(jnp.int32)[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
    ok = pos < capacity
    if valid is not None:
        ok = ok & valid.astype(bool)
    after = jnp.sum(ok, axis=1, keepdims=True) - jnp.cumsum(ok, axis=1)  # valid positions after this one
    keep = ok & (after < ring)
    return jnp.where(keep, pos % ring, ring)
