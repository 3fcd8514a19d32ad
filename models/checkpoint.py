"""Loading HF / MLX safetensors checkpoints and saving the MLX quantized layout.

A checkpoint is a directory with config.json and its weights: the files its manifest lists (written
by `save`), else those `model.safetensors.index.json` names, else every `model*.safetensors` (HF's
and mlx-lm's names; other *.safetensors files beside them, e.g. an adapter, are not read). Which
files, and opening only regular files, is models/checkpoint_files.py. Every file is opened and every
tensor name, shape and dtype checked from the shard headers before any tensor data is read (an
empty, truncated or corrupt file, a missing shard, a bad index, a FIFO, a file that cannot be read is
a ValueError naming the file); then the tensors are read one at a time from the memory-mapped shards (no second full
copy in host memory), cast, optionally quantized, and placed on the default device, where every
float tensor is checked for NaN / inf (a ValueError naming the checkpoint keys).

Files hold MLX's quantized layout (`weight [N, K*bits/32]` uint32, `scales` / `biases [N, K/g]`);
models hold the kernels' (`QuantizedWeight`): loading converts with `QuantizedWeight.from_mlx`,
saving with `to_mlx()`, so a save/load round trip is lossless. The parameter names and shapes a
config expects come from models.params.
"""
from __future__ import annotations

import math
import os
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.kernels import DispatchConfig, QuantizedWeight, quantize
from jaxspec.kernels.quant import SUPPORTED_BITS, SUPPORTED_GROUP_SIZES, all_finite, dequantize, describe_nonfinite
from safetensors import SafetensorError, safe_open

from . import fingerprint, gguf
from .assistant import Assistant, with_draft_vocab
from .checkpoint_files import (INDEX_FILE, MANIFEST, WEIGHT_FILES, FileProblem, checkpoint_files,  # noqa: F401
                               read_config, save_files, why_not)
from .config import AssistantConfig, TargetConfig, check_fit, quantization_format
from .dense import is_dense, prepared
from .layer_scan import is_stacked, stack_params, unstack_params
from .params import (BUFFERS, DERIVED, INDEX, LINEAR, TOP_LEVEL, assistant_shapes, check_params, quant_spec, quantizable,
                     quantize_params, target_shapes)
from .target import Target

def _ignorable(name: str, cfg: TargetConfig) -> bool:
    """Tensors HF itself ignores on load: k/v projections and norms of KV-shared layers."""
    parts = name.split(".")
    if len(parts) == 4 and parts[0] == "layers" and parts[2] == "self_attn" and parts[1].isdigit():
        i = int(parts[1])
        return (i < cfg.num_hidden_layers and cfg.kv_shared(i)
                and parts[3] in ("k_proj", "v_proj", "k_norm", "v_norm"))
    return False


# ---- reading -------------------------------------------------------------------------------------
def _not_loadable(path: str, why: str) -> ValueError:
    return ValueError(f"checkpoint {path!r} is not loadable: {why}")


DTYPES = ("bfloat16", "float16", "float32")  # what the models compute in


def _model_dtype(dtype):
    try:
        d = None if dtype is None else jnp.dtype(dtype)
    except (TypeError, ValueError):
        d = None
    if d is None or d.name not in DTYPES:
        raise ValueError(f"dtype={dtype!r} is not supported: load in bfloat16, float16 or float32")
    return d


def _read(path: str, parse) -> tuple[dict, object, list[str]]:
    """(config.json, parse(config.json), [weight files]) of checkpoint `path`, every file checked
    (checkpoint_files). The config is parsed before the weight files are required: its errors are
    the ones to fix first, and cost nothing to find."""
    try:
        d, _ = read_config(path, complete=False)
        cfg = parse(d)
        return d, cfg, checkpoint_files(path)[1]
    except FileProblem as e:
        raise _not_loadable(path, str(e)) from None


def _open_shard(path: str, fn: str):
    """safe_open, which checks the header and that the data cover the file exactly (nothing is read)."""
    try:
        return safe_open(fn, framework="numpy")
    except OSError as e:
        raise _not_loadable(path, why_not(e, fn)) from None
    except SafetensorError as e:
        empty = os.path.getsize(fn) == 0
        why = "is empty" if empty else f"is not a valid safetensors file (truncated or corrupt? {e})"
        raise _not_loadable(path, f"{os.path.basename(fn)!r} {why}") from None


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
    for key, v in (("bits", bits), ("group_size", gs)):
        if isinstance(v, bool) or not (isinstance(v, int) or isinstance(v, float) and v.is_integer()):
            raise ValueError(f"quantization config of {ckpt_module!r}: {key} must be an integer, got {v!r}")
    return int(bits), int(gs)


def _plan(path: str, files: list[str], shapes: dict, qcfg: dict | None, skip, family) -> tuple[dict, list, int]:
    """Match every tensor of the shards `files` to a param from the headers only, by the names of
    the model's family (its `weight_prefixes` and `ignored_modules`). Returns
    (plan: name -> dict(kind, keys, bits, group_size), handles, total bytes)."""
    handles, where = [], {}
    for fn in files:
        h = _open_shard(path, fn)
        handles.append(h)
        for key in h.keys():
            if key in where:
                raise ValueError(f"tensor {key!r} appears in two shards")
            where[key] = h
    found: dict[str, dict[str, tuple[str, Any]]] = {}
    unexpected = []
    for key in sorted(where):
        if any(part in family.ignored_modules for part in key.split(".")):
            continue
        stem, suffix = key, ""
        for sfx in (".weight", ".scales", ".biases"):
            if key.endswith(sfx):
                stem, suffix = key[: -len(sfx)], sfx
        match = None
        for pre in family.weight_prefixes:
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


def _scale_dtype(a, dtype):
    """Quantization scales / biases in the model dtype, except float32 ones, which stay float32: a
    GGUF's scales (d * sc, up to 17 significant bits) are exact only there, and the kernels compute
    in float32 whatever the stored dtype (models.gguf; `jaxspec convert` writes them so)."""
    return a if a.dtype == jnp.float32 else a.astype(dtype)


def _load_params(path, files, shapes, qcfg, skip, family, dtype, quantize_spec, progress, label) -> dict:
    """Read the planned tensors one at a time. Quantized tensors become QuantizedWeights in the
    kernels' layout (built from the file's MLX arrays), their scales and biases cast to `dtype`
    unless float32 (`_scale_dtype`);
    float ones are cast to `dtype` and, under `quantize_spec`, quantized if they are linear weights
    whose K is a whole number of groups; integer buffers become int32.

    Every float tensor is checked for NaN / inf as uploaded (after the cast to `dtype`): one fused
    reduction per tensor on device, gathered once at the end; ValueError names the checkpoint keys."""
    plan, handles, total = _plan(path, files, shapes, qcfg, skip, family)
    bits, gs = quant_spec(quantize_spec)
    prog = _Progress(total, label, progress)
    params, finite = {}, []  # (checkpoint key, the array as held in params, its layout transposed?, flag)

    def check(key, arr, transposed=False):
        finite.append((key, arr, transposed, all_finite(arr)))

    for name in sorted(plan):
        entry = plan[name]
        if entry["kind"] == "quantized":
            (wk, wh), (sk, sh), (bk, bh) = entry["keys"]
            w = jnp.asarray(wh.get_tensor(wk))
            s, b = (_scale_dtype(jnp.asarray(h.get_tensor(key)), dtype) for key, h in ((sk, sh), (bk, bh)))
            params[name] = qw = QuantizedWeight.from_mlx(w, s, b, entry["bits"], entry["group_size"])
            check(sk, qw.scales, True)  # [K/g, N] in memory, [N, K/g] in the file
            check(bk, qw.biases, True)
            prog.add(w.size * 4 + s.size * 2 + b.size * 2)
            continue
        (key, h), = entry["keys"]
        host = h.get_tensor(key)
        if entry["kind"] == INDEX:
            params[name] = jnp.asarray(host.astype(np.int32))
        else:
            arr = jnp.asarray(host).astype(dtype)
            if bits and quantizable(arr.shape, entry["kind"], gs):
                try:  # quantize checks the weight for NaN / inf itself, before quantizing
                    arr = quantize(arr, bits=bits, group_size=gs)
                except ValueError as e:
                    raise _not_loadable(path, f"tensor {key!r}: {e}") from None
            else:
                check(key, arr)
            params[name] = arr
        prog.add(host.size * 4)
        del host
    if finite:
        ok = np.asarray(jax.device_get(jnp.stack([flag for *_, flag in finite])))
        bad = [(key, arr.T if t else arr) for (key, arr, t, _), good in zip(finite, ok) if not good]
        if bad:
            raise _not_loadable(path, f"{len(bad)} tensor(s) hold NaN or inf values as {jnp.dtype(dtype).name}: "
                                      + "; ".join(f"{key!r} ({describe_nonfinite(arr)})" for key, arr in bad[:8])
                                      + ("; ..." if len(bad) > 8 else ""))
    return params


def load_target(path: str, *, dtype=jnp.bfloat16, quantize=None, matmul: DispatchConfig | None = None,
                progress: bool | None = None) -> Target:
    """Load a Gemma 4 target (gemma4_text, or the text part of gemma4 / gemma4_unified) from an HF or
    MLX (quantized) checkpoint directory. `quantize={"bits": 4, "group_size": 64}` quantizes float
    linear/embedding weights on load (weights already quantized in the file are kept as they are).
    `matmul=None` resolves to `DispatchConfig.from_env(backend="auto")` here, once (XLA's dense dot
    on a CPU, the Pallas kernels on a GPU; pass `matmul=DispatchConfig.from_env(backend="pallas")`
    to run the kernels anyway): the model then holds that config and nothing later reads the
    environment. `dtype`: bfloat16, float16 or float32 (else ValueError, before anything is read).

    A GGUF loads too: `path` a .gguf file, a directory holding one (and no config.json), or a model
    name such as "gemma-3-270m" (its pip package's file): see `load_gguf_target`."""
    dtype = _model_dtype(dtype)
    matmul = DispatchConfig.from_env(backend="auto") if matmul is None else matmul
    src = gguf.source(path)
    if src is not None:
        return load_gguf_target(src, dtype=dtype, quantize=quantize, matmul=matmul)
    d, cfg, files = _read(path, TargetConfig.from_dict)
    if not cfg.cache_layers:
        raise ValueError("every layer of this config is KV-shared: that is an assistant stack, not a target")
    shapes = target_shapes(cfg)
    skip = lambda name: _ignorable(name, cfg) or (cfg.tie_word_embeddings and name == "lm_head")
    params = _load_params(path, files, shapes, quantization_format(d), skip, cfg.family, dtype, quantize, progress,
                          "load_target")
    return prepared(Target(config=cfg, params=stack_params(cfg, params), matmul=matmul))


def _target_config(d: dict):
    """A GGUF's config.json dict as the model's config: TargetConfig.from_dict, which picks the
    family by model_type (models/families.py)."""
    return TargetConfig.from_dict(d)


def load_gguf_target(path: str, *, dtype=jnp.bfloat16, quantize=None, matmul: DispatchConfig | None = None,
                     progress=None) -> Target:
    """A target from a GGUF (models.gguf.read_gguf: `path` a .gguf file, a directory holding one, or a
    known model's name). The default is the exact load: GGUF's Q8_0 / Q5_0 / Q4_K become the kernels'
    8-bit / 8-bit / 4-bit group-32 format with float32 scales and biases, Q6_K and the float tensors
    float arrays in `dtype` (exact at float32). `quantize={"bits": b, "group_size": g}` requantizes
    every linear/embedding weight (the exact weights cast to `dtype`, then `quantize`), e.g. the
    all-4-bit group-64 form. The config is parsed, and every tensor's name, type and shape checked,
    before any tensor is decoded. `progress(done, total)`: see `models.gguf.read_gguf`."""
    dtype = _model_dtype(dtype)
    matmul = DispatchConfig.from_env(backend="auto") if matmul is None else matmul
    bits, gs = quant_spec(quantize)
    holder = {}

    def check(d):  # runs on the config before any tensor is decoded
        holder["cfg"] = cfg = _target_config(d)
        if not cfg.cache_layers:
            raise ValueError("every layer of this config is KV-shared: that is an assistant stack, not a target")

    ck = gguf.read_gguf(path, check=check, progress=progress)
    cfg = holder["cfg"]
    params = _gguf_params(ck, target_shapes(cfg), dtype, bits, gs)
    return prepared(Target(config=cfg, params=stack_params(cfg, params), matmul=matmul))


def _gguf_params(ck, shapes, dtype, bits: int, gs: int) -> dict:
    """A GGUF's HF-named tensors as a model's params (checked against `shapes`): float ones in
    `dtype`, QuantizedWeights as read, or every linear weight requantized when `bits`."""
    params, finite = {}, []
    for hf, w in ck.tensors.items():
        name = hf[len("model."):] if hf.startswith("model.") else hf
        name = name[: -len(".weight")] if name.endswith(".weight") else name
        kind = shapes.get(name, (None, None))[1]
        if bits and kind == LINEAR:
            dense = dequantize(w, jnp.float32) if isinstance(w, QuantizedWeight) else jnp.asarray(w)
            dense = dense.astype(dtype)
            if quantizable(dense.shape, kind, gs):
                try:
                    w = quantize(dense, bits=bits, group_size=gs)
                except ValueError as e:
                    raise _not_loadable(ck.path, f"tensor {hf!r}: {e}") from None
            else:
                w = dense
        elif isinstance(w, QuantizedWeight):
            finite += [(hf + " (scales)", w.scales), (hf + " (biases)", w.biases)]
        else:
            w = jnp.asarray(w).astype(dtype)
            finite.append((hf, w))
        params[name] = w
    ok = np.asarray(jax.device_get(jnp.stack([all_finite(a) for _, a in finite]))) if finite else []
    bad = [(key, a) for (key, a), good in zip(finite, ok) if not good]
    if bad:
        raise _not_loadable(ck.path, f"{len(bad)} tensor(s) hold NaN or inf values: "
                                     + "; ".join(f"{key!r} ({describe_nonfinite(a)})" for key, a in bad[:8]))
    try:
        check_params(params, shapes, "target")
    except ValueError as e:
        raise _not_loadable(ck.path, str(e)) from None
    return params


SHARED_EMBEDDING = "target"  # config.json "shared_embedding": the assistant's tied table is its target's


def load_assistant(path: str, *, dtype=jnp.bfloat16, quantize=None, matmul: DispatchConfig | None = None,
                   target=None, progress: bool | None = None) -> Assistant:
    """Load a gemma4_assistant / gemma4_unified_assistant checkpoint. With `target=` (a Target or a
    TargetConfig) the pairing is checked first (hidden size, vocabulary, head dims, KV heads).
    `dtype`, `quantize` and `matmul` as for `load_target`.

    An assistant trained by `jaxspec.train_assistant` stores no embedding table: its config.json says
    `"shared_embedding": "target"` and its tied head is the target's own table, so `target=` must be
    the models.Target it drafts for (its `embed_tokens` is shared, not copied). Its `"target"` (a
    name) and `"target_fingerprint"` (models/fingerprint.py) say which target it was trained for;
    another target is refused with one ValueError line, before any weight is read."""
    dtype = _model_dtype(dtype)
    matmul = DispatchConfig.from_env(backend="auto") if matmul is None else matmul
    d, cfg, files = _read(path, AssistantConfig.from_dict)
    shared = d.get("shared_embedding")
    trained_for = d.get("target")
    if shared is not None and shared != SHARED_EMBEDDING:
        raise _not_loadable(path, f"shared_embedding={shared!r} is not known (only {SHARED_EMBEDDING!r})")
    if shared and not isinstance(target, Target):
        raise ValueError(f"assistant {path!r} uses its target's embedding table: pass target= the models.Target it "
                         f"drafts for ({trained_for!r})")
    if target is not None:
        check_fit(cfg, getattr(target, "config", target))
        fp = d.get("target_fingerprint")
        why = fingerprint.mismatch(fp, target) if fp is not None and isinstance(target, Target) else None
        if why:
            raise ValueError(f"assistant {path!r} was trained for target {trained_for!r}, not this one: {why}")
    shapes = assistant_shapes(cfg)
    if shared:
        tcfg = target.config
        if not cfg.tie_word_embeddings or cfg.hidden_size != tcfg.hidden_size:
            raise _not_loadable(path, f"a shared embedding needs a tied head of the target's width: "
                                      f"tie_word_embeddings={cfg.tie_word_embeddings}, hidden_size={cfg.hidden_size}, "
                                      f"target hidden_size={tcfg.hidden_size}")
        shapes = {k: v for k, v in shapes.items() if k != "embed_tokens"}
    shapes = {k: v for k, v in shapes.items() if k not in DERIVED}  # rebuilt below from the ids
    skip = lambda name: _ignorable(name, cfg.text) or (cfg.tie_word_embeddings and name == "lm_head")
    params = _load_params(path, files, shapes, quantization_format(d), skip, cfg.text.family, dtype, quantize, progress,
                          "load_assistant")
    assistant = prepared(Assistant(config=cfg, params=params, matmul=matmul))
    if shared:  # the target's table as the target holds it (dense or quantized: the dispatch takes either)
        assistant = assistant.replace(params=dict(assistant.params, embed_tokens=target.params["embed_tokens"]))
    if cfg.draft_vocab_size:  # the trimmed head's rows, gathered once from the (shared) table
        try:
            assistant = with_draft_vocab(assistant, np.asarray(assistant.params["draft_vocab"]))
        except ValueError as e:
            raise _not_loadable(path, str(e)) from None
    return assistant


# ---- writing -------------------------------------------------------------------------------------
def _ckpt_module(model, name: str) -> str:
    if isinstance(model, Assistant):
        return name if name in TOP_LEVEL else "model." + name
    return name if name == "lm_head" else "model." + name


def save(model, path: str, *, shard_bytes: int = 4 << 30, config_extra: dict | None = None,
         extra_files=None) -> None:
    """Write `model` (Target or Assistant) as config.json + safetensors in the MLX layout: quantized
    modules as `.weight` (uint32) / `.scales` / `.biases`, float ones as `.weight`, buffers bare; the
    `quantization` config (and its `quantization_config` copy) gives the common bits/group_size with
    per-module overrides. HF names ("model." prefix), so `load_target` / `load_assistant` and mlx-lm
    style readers read it back.

    One shard is `model.safetensors`; more (over `shard_bytes` each) are
    `model-0000i-of-0000n.safetensors` with `model.safetensors.index.json`; a manifest
    (`jaxspec_manifest.json`) lists what the save wrote. Files get the umask's mode. The switch from
    the previous checkpoint is one atomic rename (models/checkpoint_files.py): a crash at any point
    leaves a directory that loads as the old or the new checkpoint, and the next save tidies up.
    Only files the previous save wrote (its manifest's; without one, config.json, the index,
    `model.safetensors`, `model-NNNNN-of-NNNNN.safetensors`) are replaced or deleted: other files and
    directories stay. ValueError (before writing) if `path` is not a directory or a directory sits
    where a checkpoint file goes; OSError for a failed write (ENOSPC when the disk is full), the
    previous checkpoint intact.

    `config_extra`: keys added to config.json (an assistant's `"target"`, `"target_fingerprint"`);
    with `"shared_embedding": "target"` the assistant's `embed_tokens` (its target's table) is not
    written (load_assistant takes it from the target).

    `extra_files(directory)`: writes the checkpoint's other files into `directory` (e.g. `tok.save`, as
    `jaxspec convert` does): they switch in with the weights and config in the same step, the
    manifest lists them, and the loaders refuse the directory if one goes missing. Whatever it
    raises leaves the previous checkpoint as it was."""
    if is_dense(model):
        raise ValueError("this model's weights were dequantized for the CPU at load (DenseWeight: "
                         "DispatchConfig.dense_weights); load it with DispatchConfig(backend='xla', dense=False) "
                         "to save it")
    cfg = model.config
    d = cfg.to_dict()
    extra = dict(config_extra or {})
    d.update(extra)
    omit = {"embed_tokens"} if isinstance(model, Assistant) and extra.get("shared_embedding") == SHARED_EMBEDDING else set()
    omit |= set(DERIVED)  # rebuilt at load
    formats: dict[str, tuple[int, int]] = {}
    tensors: list[tuple[str, Any]] = []
    params = model.params if isinstance(model, Assistant) else unstack_params(cfg, model.params)
    for name in sorted(set(params) - omit):
        w = params[name]
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
    d["architectures"] = [cfg.architecture if isinstance(model, Assistant) else cfg.family.architecture]
    shards, cur, size = [], [], 0
    for key, arr in tensors:
        nbytes = int(np.prod(arr.shape)) * jnp.dtype(arr.dtype).itemsize
        if cur and size + nbytes > shard_bytes:
            shards.append(cur)
            cur, size = [], 0
        cur.append((key, arr))
        size += nbytes
    shards.append(cur)

    save_files(path, shards, d, extra_files)


def quantize_model(model, *, bits: int = 4, group_size: int = 64):
    """A Target or Assistant with its float linear/embedding weights quantized (a leaf swap)."""
    if isinstance(model, Assistant):
        return model.replace(params=quantize_params(model.params, assistant_shapes(model.config), bits=bits,
                                                    group_size=group_size))
    cfg, stacked = model.config, is_stacked(model.params)
    params = quantize_params(unstack_params(cfg, model.params), target_shapes(cfg), bits=bits, group_size=group_size)
    return model.replace(params=stack_params(cfg, params) if stacked else params)
