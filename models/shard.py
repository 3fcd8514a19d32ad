"""Tensor parallelism: a model split over a device mesh with `jax.sharding`, run per shard.

    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("tp",))
    target = models.shard(target, mesh)      # the same Target, its params split over the mesh
    assistant = models.shard(assistant, mesh)

Placement (Megatron's): an attention block's q/k/v are column-parallel (split by whole heads) and its
o projection row-parallel; gate/up column-parallel and down row-parallel; the tied embedding / head
split by vocabulary; norms, scalars and the rest replicated. The KV cache is split by KV heads where
the k/v projections are. A split must fall on whole 64-row tiles (column) and whole quantization
groups (row); a block that cannot split stays replicated: K/V of a single KV head (the 12B's global
layers) are replicated while their queries still split, K/V of 2 heads over 4 devices keep the whole
block replicated. Stacked (scanned) weights keep their layer axis whole.

`forward` and `draft_step` of a sharded model run under `shard_map`: each device runs the Pallas
kernels on its own shards (local heads, local FFN columns, local vocabulary) and the partial sums
of a row-parallel projection meet in one all-reduce (`psum`); an embedding lookup into a vocabulary
shard is an all-reduce of masked rows. Logits come out split by vocabulary. Everything else in
jaxspec's loop is left to XLA's partitioner.
"""
from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxspec.kernels import DenseWeight, QuantizedWeight, take_rows
from jaxspec.kernels.quant import TILE_ROWS

from .layer_scan import cache_entries

_LAYER = re.compile(r"^(?:layers|scan)\.(\d+)\.(self_attn|mlp)\.([qkvo]_proj|gate_proj|up_proj|down_proj)$")


@dataclasses.dataclass(frozen=True)
class TensorParallel:
    """Where a sharded model lives: the mesh and the axis its weights are split over (a static,
    hashable field of the model, so programs compile per mesh)."""
    mesh: Mesh
    axis: str

    @property
    def size(self) -> int:
        return self.mesh.shape[self.axis]


def _col_ok(w, g: int) -> bool:
    """Whether w's output rows split into g parts of whole 64-row tiles (any format)."""
    return w.shape[-2] % (TILE_ROWS * g) == 0


def _row_ok(w, g: int) -> bool:
    """Whether w's input columns split into g parts of whole quantization groups."""
    k = w.shape[-1]
    return (k // w.group_size) % g == 0 if isinstance(w, QuantizedWeight) else k % g == 0


def attention_split(nq: int, nkv: int, hd: int, g: int) -> tuple[bool, bool]:
    """(queries split, K/V split) for an attention block, by whole heads and whole tiles. Queries
    may split over replicated K/V only when there is one KV head (every query head reads it)."""
    kv = nkv % g == 0 and (nkv * hd) % (TILE_ROWS * g) == 0
    q = (kv or nkv == 1) and nq % g == 0 and (nq * hd) % (TILE_ROWS * g) == 0
    return q, kv


def _text(model):
    cfg = model.config
    return getattr(cfg, "text", cfg)


def _block_layout(model, g: int) -> dict[str, str | None]:
    """param name -> "column", "row" or None (replicated)."""
    cfg, params = _text(model), model.params
    out = {}
    for name, w in params.items():
        m = _LAYER.match(name)
        if name in ("embed_tokens", "lm_head"):
            out[name] = "column" if _col_ok(w, g) else None
        elif m is None:
            out[name] = None
        elif m.group(2) == "mlp":
            pre = name.rsplit(".", 1)[0] + "."
            ok = _col_ok(params[pre + "gate_proj"], g) and _col_ok(params[pre + "up_proj"], g) and \
                _row_ok(params[pre + "down_proj"], g)
            out[name] = None if not ok else "row" if m.group(3) == "down_proj" else "column"
        else:
            i = int(m.group(1))  # a scan position j is layer j's pattern
            pre = name.rsplit(".", 1)[0] + "."
            q, kv = attention_split(cfg.num_attention_heads, cfg.layer_kv_heads[i], cfg.layer_head_dims[i], g)
            q = q and _row_ok(params[pre + "o_proj"], g)
            if kv and not q:
                raise ValueError(f"{name}: its K/V split by heads over {g} devices but its queries cannot "
                                 "(o_proj's quantization groups do not divide)")
            leaf = m.group(3)
            split = kv if leaf in ("k_proj", "v_proj") else q
            out[name] = None if not split else "row" if leaf == "o_proj" else "column"
    return out


def _spec(x, how: str | None, axis: str, base_ndim: int) -> P:
    """x split over `axis` on its output dim ("column") or input dim ("row"), counted in the unstacked
    array's `base_ndim` dims (a stack's leading layer axis stays whole)."""
    return _spec_at(x, None if how is None else x.ndim - base_ndim + (0 if how == "column" else 1), axis)


def param_specs(model, g: int, axis: str) -> dict:
    """name -> the PartitionSpec (tree) of each param of `model` over `g` devices of `axis`."""
    out = {}
    for name, how in _block_layout(model, g).items():
        w = model.params[name]
        if isinstance(w, QuantizedWeight):
            # the weight splits its row tiles (column) or its groups (row); scales/biases [K/group, N]
            # the other way round
            flip = None if how is None else "row" if how == "column" else "column"
            out[name] = dataclasses.replace(w, weight=_spec(w.weight, how, axis, 4),
                                            scales=_spec(w.scales, flip, axis, 2),
                                            biases=_spec(w.biases, flip, axis, 2))
        else:
            out[name] = _spec(w, how if getattr(w, "ndim", 0) >= 2 else None, axis, 2)
    return out


def cache_specs(target, cache, g: int, axis: str):
    """The KVCache's specs: buffer j split by KV heads iff its layers' K/V projections are."""
    cfg = target.config

    def buf(x, layers):
        i = layers[0]
        _, kv = attention_split(cfg.num_attention_heads, cfg.layer_kv_heads[i], cfg.layer_head_dims[i], g)
        return _spec_at(x, x.ndim - 2 if kv else None, axis)

    entries = cache_entries(cfg)
    return cache.replace(k=tuple(buf(x, e) for x, e in zip(cache.k, entries)),
                         v=tuple(buf(x, e) for x, e in zip(cache.v, entries)),
                         lengths=P(), pos=None if cache.pos is None else P(),
                         table=None if cache.table is None else P())  # a paged cache's pools: heads at ndim - 2 too


def _spec_at(x, dim: int | None, axis: str) -> P:
    spec = [None] * x.ndim
    if dim is not None:
        spec[dim] = axis
    return P(*spec)


def shard(model, mesh: Mesh, axis: str = "tp"):
    """`model` (a Target or Assistant) with its params placed on `mesh` as the module docstring
    says, and marked to run per shard. Its values and config are unchanged."""
    if axis not in mesh.shape:
        raise ValueError(f"mesh has no axis {axis!r} (its axes: {tuple(mesh.shape)})")
    if mesh.devices.size != jax.device_count():
        # arrays generate makes on the default devices would meet the model's in one program, which
        # XLA rejects by aborting the process
        raise ValueError(f"the mesh holds {mesh.devices.size} of this process's {jax.device_count()} devices: "
                         "shard over all of them (start the process with only the devices to use)")
    if any(isinstance(w, DenseWeight) for w in model.params.values()):
        raise ValueError("shard: this model's weights were dequantized for one CPU at load (DenseWeight); load it "
                         "with DispatchConfig(backend='xla', dense=False) to shard it")
    g = mesh.shape[axis]
    specs = param_specs(model, g, axis)
    params = {name: jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), w, specs[name])
              for name, w in model.params.items()}
    return model.replace(params=params, tp=TensorParallel(mesh, axis))


# ---- inside shard_map: what the models' code calls on its local shards --------------------------------


def reduce_rows(model, y: jax.Array, w, full_k: int) -> jax.Array:
    """`y = x @ w.T` of a row-parallel projection: the sum over the shards when w holds a slice of
    its `full_k` inputs (one all-reduce); y itself otherwise."""
    tp = model.tp
    if tp is None or w.shape[-1] == full_k:
        return y
    return jax.lax.psum(y, tp.axis)


def embed_rows(model, table, ids: jax.Array, dtype, vocab: int) -> jax.Array:
    """`take_rows(table, ids)` where `table` may hold one vocabulary shard: each device looks up the
    ids it holds, zeros elsewhere, and an all-reduce sums them (exact: one term is not zero)."""
    tp = model.tp
    n = table.shape[-2]
    if tp is None or n == vocab:
        return take_rows(table, ids, dtype)
    local = ids - jax.lax.axis_index(tp.axis) * n
    inside = (local >= 0) & (local < n)
    rows = take_rows(table, jnp.where(inside, local, 0), dtype)
    return jax.lax.psum(jnp.where(inside[..., None], rows, jnp.zeros((), rows.dtype)), tp.axis)


def logits_spec(model, head, axis: str, ndim: int = 3) -> P:
    """Logits `[..., V]` computed with the (global) `head`: split by vocabulary when the head is."""
    return P(*([None] * (ndim - 1)), axis) if _col_ok(head, model.tp.size) else P()


def run_sharded(fn, model, args_specs, out_specs):
    """`fn(*args)` under shard_map over `model.tp.mesh` (specs as shard_map takes them)."""
    args, in_specs = zip(*args_specs)
    # check_vma off: pallas_call outputs carry no varying-axes annotation to check
    return jax.shard_map(fn, mesh=model.tp.mesh, in_specs=tuple(in_specs), out_specs=out_specs,
                         check_vma=False)(*args)


def model_specs(model):
    """The model itself as a spec tree (its params' specs, its static fields unchanged)."""
    return model.replace(params=param_specs(model, model.tp.size, model.tp.axis))

