"""JAX's on-disk compilation cache for jaxspec, and a record of what a call compiles.

A new process pays for compiling every program again (the 12B's first `generate`: about a minute
on an H200), unless JAX's persistent compilation cache holds it. jaxspec turns that cache on by
itself, in ~/.cache/jaxspec/jax, the first time it builds a program (a Generator, the exactness
probe), for the Python API as for the CLI. Opt out before that with `disable_default()` (the CLI:
`--no-compile-cache`); a directory already set in JAX's configuration (`jax_compilation_cache_dir`,
e.g. $JAX_COMPILATION_CACHE_DIR) wins and keeps its settings. generate's own programs are also kept
whole in its `jaxspec-programs` folder (`jaxspec.engine.programs`), so that a new process skips their tracing too.

What the cache holds is loaded as code (pickles, executables), so a directory someone else could have
written to is never used (`checked_dir`): the directory, jaxspec's `jaxspec-programs` folder in it
and every file either reads must be owned by this user and not writable by its group or by others
(JAX's own files may be, when nobody else can enter the directory: JAX writes them with the umask's
mode), and a directory others can enter is refused while the umask would let JAX write files they
could change; so is one in a folder others can write (not sticky, as /tmp is), where they could put
a link to their own in its place. jaxspec creates its directories 0700 and its program files 0600. An explicit directory
(`enable(path)`, the CLI's --compile-cache) that is unsafe is a ValueError; the default one is created
0700 and, if found unsafe, skipped with a warning (everything runs without the cache).

    with CompileLog() as log:
        jaxspec.generate(...)
    log.programs   # [(name, trace s, lower s, compile s, load s), ...] for each program built
"""
from __future__ import annotations

import dataclasses
import os
import stat
import warnings

from jaxspec.models.checkpoint_files import umask

DEFAULT_DIR = os.path.join("~", ".cache", "jaxspec", "jax")
_auto = {"on": True, "done": False}
_warned: set = set()  # unsafe directories already warned about (once each per process)


PROGRAMS = "jaxspec-programs"  # generate's whole programs (jaxspec.engine.programs), inside the cache directory
_JAX_SUFFIX = "-cache"  # the files JAX's persistent cache reads: <key>-cache


def checked_dir(path: str, create: bool = True) -> str:
    """`path` if it is safe to load compiled programs from: a directory owned by this user and not
    writable by its group or others, with a `jaxspec-programs` folder (if any) and files in both
    that pass the same test (JAX's `*-cache` files may be writable by others when nobody else can
    enter `path`), and not enterable by others while the umask would let JAX write files they can
    change. Missing: created 0700 (parents as the umask says), or with create=False returned as it
    is (nothing to load yet). ValueError (one line, naming the path and what is wrong) otherwise;
    OSError when it cannot be created. A directory whose path others can change is refused too: a
    folder on the way (of the path as given, or as its links resolve) that others can write and that
    is not sticky lets them put their own directory, or a link to it, in its place at any time."""
    where, why = path, _replaceable(path)
    if why is None and not os.path.exists(path):
        if create:
            os.makedirs(path, mode=0o700, exist_ok=True)
        return path
    if why is None:
        st = os.stat(path)
        where, why = path, (_unsafe(st, "a directory") if stat.S_ISDIR(st.st_mode) else "it is not a directory")
    if why is None and st.st_mode & 0o011 and umask() & 0o022 != 0o022:
        why = (f"others can enter it (mode {stat.S_IMODE(st.st_mode):04o}) and the umask ({umask():04o}) makes JAX "
               "write cache files they can change (chmod 700 it, or use umask 022)")
    if why is None:
        where, why = _unsafe_entry(path, private=not st.st_mode & 0o011)
    if why:
        what = "directory" if where == path else "entry"
        raise ValueError(f"compile cache {what} {where!r} is unsafe: {why}; what the cache holds is loaded as code, "
                         f"so use a directory only you can write (e.g. chmod go-w, or another directory)")
    return path


def _replaceable(path: str) -> str | None:
    """Why someone else could replace `path`: a folder above it (as given, or where its links lead)
    that others can write and that is not sticky; None when there is none."""
    seen = set()
    for p in (os.path.abspath(path), os.path.realpath(path)):
        folder = os.path.dirname(p)
        while folder not in seen:
            seen.add(folder)
            try:
                mode = os.stat(folder).st_mode
            except OSError:  # not there (yet): nothing to replace in it
                mode = 0
            if mode & stat.S_IWOTH and not mode & stat.S_ISVTX:
                return (f"its folder {folder!r} is writable by others (mode {stat.S_IMODE(mode):04o}, not sticky), "
                        "who could put their own directory or a link in its place")
            if os.path.dirname(folder) == folder:
                break
            folder = os.path.dirname(folder)
    return None


def _unsafe(st: os.stat_result, kind: str) -> str | None:
    """Why a file or directory (its lstat) could hold what someone else wrote; None if it cannot."""
    is_kind = stat.S_ISDIR if kind == "a directory" else stat.S_ISREG
    if not is_kind(st.st_mode):
        return "it is a symbolic link" if stat.S_ISLNK(st.st_mode) else f"it is not {kind}"
    if hasattr(os, "geteuid") and st.st_uid != os.geteuid():
        return f"it is owned by uid {st.st_uid}, not by this user (uid {os.geteuid()})"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        who = "others" if st.st_mode & stat.S_IWOTH else "its group"
        return f"it is writable by {who} (mode {stat.S_IMODE(st.st_mode):04o})"
    return None


def _unsafe_entry(path: str, private: bool) -> tuple[str, str | None]:
    """(the first entry of cache directory `path` that could hold what someone else wrote, why), or
    (path, None): the files JAX reads there, the programs folder and every file in it. `private`:
    nobody else can enter `path`, so JAX's files (written with the umask's mode) are out of reach."""
    def check(entry: os.DirEntry, kind: str, strict: bool) -> tuple[str, str | None]:
        st = entry.stat(follow_symlinks=False)
        why = _unsafe(st, kind)
        if why and not strict and why.startswith("it is writable by"):
            why = None
        return entry.path, why

    with os.scandir(path) as it:
        for entry in it:
            if entry.name == PROGRAMS:
                where, why = check(entry, "a directory", strict=True)
                if why:
                    return where, why
                with os.scandir(entry.path) as files:  # jaxspec writes only files here, 0600
                    for f in files:
                        where, why = check(f, "a regular file", strict=True)
                        if why:
                            return where, why
            elif entry.name.endswith(_JAX_SUFFIX):
                where, why = check(entry, "a regular file", strict=not private)
                if why:
                    return where, why
    return path, None


def unsafe_file(fd: int) -> str | None:
    """Why the open file `fd` (a program about to be unpickled) could hold what someone else wrote:
    not a regular file, not this user's, writable by its group or others; None when it is safe."""
    return _unsafe(os.fstat(fd), "a regular file")


def _safe_or_none(path: str) -> str | None:
    """`checked_dir(path)`, or None with a warning (once per directory) when it is unsafe or cannot
    be made: for directories the user did not name here (the default, JAX's own setting)."""
    try:
        return checked_dir(path)
    except ValueError as e:
        if path not in _warned:
            _warned.add(path)
            warnings.warn(f"jaxspec: running without the on-disk compile cache: {e}", RuntimeWarning, stacklevel=3)
    except OSError:  # e.g. a read-only home
        pass
    return None


def default_dir() -> str | None:
    """DEFAULT_DIR, created 0700 if missing; None (with a RuntimeWarning, once) when it is unsafe
    (`checked_dir`) or cannot be created."""
    return _safe_or_none(os.path.expanduser(DEFAULT_DIR))


def enable(path: str | None = None) -> str | None:
    """Keep compiled programs in JAX's persistent compilation cache in `path` (default DEFAULT_DIR).
    A directory already set in JAX's configuration wins and is left with its settings. Returns the
    directory in use, or None when the cache cannot be turned on (e.g. a read-only home, or an
    unsafe default or JAX directory, see `checked_dir`: then everything runs without it).
    ValueError for an explicit `path` that is unsafe."""
    import jax  # here, not at the top: the CLI imports this module before it needs JAX

    if jax.config.jax_compilation_cache_dir:
        return _safe_or_none(jax.config.jax_compilation_cache_dir)
    if path is None:
        path = default_dir()
        if path is None:
            return None
    else:
        try:
            path = checked_dir(os.path.expanduser(path))
        except OSError:
            return None
    try:
        jax.config.update("jax_compilation_cache_dir", path)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    except Exception:
        return None
    return path


def disable_default() -> None:
    """Do not turn the cache on by default (a cache already on stays on: JAX has no off switch
    once a directory is in use)."""
    _auto["on"] = False


def ensure_default() -> str | None:
    """`enable()` once per process, unless `disable_default()` was called first. Returns the
    directory in use, or None."""
    import jax

    if _auto["on"] and not _auto["done"]:
        _auto["done"] = True
        return enable()
    configured = jax.config.jax_compilation_cache_dir
    return _safe_or_none(configured) if configured else None  # checked each time: programs load from it


# ---- what a call compiled -----------------------------------------------------------------------
_TRACE = "/jax/core/compile/jaxpr_trace_duration"
_LOWER = "/jax/core/compile/jaxpr_to_mlir_module_duration"
_COMPILE = "/jax/core/compile/backend_compile_duration"
CACHE_HIT = "/jax/compilation_cache/cache_hits"
LOAD = "/jaxspec/programs/load_duration"  # a program loaded whole from disk (jaxspec.engine.programs)
_active: list["CompileLog"] = []
_listening = {"on": False}


@dataclasses.dataclass
class Program:
    name: str
    trace_s: float = 0.0
    lower_s: float = 0.0
    compile_s: float = 0.0  # XLA's compile, or the persistent cache's fetch when it held the program
    load_s: float = 0.0     # loaded whole from disk instead (jaxspec.engine.programs): no trace, lower or compile


class CompileLog:
    """Context manager: `programs` lists each program JAX lowered and compiled inside it, in order,
    with its trace, lowering and compile seconds (from jax.monitoring's compile events)."""

    def __init__(self):
        self.programs: list[Program] = []
        self.cache_hits = 0  # programs the persistent cache served instead of XLA's compiler
        self._open: dict[str, Program] = {}

    def __enter__(self):
        import jax

        if not _listening["on"]:
            jax.monitoring.register_event_duration_secs_listener(_on_event)
            jax.monitoring.register_event_listener(_on_count)
            _listening["on"] = True
        _active.append(self)
        return self

    def __exit__(self, *exc):
        _active.remove(self)

    def _record(self, event: str, seconds: float, name: str):
        if event == _TRACE:  # tracing has no program yet: keep it for the next lowering of that name
            self._open.setdefault(name, Program(name)).trace_s += seconds
        elif event == _LOWER:
            prog = self._open.pop(name, None) or Program(name)
            prog.lower_s += seconds
            self.programs.append(prog)
        elif event == LOAD:
            self.programs.append(Program(name, load_s=seconds))
        elif event == _COMPILE:
            prog = next((p for p in reversed(self.programs) if p.name == name and not p.compile_s), None)
            if prog is None:
                prog = Program(name)
                self.programs.append(prog)
            prog.compile_s += seconds

    def names(self) -> list[str]:
        """The compiled programs' names, in order: jaxspec's "exactness_probe", "prefill",
        "decode" / "generate", among JAX's small eager ops (e.g. "convert_element_type")."""
        return [p.name for p in self.compiled]

    @property
    def compiled(self) -> list[Program]:
        """The programs that reached XLA's compiler (or the persistent cache), not only traced."""
        return [p for p in self.programs if p.compile_s > 0]

    @property
    def loaded(self) -> list[str]:
        """The names of the programs loaded whole from disk (`jaxspec.engine.programs`)."""
        return [p.name for p in self.programs if p.load_s > 0]


def _on_event(event: str, seconds: float, **kw):
    name = str(kw.get("fun_name", "?"))
    name = name[4:-1] if name.startswith("jit(") and name.endswith(")") else name  # one name per event kind
    for log in _active:
        log._record(event, seconds, name)


def _on_count(event: str, **kw):
    if event == CACHE_HIT:
        for log in _active:
            log.cache_hits += 1
