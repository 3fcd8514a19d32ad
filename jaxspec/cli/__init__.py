"""The `jaxspec` command line: argument handling and output; the work is the library's.

    jaxspec generate "def fibonacci(n):" --max-tokens 64 --compare      # the embedded default pair
    jaxspec generate "The capital of France is" --pair gemma-3-270m --compare   # Gemma 3 270M + its drafter
    jaxspec generate "Hello" --model DIR --assistant DIR --stream
    jaxspec generate - --model gemma-3-270m --draft ngram --compare < edit.txt   # prompt lookup: no drafter model
    jaxspec generate "Why is the sky blue?" --model DIR --assistant DIR --chat --temperature 0.7 --top-p 0.95
    jaxspec tiny-pair DIR                                               # a tiny random pair (smoke tests)
    jaxspec convert gemma-3-270m DIR                                    # a GGUF as a checkpoint directory

`generate` prints the generated text on stdout, then one stats line (decode tokens/s, acceptance,
mean accepted length, speedup over classic decoding with --compare). Progress, the compile notice
and warnings go to stderr. Bad input (a missing model directory, a directory that is not a model,
unreadable weight files, an assistant for another target, a prompt longer than the context or not
valid UTF-8, a --max-tokens whose run cannot fit the device's memory, a seed outside
[0, 2**64), ...) is one line on stderr and exit status 2, found before anything is loaded or
compiled where the config files can tell; --debug shows the traceback instead.

Compiled programs are kept in JAX's persistent compilation cache: --compile-cache DIR (default
~/.cache/jaxspec/jax), --no-compile-cache to run without it; a cache directory already set in
JAX's own configuration (e.g. $JAX_COMPILATION_CACHE_DIR) is left as it is. The speculative
benchmark is `python benchmarks/speculative_bench.py` in a source checkout.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import os
import re
import sys
import time
import traceback
import warnings

from jaxspec.engine import compile_cache, sampling
from jaxspec.serve.guard import ACCEPT_BACKLOG
from jaxspec.engine.generate import BLOCK_SIZE_WHY, MAX_BLOCK_SIZE, MAX_ROUNDS_PER_CHUNK, check_block_size
from jaxspec.engine.loop_config import PREFILL_CHUNK
from jaxspec.drafters.base import KINDS as DRAFT_KINDS

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


# ---------------------------------------------------------------------------------------------
# The process's edges: standard streams, the JAX backend, flag ranges


def _reserve_std_fds() -> None:
    """Put /dev/null on a closed fd 0, 1 or 2. Else the next file opened (a weight file, a compile
    cache entry) takes that number, and whatever writes to "stderr" below Python (XLA's logs) writes
    into it. Python's own sys.stdout / sys.stderr stay None for a closed stream (see _note)."""
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            try:
                nul = os.open(os.devnull, os.O_RDWR)
                if nul != fd:
                    os.dup2(nul, fd)
                    os.close(nul)
            except OSError:
                pass


def _check_stdout() -> None:
    """UsageError when stdout cannot take the output (closed: `>&-`, or opened read-only), found
    before anything is loaded rather than after the whole generation."""
    out = sys.stdout
    if out is None:
        raise UsageError("stdout is closed: the generated text has nowhere to go (redirect it to a file or "
                         "/dev/null)")
    try:
        fd = out.fileno()
    except (OSError, ValueError, AttributeError):  # not a real file (e.g. captured in a test)
        return
    try:
        import fcntl

        mode = fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE
    except (ImportError, OSError):  # no fcntl (Windows), or a descriptor closed under us
        try:
            os.fstat(fd)
            return
        except OSError:
            raise UsageError("stdout is closed: the generated text has nowhere to go") from None
    if mode == os.O_RDONLY:
        raise UsageError("stdout is open read-only: the generated text cannot be written (redirect it to a file)")


def _check_backend() -> None:
    """UsageError (one line, naming JAX_PLATFORMS when it is set) when JAX cannot start a backend,
    e.g. JAX_PLATFORMS=cuda on a machine without the CUDA plugin (JAX raises a bare AssertionError)."""
    import jax

    try:
        jax.devices()
    except Exception as e:
        detail = " ".join(str(e).split())
        want = os.environ.get("JAX_PLATFORMS") or os.environ.get("JAX_PLATFORM_NAME")
        if want:
            raise UsageError(f"JAX_PLATFORMS={want!r}: JAX cannot start {want!r} on this machine ("
                             f"{detail or 'no plugin for it is installed'}); install its jax plugin (e.g. pip "
                             "install -e '.[cuda12]' in the jaxspec checkout) or unset JAX_PLATFORMS") from None
        raise UsageError(f"JAX cannot start a backend on this machine: {detail or type(e).__name__}") from None


# Integer flags' ranges, checked up front by _check_ranges (argparse only checks they are integers:
# its own range errors print the whole usage). (flag, attribute, lowest, highest or None, why)
_GENERATE_RANGES = (("--max-tokens", "max_tokens", 1, None, ""),
                    ("--top-k", "top_k", sampling.RANGES["top_k"].lo, sampling.RANGES["top_k"].hi, ""),
                    ("--block-size", "block_size", 1, MAX_BLOCK_SIZE, BLOCK_SIZE_WHY),
                    ("--stream-rounds", "stream_rounds", 1, MAX_ROUNDS_PER_CHUNK, ""),
                    ("--devices", "devices", 1, None, ""))
MAX_KV_POSITIONS = 1 << 26  # serve --kv-positions at most (64 Mi positions: 4096 slots x 16384)
_SERVE_RANGES = (("--port", "port", 1, 65535, ""), ("--max-body-bytes", "max_body_bytes", 1024, 1 << 30, ""),
                 ("--max-queue", "max_queue", 1, 100_000, ""),
                 ("--rounds-per-chunk", "rounds_per_chunk", 1, MAX_ROUNDS_PER_CHUNK, ""),
                 ("--block-size", "block_size", 1, MAX_BLOCK_SIZE, BLOCK_SIZE_WHY),
                 ("--max-batch", "max_batch", 1, 1 << 12, ""),
                 ("--prefill-chunk", "prefill_chunk", 16, 1 << 16, " (a multiple of 16)"),
                 ("--kv-positions", "kv_positions", 16, MAX_KV_POSITIONS, " (a multiple of 16)"),
                 ("--max-connections", "max_connections", 1, 1 << 20, ""))


def _check_ranges(args, ranges) -> None:
    for flag, attr, lo, hi, why in ranges:
        v = getattr(args, attr)
        if v is not None and (v < lo or (hi is not None and v > hi)):
            rng = f">= {lo}" if hi is None else f"in {lo}..{hi}"
            raise UsageError(f"{flag} {v}: expected an integer {rng}{why}")


def _check_cache_flag(args) -> None:
    """An unsafe --compile-cache DIR (compile_cache.checked_dir) is bad input, found before anything
    is loaded; a missing one is created later (0700), when the cache is turned on."""
    if args.compile_cache is not None and not args.no_compile_cache:
        try:
            compile_cache.checked_dir(os.path.expanduser(args.compile_cache), create=False)
        except (ValueError, OSError) as e:
            raise UsageError(f"--compile-cache: {_one_line(e)}") from None


def _check_block_size(args, tcfg) -> None:
    """K against the model's context, from its config (before loading)."""
    try:
        check_block_size(args.block_size, tcfg.max_position_embeddings)
    except ValueError as e:
        raise UsageError(f"--block-size: {e}") from None


# ---------------------------------------------------------------------------------------------
# Model directories, the default pair, the compile cache


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


def _parse_configs(model_dir: str, assistant_dir: str | None):
    """(TargetConfig, AssistantConfig or None), parsed by models and the pairing checked, from the
    config files alone (nothing is loaded)."""
    from jaxspec import models

    try:
        tcfg = models.TargetConfig.from_dict(_read_config(model_dir, "model"))
    except (ValueError, NotImplementedError) as e:
        raise UsageError(f"{model_dir!r} is not a usable Gemma 4 target model: {_one_line(e)}") from None
    acfg = None
    if assistant_dir is not None:
        try:
            acfg = models.AssistantConfig.from_dict(_read_config(assistant_dir, "assistant"))
        except (ValueError, NotImplementedError) as e:
            raise UsageError(f"{assistant_dir!r} is not a usable Gemma 4 assistant (MTP drafter): "
                             f"{_one_line(e)}") from None
        try:
            models.check_fit(acfg, tcfg)
        except ValueError as e:
            detail = _one_line(e).replace("assistant does not fit the target: ", "")
            raise UsageError(f"assistant {assistant_dir!r} was made for a different target than "
                             f"{model_dir!r}: {detail}") from None
    return tcfg, acfg


def default_pair_dirs(path: str | None = None) -> tuple[str, str] | None:
    """(target dir, assistant dir) of the pair in `path` (default: the packaged default pair, see
    jaxspec.default_pair), or None when it is incomplete."""
    from jaxspec import default_pair

    if not default_pair.default_pair_available(path):
        return None
    root = default_pair.default_pair_path() if path is None else path
    return os.path.join(root, "target"), os.path.join(root, "assistant")


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


def _load(kind: str, path: str, **kw):
    from jaxspec import models

    size = _dir_bytes(path)
    big = size > (1 << 30)
    _note(f"loading {kind} from {path} ({_fmt_bytes(size)}) ...", end="\n" if big else "")
    t0 = time.perf_counter()
    try:
        loader = models.load_target if kind == "target" else models.load_assistant
        model = loader(path, progress=big, **kw)
    except BaseException as e:
        if not big:
            _note("")  # end the unfinished "loading ..." line: the error goes on a line of its own
        if isinstance(e, (ValueError, NotImplementedError, OSError)):  # the loader names the file
            raise UsageError(f"cannot load the {kind} from {path!r}: {_one_line(e)}") from None
        raise
    dt = time.perf_counter() - t0
    _note(f"loaded {kind} in {dt:.1f} s" if big else f" {dt:.1f} s")
    return model


def _dtype(args):
    import jax.numpy as jnp

    return {"bfloat16": jnp.bfloat16, "float32": jnp.float32, "float16": jnp.float16}[args.dtype]


def _load_pair(args, model_dir: str, assistant_dir: str | None, dtype):
    """(target, assistant or None, the compile cache directory or None): the on-disk cache set as
    --compile-cache / --no-compile-cache say, then both models loaded on --backend's config."""
    import jax

    from jaxspec import models

    devices = getattr(args, "devices", None)
    if devices is not None and devices > 1 and devices != jax.device_count():
        raise UsageError(f"--devices {devices}: this process has {jax.device_count()} devices, and the model is "
                         "split over all of them (make only the ones to use visible, e.g. CUDA_VISIBLE_DEVICES)")
    if args.no_compile_cache:
        compile_cache.disable_default()
    with warnings.catch_warnings(record=True) as caught:  # an unsafe default cache: one line, not Python's two
        warnings.simplefilter("always")
        cache_dir = None if args.no_compile_cache else compile_cache.enable(args.compile_cache)
    _flush_warnings(caught)
    matmul = _matmul_config(args.backend)
    if devices is not None and devices > 1:  # models.shard splits the quantized weights, not CPU-dense ones
        matmul = matmul.replace(dense=False)
    target = _load("target", model_dir, dtype=dtype, matmul=matmul)
    assistant = _load("assistant", assistant_dir, dtype=dtype, matmul=matmul, target=target) if assistant_dir else None
    if devices is not None and devices > 1:
        import numpy as np

        mesh = jax.sharding.Mesh(np.array(jax.devices()), ("tp",))
        target = models.shard(target, mesh)
        assistant = None if assistant is None else models.shard(assistant, mesh)
        _note(f"split over {devices} devices (tensor parallel)")
    return target, assistant, cache_dir


def _matmul_config(choice: str):
    """The dispatch config for --backend: auto is the Pallas kernels on a GPU and XLA's
    dequantize + dot elsewhere (kernels.resolve_backend, as the Python loaders); the environment's
    dispatch knobs (DispatchConfig.from_env) apply."""
    from jaxspec.kernels import DispatchConfig, resolve_backend

    if choice == "pallas" and resolve_backend("auto") != "pallas":
        _note("jaxspec: note: no GPU: the Pallas kernels run in interpret mode (very slow); "
              "--backend xla is the fast choice on CPU")
    return DispatchConfig.from_env(backend=choice)  # "auto": resolve_backend, the loaders' rule too


# ---------------------------------------------------------------------------------------------
# Memory


def cache_capacity(prompt_len: int, max_tokens: int, block_size: int, drafting: bool = True) -> int:
    """The cache positions `jaxspec.generate` allocates for one prompt (`LoopConfig.resolve`; checked
    before the model loads, so unpadded: the verify width taken as the block size). drafting: an
    assistant is given (else K is 1)."""
    from jaxspec.engine.loop_config import LoopConfig

    return LoopConfig.resolve(block_size=block_size, batch=1, prompt_len=prompt_len, max_new_tokens=max_tokens,
                              drafting=drafting, verify_pad=False).capacity


def device_memory() -> tuple[int, str] | None:
    """(bytes, what) of the memory the model and its cache live in: the first device's memory
    limit (jax's memory_stats, e.g. a GPU), else the host's physical memory (CPU); None when
    neither can be read."""
    import jax

    try:
        dev = jax.devices()[0]
        stats = dev.memory_stats() or {}
        limit = int(stats.get("bytes_limit") or 0)
        if limit > 0:
            return limit, f"{dev.platform.upper()} memory"
    except Exception:
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "host memory"
    except (ValueError, OSError, AttributeError):
        return None


def memory_limit() -> tuple[int, str, bool] | None:
    """(bytes, what they are, on the host?) a run may plan to fill: the device's limit (a GPU), or on a
    CPU the host memory it may use (`serve_memory.host_usable`: less a tenth for the system, within
    the cgroup's limit and what is available now); None when nothing can be read."""
    from jaxspec.engine.memory import host_usable

    mem = device_memory()
    if mem is None:
        return None
    limit, what = mem
    host = what == "host memory"
    return (*host_usable(limit), True) if host else (limit, what, False)


def _check_memory(tcfg, prompt_len: int, max_tokens: int, block_size: int, drafting: bool, dtype,
                  weight_bytes: int) -> None:
    """UsageError when this run cannot fit the device's memory: `serve_memory.batch_memory` of one
    row (its KV cache as init_cache allocates it, the step's temporaries, the verify's logits, the
    outputs, the weights and on a CPU the process and XLA's dequantized weights), as `serve` checks
    its slots. It counted the cache and the weight files only: on a CPU a run it let through could
    need 3x the weights and 1.5 GiB more."""
    from jaxspec.engine.memory import batch_memory

    mem = memory_limit()
    if mem is None:
        return
    limit, what, host = mem

    def need(tokens):
        return batch_memory(tcfg, 1, block_size if drafting else 1, dtype, weight_bytes, host=host,
                            capacity=cache_capacity(prompt_len, tokens, block_size, drafting))
    run = need(max_tokens)
    if run.total > limit:
        fix = "lower --max-tokens" if need(1).total <= limit else "even one new token does not fit: a smaller model"
        raise UsageError(f"--max-tokens {max_tokens} needs {run.describe()}; more than the {_fmt_bytes(limit)} of "
                         f"{what}: {fix}")


# ---------------------------------------------------------------------------------------------
# generate


def _prompt_text(args) -> str:
    """The prompt: the argument, or stdin for '-'. Text that is not valid UTF-8 (an argument's
    undecodable bytes arrive as lone surrogates, stdin is read as bytes) is bad input: UsageError
    naming the first bad byte; nothing is replaced."""
    if args.prompt == "-":
        raw = getattr(sys.stdin, "buffer", None)
        if raw is None:  # a text stream without bytes (e.g. replaced in a test)
            return _utf8_checked(sys.stdin.read(), "stdin")
        data = raw.read()
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise UsageError(f"the prompt (stdin) is not valid UTF-8: byte 0x{data[e.start]:02x} at offset {e.start}"
                             ) from None
    return _utf8_checked(args.prompt, "argument")


def _utf8_checked(text: str, where: str) -> str:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:  # lone surrogates: os.fsdecode's surrogateescape of bad bytes
        ch = ord(text[e.start])
        what = f"byte 0x{ch - 0xDC00:02x}" if 0xDC80 <= ch <= 0xDCFF else f"lone surrogate U+{ch:04X}"
        raise UsageError(f"the prompt ({where}) is not valid UTF-8: {what} at character {e.start}") from None
    return text


def _by_name(model: str) -> str:
    """A model known by name (`--model gemma-3-270m`) as its installed package's GGUF file; any other
    value as it is. The package missing: one line naming the pip install (exit 2)."""
    from jaxspec.models import gguf

    if model in gguf.KNOWN and not os.path.lexists(model):
        try:
            return gguf.by_name(model)
        except ValueError as e:
            raise UsageError(str(e)) from None
    return model


def _pair_name(args) -> str | None:
    """--pair's value when it names a pair (jaxspec.pairs.NAMES) rather than a directory, else None."""
    from jaxspec.pairs import NAMES

    value = getattr(args, "pair", None)
    return value if value in NAMES and not os.path.lexists(value) else None


def _resolve_named(args, name: str) -> tuple[str, str | None]:
    """A named pair's (target, drafter): jaxspec.pairs.resolve, its one-line errors as UsageError. With
    --no-assistant a real pair needs only its target (no drafter is looked for)."""
    from jaxspec import pairs

    if args.no_assistant and name in pairs.REAL:
        return _by_name(name), None
    try:
        pair = pairs.resolve(name, args.assistant)
    except ValueError as e:
        raise UsageError(f"--pair {name}: {e}") from None
    return pair.target, pair.assistant


def _resolve_dirs(args) -> tuple[str, str | None]:
    draft = getattr(args, "draft", None)
    if draft == "ngram" and args.assistant is not None:
        raise UsageError("--draft ngram drafts from the prompt, without an assistant: drop --assistant")
    if draft == "ngram":  # the target alone: a named pair's drafter is not looked for
        args.no_assistant = True
    name = _pair_name(args) if args.model is None else None
    if name is not None:
        model_dir, assistant_dir = _resolve_named(args, name)
    elif args.model is None:
        if args.assistant is not None:
            raise UsageError("--assistant needs --model (the target it drafts for) or a named pair (--pair "
                             "gemma-3-270m)")
        pair = default_pair_dirs(args.pair)
        if pair is None and args.pair is not None:
            from jaxspec.default_pair import missing_files
            from jaxspec.pairs import NAMES

            if not os.path.lexists(args.pair):
                raise UsageError(f"--pair {args.pair!r} is neither a named pair ({', '.join(NAMES)}) nor a directory")
            lacks = ", ".join(missing_files(args.pair))
            raise UsageError(f"--pair {args.pair!r} is not a model pair: it lacks {lacks}")
        if pair is None:
            raise UsageError("no model given and the embedded default pair is not installed: pass --model DIR")
        model_dir, assistant_dir = pair
    elif args.pair is not None:
        raise UsageError("--pair and --model exclude each other")
    else:
        model_dir, assistant_dir = _by_name(args.model), args.assistant
    if args.no_assistant:
        assistant_dir = None
    if draft == "mtp" and assistant_dir is None:
        raise UsageError("--draft mtp needs an assistant: --assistant DIR, or a pair that ships one")
    return model_dir, assistant_dir


def _stats_line(stats, startup_s: float, classic=None, identical: bool | None = None) -> str:
    if stats.mode == "speculative":
        parts = [f"speculative K={stats.block_size}" + (f" (verify width {stats.verify_width})"
                                                        if stats.verify_width != stats.block_size else ""),
                 f"{stats.new_tokens} new tokens", f"decode {stats.decode_tokens_per_s:.1f} tok/s",
                 f"acceptance {100 * stats.acceptance_rate:.1f}%",
                 f"mean accepted length {stats.mean_accepted_len:.2f}",
                 f"{stats.tokens_per_round:.2f} tokens/round"]
        if stats.drafter:  # which drafter ran, and its own counters (ngram: where its accepted drafts came from)
            parts.append(f"drafter {stats.drafter}" + "".join(f", {k.replace('_', ' ')} {v}"
                                                               for k, v in stats.draft_stats.items()))
    else:
        parts = ["classic", f"{stats.new_tokens} new tokens", f"decode {stats.decode_tokens_per_s:.1f} tok/s"]
    parts += [f"prefill {stats.prefill_s:.3f} s", f"startup {startup_s:.1f} s"]
    if stats.fallback:
        asked = stats.fallback.startswith("block_size=1")  # classic was asked for, not fallen back to
        parts.append(f"fell back to classic: {stats.fallback}" if stats.mode == "classic" and not asked
                     else stats.fallback)
    if classic is not None:
        c = classic.decode_tokens_per_s
        parts.append(f"classic {c:.1f} tok/s")
        parts.append(f"speedup {stats.decode_tokens_per_s / c:.2f}x" if c > 0 else "speedup n/a")
        if identical is not None:
            parts.append("greedy output identical to classic: " + ("yes" if identical else "NO"))
    return "stats: " + " | ".join(parts)


def _flush_warnings(caught) -> None:
    for w in caught:
        msg = _one_line(w.message)
        if "donated buffers were not usable" in msg:
            continue
        _note(f"jaxspec: warning: {msg.removeprefix('jaxspec: ')}")


def _generate_streamed(target, ids, assistant, tok, kw, rounds_per_chunk, show, caught):
    """Stream the text to stdout as rounds complete; returns the GenerationResult."""
    from jaxspec.engine import streaming
    from jaxspec.text.tokenizer import IncrementalDecoder

    dec = IncrementalDecoder(tok)
    result = None
    for chunk in streaming.stream_generate(target, [ids], assistant=assistant, rounds_per_chunk=rounds_per_chunk,
                                           **kw):
        if show and caught:
            _flush_warnings(caught)
            caught.clear()
        piece = dec.push(chunk.tokens[0])
        if show and piece:
            sys.stdout.write(piece)
            sys.stdout.flush()
        result = chunk.result
    tail = dec.flush()
    if show:
        sys.stdout.write(tail + "\n")
        sys.stdout.flush()
    return result


def cmd_generate(args) -> int:
    import jaxspec
    from jaxspec.text.tokenizer import TokenizerError
    from jaxspec.text import load_tokenizer

    _check_stdout()
    _check_ranges(args, _GENERATE_RANGES)
    _check_cache_flag(args)
    try:  # the request, checked once here: before anything is loaded
        request = sampling.SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                                          min_p=args.min_p, seed=args.seed)
    except ValueError as e:
        raise UsageError(str(e)) from None
    prompt = _prompt_text(args)
    if not prompt:
        raise UsageError("empty prompt")
    model_dir, assistant_dir = _resolve_dirs(args)
    tcfg, _ = _parse_configs(model_dir, assistant_dir)
    _check_block_size(args, tcfg)

    try:
        tok = load_tokenizer(model_dir, args.tokenizer)
        if args.chat:
            ids = tok.encode_chat(prompt)
        else:
            ids = tok.encode(prompt)
            if tok.has_chat_template and not args.json:
                _note("jaxspec: note: this model has a chat template; pass --chat to use it")
    except TokenizerError as e:
        raise UsageError(str(e)) from None
    if not ids:
        raise UsageError("the prompt encodes to no tokens")
    if max(ids) >= tcfg.vocab_size:
        raise UsageError(f"tokenizer {tok.source!r} produced token id {max(ids)} but the model's vocabulary has "
                         f"{tcfg.vocab_size} tokens: wrong tokenizer for this model?")
    max_tokens = args.max_tokens
    ctx = tcfg.max_position_embeddings
    if ctx is not None:
        if len(ids) >= ctx:
            raise UsageError(f"the prompt is {len(ids)} tokens, longer than the model's context of {ctx} tokens "
                             "(max_position_embeddings)")
        if len(ids) + max_tokens > ctx:
            max_tokens = ctx - len(ids)
            _note(f"jaxspec: note: --max-tokens lowered to {max_tokens} to fit the context of {ctx} tokens")
    stop = () if args.ignore_eos else tok.eos_token_ids

    dtype = _dtype(args)
    _check_backend()
    drafting = bool(assistant_dir) or args.draft == "ngram"
    _check_memory(tcfg, len(ids), max_tokens, args.block_size, drafting, dtype,
                  _dir_bytes(model_dir) + (_dir_bytes(assistant_dir) if assistant_dir else 0))
    if assistant_dir is None and not args.no_assistant:
        _note("jaxspec: note: no --assistant given: classic decoding (pass --assistant DIR for speculative decoding)")
    target, assistant, cache_dir = _load_pair(args, model_dir, assistant_dir, dtype)

    verify_pad = None if args.verify_pad is None else args.verify_pad == "on"
    request = dataclasses.replace(request, max_new_tokens=max_tokens)
    kw = dict(params=request, block_size=args.block_size, eos_token_ids=stop, verify_pad=verify_pad,
              drafter=args.draft)
    speculative = drafting and args.block_size > 1  # block size 1 decodes classically
    # Compiling is announced by the library (programs.compile_all's log lines, shown by
    # _library_notes): when it starts, or that the programs came from the on-disk cache, and how long.
    _note(f"jaxspec: running the {'speculative' if speculative else 'classic'} decode loop"
          + (f" (later runs reuse the on-disk compile cache in {cache_dir})" if cache_dir else ""))
    show = not args.json
    t0 = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        streamed = args.stream
        if streamed:
            result = _generate_streamed(target, ids, assistant, tok, kw, args.stream_rounds, show, caught)
        else:
            result = jaxspec.generate(target, [ids], assistant=assistant, **kw)
            if show:
                sys.stdout.write(tok.decode(result.tokens[0]) + "\n")
                sys.stdout.flush()
        wall = time.perf_counter() - t0
        startup = max(0.0, wall - result.stats.prefill_s - result.stats.decode_s)
        classic = identical = None
        if args.compare and drafting:
            _note("running classic decoding for --compare (compiled on first use) ...")
            classic = jaxspec.generate(target, [ids], assistant=None, **dict(kw, drafter=None))
            if args.temperature == 0:
                identical = classic.tokens == result.tokens
        elif args.compare:
            _note("jaxspec: note: --compare needs an assistant or --draft ngram; nothing to compare")
    _flush_warnings(caught)

    stats = result.stats
    if args.json:
        out = dict(text=tok.decode(result.tokens[0]), prompt_tokens=len(ids), tokens=result.tokens[0],
                   stats=stats.as_dict(), startup_s=startup, streamed=streamed)
        if classic is not None:
            c = classic.stats.decode_tokens_per_s
            out["classic"] = dict(tokens=classic.tokens[0], stats=classic.stats.as_dict())
            out["speedup"] = stats.decode_tokens_per_s / c if c > 0 else None
            out["identical_to_classic"] = identical
        print(json.dumps(out))
    elif not args.no_stats:
        print(_stats_line(stats, startup, classic.stats if classic is not None else None, identical), flush=True)
    return EXIT_OK


# ---------------------------------------------------------------------------------------------
# serve


def cmd_serve(args) -> int:
    """Load the pair and serve it over HTTP until interrupted (jaxspec.serve.app)."""
    import importlib.util

    missing = [m for m in ("fastapi", "uvicorn") if importlib.util.find_spec(m) is None]
    if missing:
        raise UsageError(f"jaxspec serve needs {' and '.join(missing)}: pip install -e '.[serve]' "
                         "(in the jaxspec checkout)")
    _check_serve_flags(args)  # before importing the server (JAX) or loading anything: found in a second
    _check_cache_flag(args)
    from jaxspec.serve import app as server
    from jaxspec.text.tokenizer import TokenizerError
    from jaxspec.text import load_tokenizer

    origins = tuple(args.allow_origin or ())
    api_key, _ = _api_key(args)
    max_connections = _max_connections(args)
    model_dir, assistant_dir = _resolve_dirs(args)
    tcfg, _ = _parse_configs(model_dir, assistant_dir)
    _check_block_size(args, tcfg)
    try:
        tok = load_tokenizer(model_dir, args.tokenizer)
    except TokenizerError as e:
        raise UsageError(str(e)) from None
    _check_backend()
    dtype = _dtype(args)
    _check_batch_memory(tcfg, args.max_batch, args.block_size if assistant_dir or args.draft == "ngram" else 1, dtype,
                        _dir_bytes(model_dir) + (_dir_bytes(assistant_dir) if assistant_dir else 0),
                        kv_positions=args.kv_positions)
    target, assistant, _ = _load_pair(args, model_dir, assistant_dir, dtype)
    named = _pair_name(args)
    name = args.model_name or ("jaxspec-default-pair" if args.model is None and args.pair in (None, "default")
                               else named or os.path.basename(os.path.normpath(model_dir)))
    srv = server.Server(target, assistant, tok, model_name=name, block_size=args.block_size,
                        max_batch=args.max_batch, rounds_per_chunk=args.rounds_per_chunk, max_queue=args.max_queue,
                        kv_positions=args.kv_positions, prefill_chunk=args.prefill_chunk, drafter=args.draft)
    if not args.no_warmup:  # the library's lines (_library_notes) name each compile between these two
        _note("jaxspec: warming up: compiling the first programs (a new shape compiles on its first request) ...")
        _note(f"jaxspec: warmed up in {srv.warm_up():.1f} s")
    # /v1/chat/completions only for a model that can chat (without a template the server refuses it)
    endpoints = "/v1/completions" + (", /v1/chat/completions" if tok.has_chat_template else "")
    guard = ("API key required" if api_key else "no API key") + (
        f", CORS for {', '.join(origins)}" if origins else "")  # never the key itself
    server.serve(srv, args.host, args.port,
                 announce=lambda: _note(f"jaxspec: serving {name!r} on http://{args.host}:{args.port} "
                                        f"(OpenAI-compatible: {endpoints}; {guard})"),
                 api_key=api_key, allow_origins=origins, max_body_bytes=args.max_body_bytes,
                 allowed_hosts=tuple(args.allowed_host or ()), max_connections=max_connections,
                 idle_timeout=args.idle_timeout, header_timeout=args.header_timeout, body_timeout=args.body_timeout)
    return EXIT_OK


def _check_batch_memory(tcfg, max_batch: int, block_size: int, dtype, weight_bytes: int,
                        kv_positions: int | None = None) -> None:
    """UsageError when --max-batch slots cannot fit the memory the run may fill (`memory_limit`; the
    estimate, serve_memory.batch_memory, bounds the warm-up's peak too: the KV pool (--kv-positions,
    else the server's positions per slot), the decode step's temporaries, the paged views, the verify
    logits, the weights and on a CPU the process itself)."""
    from jaxspec.engine.loop_config import slot_capacity
    from jaxspec.engine.memory import batch_memory, largest_batch, largest_pool
    from jaxspec.serve.app import BATCH_CONTEXT, REQUEST_CONTEXT

    mem = memory_limit()
    if mem is None:
        return
    limit, what, host = mem
    capacity = slot_capacity(tcfg.max_position_embeddings, BATCH_CONTEXT)  # the server's pool per slot
    kw = dict(capacity=capacity, host=host,
              request_capacity=slot_capacity(tcfg.max_position_embeddings, REQUEST_CONTEXT))  # Server.batch_capacity
    need = batch_memory(tcfg, max_batch, block_size, dtype, weight_bytes, kv_positions=kv_positions, **kw)
    if need.total > limit and kv_positions is not None:
        pool = largest_pool(limit, tcfg, max_batch, block_size, dtype, weight_bytes, most=kv_positions, **kw)
        raise UsageError(f"--kv-positions {kv_positions} with --max-batch {max_batch} needs {need.describe()}; more "
                         f"than the {_fmt_bytes(limit)} of {what}" +
                         (f": lower --kv-positions (at most {pool})" if pool else
                          ", and beside the other terms not even --kv-positions 16 fits: lower --max-batch"))
    if need.total > limit:
        fits = largest_batch(limit, tcfg, block_size, dtype, weight_bytes, most=max_batch, **kw)
        raise UsageError(f"--max-batch {max_batch} needs {need.describe()}; more than the {_fmt_bytes(limit)} of "
                         f"{what}: lower --max-batch" + (f" (at most {fits})" if fits else " (not even 1 fits)"))


def _api_key(args) -> tuple[str | None, str]:
    """(the key or None, where it came from). An empty one (e.g. `JAXSPEC_API_KEY=`) means none;
    one with whitespace, a control or a non-ASCII character is refused, not stripped: a header
    line cannot carry it, so it would answer 401 to every client (a key file read with its newline)."""
    key, source = args.api_key, "--api-key"
    if key is None:
        key, source = os.environ.get("JAXSPEC_API_KEY"), "$JAXSPEC_API_KEY"
    if not key:
        return None, source
    bad = next((i for i, c in enumerate(key) if not "!" <= c <= "~"), None)
    if bad is not None:
        raise UsageError(f"{source} holds {key[bad]!r} at character {bad}: an API key must be printable ASCII without "
                         "spaces (a trailing newline or carriage return included)")
    return key, source


def _check_bind(args) -> None:
    """A wildcard address (0.0.0.0, ::) listens on every interface: refused without an API key
    unless --insecure-no-key says so."""
    from jaxspec.serve.guard import is_wildcard

    if is_wildcard(args.host) and _api_key(args)[0] is None and not args.insecure_no_key:
        raise UsageError(f"--host {args.host} listens on every interface: give an API key (--api-key KEY or "
                         "$JAXSPEC_API_KEY), or pass --insecure-no-key to serve anyone who can reach it")


# File descriptors kept beside --max-connections: the server's own (model files, JAX, logs: ~70 on
# CPU) and the connections asyncio accepts in batches before the cap closes them.
FD_RESERVE = 128 + 3 * ACCEPT_BACKLOG
DEFAULT_MAX_CONNECTIONS = 512


def _max_connections(args) -> int:
    """--max-connections, or the default, checked against the open-file limit: at the cap,
    accepting a connection must still find a descriptor."""
    from jaxspec.serve.guard import fd_limit

    limit = fd_limit()
    room = None if limit is None else limit - FD_RESERVE
    if args.max_connections is None:
        if room is not None and room < 1:
            raise UsageError(f"the open-file limit of {limit} (ulimit -n) leaves no room for connections: raise it")
        return DEFAULT_MAX_CONNECTIONS if room is None else min(DEFAULT_MAX_CONNECTIONS, room)
    if room is not None and args.max_connections > room:
        raise UsageError(f"--max-connections {args.max_connections} does not fit the open-file limit of {limit} "
                         f"(ulimit -n; {FD_RESERVE} are kept for the server and connections being accepted): at most {max(room, 0)}, or raise "
                         "ulimit -n")
    return args.max_connections


# "*" or scheme://host[:port] (a browser's Origin header: no path, no trailing slash)
_ORIGIN = re.compile(r"^(\*|[a-zA-Z][a-zA-Z0-9+.-]*://(\[[0-9a-fA-F:.]+\]|[^\s/:?#\[\]@]+)(:\d{1,5})?)$")


_HOST_NAME = re.compile(r"^([A-Za-z0-9_]([A-Za-z0-9_-]{0,62})(\.[A-Za-z0-9_][A-Za-z0-9_-]{0,62})*\.?|[0-9a-fA-F:.]+)$")


def _check_serve_flags(args) -> None:
    """UsageError (one line) for a serve flag out of range, a malformed --allow-origin, or an
    address that cannot be listened on. Checked here rather than by argparse, whose errors print
    the whole usage."""
    _check_ranges(args, _SERVE_RANGES)
    if args.prefill_chunk % 16:
        raise UsageError(f"--prefill-chunk {args.prefill_chunk}: expected a multiple of 16")
    if args.kv_positions is not None and args.kv_positions % 16:
        raise UsageError(f"--kv-positions {args.kv_positions}: expected a multiple of 16 (the KV pool's blocks of "
                         "16 positions)")
    for o in args.allow_origin or ():
        m = _ORIGIN.match(o)
        if not m or (m.group(3) and not 1 <= int(m.group(3)[1:]) <= 65535):
            raise UsageError(f"--allow-origin {o!r}: expected '*' or scheme://host[:port] with a port in 1..65535, "
                             "e.g. http://localhost:3000")
    for h in args.allowed_host or ():
        if not _HOST_NAME.match(h):
            raise UsageError(f"--allowed-host {h!r}: expected a host name or address as a Host header names it, "
                             "without a scheme or port (e.g. api.example.com)")
    for flag, v in (("--idle-timeout", args.idle_timeout), ("--header-timeout", args.header_timeout),
                    ("--body-timeout", args.body_timeout)):
        if not 0 < v <= 3600:  # also NaN
            raise UsageError(f"{flag} {v}: expected seconds in (0, 3600]")
    _api_key(args)
    _check_bind(args)
    _max_connections(args)
    _check_listen(args.host, args.port)


def _check_listen(host: str, port: int) -> None:
    """UsageError unless (host, port) resolves and can be bound now (not in use, an address of
    this machine); the socket is closed again at once."""
    import socket

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as e:
        raise UsageError(f"--host {host!r} does not resolve: {_one_line(e)}") from None
    family, kind, proto, _, addr = infos[0]
    try:
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: TIME_WAIT is no obstacle
            s.bind(addr)
    except OSError as e:
        raise UsageError(f"cannot listen on {host}:{port}: {e.strerror or _one_line(e)}") from None


# ---------------------------------------------------------------------------------------------
# tiny-pair


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


# ---------------------------------------------------------------------------------------------
# convert


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


# ---------------------------------------------------------------------------------------------
# main


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="jaxspec", description="Speculative decoding (Gemma 4 + MTP assistant) in JAX.")
    p.add_argument("--version", action="version", version=f"jaxspec {_version()}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")

    g = sub.add_parser("generate", help="generate text from a prompt",
                       description="Generate text with a target model and (optionally) its MTP assistant. "
                                   "Without --model the embedded default pair is used.")
    g.add_argument("prompt", help="the prompt text ('-' reads it from stdin); it must be valid UTF-8 (else exit "
                                  "status 2; nothing is replaced)")
    g.add_argument("--model", metavar="DIR", help="target model directory (config.json, *.safetensors, tokenizer.json)")
    g.add_argument("--assistant", metavar="DIR", help="assistant (MTP drafter) directory for --model")
    g.add_argument("--pair", metavar="NAME|DIR",
                   help="without --model: a named pair, 'gemma-3-270m' (Gemma 3 270M from the gemma3 extra + its "
                        "shipped drafter; --assistant DIR replaces the drafter) or 'default' (the embedded toy "
                        "pair, also what no --model means), or a pair directory laid out like the default pair "
                        "(target/, assistant/, tokenizer.json)")
    g.add_argument("--no-assistant", action="store_true", help="classic decoding (no drafting)")
    g.add_argument("--draft", choices=DRAFT_KINDS, default=None,
                   help="what drafts: mtp (the assistant; the default when there is one) or ngram (prompt lookup: "
                        "the continuation of the last tokens' latest earlier occurrence in the prompt and output; no "
                        "drafter model, pays when the text copies its prompt, e.g. code edits, extraction)")
    g.add_argument("--tokenizer", metavar="FILE", help="tokenizer.json to use instead of the model directory's")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template (one user turn)")
    g.add_argument("--max-tokens", type=int, default=128, metavar="N",
                   help="new tokens at most (default 128); lowered to fit the model's context "
                        "(max_position_embeddings); more than the KV cache can hold in the device's memory "
                        "is exit status 2")
    g.add_argument("--temperature", type=float, default=0.0, metavar="T", help="0 = greedy (default)")
    g.add_argument("--top-k", type=int, default=None, metavar="K")
    g.add_argument("--top-p", type=float, default=None, metavar="P")
    g.add_argument("--min-p", type=float, default=None, metavar="P",
                   help="drop tokens less likely than P times the most likely one (0..1; default off)")
    g.add_argument("--seed", type=int, default=0, metavar="S",
                   help="sampling seed, an integer in [0, 2**64) (default 0)")
    g.add_argument("--block-size", type=int, default=4, metavar="K",
                   help=f"verify width K, 1..{MAX_BLOCK_SIZE}: K-1 drafts + 1 per round (default 4; 1 decodes "
                        "classically)")
    g.add_argument("--verify-pad", choices=("on", "off"), default=None,
                   help="pad the verify to the tiled matmul path (default: the dispatch config's verify_pad, "
                        "i.e. $JAXSPEC_MTP_VERIFY_PAD, else off)")
    g.add_argument("--ignore-eos", action="store_true", help="do not stop at EOS / end-of-turn tokens")
    g.add_argument("--stream", action="store_true", help="print tokens as rounds complete")
    g.add_argument("--stream-rounds", type=int, default=1, metavar="R",
                   help=f"rounds per streamed chunk, 1..{MAX_ROUNDS_PER_CHUNK} (default 1)")
    g.add_argument("--compare", action="store_true", help="also run classic decoding and report the speedup")
    g.add_argument("--backend", choices=("auto", "pallas", "xla"), default="auto",
                   help="quantized matmul: Pallas kernels (GPU default) or XLA dequantize+dot (CPU default)")
    g.add_argument("--dtype", choices=("bfloat16", "float32", "float16"), default="bfloat16",
                   help="activation / scale dtype (default bfloat16)")
    g.add_argument("--devices", type=int, default=None, metavar="N",
                   help="split the models over this process's N devices (tensor parallel, models.shard; N > 1 "
                        "must be all of them); the xla backend splits the matmuls, the Pallas kernels still "
                        "gather their weights")
    g.add_argument("--json", action="store_true", help="print one JSON object (text, tokens, stats) instead")
    g.add_argument("--no-stats", action="store_true", help="print only the text")
    g.add_argument("--compile-cache", metavar="DIR", default=None,
                   help=f"directory of the on-disk compilation cache (default {compile_cache.DEFAULT_DIR}; a "
                        "directory set in JAX's own configuration wins)")
    g.add_argument("--no-compile-cache", action="store_true", help="do not use the on-disk compilation cache")
    g.add_argument("--debug", action="store_true", help="show tracebacks")
    g.set_defaults(func=cmd_generate)

    v = sub.add_parser("serve", help="serve the pair over HTTP (OpenAI-compatible completions and chat)",
                       description="An OpenAI-compatible server (needs the `serve` extra: FastAPI, uvicorn). "
                                   "Without --model the embedded default pair is served.")
    v.add_argument("--model", metavar="DIR", help="target model directory")
    v.add_argument("--assistant", metavar="DIR", help="assistant (MTP drafter) directory for --model")
    v.add_argument("--pair", metavar="NAME|DIR", help="without --model: a named pair (gemma-3-270m, default) or a "
                                                     "pair directory laid out like the default pair")
    v.add_argument("--no-assistant", action="store_true", help="classic decoding (no drafting)")
    v.add_argument("--draft", choices=DRAFT_KINDS, default=None,
                   help="what drafts: mtp (the assistant; the default when there is one) or ngram (prompt lookup, "
                        "no drafter model)")
    v.add_argument("--tokenizer", metavar="FILE", help="tokenizer.json to use instead of the model directory's")
    v.add_argument("--model-name", metavar="NAME", help="the model id clients name (default: the model directory's "
                                                       "name, or jaxspec-default-pair)")
    v.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1; on a loopback address only requests naming "
                        "localhost in their Host header are served; a wildcard 0.0.0.0 or :: needs an API key)")
    v.add_argument("--port", type=int, default=8000, help="TCP port, 1..65535 (default 8000)")
    v.add_argument("--api-key", metavar="KEY", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1/... (default: $JAXSPEC_API_KEY, else no key; "
                        "an empty KEY means none; printable ASCII without spaces); the environment variable keeps "
                        "it out of the process list")
    v.add_argument("--insecure-no-key", action="store_true",
                   help="allow a wildcard --host (0.0.0.0, ::) without an API key")
    v.add_argument("--allowed-host", metavar="NAME", action="append",
                   help="a Host header name to serve besides localhost and the machine's own names and addresses "
                        "(e.g. the name a proxy forwards); repeatable")
    v.add_argument("--max-connections", type=int, default=None, metavar="N",
                   help=f"open connections at most (default {DEFAULT_MAX_CONNECTIONS}, or fewer under a low ulimit -n; "
                        f"at most the open-file limit - {FD_RESERVE}); at the cap the longest idle one is closed, "
                        "else the new one is answered 503")
    v.add_argument("--idle-timeout", type=float, default=5.0, metavar="S",
                   help="close a connection idle this long, before or between requests (default 5)")
    v.add_argument("--header-timeout", type=float, default=10.0, metavar="S",
                   help="close a connection whose request headers take longer to arrive (default 10)")
    v.add_argument("--body-timeout", type=float, default=60.0, metavar="S",
                   help="close a connection whose request body takes longer to arrive (default 60)")
    v.add_argument("--allow-origin", metavar="ORIGIN", action="append",
                   help="let web pages of ORIGIN (scheme://host[:port], or '*' for any) call the server; "
                        "repeatable (default: no cross-origin requests)")
    v.add_argument("--max-body-bytes", type=int, default=1 << 20, metavar="N",
                   help="largest request body, 1024..1 GiB (default 1048576 = 1 MiB); larger is HTTP 413")
    v.add_argument("--max-queue", type=int, default=64, metavar="N",
                   help="requests waiting beyond the running batch, 1..100000 (default 64); more get HTTP 429")
    v.add_argument("--block-size", type=int, default=4, metavar="K",
                   help=f"verify width K, 1..{MAX_BLOCK_SIZE} (default 4; 1 decodes classically)")
    v.add_argument("--prefill-chunk", type=int, default=PREFILL_CHUNK, metavar="N",
                   help=f"prompt tokens prefilled per step at most, a multiple of 16 (default {PREFILL_CHUNK}): a long "
                        "prompt is prefilled in chunks between the decode steps, so the running streams wait a chunk "
                        "per step, not the whole prefill; larger chunks prefill a long prompt faster and stall the "
                        "others longer")
    v.add_argument("--max-batch", type=int, default=4, metavar="N",
                   help="requests decoding together, continuously batched (default 4: with K = 4, 16 verify rows, "
                        "the multirow kernel's window). Memory grows with N: the slots share a KV pool of N x (the "
                        "context, at most 4096) positions (or --kv-positions), 3.5 times over with the decode step's "
                        "temporaries, plus 4 float32 logits of (K + 1) x vocabulary; checked at start, on a CPU "
                        "with ~1.5 GiB for the process, against the host memory less a tenth for the system, the "
                        "cgroup's limit and what is available now (the warm-up stays under it). The warm-up "
                        "compiles the same programs whatever N (each one logged; minutes on "
                        "a CPU), then runs steps over all N slots")
    v.add_argument("--kv-positions", type=int, default=None, metavar="N",
                   help=f"the KV pool the slots share, in cache positions: a multiple of 16 (its blocks), "
                        f"16..{MAX_KV_POSITIONS} (default: --max-batch x the context, at most 4096, e.g. 16384 at "
                        "--max-batch 4). A request holds the blocks its prompt + max_tokens + K need while it runs: "
                        "one that fits waits in the queue until enough blocks are free; one longer than the whole "
                        "pool is refused with HTTP 400. The memory check at start counts this pool in place of "
                        "--max-batch x 4096 positions")
    v.add_argument("--rounds-per-chunk", type=int, default=4, metavar="R",
                   help=f"decode rounds between two reads of the new tokens and two admissions, "
                        f"1..{MAX_ROUNDS_PER_CHUNK} (default 4; 1 suits a large model: on the H200 the 12B streams "
                        "6%% faster with half the time to first token)")
    v.add_argument("--backend", choices=("auto", "pallas", "xla"), default="auto")
    v.add_argument("--dtype", choices=("bfloat16", "float32", "float16"), default="bfloat16")
    v.add_argument("--no-warmup", action="store_true", help="start serving before compiling anything")
    v.add_argument("--compile-cache", metavar="DIR", default=None)
    v.add_argument("--no-compile-cache", action="store_true")
    v.add_argument("--debug", action="store_true", help="show tracebacks")
    v.set_defaults(func=cmd_serve)

    t = sub.add_parser("tiny-pair", help="write a tiny random target + assistant + tokenizer (smoke tests)")
    t.add_argument("dir", help="output directory (gets target/ and assistant/)")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--force", action="store_true", help="write into DIR even if it is not empty (its target/ and "
                                                        "assistant/ model files and tokenizer.json are replaced)")
    t.add_argument("--debug", action="store_true", help="show tracebacks")
    t.set_defaults(func=cmd_tiny_pair)

    c = sub.add_parser("convert", help="write a GGUF model as a jaxspec checkpoint directory",
                       description="Read a GGUF (a .gguf file, a directory holding one, or a model name such as "
                                   "gemma-3-270m) and write it as a jaxspec checkpoint directory (config.json, "
                                   "safetensors, tokenizer): the exact weights, which later loads read directly.")
    c.add_argument("src", help="the .gguf file, a directory holding one, or a model name (gemma-3-270m)")
    c.add_argument("out", help="output directory")
    c.add_argument("--quantize", choices=("4bit-g64", "4bit-g32", "8bit-g64"), default=None,
                   help="requantize every linear weight to this format (default: the exact mapping of the "
                        "GGUF's own types)")
    c.add_argument("--force", action="store_true", help="write into OUT even if it is not empty")
    c.add_argument("--quiet", action="store_true", help="no progress bar (shown on stderr only when it is a "
                                                        "terminal)")
    c.add_argument("--debug", action="store_true", help="show tracebacks")
    c.set_defaults(func=cmd_convert)

    return p


def _version() -> str:
    try:
        from importlib.metadata import version
        return version("jaxspec")
    except Exception:
        return "0.1.0 (source)"


def _guarded(fn, arg, debug: bool) -> int:
    """Run a command; map what escapes it by one rule: USER_ERRORS -> one line, exit 2; any other
    exception is a bug -> "internal error", exit 1; Ctrl-C -> 130; stdout closed by its reader
    (`| head`) -> quiet exit 0, as other Unix tools."""
    try:
        return fn(arg)
    except KeyboardInterrupt:
        _err("interrupted")
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        _silence_stdout()
        return EXIT_OK
    except Exception as e:
        if debug:
            traceback.print_exc()
        if isinstance(e, USER_ERRORS):
            _err(f"error: {str(e) or type(e).__name__}")  # _err makes it one line, cut once
            return EXIT_USAGE
        if not debug:
            hint = " (rerun with --debug for the traceback)"  # kept whole: the message is cut instead
            _err(f"internal error: {type(e).__name__}: {_one_line(e, MAX_MESSAGE - 100)}{hint}")
        return EXIT_ERROR


def _silence_stdout() -> None:
    """Point fd 1 at /dev/null: the interpreter's last flush of what stdout still buffers would
    otherwise raise BrokenPipeError again at exit ("Exception ignored ...", exit status 120)."""
    try:
        nul = os.open(os.devnull, os.O_WRONLY)
        os.dup2(nul, sys.stdout.fileno())
        os.close(nul)
    except (OSError, ValueError, AttributeError):
        pass


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    _reserve_std_fds()
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse: usage errors exit 2, --help / --version exit 0
        return e.code if isinstance(e.code, int) else EXIT_USAGE
    if args.command is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    with _library_notes():
        return _guarded(args.func, args, getattr(args, "debug", False))


if __name__ == "__main__":
    sys.exit(main())
