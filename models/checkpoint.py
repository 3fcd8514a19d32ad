"""Loading HF / MLX safetensors checkpoints and saving the MLX quantized layout.

A checkpoint is a directory with config.json and its weights: the files
`model.safetensors.index.json` names when it exists, else every `model*.safetensors` (HF's and
mlx-lm's names; other *.safetensors files beside them, e.g. an adapter, are not read). Every file is
opened and every tensor name, shape and dtype checked from the shard headers before any tensor data
is read (an empty, truncated or corrupt file, a missing shard or a bad index is a ValueError naming
the file); then the tensors are read one at a time from the memory-mapped shards (no second full
copy in host memory), cast, optionally quantized, and placed on the default device, where every
float tensor is checked for NaN / inf (a ValueError naming the checkpoint keys).

Files hold MLX's quantized layout (`weight [N, K*bits/32]` uint32, `scales` / `biases [N, K/g]`);
models hold the kernels' (`QuantizedWeight`): loading converts with `QuantizedWeight.from_mlx`,
saving with `to_mlx()`, so a save/load round trip is lossless. The parameter names and shapes a
config expects come from models.params.
"""
from __future__ import annotations

import fnmatch
import json
import math
import os
import secrets
import shutil
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import DispatchConfig, QuantizedWeight, quantize
from pallas_kernels.quant import SUPPORTED_BITS, SUPPORTED_GROUP_SIZES, all_finite, describe_nonfinite
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from .assistant import Assistant
from .config import AssistantConfig, TargetConfig, check_fit
from .layer_scan import is_stacked, stack_params, unstack_params
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
INDEX_FILE = "model.safetensors.index.json"
WEIGHT_FILES = "model*.safetensors"  # the weight files of a checkpoint without an index (as mlx-lm reads)


def _owned(fn: str) -> bool:
    """The files that are the checkpoint: `save` replaces them, the loader reads them (no other file)."""
    return fn in ("config.json", INDEX_FILE) or fnmatch.fnmatchcase(fn, WEIGHT_FILES)


def _not_loadable(path: str, why: str) -> ValueError:
    return ValueError(f"checkpoint {path!r} is not loadable: {why}")


def _read_config(path: str) -> dict:
    cpath = os.path.join(path, "config.json")
    if not os.path.isdir(path):
        raise ValueError(f"checkpoint path {path!r} is not a directory")
    if not os.path.isfile(cpath):
        raise ValueError(f"no config.json in {path!r}")
    try:
        with open(cpath, "rb") as f:
            data = f.read()
    except OSError as e:
        raise _not_loadable(path, f"config.json cannot be read ({e})") from None
    try:
        return json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise _not_loadable(path, f"config.json is not readable JSON ({e})") from None


def _shards(path: str) -> list[str]:
    """The weight files: those `model.safetensors.index.json` names when it exists, else every
    `model*.safetensors` (other *.safetensors files, e.g. an adapter beside the model, are not read).
    ValueError naming the file for an index that is not a JSON weight map or names missing files."""
    index = os.path.join(path, INDEX_FILE)
    if os.path.lexists(index):
        try:
            with open(index, "rb") as f:
                wmap = json.loads(f.read().decode("utf-8"))["weight_map"]
        except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as e:
            what = "has no 'weight_map'" if isinstance(e, (KeyError, TypeError)) else f"is not readable JSON ({e})"
            raise _not_loadable(path, f"{INDEX_FILE} {what}") from None
        if (not isinstance(wmap, dict) or not wmap
                or not all(isinstance(v, str) and v and os.path.basename(v) == v for v in wmap.values())):
            raise _not_loadable(path, f"{INDEX_FILE}'s weight_map must map tensor names to file names in the "
                                      "directory")
        files = sorted(set(wmap.values()))
        missing = [fn for fn in files if not os.path.isfile(os.path.join(path, fn))]
        if missing:
            raise _not_loadable(path, f"{INDEX_FILE} names weight file(s) {missing} that do not exist")
        return [os.path.join(path, fn) for fn in files]
    names = sorted(os.listdir(path))
    files = [fn for fn in names if fnmatch.fnmatchcase(fn, WEIGHT_FILES)]
    if not files:
        others = [fn for fn in names if fn.endswith(".safetensors")]
        if others:
            raise ValueError(f"no {WEIGHT_FILES} files in {path!r} (the weights are model.safetensors or the "
                             f"shards {INDEX_FILE} names; {others} are not read)")
        raise ValueError(f"no *.safetensors files in {path!r}")
    return [os.path.join(path, fn) for fn in files]


def _open_shard(path: str, fn: str):
    """safe_open, which checks the header and that the data cover the file exactly (nothing is read)."""
    try:
        return safe_open(fn, framework="numpy")
    except OSError as e:
        raise _not_loadable(path, f"{os.path.basename(fn)!r} cannot be read ({e})") from None
    except SafetensorError as e:
        empty = os.path.getsize(fn) == 0
        why = "is empty" if empty else f"is not a valid safetensors file (truncated or corrupt? {e})"
        raise _not_loadable(path, f"{os.path.basename(fn)!r} {why}") from None


def _quant_config(d: dict) -> dict | None:
    q = d.get("quantization")
    if q is not None and not isinstance(q, dict):
        raise ValueError(f"quantization must be a dict, got {q!r}")
    if q is None:
        q = d.get("quantization_config")
        if q is not None and not isinstance(q, dict):
            raise ValueError(f"quantization_config must be a dict, got {q!r}")
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
    for key, v in (("bits", bits), ("group_size", gs)):
        if isinstance(v, bool) or not (isinstance(v, int) or isinstance(v, float) and v.is_integer()):
            raise ValueError(f"quantization config of {ckpt_module!r}: {key} must be an integer, got {v!r}")
    return int(bits), int(gs)


def _plan(path: str, shapes: dict, qcfg: dict | None, skip) -> tuple[dict, list, int]:
    """Match every tensor of the shards to a param from the headers only. Returns
    (plan: name -> dict(kind, keys, bits, group_size), handles, total bytes)."""
    handles, where = [], {}
    for fn in _shards(path):
        h = _open_shard(path, fn)
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
    whose K is a whole number of groups; integer buffers become int32.

    Every float tensor is checked for NaN / inf as uploaded (after the cast to `dtype`): one fused
    reduction per tensor on device, gathered once at the end; ValueError names the checkpoint keys."""
    plan, handles, total = _plan(path, shapes, qcfg, skip)
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
            s = jnp.asarray(sh.get_tensor(sk)).astype(dtype)
            b = jnp.asarray(bh.get_tensor(bk)).astype(dtype)
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
    return Target(config=cfg, params=stack_params(cfg, params), matmul=matmul)


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
    style readers read it back.

    One shard is `model.safetensors`; more (over `shard_bytes` each) are
    `model-0000i-of-0000n.safetensors` with `model.safetensors.index.json`. The files are written and
    fsynced in a temporary directory beside `path`, then renamed in: a new `path` is that one
    directory renamed; into an existing one each file is renamed over its namesake, and the
    checkpoint files of an earlier save that this one does not rewrite (`model*.safetensors`, the
    index) are removed only after the new ones are in place. Other files in `path` (a tokenizer,
    `adapter_lora.safetensors`, ...) are left alone. If anything fails (a write, disk full, a rename)
    the directory is restored to what it was, so the previous checkpoint still loads, no temporary
    directory is left, and the error is re-raised. (A crash of the process in the middle of the few
    renames can leave a mix; the previous files are then in `.NAME.saving-*/old` beside `path`.)
    ValueError if `path` exists and is not a directory."""
    cfg = model.config
    d = cfg.to_dict()
    formats: dict[str, tuple[int, int]] = {}
    tensors: list[tuple[str, Any]] = []
    params = model.params if isinstance(model, Assistant) else unstack_params(cfg, model.params)
    for name in sorted(params):
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
    if isinstance(model, Assistant):
        d["architectures"] = ["Gemma4UnifiedAssistantForCausalLM" if cfg.model_type.startswith("gemma4_unified")
                              else "Gemma4AssistantForCausalLM"]
    else:
        d["architectures"] = ["Gemma4ForCausalLM"]
    shards, cur, size = [], [], 0
    for key, arr in tensors:
        nbytes = int(np.prod(arr.shape)) * jnp.dtype(arr.dtype).itemsize
        if cur and size + nbytes > shard_bytes:
            shards.append(cur)
            cur, size = [], 0
        cur.append((key, arr))
        size += nbytes
    shards.append(cur)

    path = os.path.realpath(os.fspath(path))
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"cannot save a checkpoint to {path!r}: it exists and is not a directory")
    parent, base = os.path.split(path)
    os.makedirs(parent, exist_ok=True)
    work = _work_dir(parent, base)
    keep_work = False  # set only when a failed swap could not be undone: `work` then holds the old files
    try:
        new = os.path.join(work, "new")
        os.mkdir(new)
        names = _write_checkpoint(new, shards, d)
        if not os.path.isdir(path):  # a new directory: one rename
            os.replace(new, path)
            try:
                _fsync_dir(parent)
            except BaseException:
                os.replace(path, new)  # a failed save leaves no checkpoint behind
                raise
        else:
            _swap_in(path, new, os.path.join(work, "old"), names)
    except _UndoFailed:
        keep_work = True
        raise
    finally:
        if not keep_work:
            shutil.rmtree(work, ignore_errors=True)


class _UndoFailed(OSError):
    pass


def _work_dir(parent: str, base: str) -> str:
    """A fresh hidden directory beside the target (same filesystem, so its renames are atomic)."""
    for _ in range(100):
        work = os.path.join(parent, f".{base}.saving-{secrets.token_hex(4)}")
        try:
            os.mkdir(work)  # the umask's mode, unlike mkdtemp's 0700: `new` may become the checkpoint
            return work
        except FileExistsError:
            continue
    raise FileExistsError(f"could not create a temporary directory beside {os.path.join(parent, base)!r}")


def _fsync_file(fn: str) -> None:
    fd = os.open(fn, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: str) -> None:
    if os.name == "posix":  # directories cannot be opened for fsync elsewhere
        _fsync_file(path)


def _write_checkpoint(out: str, shards: list, d: dict) -> list[str]:
    """Write the shards (+ index when there are several) and config.json into `out`, each file and
    then the directory fsynced. Returns the file names, config.json last (the order they are swapped in)."""
    names, weight_map = [], {}
    for n, shard in enumerate(shards):
        fn = "model.safetensors" if len(shards) == 1 else f"model-{n + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file({k: np.asarray(jax.device_get(a)) for k, a in shard}, os.path.join(out, fn),
                  metadata={"format": "mlx"})
        _fsync_file(os.path.join(out, fn))
        weight_map.update({k: fn for k, _ in shard})
        names.append(fn)
    docs = [(INDEX_FILE, {"metadata": {}, "weight_map": weight_map})] if len(shards) > 1 else []
    for fn, doc in docs + [("config.json", d)]:
        with open(os.path.join(out, fn), "w") as f:
            json.dump(doc, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        names.append(fn)
    _fsync_dir(out)
    return names


def _swap_in(path: str, new: str, old: str, names: list[str]) -> None:
    """Rename the files `names` from `new` into `path`, each file of that name already there moved
    into `old` first; then move the checkpoint files (`_owned`) of `path` that were not rewritten
    (stale shards, an index) into `old` too. Other files of `path` are never touched. If anything
    fails, every move is undone (old files back, new ones removed) and the error re-raised; if the
    undoing fails too, the old files stay in `old` and the error names it."""
    os.mkdir(old)
    stale = sorted(fn for fn in os.listdir(path) if _owned(fn) and fn not in names)
    moved, placed = [], []
    try:
        for fn in names:
            if os.path.lexists(os.path.join(path, fn)):
                os.replace(os.path.join(path, fn), os.path.join(old, fn))
                moved.append(fn)
            os.replace(os.path.join(new, fn), os.path.join(path, fn))
            placed.append(fn)
        for fn in stale:  # only now that the new files are in place
            os.replace(os.path.join(path, fn), os.path.join(old, fn))
            moved.append(fn)
        _fsync_dir(path)
    except BaseException as e:
        try:
            for fn in reversed(moved):
                os.replace(os.path.join(old, fn), os.path.join(path, fn))
            for fn in placed:
                if fn not in moved:
                    os.remove(os.path.join(path, fn))
        except BaseException as undo:
            raise _UndoFailed(f"saving to {path!r} failed ({e!r}) and restoring its previous files failed too "
                              f"({undo!r}): the previous files are in {old!r}") from e
        try:  # best effort: every previous file is back in place
            _fsync_dir(path)
        except OSError:
            pass
        raise


def quantize_model(model, *, bits: int = 4, group_size: int = 64):
    """A Target or Assistant with its float linear/embedding weights quantized (a leaf swap)."""
    if isinstance(model, Assistant):
        return model.replace(params=quantize_params(model.params, assistant_shapes(model.config), bits=bits,
                                                    group_size=group_size))
    cfg, stacked = model.config, is_stacked(model.params)
    params = quantize_params(unstack_params(cfg, model.params), target_shapes(cfg), bits=bits, group_size=group_size)
    return model.replace(params=stack_params(cfg, params) if stacked else params)
