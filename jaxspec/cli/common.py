"""Shared by the subcommands: exit codes, one-line errors and notes on stderr, the flag-range checks, config and size helpers."""
from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
from jaxspec.engine import sampling
from jaxspec.engine.generate import BLOCK_SIZE_WHY, MAX_BLOCK_SIZE, MAX_ROUNDS_PER_CHUNK


EXIT_OK, EXIT_ERROR, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130


MAX_MESSAGE = 400  # characters of one error / warning line; longer ones are cut with a marker


class UsageError(Exception):
    """Bad input: reported as one line, exit status 2."""


# What a user can fix (their input, their files, their environment): one line, exit status 2.
# Everything else is a bug: exit status 1 ("internal error"). The library raises ValueError (and
# its subclasses, e.g. TokenizerError) or NotImplementedError for what it refuses; the CLI turns
# what it finds itself (closed stdout, an unusable JAX_PLATFORMS, ...) into UsageError at the source.
USER_ERRORS = (UsageError, ValueError, NotImplementedError)


def _err(msg: str) -> None:
    _note(_one_line(f"jaxspec: {msg}"))


def _note(msg: str, end: str = "\n") -> None:
    """Progress and notes go to stderr only: with stderr closed (`2>&-`, sys.stderr is None)
    print(file=None) would write them into stdout, among the generated text; they are dropped."""
    if sys.stderr is None:
        return
    try:
        print(msg, file=sys.stderr, end=end, flush=True)
    except (OSError, ValueError):  # stderr gone (a closed pipe): nobody reads the notes
        pass


class _NoteHandler(logging.Handler):
    """The library's log records as notes on stderr ("jaxspec: compiling 3 programs ...")."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            _note(_one_line(f"jaxspec: {record.getMessage()}"))
        except Exception:  # a malformed record: never the reason a command fails
            self.handleError(record)


@contextlib.contextmanager
def _library_notes():
    """While a command runs, show the library's INFO lines (`logging`, logger "jaxspec": when
    compiling starts and how long it took, the batch engine's warm-up) on stderr; the library
    itself stays silent unless its user configures logging."""
    logger = logging.getLogger("jaxspec")
    handler, level = _NoteHandler(logging.INFO), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def _one_line(e: BaseException | str, limit: int = MAX_MESSAGE) -> str:
    """The message as one line of at most `limit` characters (whitespace runs collapsed, a longer
    one cut with a marker saying how much was left out)."""
    s = " ".join(str(e).split()) or type(e).__name__
    if len(s) > limit:
        keep = limit - 40  # room for the marker (at most 38 characters)
        s = f"{s[:keep]} ... [{len(s) - keep} more characters]"
    return s


# Integer flags' ranges, checked up front by _check_ranges (argparse only checks they are integers:
# its own range errors print the whole usage). (flag, attribute, lowest, highest or None, why)
_GENERATE_RANGES = (("--max-tokens", "max_tokens", 1, None, ""),
                    ("--top-k", "top_k", sampling.RANGES["top_k"].lo, sampling.RANGES["top_k"].hi, ""),
                    ("--block-size", "block_size", 1, MAX_BLOCK_SIZE, BLOCK_SIZE_WHY),
                    ("--stream-rounds", "stream_rounds", 1, MAX_ROUNDS_PER_CHUNK, ""),
                    ("--devices", "devices", 1, None, ""),
                    ("--n", "n", sampling.RANGES["n"].lo, sampling.RANGES["n"].hi, ""))


# serve's own flags; its batching and queue flags (--max-batch, --max-queue, ...) are ServeConfig's
# fields, checked by _check_knobs against serve.config.RANGES, the table the server checks them by.
_SERVE_RANGES = (("--port", "port", 1, 65535, ""), ("--max-body-bytes", "max_body_bytes", 1024, 1 << 30, ""),
                 ("--max-connections", "max_connections", 1, 1 << 20, ""))


def _check_ranges(args, ranges) -> None:
    for flag, attr, lo, hi, why in ranges:
        v = getattr(args, attr)
        if v is not None and (v < lo or (hi is not None and v > hi)):
            rng = f">= {lo}" if hi is None else f"in {lo}..{hi}"
            raise UsageError(f"{flag} {v}: expected an integer {rng}{why}")


def _check_knobs(args, knobs) -> None:
    """UsageError naming the flag (`--max-queue` for max_queue) of the first knob of a range table
    (name -> a serve.config.Knob) whose value is out of its range; None is left to the default."""
    for attr, knob in knobs.items():
        v = getattr(args, attr)
        if v is not None and not knob.holds(v):
            raise UsageError(f"--{attr.replace('_', '-')} {v}: expected {knob.describe()}")


def _read_config(path: str, role: str) -> dict:
    """config.json of a model directory, read up front (before the tokenizer, the context check
    and loading), and every file the loader will open checked to be a readable regular file (a
    FIFO, a symlink loop, no permission: named here); their contents are the loader's to check."""
    from jaxspec.models import gguf
    from jaxspec.models.checkpoint_files import read_config

    try:
        src = gguf.source(path)
        if src is not None:  # a GGUF: its config from the header (no tensor is read)
            return gguf.plan(src)[3]
    except ValueError as e:
        raise UsageError(f"{path!r} is not a usable {role}: {_one_line(e)}") from None
    if not os.path.lexists(path):
        raise UsageError(f"{role} directory {path!r} does not exist")
    try:
        return read_config(path, complete=False)[0]
    except ValueError as e:
        raise UsageError(f"{path!r} is not a usable {role} directory: {_one_line(e)}") from None


def _dir_bytes(path: str) -> int:
    """Bytes of the weight files the loader reads (the manifest's, the index's or model*.safetensors:
    models.checkpoint_files.checkpoint_files; other files in the directory are not counted)."""
    from jaxspec.models import gguf
    from jaxspec.models.checkpoint_files import checkpoint_files

    src = gguf.source(path)
    if src is not None:
        return os.path.getsize(src)
    return sum(os.path.getsize(f) for f in checkpoint_files(path, complete=False)[1])


def _fmt_bytes(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def _by_name(model: str, flag: str | None = None) -> str:
    """A model known by name (`--model gemma-3-270m`) as its installed package's GGUF file; any other
    value as it is. The package missing: one line naming the pip install (exit 2). With `flag`
    (`--model`), a value that is neither a path nor a known name is one line listing the names."""
    from jaxspec.models import gguf

    if model in gguf.KNOWN and not os.path.lexists(model):
        try:
            return gguf.by_name(model)
        except ValueError as e:
            raise UsageError(str(e)) from None
    if flag is not None and not os.path.lexists(model):
        hub = " (jaxspec downloads nothing: for a Hugging Face id, download its files and pass their directory)"
        raise UsageError(f"{flag} {model!r} does not exist, and is not a model name jaxspec knows "
                         f"({', '.join(sorted(gguf.KNOWN))}): pass a model directory, a .gguf file or one of those "
                         "names" + (hub if re.fullmatch(r"[\w.-]+/[\w.-]+", model) else ""))
    return model
