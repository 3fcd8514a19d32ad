"""Layers traced once: the repeating group of a target's layers runs as one `lax.scan` body.

Compile time grows with every layer traced, so the target's leading whole repeats of its layer
pattern (Gemma 4: five sliding layers and a full one) run as a scan over stacked parameters, and
only the rest (a last partial group, KV-shared layers and the layers they read) is traced per layer.

`ScanPlan(period P, groups G)`: layers `[0, G*P)` are scanned, layer `g*P + j` being group g's
position j. Their params live stacked, `"scan.{j}.{name}"` with a leading `[G]` axis (`stack_params`
at load; `unstack_params` gives the per-layer names back for saving); the KV cache keeps one buffer
per position j with the same leading axis (`cache_entry`). Kernels read a layer of a stack in place
(`pallas_kernels.Layer`), so the scan copies no weights and no cache.
"""
from __future__ import annotations

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np

from .config import TargetConfig

PREFIX = "scan."
_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
_SCAN = re.compile(r"^scan\.(\d+)\.(.+)$")


@dataclasses.dataclass(frozen=True)
class ScanPlan:
    period: int
    groups: int

    @property
    def scanned(self) -> int:
        """Layers `[0, scanned)` run in the scan."""
        return self.period * self.groups


def _signature(cfg: TargetConfig, i: int):
    """What makes two layers one traced body (their params and cache shapes and their code path)."""
    return (cfg.layer_types[i], cfg.layer_head_dims[i], cfg.layer_kv_heads[i], cfg.k_eq_v(i), cfg.mlp_width(i),
            cfg.kv_shared(i))


@functools.lru_cache(maxsize=64)
def scan_plan(cfg: TargetConfig) -> ScanPlan:
    """The shortest period whose whole repeats cover the scannable layers: those before the first
    KV-shared layer, and before the layers KV-shared layers read (a long prefill hands those layers'
    fresh K/V to the shared ones, which the scan body does not return)."""
    limit = cfg.num_hidden_layers - cfg.num_kv_shared_layers
    if cfg.num_kv_shared_layers:
        stores = [cfg.store_layer(t) for t in set(cfg.layer_types[limit:])]
        limit = min([limit] + [s for s in stores if s is not None])
    for p in range(1, limit + 1):
        g = limit // p
        if all(_signature(cfg, i) == _signature(cfg, i % p) for i in range(g * p)):
            return ScanPlan(p, g)
    return ScanPlan(1, 0)


def stacked_entries(cfg: TargetConfig) -> int:
    """How many of the KVCache's buffers are stacks (the first ones): one per scan position."""
    plan = scan_plan(cfg)
    return plan.period if plan.groups else 0


def cache_entries(cfg: TargetConfig) -> list[tuple[int, ...]]:
    """The layers of each KVCache buffer: one stacked buffer per scan position j (layers j, j + P,
    ...), then one buffer per remaining layer that owns K/V."""
    plan = scan_plan(cfg)
    stacked = [tuple(range(j, plan.scanned, plan.period)) for j in range(stacked_entries(cfg))]
    return stacked + [(i,) for i in cfg.cache_layers if i >= plan.scanned]


def cache_entry(cfg: TargetConfig, i: int) -> tuple[int, int | None]:
    """(buffer, index in its stack or None for a plain buffer) holding the K/V layer i reads."""
    plan = scan_plan(cfg)
    src = cfg.kv_source(i)
    if src < plan.scanned:
        return src % plan.period, src // plan.period
    rest = [i_ for i_ in cfg.cache_layers if i_ >= plan.scanned]
    return stacked_entries(cfg) + rest.index(src), None


def is_stacked(params: dict) -> bool:
    return any(name.startswith(PREFIX) for name in params)


def stack_params(cfg: TargetConfig, params: dict) -> dict:
    """Per-layer params -> the scanned layers' stacked under `scan.{j}.{name}` (others unchanged).
    Each stack is built on the device of its parts; the parts are dropped from the result. Params
    that cannot stack (layers of one position in different formats) are returned as they are: the
    forward then runs every layer on its own."""
    plan = scan_plan(cfg)
    if not plan.groups or is_stacked(params):
        return dict(params)
    out, parts = {}, {}
    for name, value in params.items():
        m = _LAYER.match(name)
        if m and int(m.group(1)) < plan.scanned:
            i = int(m.group(1))
            parts.setdefault((i % plan.period, m.group(2)), {})[i // plan.period] = value
        else:
            out[name] = value
    for (j, rest), by_group in parts.items():
        values = [by_group.get(g) for g in range(plan.groups)]
        if not _same_kind(values):  # e.g. a checkpoint's per-layer format override: run per layer
            return dict(params)
        out[f"{PREFIX}{j}.{rest}"] = jax.tree_util.tree_map(lambda *a: _stack(a), *values)
    return out


def _same_kind(values) -> bool:
    """Whether the values can be one stack: all present, one structure (quantization format
    included), the same shapes and dtypes."""
    if any(v is None for v in values):
        return False
    def kind(v):
        leaves, tree = jax.tree_util.tree_flatten(v)
        return tree, tuple((tuple(np.shape(a)), str(a.dtype)) for a in leaves)
    return all(kind(v) == kind(values[0]) for v in values)


def _stack(arrays):
    if all(isinstance(a, np.ndarray) for a in arrays):
        return np.stack(arrays)
    return jnp.stack(arrays)


def unstack_params(cfg: TargetConfig, params: dict) -> dict:
    """The inverse of `stack_params`: every layer's params under `layers.{i}.{name}`."""
    if not is_stacked(params):
        return dict(params)
    plan = scan_plan(cfg)
    out = {}
    for name, value in params.items():
        m = _SCAN.match(name)
        if not m:
            out[name] = value
            continue
        j, rest = int(m.group(1)), m.group(2)
        for g in range(plan.groups):
            out[f"layers.{g * plan.period + j}.{rest}"] = jax.tree_util.tree_map(lambda a, g=g: a[g], value)
    return out
