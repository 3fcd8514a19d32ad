"""`jaxspec tiny-pair` and `jaxspec convert`: writing a checkpoint directory (a tiny random pair, or a GGUF converted once)."""
from __future__ import annotations

import os
import re
import time
from jaxspec.cli.common import EXIT_OK, UsageError, _by_name, _dir_bytes, _fmt_bytes, _note, _one_line, _read_config


def cmd_tiny_pair(args) -> int:
    """models.presets.tiny_pair saved as two model directories, with a toy tokenizer in the target's
    and the same file as the pair's shared DIR/tokenizer.json (the default pair's layout), so both
    `--model DIR/target --assistant DIR/assistant` and `--pair DIR` run it."""
    from jaxspec import models
    from jaxspec.models import pair_files

    from jaxspec.text.tokenizer import DEMO_CORPUS, train_byte_bpe

    _check_output_dir(args.dir, args.force)  # before building anything
    target, assistant = models.presets.tiny_pair(seed=args.seed)
    tdir, adir = os.path.join(args.dir, "target"), os.path.join(args.dir, "assistant")

    def write(folder):
        models.save(target, os.path.join(folder, "target"))
        models.save(assistant, os.path.join(folder, "assistant"))
        tok = train_byte_bpe([DEMO_CORPUS], vocab_size=target.config.vocab_size)
        for where in (os.path.join(folder, "target"), folder):  # a complete model directory, and the
            tok.save(os.path.join(where, "tokenizer.json"))     # pair's shared one for --pair DIR

    try:  # everything written first, then switched at once: a crash leaves the old pair or the new one
        pair_files.save_pair(args.dir, write)
    except OSError as e:  # e.g. a full disk: the path and the reason, not a traceback
        raise UsageError(f"cannot write the tiny pair to {args.dir!r}: {e.strerror or _one_line(e)}"
                         + (f" ({e.filename!r})" if e.filename else "")) from None
    print(f"wrote {tdir}, {adir} and their tokenizer.json\ntry: jaxspec generate \"def f(x):\" --pair {args.dir}")
    return EXIT_OK


def _check_output_dir(path: str, force: bool, command: str = "tiny-pair") -> None:
    """An output directory that exists empty (or anything, with `force`), or can be created."""
    from jaxspec.models.checkpoint_files import why_not

    try:
        if os.path.isdir(path):
            if os.listdir(path) and not force:
                raise UsageError(f"{path!r} is not empty: {command} would replace the model files in it; pass "
                                 "--force to write there anyway")
            where = path
        elif os.path.lexists(path):
            raise UsageError(f"{path!r} is not a directory")
        else:
            where = os.path.dirname(os.path.abspath(path))
            while not os.path.lexists(where):
                where = os.path.dirname(where)
            if not os.path.isdir(where):
                raise UsageError(f"cannot create {path!r}: {where!r} is not a directory")
    except OSError as e:  # a symlink loop, a directory that cannot be listed
        raise UsageError(why_not(e, path)) from None
    if not os.access(where, os.W_OK | os.X_OK):
        raise UsageError(f"permission denied: cannot write {path!r} ({where!r} is not writable)")


def cmd_convert(args) -> int:
    """A GGUF (file, directory holding one, or a model name) written as a jaxspec checkpoint directory
    (models.save: config.json + safetensors, float32 scales kept exact) with its tokenizer, so later
    loads read safetensors and skip the GGUF decoding. Loaded in float32, so that the directory
    loads, at any dtype, exactly as the GGUF does. Weights, config and tokenizer switch in as one
    (models.save's extra_files): a failure or a kill leaves the previous directory whole, and the
    loaders refuse the directory if its tokenizer goes missing."""
    import jax.numpy as jnp

    from jaxspec import models
    from jaxspec.kernels import DispatchConfig
    from jaxspec.models import gguf

    src_name = _by_name(args.src)
    try:
        src = gguf.source(src_name)
    except ValueError as e:
        raise UsageError(_one_line(e)) from None
    if src is None:
        raise UsageError(f"{args.src!r} is not a GGUF file, a directory holding one, or a known model name "
                         f"({', '.join(sorted(gguf.KNOWN))})")
    _read_config(src, "GGUF model")  # the header, metadata and tensor table checked before "loading ..."
    _check_output_dir(args.out, args.force, "convert")
    tok = _step("reading its tokenizer", lambda: _gguf_tokenizer(src))  # bad metadata: nothing written
    quantize = None
    if args.quantize is not None:
        bits, gs = (int(v) for v in re.fullmatch(r"(\d+)bit-g(\d+)", args.quantize).groups())
        quantize = {"bits": bits, "group_size": gs}
    tok = _step("reading its tokenizer", lambda: _gguf_tokenizer(src))  # before minutes of decoding
    target = _load_gguf(src, quiet=args.quiet, dtype=jnp.float32, quantize=quantize, matmul=DispatchConfig())
    try:
        _step(f"writing {args.out} (weights, config and tokenizer)",
              lambda: models.save(target, args.out, extra_files=tok.save))
    except OSError as e:
        raise UsageError(f"cannot write {args.out!r}: {e.strerror or _one_line(e)}"
                         + (f" ({e.filename!r})" if e.filename else "")) from None
    print(f"wrote {args.out} (with its tokenizer)\ntry: jaxspec generate \"The capital of France is\" --model "
          f"{args.out} --no-assistant")
    return EXIT_OK


def _step(what: str, fn):
    """`fn()` between a note "what ..." and its time on the same stderr line (seconds of silence
    otherwise); an error ends the line first, so its own line stands alone."""
    _note(f"{what} ...", end="")
    t0 = time.perf_counter()
    try:
        out = fn()
    except BaseException:
        _note("")
        raise
    _note(f" {time.perf_counter() - t0:.1f} s")
    return out


def _load_gguf(src: str, quiet: bool, **kw):
    """`_load` for a GGUF, with a progress bar over the tensors' decoding (most of a conversion's
    time) on stderr when it is a terminal and not --quiet."""
    from jaxspec import progress
    from jaxspec.models.checkpoint import load_gguf_target

    show = progress.wanted(False if quiet else None)
    _note(f"loading target from {src} ({_fmt_bytes(_dir_bytes(src))}) ...", end="\n" if show else "")
    t0 = time.perf_counter()
    try:
        with progress.tracking("decoding tensors", enabled=show) as tick:
            model = load_gguf_target(src, progress=tick, **kw)
    except (ValueError, NotImplementedError, OSError) as e:  # the loader names the file
        if not show:
            _note("")
        raise UsageError(f"cannot load the target from {src!r}: {_one_line(e)}") from None
    dt = time.perf_counter() - t0
    _note(f"loaded target in {dt:.1f} s" if show else f" {dt:.1f} s")
    return model


def _gguf_tokenizer(src: str):
    """The GGUF's tokenizer, rebuilt from its metadata (jaxspec.text.gguf) before anything is
    loaded or written: unusable tokenizer metadata is a TokenizerError (bad input, exit 2) with
    nothing written."""
    from jaxspec.text.gguf import tokenizer_from_gguf
    from jaxspec.models import gguf

    meta = gguf.plan(src)[1]  # jaxspec's parse of the metadata: seconds, where GGUFReader takes tens
    return tokenizer_from_gguf(src, reader=gguf.MetadataReader(meta))
