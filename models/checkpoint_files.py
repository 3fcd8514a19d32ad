"""The files of a checkpoint directory: which ones a loader reads, opened only if they are regular
files, and `save_files`, which replaces a checkpoint's files so that a crash at any point leaves the
old or the new checkpoint. No JAX here (numpy and safetensors only): a test's child process runs
`save_files` without starting JAX.

Every file or directory that cannot be used is a `FileProblem` (a ValueError) naming the path and
what is wrong: it does not exist, permission denied, a symlink loop, or it is a FIFO / directory /
device where a regular file belongs (nothing but a regular file is ever opened, so a FIFO cannot
block a reader).

The manifest (`jaxspec_manifest.json`, written by `save_files`) lists the files a save wrote (the
weights, config.json, and any other files of the checkpoint, e.g. the tokenizer `jaxspec convert`
writes: a loader refuses the directory when one of them is missing) and the sizes of its weight
files. A save switches versions with one atomic rename of the manifest:
1. the new files are written and fsynced under `.saving-<token>/` inside the directory;
2. the manifest naming them (`staged`) and the previous save's files it makes stale (`stale`) is
   renamed in: from here on the directory holds the new checkpoint;
3. the staged files are renamed over their final names, the stale ones deleted, and the manifest
   rewritten without `staged` / `stale`.
A reader that finds `staged` in the manifest (a save killed in step 3) reads each file from
`.saving-<token>/` while it is still there, else under its final name; the next save finishes
step 3 and deletes the `.saving-*` directories of saves killed before step 2. A save deletes or
replaces only files its predecessor's manifest lists, or, in a directory without a manifest (saved
before manifests existed, or by another tool), only files with the names save writes: config.json,
the index, `model.safetensors`, `model-NNNNN-of-NNNNN.safetensors`.
"""
from __future__ import annotations

import errno
import fnmatch
import json
import os
import re
import secrets
import shutil
import stat

import numpy as np
from safetensors import SafetensorError
from safetensors import numpy as st_numpy

CONFIG = "config.json"
INDEX_FILE = "model.safetensors.index.json"
MANIFEST = "jaxspec_manifest.json"
WEIGHT_FILES = "model*.safetensors"  # the weight files of a directory without index or manifest (as mlx-lm reads)
_SAVED_NAMES = re.compile(r"model(-\d{5}-of-\d{5})?\.safetensors\Z")  # the weight file names save writes
_STAGING = re.compile(r"\.saving-[0-9a-f]{16}\Z")
_MANIFEST_FORMAT = "jaxspec checkpoint manifest"


class FileProblem(ValueError):
    """A file or directory that cannot be used; the message names the path and why."""


def _kind(mode: int) -> str:
    for test, what in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISREG, "a regular file")):
        if test(mode):
            return what
    return "not a regular file"


def why_not(e: OSError, path: str) -> str:
    """An OSError of opening or stat-ing `path`, as one line naming the path."""
    if e.errno in (errno.EACCES, errno.EPERM):
        return f"permission denied: cannot read {path!r}"
    if e.errno == errno.ELOOP:
        return f"{path!r} is a symlink loop"
    if e.errno == errno.ENOENT:
        return f"{path!r} is a dangling symlink" if os.path.islink(path) else f"{path!r} does not exist"
    if e.errno == errno.ENOTDIR:
        return f"{path!r} does not exist (a component of the path is not a directory)"
    return f"cannot read {path!r}: {e.strerror or e}"


def _stat(path: str) -> os.stat_result:
    try:
        return os.stat(path)
    except OSError as e:
        raise FileProblem(why_not(e, path)) from None


def stat_regular(path: str) -> os.stat_result:
    """os.stat of `path` (symlinks followed), which must be a regular file; FileProblem otherwise."""
    st = _stat(path)
    if not stat.S_ISREG(st.st_mode):
        raise FileProblem(f"{path!r} is {_kind(st.st_mode)}, not a regular file")
    return st


def _open_regular(path: str) -> int:
    """A read-only descriptor of regular file `path`: checked by stat first, then opened
    non-blocking and checked again on the descriptor (a FIFO swapped in between cannot block)."""
    stat_regular(path)
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise FileProblem(why_not(e, path)) from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise FileProblem(f"{path!r} is {_kind(mode)}, not a regular file")
    return fd


def read_regular(path: str) -> bytes:
    """The bytes of regular file `path` (opened only if it is one: `_open_regular`)."""
    with open(_open_regular(path), "rb") as f:
        try:
            return f.read()
        except OSError as e:
            raise FileProblem(why_not(e, path)) from None


def list_dir(path: str) -> list[str]:
    """The sorted entries of directory `path`; FileProblem if it is not a readable directory."""
    st = _stat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise FileProblem(f"{path!r} is {_kind(st.st_mode)}, not a directory")
    try:
        return sorted(os.listdir(path))
    except OSError as e:
        raise FileProblem(why_not(e, path)) from None


def probe_regular(path: str) -> os.stat_result:
    """`stat_regular`, then an open (non-blocking) and close: a file that cannot be read is named
    here, not by the reader that opens it later (safetensors reports EACCES as "No such file")."""
    fd = _open_regular(path)
    try:
        return os.fstat(fd)
    finally:
        os.close(fd)


def _json(data: bytes, fn: str):
    try:
        return json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise FileProblem(f"{fn} is not readable JSON ({' '.join(str(e).split())[:200]})") from None


# ---- reading -------------------------------------------------------------------------------------
def read_manifest(path: str) -> dict | None:
    """The manifest of checkpoint directory `path`, or None when it has none."""
    mpath = os.path.join(path, MANIFEST)
    if not os.path.lexists(mpath):
        return None
    m = _json(read_regular(mpath), MANIFEST)
    names = m.get("files") if isinstance(m, dict) else None
    ok = (isinstance(m, dict) and m.get("format") == _MANIFEST_FORMAT and m.get("version") == 1
          and isinstance(names, list) and CONFIG in names and all(_plain_name(n) for n in names)
          and isinstance(m.get("weights"), dict) and m["weights"] and set(m["weights"]) <= set(names)
          and all(isinstance(v, int) and not isinstance(v, bool) for v in m["weights"].values())
          and isinstance(m.get("staged", ""), str) and _STAGING.match(m.get("staged", ".saving-" + "0" * 16))
          and isinstance(m.get("stale", []), list) and all(_plain_name(n) for n in m.get("stale", [])))
    if not ok:
        raise FileProblem(f"{MANIFEST} is not a manifest models.save wrote (remove it to load the directory by "
                          "the usual rules)")
    return m


def _plain_name(n) -> bool:
    return isinstance(n, str) and n not in ("", ".", "..") and os.path.basename(n) == n


def _located(path: str, m: dict, name: str) -> str:
    """Where file `name` of manifest `m` is now: in the staging directory of a save that was cut
    short after switching (while it is still there), else under its own name."""
    staging = _staging_dir(path, m)
    if staging is not None:
        staged = os.path.join(staging, name)
        if _is_regular(staged):
            return staged
    return os.path.join(path, name)


def located(path: str, name: str) -> str:
    """Where file `name` of directory `path` is read from: for a checkpoint whose save was cut short
    after its switch (its manifest still names a staging directory), the staged copy while it is
    there; else `path/name`. A reader of a checkpoint's other files (its tokenizer) goes through
    this, as the loaders do, so that it reads the same version as the weights."""
    try:
        m = read_manifest(path)
    except (FileProblem, OSError):
        m = None
    return os.path.join(path, name) if m is None or name not in m["files"] else _located(path, m, name)


def _is_regular(path: str) -> bool:
    """Whether `path` itself (not a symlink's target) is a regular file."""
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


def _staging_dir(path: str, m: dict) -> str | None:
    """The staging directory manifest `m` names, if it is a real subdirectory of `path`: a symlink
    (e.g. to another directory) or a non-directory there is ignored, so that neither a reader nor the
    next save reads, moves or deletes anything outside the checkpoint through it."""
    if "staged" not in m:
        return None
    staging = os.path.join(path, m["staged"])  # read_manifest checked the name: .saving-<16 hex digits>
    try:
        return staging if stat.S_ISDIR(os.lstat(staging).st_mode) else None
    except OSError:
        return None


def checkpoint_files(path: str, complete: bool = True) -> tuple[str, list[str]]:
    """(config.json, [weight files]) of checkpoint directory `path`, every one checked to be a
    readable regular file (`probe_regular`; nothing is read here but the manifest and the index).
    The weight files are those the manifest lists (at the sizes it records), else those
    `model.safetensors.index.json` names, else every `model*.safetensors`. FileProblem for what
    cannot be read, ValueError when there are no weight files. With `complete=False` (the CLI's
    check before the loader runs) only the files present are checked: missing files, sizes and the
    absence of weights are left to the loader."""
    names = list_dir(path)
    m = read_manifest(path)
    if m is not None:
        found = {fn: _located(path, m, fn) for fn in sorted(m["weights"])}
        found = {fn: where for fn, where in found.items() if complete or os.path.lexists(where)}
        if complete and not any(os.path.lexists(where) for where in found.values()):
            raise ValueError(f"no *.safetensors files in {path!r}")  # as without a manifest
        weights = []
        for fn, where in found.items():
            got = probe_regular(where).st_size
            if complete and got != m["weights"][fn]:
                raise FileProblem(f"{os.path.relpath(where, path)!r} has {got} bytes where {MANIFEST} records "
                                  f"{m['weights'][fn]}: it changed after models.save wrote it (remove {MANIFEST} "
                                  "to load the directory by the usual rules)")
            weights.append(where)
        config = _located(path, m, CONFIG)
        probe_regular(config)
        if complete:  # the save's other files (a converted model's tokenizer): part of the checkpoint
            for fn in m["files"]:
                where = _located(path, m, fn)
                if fn in m["weights"] or fn in (CONFIG, INDEX_FILE):
                    continue
                if not os.path.lexists(where):
                    raise FileProblem(f"{fn!r} is missing from {path!r}: it is part of the checkpoint models.save "
                                      f"wrote there ({MANIFEST} lists it); write the directory again (e.g. jaxspec "
                                      "convert --force)")
                probe_regular(where)
        return config, weights
    config = os.path.join(path, CONFIG)
    if CONFIG not in names:
        raise FileProblem(f"no config.json in {path!r}")
    probe_regular(config)
    if INDEX_FILE in names:
        index = os.path.join(path, INDEX_FILE)
        try:
            wmap = _json(read_regular(index), INDEX_FILE)["weight_map"]
        except (KeyError, TypeError):
            raise FileProblem(f"{INDEX_FILE} has no 'weight_map'") from None
        if not isinstance(wmap, dict) or not wmap or not all(_plain_name(v) for v in wmap.values()):
            raise FileProblem(f"{INDEX_FILE}'s weight_map must map tensor names to file names in the directory")
        files = sorted(set(wmap.values()))
        missing = [fn for fn in files if not os.path.lexists(os.path.join(path, fn))]
        files = [fn for fn in files if complete or fn not in missing]
        if missing and complete:
            raise FileProblem(f"{INDEX_FILE} names weight file(s) {missing} that do not exist")
    else:
        files = [fn for fn in names if fnmatch.fnmatchcase(fn, WEIGHT_FILES)]
        if not files and complete:
            others = [fn for fn in names if fn.endswith(".safetensors")]
            if others:
                raise ValueError(f"no {WEIGHT_FILES} files in {path!r} (the weights are model.safetensors or the "
                                 f"shards {INDEX_FILE} names; {others} are not read)")
            raise ValueError(f"no *.safetensors files in {path!r}")
    weights = [os.path.join(path, fn) for fn in files]
    for fn in weights:
        probe_regular(fn)
    return config, weights


def read_config(path: str, complete: bool = True) -> tuple[dict, list[str]]:
    """(config.json as a dict, [weight files]) of checkpoint directory `path`, after
    `checkpoint_files(path, complete)` checked the files."""
    config, weights = checkpoint_files(path, complete)
    d = _json(read_regular(config), CONFIG)
    if not isinstance(d, dict):
        raise FileProblem(f"{CONFIG} is not a JSON object")
    return d, weights


# ---- writing -------------------------------------------------------------------------------------
def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: str) -> None:
    if os.name == "posix":  # directories cannot be opened for fsync elsewhere
        _fsync(path)


def _write_json(fn: str, doc) -> None:
    """A file created with the umask's mode (as open() creates files), written and fsynced."""
    fd = os.open(fn, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0), 0o666)
    with open(fd, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def umask() -> int:
    """This process's umask."""
    try:  # Linux reports it without changing it
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)  # elsewhere: set and restore (a brief window for other threads)
    os.umask(mask)
    return mask


def _write_shard(fn: str, tensors: dict, metadata: dict, shown: str) -> None:
    """safetensors' save_file, then the umask's mode (it creates files 0600) and an fsync. Its
    errors become the OSError they report (a full disk is ENOSPC), naming the file as `shown`."""
    try:
        st_numpy.save_file(tensors, fn, metadata=metadata)
    except SafetensorError as e:
        code = re.search(r"\(os error (\d+)\)", str(e))
        if code is None:
            raise
        raise OSError(int(code.group(1)), os.strerror(int(code.group(1))), shown) from None
    fd = os.open(fn, os.O_RDONLY)
    try:
        os.fchmod(fd, 0o666 & ~umask())
        os.fsync(fd)
    finally:
        os.close(fd)


def _finish(path: str, m: dict) -> None:
    """Step 3 of a save whose manifest `m` is in place (see the module docstring); idempotent, so a
    save cut short anywhere in it is finished by the next one."""
    staging = _staging_dir(path, m)
    if staging is None:  # gone, or not the save's own directory (a symlink, a file): left as it is
        staging = os.path.join(path, ".saving-" + secrets.token_hex(8))
        os.mkdir(staging)  # for the manifest's temporary file below
    for fn in m["files"]:  # only the save's regular files, from its own directory inside `path`
        if _is_regular(os.path.join(staging, fn)):
            os.replace(os.path.join(staging, fn), os.path.join(path, fn))
    for fn in m.get("stale", []):
        try:
            if not stat.S_ISDIR(os.lstat(os.path.join(path, fn)).st_mode):  # a file or a link, never its target
                os.remove(os.path.join(path, fn))
        except FileNotFoundError:
            pass
    _fsync_dir(path)
    done = {k: v for k, v in m.items() if k not in ("staged", "stale")}
    _write_json(os.path.join(staging, MANIFEST), done)
    os.replace(os.path.join(staging, MANIFEST), os.path.join(path, MANIFEST))
    _fsync_dir(path)
    shutil.rmtree(staging, ignore_errors=True)


def _recover(path: str) -> dict | None:
    """Finish a save cut short after it switched, delete what saves cut short before left; returns
    the manifest (None for a directory without one)."""
    m = read_manifest(path)
    if m is not None and "staged" in m:
        _finish(path, m)
        m = read_manifest(path)
    for fn in os.listdir(path):
        if _STAGING.match(fn) and os.path.isdir(os.path.join(path, fn)) and not os.path.islink(os.path.join(path, fn)):
            shutil.rmtree(os.path.join(path, fn))
    return m


def _owned(path: str, m: dict | None) -> set[str]:
    """The files of directory `path` that the previous save wrote: those its manifest lists, else
    (no manifest) config.json, the index and the weight files with the names save writes."""
    names = set(m["files"]) if m is not None else {fn for fn in os.listdir(path)
                                                   if fn in (CONFIG, INDEX_FILE) or _SAVED_NAMES.match(fn)}
    owned = set()
    for fn in names:  # files and symlinks only: a directory of that name is not the save's
        try:
            mode = os.lstat(os.path.join(path, fn)).st_mode
        except FileNotFoundError:
            continue
        if stat.S_ISREG(mode) or stat.S_ISLNK(mode):
            owned.add(fn)
    return owned


def _check_targets(path: str, names) -> None:
    """ValueError when a directory or other non-file holds a name the save writes in `path`."""
    for fn in names:
        try:
            mode = os.lstat(os.path.join(path, fn)).st_mode
        except FileNotFoundError:
            continue
        if not (stat.S_ISREG(mode) or stat.S_ISLNK(mode)):
            raise ValueError(f"cannot save to {path!r}: {os.path.join(path, fn)!r} is {_kind(mode)}, where the "
                             "checkpoint's file goes (move it away)")


def save_files(path: str, shards: list[list[tuple[str, object]]], config: dict, extra_files=None) -> None:
    """Write checkpoint directory `path`: `shards` (lists of (tensor name, array)) as
    `model.safetensors` or `model-0000i-of-0000n.safetensors` + index, `config` as config.json,
    and the manifest, switching from the previous checkpoint atomically (module docstring). Arrays
    are converted with np.asarray one shard at a time. `extra_files(directory)`: writes the checkpoint's
    other files (e.g. its tokenizer) into `directory` (plain files, not the names above); they are
    part of the checkpoint: switched in with the weights and config, listed in the manifest (a
    loader then requires them). ValueError (before the switch) for a `path` that is not a
    directory, a name the save must write held by a directory or other non-file, or an
    `extra_files` that writes anything but files; OSError for a failed write (ENOSPC for a full
    disk), and whatever `extra_files` raises: the previous checkpoint intact."""
    path = os.fspath(path)
    try:
        st = os.stat(path)
        if not stat.S_ISDIR(st.st_mode):
            raise ValueError(f"cannot save a checkpoint to {path!r}: it exists and is {_kind(st.st_mode)}, not a "
                             "directory")
    except FileNotFoundError:
        if os.path.islink(path):
            raise ValueError(f"cannot save a checkpoint to {path!r}: it is a dangling symlink") from None
        os.makedirs(path)
    except OSError as e:
        if e.errno != errno.ELOOP:
            raise
        raise ValueError(f"cannot save a checkpoint to {path!r}: it is a symlink loop") from None
    n = len(shards)
    weights = ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    names = weights + ([INDEX_FILE] if n > 1 else []) + [CONFIG]
    _check_targets(path, names)
    m_old = _recover(path)
    token = ".saving-" + secrets.token_hex(8)
    staging = os.path.join(path, token)
    os.mkdir(staging)
    try:
        if extra_files is not None:  # first: the checkpoint's other files (quick), then the weights
            extra_files(staging)
            added = sorted(os.listdir(staging))
            for fn in added:
                where = os.path.join(staging, fn)
                if fn in names or fn == MANIFEST or not _is_regular(where):
                    raise ValueError(f"cannot save to {path!r}: its extra files must be plain files other than the "
                                     f"checkpoint's own, not {fn!r}")
                _fsync(where)
            _check_targets(path, added)
            names = names + added
        stale = sorted(_owned(path, m_old) - set(names))
        sizes, weight_map = {}, {}
        for fn, shard in zip(weights, shards):
            _write_shard(os.path.join(staging, fn), {k: np.asarray(a) for k, a in shard}, {"format": "mlx"},
                         os.path.join(path, fn))
            sizes[fn] = os.stat(os.path.join(staging, fn)).st_size
            weight_map.update({k: fn for k, _ in shard})
        if n > 1:
            _write_json(os.path.join(staging, INDEX_FILE), {"metadata": {}, "weight_map": weight_map})
        _write_json(os.path.join(staging, CONFIG), config)
        m = {"format": _MANIFEST_FORMAT, "version": 1, "files": names, "weights": sizes, "staged": token,
             "stale": stale}
        _write_json(os.path.join(staging, ".pending"), m)
        _fsync_dir(staging)
        os.replace(os.path.join(staging, ".pending"), os.path.join(path, MANIFEST))  # the switch
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    _fsync_dir(path)
    _finish(path, m)
