"""The `jaxspec` command line: every subcommand's flags and help."""
from __future__ import annotations

import argparse
from jaxspec import weights_cache
from jaxspec.engine import compile_cache
from jaxspec.engine.generate import MAX_BLOCK_SIZE, MAX_ROUNDS_PER_CHUNK
from jaxspec.drafters.base import KINDS as DRAFT_KINDS
from jaxspec.serve.config import PLATFORM_DEFAULTS, RANGES as SERVE_KNOBS, ServeConfig
from jaxspec.cli.serve_flags import DEFAULT_MAX_CONNECTIONS, FD_RESERVE

SERVE = ServeConfig()  # serve's defaults


def _multiple_of(knob: str, after_default: str = "") -> str:
    """A serve knob's range, multiple and default, as its flag's help says them."""
    k = SERVE_KNOBS[knob]
    return f"{k.span} and a multiple of {k.multiple} (default {getattr(SERVE, knob)}{after_default})"


MODEL_HELP = ("the target model: a directory (config.json, *.safetensors, tokenizer.json), a .gguf file (or a "
              "directory holding one), or a model name: gemma-3-270m (Gemma 3 270M, the gemma3 extra's GGUF)")
WEIGHTS_CACHE_HELP = ("read a GGUF --model as it is, every run (default: its weights are converted once into "
                      f"${weights_cache.ENV}, else {weights_cache.DEFAULT_DIR}, and later runs load them from there)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="jaxspec", description="Speculative decoding (Gemma 4 + MTP assistant) in JAX.")
    p.add_argument("--version", action="version", version=f"jaxspec {_version()}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")

    g = sub.add_parser("generate", help="generate text from a prompt",
                       description="Generate text with a target model and (optionally) its MTP assistant. "
                                   "Without --model the embedded default pair is used.")
    g.add_argument("prompt", help="the prompt text ('-' reads it from stdin); it must be valid UTF-8 (else exit "
                                  "status 2; nothing is replaced)")
    g.add_argument("--model", metavar="DIR|FILE.gguf|NAME", help=MODEL_HELP)
    g.add_argument("--assistant", metavar="DIR", help="assistant (MTP drafter) directory for --model")
    g.add_argument("--pair", metavar="NAME|DIR",
                   help="without --model: a named pair, 'gemma-3-270m' (Gemma 3 270M from the gemma3 extra with the "
                        "drafter shipped for it, when one is: none is yet, so it needs --assistant DIR, a drafter "
                        "you trained) or 'default' (the embedded toy pair, also what no --model means), or a pair "
                        "directory laid out like the default pair (target/, assistant/, tokenizer.json)")
    g.add_argument("--no-assistant", action="store_true", help="classic decoding (no drafting)")
    g.add_argument("--draft", choices=DRAFT_KINDS, default=None,
                   help="what drafts: mtp (the assistant; the default when there is one), ngram (prompt lookup: "
                        "the continuation of the last tokens' latest earlier occurrence in the prompt and output; no "
                        "drafter model, pays when the text copies its prompt, e.g. code edits, extraction) or hybrid "
                        "(prompt lookup where the last 2-3 tokens occurred before, else the assistant)")
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
    g.add_argument("--presence-penalty", type=float, default=0.0, metavar="P",
                   help="OpenAI's: lower each token's logit by P once it was generated (-2..2; default 0, off)")
    g.add_argument("--frequency-penalty", type=float, default=0.0, metavar="F",
                   help="OpenAI's: lower each token's logit by F times the times it was generated (-2..2; "
                        "default 0, off)")
    g.add_argument("--repetition-penalty", type=float, default=1.0, metavar="R",
                   help="HF's: divide the positive logits (multiply the negative ones) of every token in the prompt "
                        "and the output by R (0.01..100; default 1, off; e.g. 1.3 keeps a small model from looping)")
    g.add_argument("--seed", type=int, default=0, metavar="S",
                   help="sampling seed, an integer in [0, 2**64) (default 0)")
    g.add_argument("--n", type=int, default=1, metavar="N",
                   help="choices to generate, 1..16 (default 1): choice i runs with seed S + i, printed one after "
                        "another under a numbered header")
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
    g.add_argument("--no-weights-cache", action="store_true", help=WEIGHTS_CACHE_HELP)
    g.add_argument("--debug", action="store_true", help="show tracebacks")

    v = sub.add_parser("serve", help="serve the pair over HTTP (OpenAI-compatible completions and chat)",
                       description="An OpenAI-compatible server (needs the `serve` extra: FastAPI, uvicorn). "
                                   "Without --model the embedded default pair is served.")
    v.add_argument("--model", metavar="DIR|FILE.gguf|NAME", help=MODEL_HELP)
    v.add_argument("--assistant", metavar="DIR", help="assistant (MTP drafter) directory for --model")
    v.add_argument("--pair", metavar="NAME|DIR", help="without --model: a named pair (gemma-3-270m, default) or a "
                                                     "pair directory laid out like the default pair")
    v.add_argument("--no-assistant", action="store_true", help="classic decoding (no drafting)")
    v.add_argument("--draft", choices=DRAFT_KINDS, default=None,
                   help="what drafts: mtp (the assistant; the default when there is one), ngram (prompt lookup, "
                        "no drafter model) or hybrid (prompt lookup where it matches, else the assistant)")
    v.add_argument("--tokenizer", metavar="FILE", help="tokenizer.json to use instead of the model directory's")
    v.add_argument("--model-name", metavar="NAME", help="the model id clients name (default: the name --model or "
                                                       "--pair gave a known model, its file's name also accepted; "
                                                       "else the model directory's or file's name, or "
                                                       "jaxspec-default-pair)")
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
    v.add_argument("--max-queue", type=int, default=SERVE.max_queue, metavar="N",
                   help=f"requests waiting beyond the running batch, {SERVE_KNOBS['max_queue'].span} (default "
                        f"{SERVE.max_queue}); more get HTTP 429")
    v.add_argument("--block-size", type=int, default=SERVE.block_size, metavar="K",
                   help=f"verify width K, {SERVE_KNOBS['block_size'].span} (default {SERVE.block_size}; 1 decodes "
                        "classically)")
    v.add_argument("--prefill-chunk", type=int, default=SERVE.prefill_chunk, metavar="N",
                   help=f"the width prompts are cut into, {_multiple_of('prefill_chunk')}: a prompt advances "
                        "one chunk per step, between the decode steps, so the running streams wait for chunks, not a "
                        "whole prefill; wider chunks prefill a long prompt faster and make a step with chunks longer")
    budget = ("the decode rounds of every slot count first, what is left buys one --prefill-chunk of as many waiting "
              "prompts as fit (at least one), in one program; larger budgets admit bursts sooner (throughput, time "
              "to first token) and make the running streams' worst gap longer")
    v.add_argument("--step-tokens", type=int, default=SERVE.step_tokens, metavar="N",
                   help=f"a step's token budget, {_multiple_of('step_tokens', ', provisional until measured')}: {budget}")
    v.add_argument("--max-batch", type=int, default=SERVE.max_batch, metavar="N",
                   help=f"requests decoding together, continuously batched, {SERVE_KNOBS['max_batch'].span} "
                        "(default 4 on a GPU: with K = 4, 16 verify rows, the multirow kernel's window; 1 on a CPU, "
                        "where every step computes a whole row bucket: from 2 slots on, 16 rows). Memory grows with N: the slots share a KV pool of N x (the "
                        "context, at most 4096) positions (or --kv-positions), 3.5 times over with the decode step's "
                        "temporaries, plus 4 float32 logits of (K + 1) x vocabulary; checked at start, on a CPU "
                        "with ~1.5 GiB for the process, against the host memory less a tenth for the system, the "
                        "cgroup's limit and what is available now (the warm-up stays under it). The warm-up "
                        "compiles the same programs whatever N (each one logged; minutes on "
                        "a CPU), then runs steps over all N slots")
    v.add_argument("--kv-positions", type=int, default=SERVE.kv_positions, metavar="N",
                   help=f"the KV pool the slots share, in cache positions: a multiple of "
                        f"{SERVE_KNOBS['kv_positions'].multiple} (its blocks), {SERVE_KNOBS['kv_positions'].span} "
                        "(default: --max-batch x the context, at most 4096, e.g. 16384 at "
                        "--max-batch 4). A request holds the blocks its prompt + max_tokens + K need while it runs: "
                        "one that fits waits in the queue until enough blocks are free; one longer than the whole "
                        "pool is refused with HTTP 400. The memory check at start counts this pool in place of "
                        "--max-batch x 4096 positions")
    v.add_argument("--max-context", type=int, default=SERVE.max_context, metavar="N",
                   help=f"positions one request may hold, its prompt and output, a multiple of "
                        f"{SERVE_KNOBS['max_context'].multiple}, {SERVE_KNOBS['max_context'].span}, at most the "
                        f"model's context (default 32768 on a GPU, {PLATFORM_DEFAULTS['cpu']['max_context']} on a CPU, "
                        "the KV pool's 4096 a slot). Longer requests are refused with HTTP 400")
    v.add_argument("--rounds-per-chunk", type=int, default=SERVE.rounds_per_chunk, metavar="R",
                   help=f"decode rounds between two reads of the new tokens and two admissions, "
                        f"{SERVE_KNOBS['rounds_per_chunk'].span} (default {SERVE.rounds_per_chunk}; 1 suits a large "
                        "model: on the H200 the 12B streams 6%% faster with half the time to first token)")
    v.add_argument("--no-prefix-cache", action="store_true",
                   help="prefill every prompt whole: by default a prompt's full KV blocks that an earlier prompt "
                        "computed (the same tokens from the start: a shared system prompt, a chat's earlier turns) "
                        "are shared, not prefilled again, with the same output either way; cached blocks nobody "
                        "holds are evicted, least recently used first, when a request needs the memory")
    v.add_argument("--ring-snapshots", type=int, default=SERVE.ring_snapshots, metavar="N",
                   help=f"copies of a slot's sliding-window rings that prefix reuse keeps, "
                        f"{SERVE_KNOBS['ring_snapshots'].span} (default: one per two slots, at least 4): a prompt "
                        "finds its cached blocks only up to a chunk boundary a copy was taken at (its last one, a "
                        "prefix another prompt shared, any while there is room); each is a slot's rings (341 MB "
                        "at 12B shapes), counted by the memory check")
    v.add_argument("--backend", choices=("auto", "pallas", "xla"), default="auto")
    v.add_argument("--dtype", choices=("bfloat16", "float32", "float16"), default="bfloat16")
    v.add_argument("--no-warmup", action="store_true", help="start serving before compiling anything")
    v.add_argument("--compile-cache", metavar="DIR", default=None)
    v.add_argument("--no-compile-cache", action="store_true")
    v.add_argument("--no-weights-cache", action="store_true", help=WEIGHTS_CACHE_HELP)
    v.add_argument("--debug", action="store_true", help="show tracebacks")

    t = sub.add_parser("tiny-pair", help="write a tiny random target + assistant + tokenizer (smoke tests)")
    t.add_argument("dir", help="output directory (gets target/ and assistant/)")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--force", action="store_true", help="write into DIR even if it is not empty (its target/ and "
                                                        "assistant/ model files and tokenizer.json are replaced)")
    t.add_argument("--debug", action="store_true", help="show tracebacks")

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

    return p


def _version() -> str:
    try:
        from importlib.metadata import version
        return version("jaxspec")
    except Exception:
        return "0.1.0 (source)"
