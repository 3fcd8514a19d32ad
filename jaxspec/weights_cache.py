"""A GGUF's weights converted once, kept in a cache folder, and loaded from there by later runs.

Reading a GGUF decodes every tensor (the real Gemma 3 270M: 6-14 s on a 2-core CPU); the checkpoint
directory `jaxspec convert` writes from it loads in a few seconds, exactly as the GGUF does (float32
scales kept; tests/models/test_gguf.py). `jaxspec generate` and `jaxspec serve` keep that directory
here, so only a GGUF's first run pays for its decoding:

    entry = weights_cache.lookup(src)          # the converted directory, or None (a miss)
    entry = weights_cache.build(src)           # convert now (what a miss does), then lookup's answer

Where: $JAXSPEC_WEIGHTS_CACHE, else ~/.cache/jaxspec/weights; inside it `v<FORMAT>/`, FORMAT being
bumped whenever the conversion's result changes (the GGUF decoding, the saved layout), so an older
jaxspec's entries are never read. An entry is named by the GGUF's content: its sha256, computed once
per file and remembered by the file's identity (real path, device, inode, size, modification and
change times: a file replaced, rewritten or touched is hashed again) in `v<FORMAT>/ids/`. The content,
not the path or the package: the same file anywhere (a copy, the package's cache path, a download)
finds the same entry, and any GGUF can have one (a known package's recorded sha256 would only cover
that package's file, which models.gguf_package already checks against it on every run).

An entry is a checkpoint directory (`models.save`: config.json, safetensors, the tokenizer) plus
ENTRY_FILE: the format, the GGUF's sha256 and size, and every file's size and CRC-32. `lookup`
checks all of it, so a truncated, damaged, foreign or half-deleted entry is a miss, never a crash
(CRC-32 finds damage, as sha256 would, at 2.5x its speed: the 270M's 354 MB entry in ~0.3 s on an
idle core; whoever can write the cache can rewrite its checksums too, so a cryptographic hash would
guard nothing more); `build` writes a new entry under a temporary
name in the same folder and renames it into place (a reader sees the whole entry or none; a killed
build leaves only its temporary folder, removed by a later build once it is an hour old). Folders are
created 0700. Deleting the cache folder at any time costs only the next run's conversion.
"""
from __future__ import annotations

import hashlib
import json
import os
import secrets
import shutil
import stat
import time
import zlib

from jaxspec.models.checkpoint_files import _fsync  # the checkpoints' own: a file's bytes to disk

ENV = "JAXSPEC_WEIGHTS_CACHE"
DEFAULT_DIR = os.path.join("~", ".cache", "jaxspec", "weights")
FORMAT = 1  # bump when the conversion's result changes: entries of another format are never read
ENTRY_FILE = "jaxspec_weights_cache.json"
_KIND = "jaxspec weights cache entry"
_TMP = ".building-"
STALE_S = 3600  # a temporary folder untouched this long belongs to no running build


def root() -> str:
    """The cache folder: $JAXSPEC_WEIGHTS_CACHE, else ~/.cache/jaxspec/weights."""
    return os.path.expanduser(os.environ.get(ENV) or DEFAULT_DIR)


def _home(where: str | None) -> str:
    return os.path.join(root() if where is None else where, f"v{FORMAT}")


def _made(path: str) -> str:
    """`path` and the cache folders above it up to the root, created 0700 where missing."""
    if not os.path.isdir(path):
        _made(os.path.dirname(path))
        os.makedirs(path, mode=0o700, exist_ok=True)
    return path


def sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def crc32_file(path: str) -> int:
    crc = 0
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            crc = zlib.crc32(block, crc)
    return crc


def _identity(path: str) -> list:
    st = os.stat(path)
    return [os.path.realpath(path), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def gguf_digest(src: str, where: str | None = None) -> str:
    """The sha256 of GGUF file `src`, hashed once per file identity (remembered in `ids/`; a
    file changed while it was hashed is not remembered). OSError when `src` cannot be read."""
    ident = _identity(src)
    memo = os.path.join(_home(where), "ids", hashlib.sha256(ident[0].encode()).hexdigest()[:32] + ".json")
    try:
        with open(memo, encoding="utf-8") as f:
            known = json.load(f)
        if known["identity"] == ident and _is_sha256(known["sha256"]):
            return known["sha256"]
    except (OSError, ValueError, KeyError, TypeError):
        pass
    digest = sha256_file(src)
    if _identity(src) == ident:
        try:
            _write_json(memo, {"identity": ident, "sha256": digest})
        except OSError:  # a read-only cache: hashed again next time
            pass
    return digest


def _is_sha256(s) -> bool:
    return isinstance(s, str) and len(s) == 64 and all(c in "0123456789abcdef" for c in s)


def entry_path(digest: str, where: str | None = None) -> str:
    return os.path.join(_home(where), digest[:32])


def lookup(src: str, where: str | None = None) -> str | None:
    """The converted directory of GGUF `src` when the cache holds a sound one (`check`), else None."""
    try:
        digest = gguf_digest(src, where)
    except OSError:
        return None
    path = entry_path(digest, where)
    return path if check(path, digest) is None else None


def check(path: str, digest: str) -> str | None:
    """Why entry `path` is not the converted GGUF of sha256 `digest` (None: it is): ENTRY_FILE
    missing or not this format's, another GGUF's, a file missing, of another size or checksum."""
    try:
        if not stat.S_ISDIR(os.lstat(path).st_mode):
            return "it is not a directory"
        if not stat.S_ISREG(os.lstat(os.path.join(path, ENTRY_FILE)).st_mode):  # never opened: a FIFO would block
            return f"its {ENTRY_FILE} is not a regular file"
        with open(os.path.join(path, ENTRY_FILE), encoding="utf-8") as f:
            doc = json.load(f)
    except FileNotFoundError:
        return "no entry there"
    except (OSError, ValueError) as e:
        return f"its {ENTRY_FILE} cannot be read ({e})"
    files = doc.get("files") if isinstance(doc, dict) else None
    if not (isinstance(files, dict) and files and doc.get("kind") == _KIND and doc.get("format") == FORMAT):
        return f"its {ENTRY_FILE} is not a format-{FORMAT} entry"
    if doc.get("gguf_sha256") != digest:
        return "it was converted from another file"
    for name, sums in files.items():
        if os.path.basename(name) != name or name in ("", ".", ".."):
            return f"it names a file outside it ({name!r})"
        if not (isinstance(sums, list) and len(sums) == 2 and all(type(v) is int for v in sums)):
            return f"its {ENTRY_FILE} is not a format-{FORMAT} entry"
        (size, crc), fn = sums, os.path.join(path, name)
        try:
            st = os.lstat(fn)
        except OSError:
            return f"{name} is missing"
        if not stat.S_ISREG(st.st_mode) or st.st_size != size:
            return f"{name} has {st.st_size} bytes, not {size}"
        try:
            if crc32_file(fn) != crc:
                return f"{name} fails its checksum"
        except OSError as e:
            return f"{name} cannot be read ({e})"
    return None


def build(src: str, where: str | None = None, *, tokenizer=None, progress=None, replace: bool = False) -> str:
    """Convert GGUF `src` into its entry (as `jaxspec convert` does: float32 scales, the tokenizer
    from its metadata, or `tokenizer` when the caller has built it already) and return the entry's
    path: written under a temporary name, checksummed, renamed into place. A sound entry already
    there (another process's) is kept and returned (`replace`: replaced too, e.g. one that passed its
    checks and did not load); an unsound one is replaced. ValueError for a
    GGUF that cannot be converted, OSError for a cache that cannot be written (the previous entry,
    if any, untouched). `progress(done, total)`: the tensors' decoding (`models.gguf.read_gguf`)."""
    import jax.numpy as jnp

    from jaxspec import models
    from jaxspec.kernels import DispatchConfig
    from jaxspec.models import gguf
    from jaxspec.models.checkpoint import load_gguf_target
    from jaxspec.text.gguf import tokenizer_from_gguf

    digest, size = gguf_digest(src, where), os.path.getsize(src)
    path = entry_path(digest, where)
    home = _made(os.path.dirname(path))
    _remove_stale(home)
    tmp = os.path.join(home, f"{_TMP}{secrets.token_hex(8)}")
    os.mkdir(tmp, 0o700)
    try:
        tok = tokenizer
        if tok is None:
            tok = tokenizer_from_gguf(src, reader=gguf.MetadataReader(gguf.plan(src)[1]))
        target = load_gguf_target(src, dtype=jnp.float32, matmul=DispatchConfig(backend="xla", dense=False),
                                  progress=progress)
        models.save(target, tmp, extra_files=tok.save)
        files = {n: [os.path.getsize(os.path.join(tmp, n)), crc32_file(os.path.join(tmp, n))]
                 for n in sorted(os.listdir(tmp)) if os.path.isfile(os.path.join(tmp, n))}
        _write_json(os.path.join(tmp, ENTRY_FILE), {"kind": _KIND, "format": FORMAT, "gguf_sha256": digest,
                                                    "gguf_size": size, "source": os.path.realpath(src),
                                                    "files": files})
        _fsync(tmp)
        if os.path.lexists(path) and (replace or check(path, digest) is not None):  # set aside, then gone
            aside = os.path.join(home, f"{_TMP}{secrets.token_hex(8)}")
            os.rename(path, aside)
            shutil.rmtree(aside, ignore_errors=True)
        try:
            os.rename(tmp, path)
        except OSError:
            if check(path, digest) is not None:  # not another build's sound entry: a real failure
                raise
        _fsync(home)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def _remove_stale(home: str) -> None:
    """Delete the temporary folders of builds killed at least STALE_S ago."""
    now = time.time()
    for n in os.listdir(home):
        p = os.path.join(home, n)
        try:
            if n.startswith(_TMP) and stat.S_ISDIR(os.lstat(p).st_mode) and now - os.lstat(p).st_mtime > STALE_S:
                shutil.rmtree(p, ignore_errors=True)
        except OSError:
            pass


def _write_json(fn: str, doc) -> None:
    """`fn` replaced whole (a temporary file renamed over it)."""
    _made(os.path.dirname(fn))
    tmp = f"{fn}.{secrets.token_hex(8)}.tmp"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(doc, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, fn)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
