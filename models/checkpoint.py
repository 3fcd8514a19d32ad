"""Loading HF / MLX safetensors checkpoints and saving the MLX quantized layout.

A checkpoint is a directory with config.json and one or more *.safetensors shards. Every tensor
name, shape and dtype is checked from the shard headers before any tensor data is read; then the
tensors are read one at a time from the memory-mapped shards (no second full copy in host memory),
cast, optionally quantized, and placed on the default device.

Files hold MLX's quantized layout (`weight [N, K*bits/32]` uint32, `scales` / `biases [N, K/g]`);
models hold the kernels' (`QuantizedWeight`): loading converts with `QuantizedWeight.from_mlx`,
saving with `to_mlx()`, so a save/load round trip is lossless. The parameter names and shapes a
config expects come from models.params.
"""
from __future__ import annotations

import glob
import json
import math
import os
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import DispatchConfig, QuantizedWeight, quantize
from pallas_kernels.quant import SUPPORTED_BITS, SUPPORTED_GROUP_SIZES
from safetensors import safe_open
from safetensors.numpy import save_file

from .assistant import Assistant
from .config import AssistantConfig, TargetConfig, check_fit
from .params import (BUFFERS, INDEX, LINEAR, TOP_LEVEL, assistant_shapes, quant_spec, quantizable, quantize_params,
                     target_shapes)
from .target import Target

_PREFIXES = ("model.language_model.", "language_model.model.", "model.", "language_model.", "")
_IGNORED_PARTS = {"vision_tower", "audio_tower", "embed_vision", "embed_audio", "multi_modal_projector",
                  "vision_model", "audio_model", "rotary_emb"}


def _ignorable(name: str, cfg: TargetConfig) -> bool:
    """Tensors HF itself ignores on load: k/v projections and norms of KV-shared layers."""
    parts = name.split(".")
    if len(parts) == 4 and parts[0] == "layers" and parts[2] == "self_attn" and parts[1].isdigit():
        i = int(parts[1])
        return (i < cfg.num_hidden_layers and cfg.kv_shared(i)
                and parts[3] in ("k_proj", "v_proj", "k_norm", "v_norm"))
    return False


# ---- reading -------------------------------------------------------------------------------------
def _read_config(path: str) -> dict:
    cpath = os.path.join(path, "config.json")
    if not os.path.isdir(path):
        raise ValueError(f"checkpoint path {path!r} is not a directory")
    if not os.path.isfile(cpath):
        raise ValueError(f"no config.json in {path!r}")
    with open(cpath) as f:
        return json.load(f)


def _shards(path: str) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(path, fn) for fn in files]
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ValueError(f"no *.safetensors files in {path!r}")
    return files


def _quant_config(d: dict) -> dict | None:
    q = d.get("quantization")
    if q is None:
        q = d.get("quantization_config")
        if q is not None and "bits" not in q:
            raise NotImplementedError(f"quantization_config {q.get('quant_method', q)!r} is not the MLX affine "
                                      "format (expected 'bits' and 'group_size')")
    if q is not None and q.get("mode", "affine") != "affine":
        raise NotImplementedError(f"quantization mode {q.get('mode')!r} is not supported (only 'affine')")
    return q


def _module_format(qcfg: dict | None, ckpt_module: str, name: str, n_words: int, n_groups: int, k: int):
    """(bits, group_size) of a quantized module: the per-module override, else the global setting,
    else inferred from the shapes (weight words and scale groups against the logical K)."""
    over = (qcfg or {}).get(ckpt_module, (qcfg or {}).get(name))
    if isinstance(over, dict):
        bits, gs = over.get("bits", qcfg.get("bits")), over.get("group_size", qcfg.get("group_size"))
    elif qcfg is not None and "bits" in qcfg:
        bits, gs = qcfg["bits"], qcfg.get("group_size", 64)
    else:
        bits, gs = 32 * n_words // k, (k // n_groups if n_groups else 0)
    return int(bits), int(gs)


def _plan(path: str, shapes: dict, qcfg: dict | None, skip) -> tuple[dict, list, int]:
    """Match every tensor of the shards to a param from the headers only. Returns
    (plan: name -> dict(kind, keys, bits, group_size), handles, total bytes)."""
    handles, where = [], {}
    for fn in _shards(path):
        h = safe_open(fn, framework="numpy")
        handles.append(h)
        for key in h.keys():
            if key in where:
                raise ValueError(f"tensor {key!r} appears in two shards")
            where[key] = h
    found: dict[str, dict[str, tuple[str, Any]]] = {}
    unexpected = []
    for key in sorted(where):
        if any(part in _IGNORED_PARTS for part in key.split(".")):
            continue
        stem, suffix = key, ""
        for sfx in (".weight", ".scales", ".biases"):
            if key.endswith(sfx):
                stem, suffix = key[: -len(sfx)], sfx
        match = None
        for pre in _PREFIXES:
            if stem.startswith(pre) and stem[len(pre):] in shapes:
                match = stem[len(pre):]
                break
            if stem.startswith(pre) and skip(stem[len(pre):]):
                match = ""
                break
        if match == "":
            continue
        if match is None:
            unexpected.append(key)
            continue
        slot = found.setdefault(match, {})
        if suffix in slot:
            raise ValueError(f"tensors {slot[suffix][0]!r} and {key!r} both map to param {match!r}")
        slot[suffix] = (key, where[key])
    problems = []
    if unexpected:
        problems.append(f"unexpected tensors {unexpected}")
    missing = sorted(set(shapes) - set(found))
    if missing:
        problems.append(f"missing tensors for params {missing}")
    plan, total = {}, 0
    for name in sorted(set(shapes) & set(found)):
        want, kind = shapes[name]
        got = found[name]
        buffer = name.split(".")[-1] in BUFFERS
        wkey = "" if buffer else ".weight"
        if wkey not in got:
            problems.append(f"param {name!r}: no tensor {name + wkey!r} (found {sorted(k for k, _ in got.values())})")
            continue
        key, h = got[wkey]
        sl = h.get_slice(key)
        shape, dtype = tuple(sl.get_shape()), sl.get_dtype()
        quantized = ".scales" in got or ".biases" in got
        if quantized:
            if kind != LINEAR:
                problems.append(f"tensor {key!r} is quantized but param {name!r} must be float")
                continue
            if ".scales" not in got or ".biases" not in got:
                problems.append(f"quantized param {name!r} needs .weight, .scales and .biases; found "
                                f"{sorted(k for k, _ in got.values())}")
                continue
            skey, sh = got[".scales"]
            bkey, bh = got[".biases"]
            sshape, bshape = tuple(sh.get_slice(skey).get_shape()), tuple(bh.get_slice(bkey).get_shape())
            n, k = want
            stem = key[: -len(".weight")]
            bits, gs = _module_format(qcfg, stem, name, shape[-1] if len(shape) == 2 else 0,
                                      sshape[-1] if len(sshape) == 2 else 0, k)
            if bits not in SUPPORTED_BITS or gs not in SUPPORTED_GROUP_SIZES:
                problems.append(f"quantized param {name!r}: bits={bits}, group_size={gs} not supported "
                                f"(bits {SUPPORTED_BITS}, group_size {SUPPORTED_GROUP_SIZES})")
                continue
            if dtype != "U32":
                problems.append(f"tensor {key!r} has dtype {dtype}, expected U32 (packed {bits}-bit)")
            exp_w, exp_s = (n, k * bits // 32), (n, k // gs)
            for tkey, tshape, exp in ((key, shape, exp_w), (skey, sshape, exp_s), (bkey, bshape, exp_s)):
                if tshape != exp:
                    problems.append(f"tensor {tkey!r} has shape {tshape}, expected {exp} for param {name!r} "
                                    f"{tuple(want)} at bits={bits}, group_size={gs}")
            plan[name] = dict(kind="quantized", keys=(got[".weight"], got[".scales"], got[".biases"]),
                              bits=bits, group_size=gs)
            total += math.prod(exp_w) * 4 + 2 * math.prod(exp_s) * 2
        else:
            extra = sorted(k for s, (k, _) in got.items() if s != wkey)
            if extra:
                problems.append(f"unexpected tensors {extra} for float param {name!r}")
            if shape != tuple(want):
                problems.append(f"tensor {key!r} has shape {shape}, expected {tuple(want)}")
            if kind == INDEX and dtype not in ("I64", "I32", "U32", "I16", "U16"):
                problems.append(f"tensor {key!r} has dtype {dtype}, expected an integer type")
            if kind != INDEX and dtype not in ("F32", "F16", "BF16", "F64"):
                problems.append(f"tensor {key!r} has dtype {dtype}, expected a float type")
            plan[name] = dict(kind=kind, keys=(got[wkey],))
            total += math.prod(shape) * 4
    if problems:
        raise ValueError(f"checkpoint {path!r} does not match its config: " + "; ".join(problems))
    return plan, handles, total


class _Progress:
    def __init__(self, total: int, label: str, enabled: bool | None):
        self.total, self.done, self.label = max(total, 1), 0, label
        self.enabled = total > (1 << 30) if enabled is None else enabled
        self.next, self.t0 = 0.0, time.time()

    def add(self, n: int):
        self.done += n
        frac = self.done / self.total
        if self.enabled and (frac >= self.next or self.done >= self.total):
            print(f"\r{self.label}: {100 * frac:5.1f}% ({self.done / 2**30:.2f} GiB, "
                  f"{time.time() - self.t0:.0f}s)", end="\n" if self.done >= self.total else "",
                  file=sys.stderr, flush=True)
            self.next = frac + 0.02


def _load_params(path, shapes, qcfg, skip, dtype, quantize_spec, progress, label) -> dict:
    """Read the planned tensors one at a time. Quantized tensors become QuantizedWeights in the
    kernels' layout (built from the file's MLX arrays), their scales and biases cast to `dtype`;
    float ones are cast to `dtype` and, under `quantize_spec`, quantized if they are linear weights
    whose K is a whole number of groups; integer buffers become int32."""
    plan, handles, total = _plan(path, shapes, qcfg, skip)
    bits, gs = quant_spec(quantize_spec)
    prog = _Progress(total, label, progress)
    params = {}
    for name in sorted(plan):
        entry = plan[name]
        if entry["kind"] == "quantized":
            (wk, wh), (sk, sh), (bk, bh) = entry["keys"]
            w = jnp.asarray(wh.get_tensor(wk))
            s = jnp.asarray(sh.get_tensor(sk)).astype(dtype)
            b = jnp.asarray(bh.get_tensor(bk)).astype(dtype)
            params[name] = QuantizedWeight.from_mlx(w, s, b, entry["bits"], entry["group_size"])
            prog.add(w.size * 4 + s.size * 2 + b.size * 2)
            continue
        (key, h), = entry["keys"]
        host = h.get_tensor(key)
        if entry["kind"] == INDEX:
            params[name] = jnp.asarray(host.astype(np.int32))
        else:
            arr = jnp.asarray(host).astype(dtype)
            if bits and quantizable(arr.shape, entry["kind"], gs):
                arr = quantize(arr, bits=bits, group_size=gs)
            params[name] = arr
        prog.add(host.size * 4)
        del host
    return params


def load_target(path: str, *, dtype=jnp.bfloat16, quantize=None, matmul: DispatchConfig | None = None,
                progress: bool | None = None) -> Target:
    """Load a Gemma 4 target (gemma4_text, or the text part of gemma4 / gemma4_unified) from an HF or
    MLX (quantized) checkpoint directory. `quantize={"bits": 4, "group_size": 64}` quantizes float
    linear/embedding weights on load (weights already quantized in the file are kept as they are).
    `matmul=None` resolves to `DispatchConfig.from_env()` here, once: the model then holds that
    config and nothing later reads the environment."""
    matmul = DispatchConfig.from_env() if matmul is None else matmul
    d = _read_config(path)
    cfg = TargetConfig.from_dict(d)
    if not cfg.cache_layers:
        raise ValueError("every layer of this config is KV-shared: that is an assistant stack, not a target")
    shapes = target_shapes(cfg)
    skip = lambda name: _ignorable(name, cfg) or (cfg.tie_word_embeddings and name == "lm_head")
    params = _load_params(path, shapes, _quant_config(d), skip, dtype, quantize, progress, "load_target")
    return Target(config=cfg, params=params, matmul=matmul)


def load_assistant(path: str, *, dtype=jnp.bfloat16, quantize=None, matmul: DispatchConfig | None = None,
                   target=None, progress: bool | None = None) -> Assistant:
    """Load a gemma4_assistant / gemma4_unified_assistant checkpoint. With `target=` (a Target or a
    TargetConfig) the pairing is checked first (hidden size, vocabulary, head dims, KV heads).
    `quantize` and `matmul` as for `load_target`."""
    matmul = DispatchConfig.from_env() if matmul is None else matmul
    d = _read_config(path)
    cfg = AssistantConfig.from_dict(d)
    if target is not None:
        check_fit(cfg, getattr(target, "config", target))
    shapes = assistant_shapes(cfg)
    skip = lambda name: _ignorable(name, cfg.text) or (cfg.tie_word_embeddings and name == "lm_head")
    params = _load_params(path, shapes, _quant_config(d), skip, dtype, quantize, progress, "load_assistant")
    return Assistant(config=cfg, params=params, matmul=matmul)


# ---- writing -------------------------------------------------------------------------------------
def _ckpt_module(model, name: str) -> str:
    if isinstance(model, Assistant):
        return name if name in TOP_LEVEL else "model." + name
    return name if name == "lm_head" else "model." + name


def save(model, path: str, *, shard_bytes: int = 4 << 30) -> None:
    """Write `model` (Target or Assistant) as config.json + safetensors in the MLX layout: quantized
    modules as `.weight` (uint32) / `.scales` / `.biases`, float ones as `.weight`, buffers bare; the
    `quantization` config (and its `quantization_config` copy) gives the common bits/group_size with
    per-module overrides. HF names ("model." prefix), so `load_target` / `load_assistant` and mlx-lm
    style readers read it back."""
    cfg = model.config
    d = cfg.to_dict()
    formats: dict[str, tuple[int, int]] = {}
    tensors: list[tuple[str, Any]] = []
    for name in sorted(model.params):
        w = model.params[name]
        mod = _ckpt_module(model, name)
        if isinstance(w, QuantizedWeight):
            formats[mod] = (w.bits, w.group_size)
            words, scales, biases = w.to_mlx()  # files hold MLX's layout, models the kernels'
            tensors += [(mod + ".weight", words), (mod + ".scales", scales), (mod + ".biases", biases)]
        elif name.split(".")[-1] in BUFFERS:
            tensors.append((mod, w))
        else:
            tensors.append((mod + ".weight", w))
    if formats:
        common = max(set(formats.values()), key=list(formats.values()).count)
        q: dict[str, Any] = {"group_size": common[1], "bits": common[0], "mode": "affine"}
        for mod, f in sorted(formats.items()):
            if f != common:
                q[mod] = {"group_size": f[1], "bits": f[0]}
        d["quantization"] = q
        d["quantization_config"] = dict(q)
    if isinstance(model, Assistant):
        d["architectures"] = ["Gemma4UnifiedAssistantForCausalLM" if cfg.model_type.startswith("gemma4_unified")
                              else "Gemma4AssistantForCausalLM"]
    else:
        d["architectures"] = ["Gemma4ForCausalLM"]
    os.makedirs(path, exist_ok=True)
    for old in glob.glob(os.path.join(path, "*.safetensors")) + glob.glob(os.path.join(path, "*.index.json")):
        os.remove(old)
    shards, cur, size = [], [], 0
    for key, arr in tensors:
        nbytes = int(np.prod(arr.shape)) * jnp.dtype(arr.dtype).itemsize
        if cur and size + nbytes > shard_bytes:
            shards.append(cur)
            cur, size = [], 0
        cur.append((key, arr))
        size += nbytes
    shards.append(cur)
    weight_map = {}
    for n, shard in enumerate(shards):
        fn = "model.safetensors" if len(shards) == 1 else f"model-{n + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file({k: np.asarray(jax.device_get(a)) for k, a in shard}, os.path.join(path, fn),
                  metadata={"format": "mlx"})
        weight_map.update({k: fn for k, _ in shard})
    if len(shards) > 1:
        with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {}, "weight_map": weight_map}, f, indent=1)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(d, f, indent=1)


def quantize_model(model, *, bits: int = 4, group_size: int = 64):
    """A Target or Assistant with its float linear/embedding weights quantized (a leaf swap)."""
    shapes = assistant_shapes(model.config) if isinstance(model, Assistant) else target_shapes(model.config)
    return model.replace(params=quantize_params(model.params, shapes, bits=bits, group_size=group_size))
