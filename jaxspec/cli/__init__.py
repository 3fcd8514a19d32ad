"""The `jaxspec` command line: argument handling and output; the work is the library's. This module runs
`generate` and `serve` and dispatches; parser.py holds the flags, common.py the one-line errors and
shared checks, serve_flags.py serve's pre-load checks, convert.py `tiny-pair` and `convert`.

    jaxspec generate "def fibonacci(n):" --max-tokens 64 --compare      # the embedded default pair
    jaxspec generate "The capital of France is" --model gemma-3-270m --draft ngram --compare   # Gemma 3 270M
    jaxspec generate "Hello" --model DIR --assistant DIR --stream
    jaxspec generate - --model gemma-3-270m --draft ngram --compare < edit.txt   # prompt lookup: no drafter model
    jaxspec generate "Why is the sky blue?" --model DIR --assistant DIR --chat --temperature 0.7 --top-p 0.95
    jaxspec generate "The capital of France is" --model gemma-3-270m --repetition-penalty 1.3   # no loops
    jaxspec generate "Once upon a time" --temperature 0.8 --n 3 --seed 7      # 3 choices, seeds 7, 8, 9
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

import dataclasses
import json
import os
import sys
import time
import traceback
import warnings

from jaxspec.drafters import base as drafters
from jaxspec.engine import compile_cache, sampling
from jaxspec.engine.generate import check_block_size
from jaxspec.cli.common import (EXIT_ERROR, EXIT_INTERRUPTED, EXIT_OK, EXIT_USAGE, MAX_MESSAGE, USER_ERRORS,
                                UsageError, _GENERATE_RANGES, _by_name, _check_ranges, _dir_bytes, _err, _fmt_bytes,
                                _library_notes, _note, _one_line, _read_config)  # noqa: F401  (named here for the tests)
from jaxspec.cli.serve_flags import (FD_RESERVE, _api_key, _check_bind, _check_serve_flags, _max_connections,  # noqa: F401  (named here for the tests)
                                     _serve_config, _served_names)
from jaxspec.cli.convert import cmd_convert, cmd_tiny_pair
from jaxspec.cli.parser import build_parser


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


def _cached_weights(args, model_dir: str) -> tuple[str, str | None]:
    """(what to read the model from, the GGUF it stands for or None): a GGUF whose converted weights
    the cache holds (jaxspec.weights_cache.lookup, checksums checked) is read from that directory
    (config, tokenizer, weights: none of the GGUF's decoding), with one line saying where; any other
    GGUF is read as it is and converted into the cache when it loads (`_load_target`). Neither with
    --no-weights-cache, nor for a model that is not a GGUF file."""
    from jaxspec import weights_cache
    from jaxspec.models import gguf

    if getattr(args, "no_weights_cache", False):
        return model_dir, None
    try:
        src = gguf.source(model_dir)
    except ValueError:  # _read_config names the problem
        return model_dir, None
    if src is None or not os.path.isfile(src):
        return model_dir, None
    hit = weights_cache.lookup(src)  # (the memory checks size the weights by the GGUF's bytes either way)
    if hit is None:
        return model_dir, src
    _note(f"jaxspec: weights from the cache {hit} (converted from {src}; --no-weights-cache reads the GGUF)")
    return hit, src


def _load_target(path: str, src: str | None, tok, **kw):
    """The target from `path`; for a GGUF (`src`, see `_cached_weights`) from its cache entry,
    converted first on a miss (the run's own tokenizer `tok` saved with it). A cache that cannot be
    written, or an entry that does not load, is noted and skipped: the GGUF is read as it is."""
    from jaxspec import weights_cache
    from jaxspec.cli.convert import _step

    if src is None:
        return _load("target", path, **kw)
    hit = path != src
    if hit:
        try:
            return _load("target", path, **kw)
        except UsageError as e:
            _note(f"jaxspec: note: the cached weights do not load ({_one_line(e)}): converting {src} again")
    try:
        entry = _step(f"converting {src} into the weights cache (once; later runs load it)",
                      lambda: weights_cache.build(src, tokenizer=tok, replace=hit))
    except OSError as e:
        _note(f"jaxspec: note: cannot write the weights cache {weights_cache.root()!r} ({e.strerror or _one_line(e)}): "
              "reading the GGUF")
        return _load("target", src, **kw)
    except ValueError as e:  # the GGUF itself: the loader's one line names it
        raise UsageError(f"cannot load the target from {src!r}: {_one_line(e)}") from None
    _note(f"jaxspec: weights cache: {entry} (--no-weights-cache reads the GGUF)")
    return _load("target", entry, **kw)


def _dtype(args):
    import jax.numpy as jnp

    return {"bfloat16": jnp.bfloat16, "float32": jnp.float32, "float16": jnp.float16}[args.dtype]


def _load_pair(args, model_dir: str, assistant_dir: str | None, dtype, gguf_src: str | None = None, tok=None):
    """(target, assistant or None, the compile cache directory or None): the on-disk cache set as
    --compile-cache / --no-compile-cache say, then both models loaded on --backend's config (a GGUF
    target through the weights cache: `_load_target`)."""
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
    target = _load_target(model_dir, gguf_src, tok, dtype=dtype, matmul=matmul)
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
        model_dir, assistant_dir = _by_name(args.model, "--model"), args.assistant
    if args.no_assistant:
        assistant_dir = None
    if draft is not None and drafters.get(draft).DEFAULT.needs_params and assistant_dir is None:
        raise UsageError(f"--draft {draft} needs an assistant: --assistant DIR, or a pair that ships one")
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
                                          min_p=args.min_p, seed=args.seed, presence_penalty=args.presence_penalty,
                                          frequency_penalty=args.frequency_penalty,
                                          repetition_penalty=args.repetition_penalty)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if args.n > 1 and args.compare:
        raise UsageError("--compare runs one generation: it cannot be combined with --n > 1")
    prompt = _prompt_text(args)
    if not prompt:
        raise UsageError("empty prompt")
    model_dir, assistant_dir = _resolve_dirs(args)
    model_dir, gguf_src = _cached_weights(args, model_dir)
    tcfg, _ = _parse_configs(model_dir, assistant_dir)
    _check_block_size(args, tcfg)

    try:
        tok = load_tokenizer(model_dir, args.tokenizer)
        if gguf_src is not None and args.tokenizer is None:
            # a cache entry's tokenizer is the GGUF's, rebuilt: its errors name the file the user's
            # --model stands for (the GGUF's "a base model?" note), not a directory they never gave
            tok.source = gguf_src
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
                  _dir_bytes(gguf_src or model_dir) + (_dir_bytes(assistant_dir) if assistant_dir else 0))
    if assistant_dir is None and not args.no_assistant:
        _note("jaxspec: note: no --assistant given: classic decoding (pass --assistant DIR for speculative decoding)")
    target, assistant, cache_dir = _load_pair(args, model_dir, assistant_dir, dtype, gguf_src,
                                              None if args.tokenizer else tok)

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
    streamed = args.stream
    choices = []  # (result, startup seconds) per choice
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(args.n):  # choice i is its own run with seed + i (the server's n too)
            seed = (args.seed + i) % sampling.SEED_LIMIT
            kw["params"] = dataclasses.replace(request, seed=seed)
            if args.n > 1 and show:
                sys.stdout.write(f"[choice {i}, seed {seed}]\n")
            t0 = time.perf_counter()
            if streamed:
                result = _generate_streamed(target, ids, assistant, tok, kw, args.stream_rounds, show, caught)
            else:
                result = jaxspec.generate(target, [ids], assistant=assistant, **kw)
                if show:
                    sys.stdout.write(tok.decode(result.tokens[0]) + "\n")
                    sys.stdout.flush()
            wall = time.perf_counter() - t0
            startup = max(0.0, wall - result.stats.prefill_s - result.stats.decode_s)
            choices.append((result, startup))
            if args.n > 1 and show and not args.no_stats:
                print(_stats_line(result.stats, startup), flush=True)
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
    if args.json and args.n > 1:
        print(json.dumps(dict(choices=[dict(index=i, text=tok.decode(r.tokens[0]), tokens=r.tokens[0],
                                            stats=r.stats.as_dict(), startup_s=s) for i, (r, s) in enumerate(choices)],
                              prompt_tokens=len(ids), streamed=streamed)))
    elif args.json:
        out = dict(text=tok.decode(result.tokens[0]), prompt_tokens=len(ids), tokens=result.tokens[0],
                   stats=stats.as_dict(), startup_s=startup, streamed=streamed)
        if classic is not None:
            c = classic.stats.decode_tokens_per_s
            out["classic"] = dict(tokens=classic.tokens[0], stats=classic.stats.as_dict())
            out["speedup"] = stats.decode_tokens_per_s / c if c > 0 else None
            out["identical_to_classic"] = identical
        print(json.dumps(out))
    elif not args.no_stats and args.n == 1:
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
    name, aliases = _served_names(args, model_dir)
    model_dir, gguf_src = _cached_weights(args, model_dir)
    tcfg, _ = _parse_configs(model_dir, assistant_dir)
    _check_block_size(args, tcfg)
    try:
        tok = load_tokenizer(model_dir, args.tokenizer)
    except TokenizerError as e:
        raise UsageError(str(e)) from None
    _check_backend()
    dtype = _dtype(args)
    config = _serve_config(args).resolved()  # the machine's slots and positions where no flag names them
    _check_batch_memory(tcfg, config, args.block_size if assistant_dir or args.draft == "ngram" else 1, dtype,
                        _dir_bytes(gguf_src or model_dir) + (_dir_bytes(assistant_dir) if assistant_dir else 0))
    target, assistant, _ = _load_pair(args, model_dir, assistant_dir, dtype, gguf_src, None if args.tokenizer else tok)
    srv = server.Server(target, assistant, tok, config, model_name=name, aliases=aliases, drafter=args.draft)
    if not args.no_warmup:  # the library's lines (_library_notes) name each compile between these two
        _note("jaxspec: warming up: compiling the first programs (a new shape compiles on its first request) ...")
        _note(f"jaxspec: warmed up in {srv.warm_up():.1f} s")
    # /v1/chat/completions only for a model that can chat (without a template the server refuses it)
    endpoints = "/v1/completions" + (", /v1/chat/completions" if tok.has_chat_template else "")
    guard = ("API key required" if api_key else "no API key") + (
        f", CORS for {', '.join(origins)}" if origins else "")  # never the key itself
    server.serve(srv, args.host, args.port,
                 announce=lambda: _note(f"jaxspec: serving {name!r}{''.join(f' (also {a!r})' for a in aliases)} on "
                                        f"http://{args.host}:{args.port} "
                                        f"(OpenAI-compatible: {endpoints}; {guard})"),
                 api_key=api_key, allow_origins=origins, max_body_bytes=args.max_body_bytes,
                 allowed_hosts=tuple(args.allowed_host or ()), max_connections=max_connections,
                 idle_timeout=args.idle_timeout, header_timeout=args.header_timeout, body_timeout=args.body_timeout)
    return EXIT_OK


def _check_batch_memory(tcfg, config, block_size: int, dtype, weight_bytes: int) -> None:
    """UsageError when the resolved serving config's slots (`max_batch`) cannot fit the memory the
    run may fill (`memory_limit`; the estimate, serve_memory.batch_memory, bounds the warm-up's peak
    too: the KV pool (--kv-positions, else the server's positions per slot), the decode step's
    temporaries, the paged views of a request's positions, the verify logits, the weights and on a
    CPU the process itself)."""
    from jaxspec.engine.memory import batch_memory, largest_batch, largest_pool

    max_batch, kv_positions = config.max_batch, config.kv_positions

    mem = memory_limit()
    if mem is None:
        return
    limit, what, host = mem
    kw = _serve_memory_kw(tcfg, config, host)
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
                         f"{what}: lower --max-batch" + (f" (at most {fits})" if fits else " (not even 1 fits)")
                         + _fewer_snapshots(need, limit))


def _serve_memory_kw(tcfg, config, host: bool) -> dict:
    """`batch_memory`'s keywords for a resolved serving config (besides the slots and the pool): the
    server's positions per slot, a request's capacity, prefix reuse and its ring snapshots."""
    from jaxspec.engine.loop_config import slot_capacity
    from jaxspec.serve.config import BATCH_CONTEXT

    context = tcfg.max_position_embeddings
    return dict(capacity=slot_capacity(context, BATCH_CONTEXT), host=host,  # the server's pool per slot
                request_capacity=config.request_capacity(context),  # Server.batch_capacity
                prefix_cache=config.prefix_cache, ring_snapshots=config.ring_snapshots)


def _fewer_snapshots(need, limit: int) -> str:
    """The other way to fit, when prefix reuse's ring snapshots are what does not: how many do."""
    rest, each = need.total - need.snapshots, need.snapshot_bytes
    if not need.snapshots or rest > limit:
        return ""
    n = (limit - rest) // each
    return (f", or keep fewer ring snapshots: --ring-snapshots {n} ({_fmt_bytes(each)} each)" if n
            else "") + ", or --no-prefix-cache"


# ---------------------------------------------------------------------------------------------
# tiny-pair


# ---------------------------------------------------------------------------------------------
# convert


# ---------------------------------------------------------------------------------------------
# main


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


# What each subcommand of `build_parser` runs.
COMMANDS = {"generate": cmd_generate, "serve": cmd_serve, "tiny-pair": cmd_tiny_pair, "convert": cmd_convert}


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
        return _guarded(COMMANDS[args.command], args, getattr(args, "debug", False))


if __name__ == "__main__":
    sys.exit(main())
