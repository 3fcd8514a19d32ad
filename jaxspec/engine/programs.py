"""generate's compiled programs: each compiled once per shapes, several at once, and kept whole on disk.

A generate call needs up to three programs: the exactness probe's forward, the prefill and the decode
loop. `compile_all` builds them together:
- in memory, each once per shapes (a second call of the same shapes compiles nothing);
- several at once: each is traced and lowered in turn on the calling thread (Python work, one at a
  time) and then compiled by XLA in a thread of its own, so the compiles overlap one another and the
  next program's tracing (the 12B's decode loop alone compiles for ~10 s on an H200 host);
- whole on disk, when jaxspec's on-disk cache is on (`compile_cache`): keyed by what decides the
  program without tracing it (its name and static settings, its arguments' tree with the model
  configs, their shapes, dtypes and devices, the device kind, JAX's version and flags, and a hash of
  the jaxspec, models and pallas_kernels sources), so a new process loads it without tracing or
  lowering, which JAX's persistent cache still needs to find its entry (~5 s for the 12B's three).
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import logging
import os
import pickle
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Sequence

import jax

from jaxspec.engine import compile_cache

# One line when compiling starts and one with how long it took (INFO: silent unless the user
# configures logging; the CLI and the server show them). Programs already in memory log nothing.
log = logging.getLogger(__name__)

_MEMO: dict = {}
_thread = threading.local()  # per compile thread: whether JAX's persistent cache served its compile
_listening: list[bool] = []


@dataclasses.dataclass(frozen=True)
class Program:
    """One program to compile: `lower()` traces and lowers it (called only when neither memory nor
    disk holds it). `setting` (hashable) and `args` (arrays or ShapeDtypeStructs) decide it: two
    Programs with equal name, setting and argument tree/shapes/dtypes/shardings are the same program."""

    name: str
    setting: Any
    args: tuple
    lower: Callable[[], jax.stages.Lowered]

    def signature(self) -> tuple:
        leaves, tree = jax.tree_util.tree_flatten(self.args)
        return (self.name, self.setting, tree,
                tuple((x.shape, str(x.dtype), bool(getattr(x, "weak_type", False)), _placement(x)) for x in leaves))


def _placement(x) -> str | None:
    """How an argument is laid out over devices, for a sharded model (models.shard): a program is
    compiled for its arguments' shardings. None for one on a single device (or not yet placed)."""
    sharding = getattr(x, "sharding", None)
    if sharding is None or len(sharding.device_set) == 1:
        return None
    return str(sharding)


def compile_all(programs: Sequence[Program]) -> list[jax.stages.Compiled]:
    """The compiled programs, in order: from memory, else from disk, else compiled (all that
    are missing at once; the first in the list starts compiling first, so put the longest there)."""
    sigs = [p.signature() for p in programs]
    todo = {}  # signature -> (program, its path on disk or None)
    t0, loaded = time.perf_counter(), []
    for p, sig in zip(programs, sigs):
        if sig in _MEMO or sig in todo:
            continue
        path = _path(p, sig)
        if _load(p, sig, path):
            loaded.append(p.name)
        else:
            todo[sig] = (p, path)
    if loaded:
        log.info("loaded %s from the on-disk cache in %.1f s", _names(loaded), time.perf_counter() - t0)
    if todo:
        t0 = time.perf_counter()
        names = _names([p.name for p, _ in todo.values()])
        log.info("compiling %s (the first run for these shapes can take a while) ...", names)
        if not _listening:
            jax.monitoring.register_event_listener(_on_count)
            _listening.append(True)
        with ThreadPoolExecutor(max_workers=len(todo), thread_name_prefix="jaxspec-compile") as pool:
            # Lowering stays on this thread (JAX's tracing is Python); each compile runs beside it.
            pending = [(sig, path, pool.submit(_compile, p.lower())) for sig, (p, path) in todo.items()]
            for sig, path, future in pending:
                _MEMO[sig], from_jax_cache = future.result()
                if not from_jax_cache:  # an executable JAX's cache loaded may not serialize whole
                    _save(path, _MEMO[sig])  # (on CPU it lost its code): keep only fresh compiles
        log.info("compiled %s in %.1f s", names, time.perf_counter() - t0)
    return [_MEMO[s] for s in sigs]


def _names(names: list[str]) -> str:
    """"3 programs (generate, prefill, probe)" / "1 program (prefill)": what a log line names."""
    return f"{len(names)} program{'s' if len(names) != 1 else ''} ({', '.join(names)})"


def _compile(lowered) -> tuple[jax.stages.Compiled, bool]:
    """(the executable, whether JAX's persistent cache served it), compiled on this thread."""
    _thread.hit = False
    compiled = lowered.compile()
    return compiled, _thread.hit


def _on_count(event: str, **kw):
    if event == compile_cache.CACHE_HIT:  # recorded on the thread that compiles
        _thread.hit = True


def compiled(program: Program) -> jax.stages.Compiled:
    return compile_all([program])[0]


def clear() -> None:
    """Forget the programs compiled in this process (the disk keeps its copies)."""
    _MEMO.clear()


# ---- on disk -----------------------------------------------------------------------------------
def directory() -> str | None:
    """Where whole programs are kept: `jaxspec-programs` in JAX's compilation cache directory, when
    jaxspec's on-disk cache is on (`compile_cache.ensure_default`); else None."""
    root = compile_cache.ensure_default()  # checked there, with this folder and its files (checked_dir)
    return os.path.join(root, compile_cache.PROGRAMS) if root else None


@functools.cache
def _sources_hash() -> str:
    h = hashlib.sha256()
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the jaxspec package, every room
    # followlinks: in a source checkout jaxspec/models and jaxspec/kernels link to models/ and
    # pallas_kernels/; in a wheel they are real folders. Either way they are part of the hash.
    for dirpath, dirnames, files in sorted(os.walk(here, followlinks=True)):
        dirnames.sort()
        for f in sorted(f for f in files if f.endswith(".py")):
            path = os.path.join(dirpath, f)
            h.update(os.path.relpath(path, here).encode())
            with open(path, "rb") as fh:
                h.update(fh.read())
    return h.hexdigest()


def _environment() -> tuple:
    from importlib import metadata

    dev = jax.devices()[0]
    cfg = jax.config
    return (jax.__version__, metadata.version("jaxlib"), dev.platform, dev.device_kind,
            dev.client.platform_version, jax.device_count(), os.environ.get("XLA_FLAGS", ""),
            cfg.jax_enable_x64, str(cfg.jax_default_matmul_precision), str(cfg.jax_default_prng_impl))


def _path(program: Program, sig: tuple) -> str | None:
    root = directory()
    if root is None:
        return None
    devices = sorted({str(getattr(x, "sharding", None)) for x in jax.tree_util.tree_leaves(program.args)})
    key = repr((sig, devices, _environment(), _sources_hash()))
    return os.path.join(root, f"{program.name}-{hashlib.sha256(key.encode()).hexdigest()[:40]}.bin")


def _execution_devices(program: Program) -> list | None:
    """The devices to load a program onto: its arguments' one device when they all sit on one (JAX
    would otherwise load it onto all of the process's devices, and a one-device program then
    refuses its arguments); None (all of them) for a program over a mesh, which models.shard makes
    span the process's devices."""
    sets = {frozenset(s.device_set) for s in (getattr(x, "sharding", None)
                                              for x in jax.tree_util.tree_leaves(program.args)) if s is not None}
    if not sets:
        return [jax.devices()[0]]
    if len(sets) == 1 and len(next(iter(sets))) == 1:
        return list(next(iter(sets)))
    return None


def _load(program: Program, sig: tuple, path: str | None) -> bool:
    if path is None or not os.path.exists(path):
        return False
    from jax.experimental import serialize_executable

    t0 = time.perf_counter()
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
        with open(fd, "rb") as f:
            # Checked again on what is open (directory() checked the folder and its files): a file
            # someone else could have written is never unpickled, nor deleted (compiled over instead).
            if compile_cache.unsafe_file(f.fileno()) is not None:
                return False
            blob = f.read()
    except OSError:
        return False
    try:
        payload, in_tree, out_tree = pickle.loads(blob)
        loaded = serialize_executable.deserialize_and_load(payload, in_tree, out_tree,
                                                           execution_devices=_execution_devices(program))
    except Exception:  # a damaged or foreign file: drop it and compile instead
        try:
            os.remove(path)
        except OSError:
            pass
        return False
    if not _takes(loaded, program):  # its key matched, its inputs do not: a miss (compiled afresh, saved over)
        return False
    _MEMO[sig] = loaded
    jax.monitoring.record_event_duration_secs(compile_cache.LOAD, time.perf_counter() - t0, fun_name=program.name)
    return True


def _takes(loaded, program: Program) -> bool:
    """Whether a program read from disk takes `program`'s arguments: the same tree (its metadata, e.g. a
    model's static config, included: a key is a hash of its text, which need not tell two apart) and
    the same shapes and dtypes. Calling one that does not fails inside generate."""
    try:
        leaves, tree = jax.tree_util.tree_flatten((program.args, {}))
        avals = jax.tree_util.tree_leaves(loaded.in_avals)
        return loaded.in_tree == tree and len(avals) == len(leaves) and all(
            a.shape == x.shape and a.dtype == x.dtype for a, x in zip(avals, leaves))
    except Exception:  # metadata that cannot even be compared: not this program's
        return False


def _save(path: str | None, compiled: jax.stages.Compiled) -> None:
    if path is None:
        return
    from jax.experimental import serialize_executable

    try:
        blob = pickle.dumps(serialize_executable.serialize(compiled))
        os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)  # only this user writes (or enters) it
        tmp = f"{path}.{os.getpid()}.tmp"
        if os.path.lexists(tmp):  # left by a killed process: a new file, so that it gets the mode below
            os.remove(tmp)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with open(fd, "wb") as f:
            f.write(blob)
        os.replace(tmp, path)  # whole or not at all: another process may be reading
    except Exception:  # e.g. an executable this backend cannot serialize, a read-only disk
        pass
