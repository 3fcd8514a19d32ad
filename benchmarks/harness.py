"""Timing helpers shared by the benchmarks (GPU or CPU).

Pitfalls this avoids (seen on the H200, see docs/kernels.md): a jitted call costs ~100-160 us of
dispatch + sync, so many ops go in one call and an empty call's time is subtracted; XLA merges dots
that share an operand and removes repeated identical computations, so every op in a call gets its
own (x, w) pair; weight sets together exceed the 60 MB L2 several times, so no op reads a cached weight.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import time

import jax
import jax.numpy as jnp


def no_command_buffers():
    """Make XLA launch every kernel on its own instead of replaying runs of them as CUDA graphs
    (command buffers), whose kernels a profiler trace does not show one by one. Call before the
    first computation; it changes launch costs, so traced runs report their wall time with it."""
    flag = "--xla_gpu_enable_command_buffer="
    current = os.environ.get("XLA_FLAGS", "")
    if flag not in current:
        os.environ["XLA_FLAGS"] = (current + " " + flag).strip()


def sync(tree):
    jax.tree_util.tree_map(lambda a: a.block_until_ready() if hasattr(a, "block_until_ready") else a, tree)
    return tree


def median_time(fn, *args, warmup: int = 2, repeats: int = 7) -> float:
    """Median wall seconds of `fn(*args)` (synchronised), after warm-up calls."""
    for _ in range(warmup):
        sync(fn(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        sync(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


_EMPTY = None
_EMPTY_WITH = {}


def empty_call_with_seconds(*args) -> float:
    """The fixed cost of one jitted call that takes `args` (every array of them) and does almost
    nothing: passing each argument costs host time (~0.7 us per array on a 2-core CPU), so a call
    over 32 weight sets (128 arrays) pays more than an empty call of one. keep_unused: else jit
    drops the unused arrays from the compiled call and only the Python side of passing them is
    counted. Cached by the arguments' structure, shapes and dtypes."""
    leaves, tree = jax.tree_util.tree_flatten(args)
    key = (tree, tuple((a.shape, str(a.dtype)) for a in leaves))
    if key not in _EMPTY_WITH:
        f = jax.jit(lambda *a: jax.tree_util.tree_leaves(a)[0].ravel()[:1], keep_unused=True)
        _EMPTY_WITH[key] = median_time(f, *args, warmup=3, repeats=15)
    return _EMPTY_WITH[key]


def empty_call_seconds() -> float:
    """The fixed cost of one jitted call that does (almost) nothing."""
    global _EMPTY
    if _EMPTY is None:
        f = jax.jit(lambda a: a + 1)
        a = jnp.ones((8,), jnp.float32)
        _EMPTY = median_time(f, a, warmup=3, repeats=21)
    return _EMPTY


def hbm_bandwidth(gib: float = 2.0) -> float:
    """Bytes/s of a device copy (read + write counted), the ceiling for the bytes floor."""
    n = int(gib * 2**30) // 4
    a = jnp.ones((n,), jnp.float32) * 1.5
    f = jax.jit(lambda a: a * 1.0001)  # one read, one write
    t = median_time(f, a, warmup=2, repeats=9)
    return 2 * n * 4 / t


def environment(commit: str | None = None) -> dict:
    """Device, JAX version, date, and the commit measured: `commit` (a tool's --commit, for trees
    copied without .git), else `git rev-parse` of the working tree, else "unknown"."""
    dev = jax.devices()[0]
    if not commit:
        try:
            commit = subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], text=True,
                                             stderr=subprocess.DEVNULL,
                                             cwd=os.path.dirname(os.path.abspath(__file__))).strip()
        except Exception:
            commit = "unknown"
    return {"device": getattr(dev, "device_kind", str(dev)), "platform": dev.platform,
            "jax": jax.__version__, "commit": commit,
            "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}


def environment_line(commit: str | None = None) -> str:
    """`environment(commit)` as one line for a report's header."""
    return ", ".join(f"{k} {v}" for k, v in environment(commit).items())


def write_report(out: str, name: str, meta: dict, rows: list, lines: list[str]) -> None:
    """A tool's results: `out/name.json` ({"meta", "rows"}) and `out/name.md` (the report's lines)."""
    with open(os.path.join(out, f"{name}.json"), "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    with open(os.path.join(out, f"{name}.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


# ---- random-weight models --------------------------------------------------------------------
Q4 = {"bits": 4, "group_size": 64}


def truncate_layers(cfg_dict: dict, n: int) -> dict:
    """The first n layers of a target config, the last made full (the model needs one of each type
    the assistant reads). Per-layer shapes are unchanged, so per-layer costs carry over."""
    d = json.loads(json.dumps(cfg_dict))
    text = d.get("text_config", d)
    types = list(text["layer_types"])[:n]
    types[-1] = "full_attention"
    if "sliding_attention" not in types and n > 1:
        types[0] = "sliding_attention"
    text["layer_types"] = types
    text["num_hidden_layers"] = n
    text["num_kv_shared_layers"] = min(text.get("num_kv_shared_layers") or 0, max(0, n - 2))
    return d


def random_pair(target: str, assistant: str | None = None, *, layers: int = 0, matmul=None, seed: int = 0,
                dtype=jnp.bfloat16, quantize=Q4):
    """(target, assistant or None) with random weights. target: a preset name, or "tiny" (no context
    limit; `layers` of Gemma 4's pattern, any number); a preset keeps its first `layers` layers
    (`truncate_layers`). assistant: a preset name, "tiny" (one that fits the target) or None."""
    from jaxspec import models
    from jaxspec.models import presets

    key = jax.random.key(seed)
    if target == "tiny":
        shape = dict(num_hidden_layers=layers, layer_types=presets.layer_pattern(layers, 6)) if layers else {}
        tdict = presets.tiny_target_dict(max_position_embeddings=None, **shape)
    else:
        tdict = truncate_layers(presets.TARGETS[target], layers) if layers else presets.TARGETS[target]
    t = presets.random_model(models.TargetConfig.from_dict(tdict), key, dtype=dtype, quantize=quantize, matmul=matmul)
    if not assistant:
        return t, None
    acfg = (models.AssistantConfig.from_dict(presets.tiny_assistant_dict(tdict)) if assistant == "tiny"
            else presets.assistant_config(assistant))
    return t, presets.random_model(acfg, jax.random.fold_in(key, 1), dtype=dtype, quantize=quantize, matmul=matmul)


def devices_error(devices: int) -> str | None:
    """Why `--devices N` cannot run in this process (None when it can): a split needs all of them."""
    if devices < 1 or (devices > 1 and devices != jax.device_count()):
        return (f"--devices {devices}: this process has {jax.device_count()} devices (use all of them; "
                "restrict them with CUDA_VISIBLE_DEVICES)")
    return None


def split_pair(target, assistant, devices: int):
    """(target, assistant) split over the process's devices with `models.shard` when devices > 1."""
    if devices <= 1:
        return target, assistant
    from jaxspec import models
    import numpy as np

    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("tp",))
    return models.shard(target, mesh), None if assistant is None else models.shard(assistant, mesh)
