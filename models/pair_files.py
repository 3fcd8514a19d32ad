"""A target + assistant pair written as one: `jaxspec tiny-pair DIR` switches both at once, so a
crash at any point leaves the old pair or the new one, never a new target beside an old assistant
or a half-written tokenizer. No JAX here (a test's child process runs `save_pair` without it).

Layout: `DIR/target`, `DIR/assistant` and `DIR/tokenizer.json` (the pair's shared tokenizer, read by
`--pair DIR`) are symbolic links to the same names under `.pair`, and `DIR/.pair` links to the folder `.pair-<token>` holding the current pair. A save writes
everything into a new `.pair-<token>` (invisible until the switch), fsyncs it, and switches with one
atomic rename of a new `.pair` link; then deletes the pair folders it made before (each marked with
MARK; a folder without it is never deleted). A DIR whose `target` / `assistant` are real
directories (written before this layout, or by hand) has them moved into an unmarked pair folder
once, which `.pair` points at until the switch: a crash during that move leaves one of them missing
(refused by the loader), never a mismatched pair.
"""
from __future__ import annotations

import os
import re
import secrets
import shutil
import stat
from typing import Callable

LINKED = ("target", "assistant", "tokenizer.json")  # the pair's entries, each a link through LINK
LINK = ".pair"
MARK = ".jaxspec-pair"  # in each pair folder save_pair made: only those are deleted later
_FOLDER = re.compile(r"\.pair-[0-9a-f]{16}\Z")


def save_pair(path: str, write: Callable[[str], None]) -> None:
    """Write a pair into directory `path` (created if missing) by `write(folder)`, which must fill
    `folder/target`, `folder/assistant` and `folder/tokenizer.json`; switch to it atomically (module docstring). Anything
    `write` raises leaves `path` as it was (its folder removed)."""
    os.makedirs(path, exist_ok=True)
    new = _folder(path, marked=True)
    try:
        write(new)
        _fsync_tree(new)
    except BaseException:
        shutil.rmtree(new, ignore_errors=True)
        raise
    _adopt(path)  # real target/assistant directories: into a pair folder, behind the links
    _switch(path, os.path.basename(new))
    _tidy(path, keep=os.path.basename(new))


def _folder(path: str, marked: bool) -> str:
    folder = os.path.join(path, ".pair-" + secrets.token_hex(8))
    os.mkdir(folder)
    if marked:
        open(os.path.join(folder, MARK), "w").close()
    return folder


def _switch(path: str, target: str) -> None:
    """Point `path/name` at `target` with one rename of a new symbolic link over it."""
    tmp = os.path.join(path, f"{LINK}.{secrets.token_hex(8)}.tmp")
    os.symlink(target, tmp)
    os.replace(tmp, os.path.join(path, LINK))  # the switch
    _fsync(path)


def _adopt(path: str) -> None:
    """Make `path/target`, `path/assistant` and `path/tokenizer.json` the links through `.pair`. Real
    entries under those names move into one new unmarked pair folder (kept: they may hold more than a pair), which
    `.pair` then names; links to anywhere else are replaced (their targets untouched)."""
    found = {}
    for name in LINKED:
        try:
            found[name] = os.lstat(os.path.join(path, name)).st_mode
        except FileNotFoundError:
            pass
    real = [n for n, mode in found.items() if not stat.S_ISLNK(mode)]
    if real:
        old = _folder(path, marked=False)
        for name in ("tokenizer.json", "assistant", "target"):  # a crash between leaves one missing, not a mismatch
            if name in real:
                os.rename(os.path.join(path, name), os.path.join(old, name))
        _switch(path, os.path.basename(old))
    for name in LINKED:
        want = os.path.join(LINK, name)
        p = os.path.join(path, name)
        if os.path.islink(p) and os.readlink(p) == want:
            continue
        tmp = os.path.join(path, f".{name}.{secrets.token_hex(8)}.tmp")
        os.symlink(want, tmp)
        os.replace(tmp, p)
    _fsync(path)


def _tidy(path: str, keep: str) -> None:
    """Delete the pair folders save_pair made other than `keep` (real directories with MARK) and
    temporary links a crash left."""
    for fn in os.listdir(path):
        p = os.path.join(path, fn)
        if _FOLDER.match(fn) and fn != keep:
            st = os.lstat(p)
            if stat.S_ISDIR(st.st_mode) and os.path.lexists(os.path.join(p, MARK)):
                shutil.rmtree(p, ignore_errors=True)
        elif fn.endswith(".tmp") and fn.startswith(".") and os.path.islink(p):
            os.remove(p)


def _fsync(path: str) -> None:
    if os.name != "posix":  # directories cannot be opened for fsync elsewhere
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(path: str) -> None:
    """fsync every regular file and directory under `path` (what the switch will make visible)."""
    for dirpath, _, files in os.walk(path):
        for f in files:
            if stat.S_ISREG(os.lstat(os.path.join(dirpath, f)).st_mode):
                _fsync(os.path.join(dirpath, f))
        _fsync(dirpath)
