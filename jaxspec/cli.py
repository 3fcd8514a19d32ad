"""The `jaxspec` command line.

    jaxspec generate "def fibonacci(n):" --max-tokens 64 --compare      # the embedded default pair
    jaxspec generate "Hello" --model DIR --assistant DIR --stream
    jaxspec generate "Why is the sky blue?" --model DIR --assistant DIR --chat --temperature 0.7 --top-p 0.95
    jaxspec bench ...                                                   # benchmarks/speculative_bench.py
    jaxspec tiny-pair DIR                                               # a tiny random pair (smoke tests)

`generate` prints the generated text on stdout, then one stats line (decode tokens/s, acceptance,
mean accepted length, speedup over classic decoding with --compare). Progress, the compile notice
and warnings go to stderr. Bad input (a missing model directory, a directory that is not a model,
an assistant for another target, a prompt longer than the context, ...) is one line on stderr and
exit status 2; --debug shows the traceback instead.

Compiled programs are cached on disk (JAX's persistent compilation cache) in
$JAXSPEC_COMPILE_CACHE, default ~/.cache/jaxspec/jax; JAXSPEC_COMPILE_CACHE=0 or
--no-compile-cache turns it off, and an explicit JAX_COMPILATION_CACHE_DIR wins.
"""
from __future__ import annotations

import argparse
import glob
import importlib.util
import itertools
import json
import os
import sys
import time
import traceback
import warnings
from pathlib import Path

EXIT_OK, EXIT_ERROR, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130
PACKAGE_DIR = Path(__file__).resolve().parent
DEFAULT_PAIR_DIR = PACKAGE_DIR / "default_pair"
BENCH_SCRIPT = PACKAGE_DIR.parent / "benchmarks" / "speculative_bench.py"
COMPILE_CACHE_ENV = "JAXSPEC_COMPILE_CACHE"


class UsageError(Exception):
    """Bad input: reported as one line, exit status 2."""


def _err(msg: str) -> None:
    print(f"jaxspec: {msg}", file=sys.stderr, flush=True)


def _note(msg: str, end: str = "\n") -> None:
    print(msg, file=sys.stderr, end=end, flush=True)


def _one_line(e: BaseException) -> str:
    s = " ".join(str(e).split())
    return s or type(e).__name__


# ---------------------------------------------------------------------------------------------
# Model directories, the default pair, the compile cache


def _read_config(path: str, role: str) -> dict:
    """config.json of a model directory, with the checks that make a directory a model."""
    if not os.path.exists(path):
        raise UsageError(f"{role} directory {path!r} does not exist")
    if not os.path.isdir(path):
        raise UsageError(f"{role} path {path!r} is not a directory")
    cpath = os.path.join(path, "config.json")
    if not os.path.isfile(cpath):
        raise UsageError(f"{path!r} is not a model directory: no config.json")
    try:
        with open(cpath) as f:
            d = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise UsageError(f"{path!r} is not a model directory: config.json is unreadable ({_one_line(e)})") from None
    if not isinstance(d, dict):
        raise UsageError(f"{path!r} is not a model directory: config.json is not a JSON object")
    if not glob.glob(os.path.join(path, "*.safetensors")):
        raise UsageError(f"{path!r} is not a model directory: no *.safetensors weights")
    return d


def _parse_configs(model_dir: str, assistant_dir: str | None):
    """(target config dict, TargetConfig, AssistantConfig or None), pairing checked, from the
    config files alone (nothing is loaded)."""
    import models

    d = _read_config(model_dir, "model")
    try:
        tcfg = models.TargetConfig.from_dict(d)
    except (ValueError, NotImplementedError) as e:
        raise UsageError(f"{model_dir!r} is not a usable Gemma 4 target model: {_one_line(e)}") from None
    acfg = None
    if assistant_dir is not None:
        ad = _read_config(assistant_dir, "assistant")
        try:
            acfg = models.AssistantConfig.from_dict(ad)
        except (ValueError, NotImplementedError) as e:
            raise UsageError(f"{assistant_dir!r} is not a usable Gemma 4 assistant (MTP drafter): "
                             f"{_one_line(e)}") from None
        try:
            models.check_fit(acfg, tcfg)
        except ValueError as e:
            detail = _one_line(e).replace("assistant does not fit the target: ", "")
            raise UsageError(f"assistant {assistant_dir!r} was made for a different target than "
                             f"{model_dir!r}: {detail}") from None
    return d, tcfg, acfg


def context_length(config: dict) -> int | None:
    """max_position_embeddings of a target config.json (top level or text_config), or None."""
    for d in (config, config.get("text_config") or {}):
        v = d.get("max_position_embeddings")
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    return None


def default_pair_dirs() -> tuple[str, str] | None:
    """(target dir, assistant dir) of the embedded default pair, or None when it is not installed.

    Uses `jaxspec.default_pair` (`default_pair_available()` / `default_pair_path()`, which honour
    $JAXSPEC_DEFAULT_PAIR): the pair directory holds target/, assistant/ and a shared
    tokenizer.json. Without that module, model directories under jaxspec/default_pair/ are told
    apart by their config.json model_type."""
    try:
        from . import default_pair as dp
    except Exception:
        dp = None
    available = getattr(dp, "default_pair_available", None)
    path_fn = getattr(dp, "default_pair_path", None)
    if callable(available) and callable(path_fn):
        if not available():
            return None
        root = path_fn()
        return os.path.join(root, "target"), os.path.join(root, "assistant")
    if not DEFAULT_PAIR_DIR.is_dir():
        return None
    target = assistant = None
    for cfg in sorted(DEFAULT_PAIR_DIR.glob("*/config.json")):
        try:
            mt = json.loads(cfg.read_text()).get("model_type", "")
        except (OSError, ValueError, AttributeError):
            continue
        if "assistant" in mt:
            assistant = assistant or str(cfg.parent)
        elif mt.startswith("gemma4"):
            target = target or str(cfg.parent)
    if target and assistant:
        return target, assistant
    return None


def enable_compile_cache(path: str | None = None) -> str | None:
    """Turn on JAX's persistent compilation cache (a later run with the same shapes skips
    compilation). Returns the directory, or None when it is off ($JAXSPEC_COMPILE_CACHE=0) or JAX's
    own JAX_COMPILATION_CACHE_DIR already decides."""
    import jax

    if os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        return None
    raw = path or os.environ.get(COMPILE_CACHE_ENV, "")
    if raw.lower() in ("0", "off", "false", "no"):
        return None
    if not raw:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        raw = os.path.join(base, "jaxspec", "jax")
    try:
        os.makedirs(raw, exist_ok=True)
        jax.config.update("jax_compilation_cache_dir", raw)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    except Exception:  # a read-only home, an old JAX: run without the cache
        return None
    return raw


def _dir_bytes(path: str) -> int:
    return sum(os.path.getsize(f) for f in glob.glob(os.path.join(path, "*.safetensors")))


def _fmt_bytes(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def _load(kind: str, path: str, **kw):
    import models

    size = _dir_bytes(path)
    big = size > (1 << 30)
    _note(f"loading {kind} from {path} ({_fmt_bytes(size)}) ...", end="\n" if big else "")
    t0 = time.perf_counter()
    try:
        loader = models.load_target if kind == "target" else models.load_assistant
        model = loader(path, progress=big, **kw)
    except (ValueError, NotImplementedError) as e:
        if not big:
            _note("")
        raise UsageError(f"cannot load the {kind} from {path!r}: {_one_line(e)}") from None
    dt = time.perf_counter() - t0
    _note(f"loaded {kind} in {dt:.1f} s" if big else f" {dt:.1f} s")
    return model


def _matmul_config(choice: str):
    import jax

    from pallas_kernels import DispatchConfig

    on_gpu = jax.default_backend() == "gpu"
    if choice == "auto":
        if os.environ.get("JAXSPEC_MATMUL_BACKEND"):
            return DispatchConfig()
        return DispatchConfig() if on_gpu else DispatchConfig(backend="xla")
    if choice == "pallas" and not on_gpu:
        _note("jaxspec: note: no GPU: the Pallas kernels run in interpret mode (very slow); "
              "--backend xla is the fast choice on CPU")
    return DispatchConfig(backend=choice)


# ---------------------------------------------------------------------------------------------
# generate


def _prompt_text(args) -> str:
    if args.prompt == "-":
        return sys.stdin.read()
    return args.prompt


def _resolve_dirs(args) -> tuple[str, str | None]:
    if args.model is None:
        if args.assistant is not None:
            raise UsageError("--assistant needs --model (the target it drafts for)")
        pair = default_pair_dirs()
        if pair is None:
            raise UsageError("no model given and the embedded default pair is not installed: pass --model DIR")
        model_dir, assistant_dir = pair
    else:
        model_dir, assistant_dir = args.model, args.assistant
    if args.no_assistant:
        assistant_dir = None
    return model_dir, assistant_dir


def _stats_line(stats, startup_s: float, classic=None, identical: bool | None = None) -> str:
    if stats.mode == "speculative":
        parts = [f"speculative K={stats.block_size}" + (f" (verify width {stats.verify_width})"
                                                        if stats.verify_width != stats.block_size else ""),
                 f"{stats.new_tokens} new tokens", f"decode {stats.decode_tokens_per_s:.1f} tok/s",
                 f"acceptance {100 * stats.acceptance_rate:.1f}%",
                 f"mean accepted length {stats.mean_accepted_len:.2f}",
                 f"{stats.tokens_per_round:.2f} tokens/round"]
    else:
        parts = ["classic", f"{stats.new_tokens} new tokens", f"decode {stats.decode_tokens_per_s:.1f} tok/s"]
    parts += [f"prefill {stats.prefill_s:.3f} s", f"startup {startup_s:.1f} s"]
    if stats.fallback:
        parts.append(f"fell back to classic: {stats.fallback}" if stats.mode == "classic" else stats.fallback)
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
    """Stream the text to stdout as rounds complete; returns the GenerationResult, or None when
    streaming is unavailable (then nothing was printed and the caller generates normally)."""
    from . import streaming
    from .tokenizer import IncrementalDecoder

    dec = IncrementalDecoder(tok)
    result = None
    try:
        chunks = streaming.stream_generate(target, [ids], assistant=assistant, rounds_per_chunk=rounds_per_chunk,
                                           **kw)
        first = next(chunks)
    except streaming.StreamingUnavailable as e:
        _note(f"jaxspec: note: streaming is unavailable ({_one_line(e)}); the text is printed at the end")
        return None
    for chunk in itertools.chain([first], chunks):
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
    from .sampling import validate_sampling
    from .tokenizer import TokenizerError, load_tokenizer

    try:
        validate_sampling(args.temperature, args.top_k, args.top_p)
    except ValueError as e:
        raise UsageError(str(e)) from None
    prompt = _prompt_text(args)
    if not prompt:
        raise UsageError("empty prompt")
    model_dir, assistant_dir = _resolve_dirs(args)
    tdict, tcfg, acfg = _parse_configs(model_dir, assistant_dir)

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
    ctx = context_length(tdict)
    if ctx is not None:
        if len(ids) >= ctx:
            raise UsageError(f"the prompt is {len(ids)} tokens, longer than the model's context of {ctx} tokens "
                             "(max_position_embeddings)")
        if len(ids) + max_tokens > ctx:
            max_tokens = ctx - len(ids)
            _note(f"jaxspec: note: --max-tokens lowered to {max_tokens} to fit the context of {ctx} tokens")
    stop = () if args.ignore_eos else tok.eos_token_ids

    import jax.numpy as jnp

    if assistant_dir is None and not args.no_assistant:
        _note("jaxspec: note: no --assistant given: classic decoding (pass --assistant DIR for speculative decoding)")
    if not args.no_compile_cache:
        enable_compile_cache()
    matmul = _matmul_config(args.backend)
    dtype = {"bfloat16": jnp.bfloat16, "float32": jnp.float32, "float16": jnp.float16}[args.dtype]
    target = _load("target", model_dir, dtype=dtype, matmul=matmul)
    assistant = _load("assistant", assistant_dir, dtype=dtype, matmul=matmul, target=target) if assistant_dir else None

    verify_pad = None if args.verify_pad is None else args.verify_pad == "on"
    kw = dict(max_new_tokens=max_tokens, block_size=args.block_size, temperature=args.temperature,
              top_k=args.top_k, top_p=args.top_p, seed=args.seed, eos_token_ids=stop, verify_pad=verify_pad)
    mode = "speculative decode loop" if assistant is not None else "decode loop"
    _note(f"compiling the {mode} (first run for these shapes can take a while; later runs reuse the "
          "on-disk compile cache) ...")

    show = not args.json
    t0 = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = None
        if args.stream:
            result = _generate_streamed(target, ids, assistant, tok, kw, args.stream_rounds, show, caught)
        streamed = result is not None
        if result is None:
            result = jaxspec.generate(target, [ids], assistant=assistant, **kw)
            if show:
                sys.stdout.write(tok.decode(result.tokens[0]) + "\n")
                sys.stdout.flush()
        wall = time.perf_counter() - t0
        startup = max(0.0, wall - result.stats.prefill_s - result.stats.decode_s)
        classic = identical = None
        if args.compare and assistant is not None:
            _note("running classic decoding for --compare (compiled on first use) ...")
            classic = jaxspec.generate(target, [ids], assistant=None, **kw)
            if args.temperature == 0:
                identical = classic.tokens == result.tokens
        elif args.compare:
            _note("jaxspec: note: --compare needs an assistant; nothing to compare")
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
# bench, tiny-pair


def cmd_bench(argv: list[str]) -> int:
    """Forward to benchmarks/speculative_bench.py's main(argv) (a source checkout only: the
    benchmarks are not part of the installed package)."""
    if not BENCH_SCRIPT.is_file():
        raise UsageError(f"jaxspec bench needs {BENCH_SCRIPT.relative_to(BENCH_SCRIPT.parent.parent)} from a source "
                         f"checkout (not found at {BENCH_SCRIPT}); clone the repository and `pip install -e .`")
    for p in (str(BENCH_SCRIPT.parent), str(BENCH_SCRIPT.parent.parent)):
        if p not in sys.path:
            sys.path.insert(0, p)
    spec = importlib.util.spec_from_file_location("speculative_bench", BENCH_SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["speculative_bench"] = mod
    spec.loader.exec_module(mod)
    main_fn = getattr(mod, "main", None)
    if not callable(main_fn):
        raise UsageError(f"{BENCH_SCRIPT} has no main(argv)")
    try:
        rc = main_fn(list(argv))
    except SystemExit as e:  # argparse --help / usage errors inside the benchmark
        rc = e.code
    if rc is None:
        return EXIT_OK
    return rc if isinstance(rc, int) else EXIT_ERROR


_DEMO_CORPUS = """\
def fibonacci(n):
    if n < 2:
        return n
    return fibonacci(n - 1) + fibonacci(n - 2)

def factorial(n):
    result = 1
    for i in range(2, n + 1):
        result *= i
    return result

class Stack:
    def __init__(self):
        self.items = []

    def push(self, item):
        self.items.append(item)

    def pop(self):
        return self.items.pop()

for name, value in sorted(table.items()):
    print(f"{name}: {value}")

Speculative decoding lets a small draft model propose several tokens and a large target model
check them all in one forward pass. Every draft up to the first disagreement is kept, plus one
token from the target, so the output is exactly what the target alone would have written.
The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single
step. Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000. Punctuation: ( ) [ ] { } < > = + - * / % , . ; :
Unicode: café, naïve, über, smörgåsbord, 東京, 日本語, ☃, π ≈ 3.14159.
"""


def _demo_text() -> str:
    return _DEMO_CORPUS * 3


def write_tiny_pair(path: str, *, seed: int = 0, vocab_size: int = 512, context: int = 256,
                    target_layers: int = 2) -> tuple[str, str]:
    """Write a tiny random Gemma-4-shaped target + assistant (4-bit MLX format, bf16 scales) and a
    byte-level BPE tokenizer trained on a few KB of text to `path/target` and `path/assistant`.
    Returns the two directories. For smoke tests and the quickstart notebook: the text it generates
    is noise, and acceptance is whatever random weights give."""
    import jax.numpy as jnp
    import numpy as np

    import models
    from models.checkpoint import INDEX, LINEAR
    from models.config import FULL, SLIDING
    from models.presets import tiny_assistant_dict, tiny_target_dict
    from pallas_kernels import QuantizedWeight

    from .tokenizer import DEMO_SPECIAL_TOKENS, train_byte_bpe

    if target_layers < 1:
        raise ValueError("target_layers must be >= 1")
    types = [SLIDING] * (target_layers - 1) + [FULL]
    td = tiny_target_dict(vocab_size=vocab_size, num_hidden_layers=target_layers, layer_types=types)
    ad = tiny_assistant_dict(td, text=dict(hidden_size=td["hidden_size"], num_hidden_layers=1,
                                           num_kv_shared_layers=1, layer_types=[FULL]))
    tcfg, acfg = models.TargetConfig.from_dict(td), models.AssistantConfig.from_dict(ad)
    rng = np.random.default_rng(seed)
    gs = 32

    def params(shapes):
        out = {}
        for name in sorted(shapes):
            shape, kind = shapes[name]
            if kind == INDEX:
                out[name] = jnp.asarray(rng.permutation(shape[0]), jnp.int32)
            elif kind == LINEAR and shape[-1] % gs == 0:
                n, k = shape
                a = float(np.sqrt(3.0 / k))
                words = rng.integers(0, 2**32, (n, k // 8), dtype=np.uint32)
                scales = (2 * a / 15) * rng.uniform(0.8, 1.2, (n, k // gs))
                biases = -a * rng.uniform(0.8, 1.2, (n, k // gs))
                out[name] = QuantizedWeight(jnp.asarray(words), jnp.asarray(scales, jnp.bfloat16),
                                            jnp.asarray(biases, jnp.bfloat16), 4, gs)
            elif kind == LINEAR:
                a = float(np.sqrt(3.0 / shape[-1]))
                out[name] = jnp.asarray(rng.uniform(-a, a, shape), jnp.bfloat16)
            else:
                out[name] = jnp.asarray(1.0 + 0.1 * rng.standard_normal(shape), jnp.bfloat16)
        return out

    # Random weights alone make a model that repeats one token and an assistant that never agrees
    # with it. Shape them (as tests/test_generate.py does) so the demo says something about
    # speculation: the target's blocks are damped and its final norm gets random signs, so its next
    # token is mostly a function of the current one; the assistant shares the target's embedding
    # table and final norm and passes the token embedding straight through (identity
    # pre-projection, damped blocks), so it predicts that function often but not always.
    tp = params(models.target_shapes(tcfg))
    h = tcfg.hidden_size
    tp["norm"] = jnp.asarray(rng.choice([-1.0, 1.0], h) * rng.uniform(0.5, 1.5, h), jnp.bfloat16)
    post = ("post_attention_layernorm", "post_feedforward_layernorm")
    for name in tp:
        if name.endswith(post):
            tp[name] = tp[name] * 0.2
    ap = params(models.assistant_shapes(acfg))
    ap["embed_tokens"], ap["norm"] = tp["embed_tokens"], tp["norm"]
    mix = 0.03 * rng.standard_normal((h, h)) / np.sqrt(h)
    ap["pre_projection"] = jnp.asarray(np.concatenate([np.eye(h), mix], 1), jnp.bfloat16)
    for name in ap:
        if name.endswith(post):
            ap[name] = ap[name] * 0.03
    target = models.Target(config=tcfg, params=tp)
    assistant = models.Assistant(config=acfg, params=ap)
    tdir, adir = os.path.join(path, "target"), os.path.join(path, "assistant")
    models.save(target, tdir)
    models.save(assistant, adir)
    extra = dict(max_position_embeddings=context, pad_token_id=0, eos_token_id=1, bos_token_id=2)
    for d in (tdir, adir):
        cpath = os.path.join(d, "config.json")
        with open(cpath) as f:
            cfg = json.load(f)
        cfg.update(extra)
        with open(cpath, "w") as f:
            json.dump(cfg, f, indent=1)
    tok = train_byte_bpe([_demo_text()], vocab_size=vocab_size)
    tok.save(os.path.join(tdir, "tokenizer.json"))
    pad, eos, bos = DEMO_SPECIAL_TOKENS
    with open(os.path.join(tdir, "tokenizer_config.json"), "w") as f:
        json.dump(dict(bos_token=bos, eos_token=eos, pad_token=pad), f, indent=1)
    return tdir, adir


def cmd_tiny_pair(args) -> int:
    tdir, adir = write_tiny_pair(args.dir, seed=args.seed)
    print(f"wrote {tdir} and {adir}\ntry: jaxspec generate \"def f(x):\" --model {tdir} --assistant {adir}")
    return EXIT_OK


# ---------------------------------------------------------------------------------------------
# main


def _positive_int(s: str) -> int:
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {s!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {v}")
    return v


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="jaxspec", description="Speculative decoding (Gemma 4 + MTP assistant) in JAX.")
    p.add_argument("--version", action="version", version=f"jaxspec {_version()}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")

    g = sub.add_parser("generate", help="generate text from a prompt",
                       description="Generate text with a target model and (optionally) its MTP assistant. "
                                   "Without --model the embedded default pair is used.")
    g.add_argument("prompt", help="the prompt text ('-' reads it from stdin)")
    g.add_argument("--model", metavar="DIR", help="target model directory (config.json, *.safetensors, tokenizer.json)")
    g.add_argument("--assistant", metavar="DIR", help="assistant (MTP drafter) directory for --model")
    g.add_argument("--no-assistant", action="store_true", help="classic decoding (no drafting)")
    g.add_argument("--tokenizer", metavar="FILE", help="tokenizer.json to use instead of the model directory's")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template (one user turn)")
    g.add_argument("--max-tokens", type=_positive_int, default=128, metavar="N", help="new tokens at most (default 128)")
    g.add_argument("--temperature", type=float, default=0.0, metavar="T", help="0 = greedy (default)")
    g.add_argument("--top-k", type=_positive_int, default=None, metavar="K")
    g.add_argument("--top-p", type=float, default=None, metavar="P")
    g.add_argument("--seed", type=int, default=0, metavar="S")
    g.add_argument("--block-size", type=_positive_int, default=4, metavar="K",
                   help="verify width K: K-1 drafts + 1 per round (default 4)")
    g.add_argument("--verify-pad", choices=("on", "off"), default=None,
                   help="pad the verify to the tiled matmul path (default: $JAXSPEC_MTP_VERIFY_PAD, else off)")
    g.add_argument("--ignore-eos", action="store_true", help="do not stop at EOS / end-of-turn tokens")
    g.add_argument("--stream", action="store_true", help="print tokens as rounds complete")
    g.add_argument("--stream-rounds", type=_positive_int, default=1, metavar="R",
                   help="rounds per streamed chunk (default 1)")
    g.add_argument("--compare", action="store_true", help="also run classic decoding and report the speedup")
    g.add_argument("--backend", choices=("auto", "pallas", "xla"), default="auto",
                   help="quantized matmul: Pallas kernels (GPU default) or XLA dequantize+dot (CPU default)")
    g.add_argument("--dtype", choices=("bfloat16", "float32", "float16"), default="bfloat16",
                   help="activation / scale dtype (default bfloat16)")
    g.add_argument("--json", action="store_true", help="print one JSON object (text, tokens, stats) instead")
    g.add_argument("--no-stats", action="store_true", help="print only the text")
    g.add_argument("--no-compile-cache", action="store_true", help="do not use the on-disk compilation cache")
    g.add_argument("--debug", action="store_true", help="show tracebacks")
    g.set_defaults(func=cmd_generate)

    t = sub.add_parser("tiny-pair", help="write a tiny random target + assistant + tokenizer (smoke tests)")
    t.add_argument("dir", help="output directory (gets target/ and assistant/)")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--debug", action="store_true", help="show tracebacks")
    t.set_defaults(func=cmd_tiny_pair)

    sub.add_parser("bench", help="run the speculative benchmark (benchmarks/speculative_bench.py; "
                                 "`jaxspec bench --help` for its options)", add_help=False)
    return p


def _version() -> str:
    try:
        from importlib.metadata import version
        return version("jaxspec")
    except Exception:
        return "0.1.0 (source)"


def _guarded(fn, arg, debug: bool) -> int:
    try:
        return fn(arg)
    except UsageError as e:
        if debug:
            traceback.print_exc()
        _err(f"error: {_one_line(e)}")
        return EXIT_USAGE
    except KeyboardInterrupt:
        _err("interrupted")
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # `jaxspec generate ... | head`
        try:
            sys.stdout = open(os.devnull, "w")
        except OSError:
            pass
        return EXIT_OK
    except (ValueError, NotImplementedError) as e:  # input the library refused (sampling, budgets, ...)
        if debug:
            traceback.print_exc()
        _err(f"error: {_one_line(e)}")
        return EXIT_USAGE
    except Exception as e:
        if debug:
            traceback.print_exc()
            return EXIT_ERROR
        _err(f"internal error: {type(e).__name__}: {_one_line(e)[:500]} (rerun with --debug for the traceback)")
        return EXIT_ERROR


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] == "bench":
        rest = argv[1:]
        debug = "--debug" in rest
        return _guarded(cmd_bench, rest, debug)
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse: usage errors exit 2, --help / --version exit 0
        return e.code if isinstance(e.code, int) else EXIT_USAGE
    if args.command is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    return _guarded(args.func, args, getattr(args, "debug", False))


if __name__ == "__main__":
    sys.exit(main())
