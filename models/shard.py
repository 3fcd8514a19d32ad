"""Tensor parallelism: a model's weights placed over a device mesh with `jax.sharding`.

    mesh = jax.sharding.Mesh(np.array(jax.devices()[:G]), ("tp",))
    target = models.shard(target, mesh)      # the same Target; its params now live split over G devices

Placement (Megatron's): q/k/v and gate/up are column-parallel (split over their output rows N), o and
down row-parallel (split over their input K), the tied embedding / head split by vocabulary; norms,
scalars and everything else replicated. A weight is split only where the split falls on whole
64-row tiles (column: N a multiple of 64 G) or whole quantization groups (row: K / group a multiple
of G); otherwise it stays replicated (e.g. a single KV head's k/v projection). A stacked weight
(`layer_scan`) keeps its leading layer axis unsplit. Under jit, XLA's partitioner runs each matmul
where its weight shard lives and adds the all-reduce after a row-parallel one; the KV cache follows
the k/v projections (split by KV heads where they are).

Status (issue 27): this is the placement, exact on the XLA matmul backend. The Pallas kernels are
custom calls the partitioner cannot split: with backend "pallas" a sharded model computes the same
values but gathers each weight first. Running them per shard under `shard_map` is the next step.
"""
from __future__ import annotations

import dataclasses

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from pallas_kernels import QuantizedWeight
from pallas_kernels.quant import TILE_ROWS

COLUMN = frozenset({"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "embed_tokens", "lm_head"})
ROW = frozenset({"o_proj", "down_proj"})


def layout(name: str) -> str | None:
    """"column", "row" or None (replicated) for a param name (its last component decides)."""
    leaf = name.rsplit(".", 1)[-1]
    return "column" if leaf in COLUMN else "row" if leaf in ROW else None


def _put(x, mesh: Mesh, axis: str, dim: int | None, base_ndim: int):
    """Place x with `dim` (counted in the unstacked array's `base_ndim` dims) split over `axis`."""
    spec = [None] * x.ndim
    if dim is not None:
        spec[x.ndim - base_ndim + dim] = axis
    return jax.device_put(x, NamedSharding(mesh, PartitionSpec(*spec)))


def _place(w, how: str | None, mesh: Mesh, axis: str):
    g = mesh.shape[axis]
    if isinstance(w, QuantizedWeight):
        n, k = w.shape
        if how == "column" and n % (TILE_ROWS * g) == 0:
            dims = (0, 1)  # weight: its row tiles; scales/biases [K/group, N]: their columns
        elif how == "row" and (k // w.group_size) % g == 0:
            dims = (1, 0)  # weight: its groups; scales/biases: their rows
        else:
            dims = (None, None)
        return dataclasses.replace(w, weight=_put(w.weight, mesh, axis, dims[0], 4),
                                   scales=_put(w.scales, mesh, axis, dims[1], 2),
                                   biases=_put(w.biases, mesh, axis, dims[1], 2))
    if how is None or getattr(w, "ndim", 0) < 2:
        return _put(w, mesh, axis, None, 0)
    dim = 0 if how == "column" else 1
    return _put(w, mesh, axis, dim if w.shape[w.ndim - 2 + dim] % g == 0 else None, 2)


def shard(model, mesh: Mesh, axis: str = "tp"):
    """`model` (a Target or Assistant) with every param placed on `mesh` as the module docstring says.
    `axis` names the mesh axis to split over; the model's values and config are unchanged."""
    if axis not in mesh.shape:
        raise ValueError(f"mesh has no axis {axis!r} (its axes: {tuple(mesh.shape)})")
    if mesh.devices.size != jax.device_count():
        # arrays generate makes on the default devices would meet the model's in one program, which
        # XLA rejects by aborting the process
        raise ValueError(f"the mesh holds {mesh.devices.size} of this process's {jax.device_count()} devices: "
                         "shard over all of them (start the process with only the devices to use)")
    return model.replace(params={name: _place(w, layout(name), mesh, axis) for name, w in model.params.items()})
