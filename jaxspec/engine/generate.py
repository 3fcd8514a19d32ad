"""Public API: `generate` (validate on the host, run, cut, report stats) and `make_generate` (the
jitted function behind it).
"""
from __future__ import annotations

import collections.abc
import dataclasses
import functools
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec import models
from jaxspec.kernels import ROW_TILE
from jaxspec.kernels.xla import program_options

from jaxspec.engine import compile_cache
from jaxspec.engine import loop
from jaxspec.engine import programs
from jaxspec.engine import sampling
from jaxspec.engine import verify
from jaxspec.drafters import base as drafters
from jaxspec.engine.loop_config import BUDGET_BUCKET, PROMPT_BUCKET, LoopConfig, round_up as _round_up, size_bucket  # noqa: F401  (the buckets: named here too)
from jaxspec.engine.verify import MAX_VERIFY_WIDTH  # noqa: F401  (the knobs' bounds are named here)

# The knobs' bounds, one per kind, checked by `check_int` wherever the knob is accepted (generate,
# make_generate, streaming, BatchEngine, the server, the CLI before it loads anything).
# K: a verify of more rows than the kernels' row window (ROW_TILE, the multirow GEMV's tile) is no
# longer one weight read, so it cannot pay; past it K only multiplies compile time (K = 1000 ran
# the exactness probe's 1000 steps and compiled for minutes, deaf to Ctrl-C).
MAX_BLOCK_SIZE = ROW_TILE
# Rounds per streamed chunk / server step: a chunk is one program of exactly that many rounds, and
# past 64 the first tokens wait for the whole chunk (a million rounds never finished).
MAX_ROUNDS_PER_CHUNK = 64
BLOCK_SIZE_WHY = f" (K: at most the kernels' {MAX_BLOCK_SIZE}-row window)"  # said with K's range


def check_int(name: str, value, lo: int, hi: int | None = None, why: str = "") -> int:
    """`value` as an int; ValueError naming `name` and the range (then `why`) unless it is an
    integer (Python or numpy, not a bool) in lo..hi (hi None: no upper bound)."""
    if not _is_int(value) or value < lo or (hi is not None and value > hi):
        rng = f"an integer >= {lo}" if hi is None else f"an integer in {lo}..{hi}"
        raise ValueError(f"{name} must be {rng}{why}, got {value!r}"[:300])
    return int(value)


def check_block_size(block_size, context: int | None = None) -> int:
    """K in 1..MAX_BLOCK_SIZE, and no wider than the model's context when it has one."""
    k = check_int("block_size", block_size, 1, MAX_BLOCK_SIZE, BLOCK_SIZE_WHY)
    if context is not None and k > context:
        raise ValueError(f"block_size={k} is wider than the model's context of {context} tokens")
    return k


# --------------------------------------------------------------------------------------------
# Results


@dataclasses.dataclass
class GenerationStats:
    mode: str                      # "speculative" or "classic"
    block_size: int                # K actually used (1 for classic)
    verify_width: int              # K, or the padded width
    rounds: int                    # loop iterations (verify forwards of the whole batch)
    row_rounds: int                # sum over rows of the rounds each row was active
    drafted: int
    accepted: int
    acceptance_rate: float         # accepted / drafted
    mean_accepted_len: float       # accepted drafts per active row-round
    tokens_per_round: float        # emitted tokens per active row-round (first token excluded)
    accepted_hist: list[int]       # accepted_hist[a]: active row-rounds that accepted a drafts
    new_tokens: int                # all rows, including the first token from prefill
    prefill_s: float
    decode_s: float
    decode_tokens_per_s: float     # new_tokens / decode_s
    fallback: str | None = None    # why speculative decoding was not used (or ran a smaller K) when asked for
    probe_logit_diff: float | None = None  # exactness probe: max |wide verify - single steps| logit
    backend: str | None = None     # the target's matmul path: "xla", "pallas", "pallas (interpret mode)"
    drafter: str | None = None     # the drafter that ran (its kind, jaxspec.drafters.KINDS); None: classic
    draft_stats: dict = dataclasses.field(default_factory=dict)  # the drafter's own counters (ngram:
                                   # matched_rounds, accepted_from_prompt, accepted_from_output)

    # Per-position acceptance, as vLLM and SGLang report it. A round keeps a prefix of its drafts, so
    # draft i is kept exactly in the row-rounds that accepted >= i: suffix sums of the loop's own
    # histogram (one add per round inside the jitted loop), nothing counted twice.
    @property
    def position_accepted(self) -> list[int]:
        """[i - 1]: active row-rounds that kept draft i, for i = 1 .. K-1."""
        return [sum(self.accepted_hist[i:]) for i in range(1, len(self.accepted_hist))]

    @property
    def position_acceptance(self) -> list[float]:
        """[i - 1]: the fraction of active row-rounds that kept draft i (how often draft 1, 2, 3 is kept)."""
        return [n / self.row_rounds if self.row_rounds else 0.0 for n in self.position_accepted]

    def as_dict(self) -> dict[str, Any]:
        return dict(dataclasses.asdict(self), position_accepted=self.position_accepted,
                    position_acceptance=self.position_acceptance)


@dataclasses.dataclass
class GenerationResult:
    tokens: list[list[int]]        # one list per prompt row, cut after the first EOS/stop (inclusive)
    stats: GenerationStats
    # with `logprobs=N`: per row, per token (its log-probability under the target's logits, the N
    # most likely [(id, log-probability)], most likely first); else None
    logprobs: list[list[tuple]] | None = None


# --------------------------------------------------------------------------------------------
# The jitted function


@functools.cache
def _prefill_jit():
    """loop.prefill jitted (shared by every Generator, keyed by PrefillSpec), with jaxspec's program
    options (kernels.xla.program_options: known once the backend is, so made on first use)."""
    return jax.jit(loop.prefill, static_argnums=0, compiler_options=program_options() or None)


@functools.lru_cache(maxsize=None)
def _jits(spec: loop.LoopSpec):
    """The jitted whole run, decode loop and fixed-round decode of one spec (shared by the
    Generators of that spec, whatever their default sampling values)."""
    def generate(t, a, *xs):  # the program names JAX logs (compile_cache.CompileLog)
        return loop.run(spec, t, a, *xs)

    def decode(t, a, s, n):
        return loop.decode(spec, t, a, s, n)

    def decode_rounds(t, a, s, rounds):
        return loop.decode_rounds(spec, t, a, s, rounds)

    opts = program_options() or None
    return (jax.jit(generate, compiler_options=opts), jax.jit(decode, donate_argnums=(2,), compiler_options=opts),
            jax.jit(decode_rounds, static_argnums=(3,), donate_argnums=(2,), compiler_options=opts))


@functools.lru_cache(maxsize=64)
def _round_budget(n: int) -> jax.Array:
    """decode's max_rounds as a device scalar, made once per value: building it per call costs a
    conversion program and a host-to-device copy (~0.3 ms on an H200 host)."""
    return jnp.asarray(n, jnp.int32)


class Generator:
    """The compiled generation for one static setting (see `make_generate`).

    `gen(target, assistant, prompt, lengths, key, limit=None, stop_ids=None, rows=None) -> DecodeState`
    runs prefill and the whole decode in one jit (assistant None when block_size == 1):
      prompt int32 [B, P] right-padded (any pad id); lengths int32 [B] true lengths (>= 1);
      key a jax PRNG key; limit int32 [B] per-row budgets in 1..max_new_tokens (default: all
      max_new_tokens); stop_ids int32 [S] EOS/stop ids padded with -1 (default: none); rows the
      per-row sampling values (`sampling.row_params`; default: `defaults` for every row).
    The program depends on the spec's `SamplingMode` only, so any temperature / top_k / top_p
    (and bias) its mode covers runs without compiling.
    `gen.inputs(prompt_ids, ...)` builds those arrays from Python lists; `gen.tokens(state)` cuts
    the output rows.

    The same computation in two halves, each compiled ahead of time once per shapes: `prefill`
    (shared by all block sizes) gives the state, `decode(..., max_rounds)` runs up to max_rounds
    rounds from it and can be called again on the state it returns (the state's shapes never
    change, so every call runs one program). `gen.run(...)` is prefill + one decode of the whole
    budget, timed without compilation; `generate` uses it. Host loops (streaming, batching) use
    `compiled_rounds` instead: exactly R rounds per call, which on a GPU returns once queued.
    """

    def __init__(self, spec: loop.LoopSpec, defaults: sampling.SamplingParams = sampling.SamplingParams()):
        self.spec, self.defaults = spec, defaults
        compile_cache.ensure_default()
        self._run, self._decode, self._decode_rounds = _jits(spec)

    def __call__(self, target, assistant, prompt, lengths, key, limit=None, stop_ids=None, rows=None):
        b = prompt.shape[0]
        if limit is None:
            limit = jnp.full((b,), self.spec.max_new_tokens, jnp.int32)
        if stop_ids is None:
            stop_ids = stop_array(())
        if rows is None:
            rows = self.rows(b)
        return self._run(target, self.params(assistant), prompt, lengths, key, limit, stop_ids, rows)

    def rows(self, batch: int, params=None) -> sampling.RowParams:
        """Per-row sampling values: `params` one SamplingParams for every row, a list of one per
        row, or None (this Generator's defaults). ValueError when the spec's mode does not cover one."""
        params = self.defaults if params is None else params
        params = [params] * batch if isinstance(params, sampling.SamplingParams) else list(params)
        if len(params) != batch:
            raise ValueError(f"{len(params)} sampling settings for {batch} rows")
        return sampling.row_params(params, self.spec.sampling)

    def prefill_spec(self, target, prompt) -> loop.PrefillSpec:
        return self.spec.prefill_spec(prompt.shape[1], prompt.shape[0], target.matmul)

    def prefill_program(self, target, prompt, lengths, key, limit, stop_ids, rows) -> programs.Program:
        spec = self.prefill_spec(target, prompt)
        args = (target, prompt, lengths, key, limit, stop_ids, rows)
        return programs.Program("prefill", spec, args, lambda: _prefill_jit().lower(spec, *args))

    def params(self, assistant):
        """What the compiled programs take as the drafter's params: the assistant when this spec's
        drafter runs on one (the MTP assistant), else None."""
        drafter = self.spec.drafter
        return assistant if drafter is not None and drafter.needs_params else None

    def decode_program(self, target, assistant, state) -> programs.Program:
        """`state` may be shapes only (`loop.state_shapes`): the program can be built before the prefill runs."""
        args = (target, self.params(assistant), state, jnp.zeros((), jnp.int32))
        return programs.Program("decode", self.spec, args, lambda: self._decode.lower(*args))

    def rounds_program(self, target, assistant, state, rounds: int) -> programs.Program:
        """`loop.decode_rounds`' program (exactly `rounds` rounds per call); `state` may be shapes only."""
        args = (target, self.params(assistant), state)
        return programs.Program("decode_rounds", (self.spec, rounds), args,
                                lambda: self._decode_rounds.lower(*args, rounds))

    def all_programs(self, target, assistant, prompt, lengths, key, limit, stop_ids, rows,
                     rounds_per_chunk: int | None = None) -> list[programs.Program]:
        """The decode program and the prefill's, for `programs.compile_all` (longest first): the
        decode loop, or with `rounds_per_chunk` the fixed-round program streaming runs."""
        state = loop.state_shapes(self.spec, target, prompt, limit, stop_ids, key, rows)
        decode = (self.decode_program(target, assistant, state) if rounds_per_chunk is None
                  else self.rounds_program(target, assistant, state, rounds_per_chunk))
        return [decode, self.prefill_program(target, prompt, lengths, key, limit, stop_ids, rows)]

    def compiled_prefill(self, target, prompt, lengths, key, limit, stop_ids, rows) -> Callable[[], loop.DecodeState]:
        """`() -> state`: the prefill of these inputs, compiled now (cached per shapes), run when
        called; the state comes in decode's shapes (`loop.start`)."""
        args = (target, prompt, lengths, key, limit, stop_ids, rows)
        pre = programs.compiled(self.prefill_program(*args))
        return lambda: loop.start(self.spec, pre(*args))

    def compiled_decode(self, target, assistant, state) -> Callable[[loop.DecodeState, int], loop.DecodeState]:
        """`(state, max_rounds) -> state`: up to max_rounds more rounds, compiled now (cached per
        shapes: one program for every state and budget). The state passed in is donated."""
        params = self.params(assistant)
        dec = programs.compiled(self.decode_program(target, assistant, state))
        return lambda s, max_rounds: dec(target, params, s, _round_budget(int(max_rounds)))

    def prefill(self, target, prompt, lengths, key, limit, stop_ids, rows) -> loop.DecodeState:
        return self.compiled_prefill(target, prompt, lengths, key, limit, stop_ids, rows)()

    def compiled_rounds(self, target, assistant, state, rounds: int) -> Callable[[loop.DecodeState], loop.DecodeState]:
        """`state -> state`: exactly `rounds` more rounds (`loop.decode_rounds`: no early exit, so on
        a GPU the call returns once queued), compiled now. The state passed in is donated."""
        params = self.params(assistant)
        dec = programs.compiled(self.rounds_program(target, assistant, state, rounds))
        return lambda s: dec(target, params, s)

    def decode(self, target, assistant, state, max_rounds: int | None = None) -> loop.DecodeState:
        """Up to `max_rounds` rounds (default: until every row is done); `state` is donated."""
        n = self.spec.max_new_tokens if max_rounds is None else max_rounds
        return self.compiled_decode(target, assistant, state)(state, n)

    def run(self, target, assistant, prompt, lengths, key, limit, stop_ids, rows):
        """-> (state, prefill seconds, decode seconds), compilation excluded. ValueError after the
        prefill when its logits were not finite (`loop.check_prefill`)."""
        pre = self.compiled_prefill(target, prompt, lengths, key, limit, stop_ids, rows)
        t0 = time.perf_counter()
        state = jax.block_until_ready(pre())
        t1 = time.perf_counter()
        loop.check_prefill(state)
        dec = self.compiled_decode(target, assistant, state)
        t2 = time.perf_counter()
        state = jax.block_until_ready(dec(state, self.spec.max_new_tokens))
        t3 = time.perf_counter()
        return state, t1 - t0, t3 - t2

    def compiled_decode_text(self, target, assistant, state) -> str:
        """The optimized HLO of the decode loop (to inspect launches per round)."""
        return programs.compiled(self.decode_program(target, assistant, state)).as_text()

    def inputs(self, prompt_ids, *, max_new_tokens=None, eos_token_ids=(), stop_token_ids=(), seed=0,
               prompt_width=None, params=None, choices: int = 1):
        """(prompt, lengths, key, limit, stop_ids, rows) arrays for `gen(target, assistant, *inputs)`.
        seed: an integer in [0, 2**64) (`sampling.seed_key`; ValueError otherwise). params: the
        rows' sampling (see `rows`). choices: per prompt row (`choice_rows`): row b * choices + i
        has its own key, seed + i's, so it draws what the prompt alone with that seed draws."""
        check_choices(choices, seed)
        rows = choice_rows(_as_batch(prompt_ids), choices)
        row_params = self.rows(len(rows), params)
        n = self.spec.max_new_tokens if max_new_tokens is None else int(max_new_tokens)
        if not 1 <= n <= self.spec.max_new_tokens:
            raise ValueError(f"max_new_tokens={n} must be in 1..{self.spec.max_new_tokens} for this Generator")
        longest = max(len(r) for r in rows)
        width = prompt_width or size_bucket(longest, PROMPT_BUCKET)
        prompt = np.zeros((len(rows), width), np.int32)
        for i, r in enumerate(rows):
            prompt[i, :len(r)] = r
        key = sampling.seed_key(seed) if choices == 1 else jnp.stack(
            [sampling.seed_key(seed + i) for _ in range(len(rows) // choices) for i in range(choices)])
        return (jnp.asarray(prompt), jnp.asarray([len(r) for r in rows], jnp.int32),
                key, jnp.full((len(rows),), n, jnp.int32),
                stop_array((*eos_token_ids, *stop_token_ids)), row_params)

    @staticmethod
    def tokens(state) -> list[list[int]]:
        """The output rows, cut to their lengths; ValueError when the prefill's logits were not
        finite (`loop.check_prefill`)."""
        loop.check_prefill(state)
        out, n = jax.device_get((state.out, state.n_out))
        return [out[b, :n[b]].tolist() for b in range(out.shape[0])]


def stop_array(ids) -> jax.Array:
    """Stop ids as int32 [S], S a multiple of 4 (>= 4), padded with -1 (matches no token)."""
    ids = sorted({int(t) for t in ids})
    size = max(4, _round_up(len(ids), 4))
    return jnp.asarray(ids + [-1] * (size - len(ids)), jnp.int32)


_GENERATORS: dict = {}


def make_generate(*, block_size: int = 4, max_new_tokens: int = 128, verify_pad=None, cache_size: int | None = None,
                  mode: sampling.SamplingMode | None = None, params: sampling.SamplingParams | None = None,
                  drafter=None, **knobs) -> Generator:
    """The jitted generation function for one static setting (cached: equal arguments return the
    same Generator). block_size: 1..MAX_BLOCK_SIZE, 1 is classic decoding (no assistant).
    max_new_tokens is the output buffer and the largest per-row budget; smaller budgets and EOS/stop
    ids are runtime inputs. drafter: what drafts when block_size > 1 (a kind in
    `jaxspec.drafters.base.KINDS` or a drafter object; None: the MTP assistant, passed at call time).
    params (a SamplingParams) or its keywords (temperature, top_k, top_p, logit_bias, draft,
    logprobs, ...): the default per-row sampling values; what the program can do is `mode`
    (default: the least those values and their `logprobs` need), so Generators that differ only
    in the values share their compiled programs.
    verify_pad: None (the target's `matmul.verify_pad`, read when the Generator runs), a bool or a
    width (at most MAX_VERIFY_WIDTH). cache_size: KV positions per row (None: prompt width +
    max_new_tokens + verify width). See Generator for the call signature."""
    check_block_size(block_size)
    check_int("max_new_tokens", max_new_tokens, 1)
    request = sampling.SamplingParams.build(params, **knobs)
    params = request.per_row()
    if mode is None:
        mode = request.mode()
    elif not mode.covers(request):
        raise ValueError(f"mode {mode} does not cover the sampling values {request}")
    if isinstance(drafter, str):
        drafter = drafters.get(drafter).DEFAULT
    spec = loop.LoopSpec(block_size=int(block_size), max_new_tokens=int(max_new_tokens), sampling=mode,
                         verify_pad=None if verify_pad is None else verify.resolve_verify_pad(verify_pad, None),
                         cache_size=cache_size, drafter=drafter)
    gen = _GENERATORS.get((spec, params))
    if gen is None:
        gen = _GENERATORS[(spec, params)] = Generator(spec, params)
    return gen


# --------------------------------------------------------------------------------------------
# Input handling


def _as_batch(prompt_ids) -> list[list[int]]:
    """One sequence of ints, or a sequence of them, or a 1-D / 2-D integer array -> a list of rows.
    Anything else (None, a dict, a set, a generator, text) is a ValueError naming prompt_ids:
    a mapping would otherwise pass as its keys."""
    if isinstance(prompt_ids, (str, bytes)):
        raise ValueError("prompt_ids must be token ids (ints), not text: tokenize first")
    if _plain_ints(prompt_ids):
        return [list(prompt_ids)]
    if isinstance(prompt_ids, (np.ndarray, jax.Array)):
        arr = np.asarray(prompt_ids)
        if arr.ndim not in (1, 2):
            raise ValueError(f"prompt_ids array must be 1-D or 2-D, got shape {arr.shape}")
        prompt_ids = [arr.tolist()] if arr.ndim == 1 else arr.tolist()
    else:
        if not _is_sequence(prompt_ids):
            raise ValueError(f"prompt_ids must be a sequence of ints or a sequence of them, got "
                             f"{type(prompt_ids).__name__}")
        if len(prompt_ids) == 0:
            raise ValueError("empty prompt: prompt_ids has no token ids")
        if not any(_is_sequence(t) for t in prompt_ids):  # one sequence (its items checked below)
            prompt_ids = [prompt_ids]
    rows = []
    for i, row in enumerate(prompt_ids):
        if _plain_ints(row):
            rows.append(list(row))
            continue
        if not _is_sequence(row):
            raise ValueError(f"prompt row {i} is not a sequence of ints: {row!r}"[:300])
        row = list(row.tolist() if isinstance(row, (np.ndarray, jax.Array)) else row)
        bad = [t for t in row if not _is_int(t)]
        if bad:
            raise ValueError(f"prompt row {i} has non-integer token ids, e.g. {bad[0]!r}"[:300])
        if len(row) == 0:
            raise ValueError(f"empty prompt: row {i} has no tokens")
        rows.append([int(t) for t in row])
    if not rows:
        raise ValueError("empty prompt: no rows")
    return rows


def check_choices(n, seed) -> int:
    """n (choices per prompt row) in 1..MAX_CHOICES, and seed + n - 1 a seed; ValueError otherwise."""
    if not sampling.RANGES["n"].holds(n):
        raise ValueError(f"n must be {sampling.RANGES['n'].describe()}, got {n!r}")
    sampling.validate_seed(seed)
    if n > 1 and not sampling.RANGES["seed"].holds(seed + n - 1):
        raise ValueError(f"n={n} choices take the seeds {seed}..{seed + n - 1}, past the largest seed "
                         f"{sampling.SEED_LIMIT - 1}")
    return int(n)


def choice_rows(rows: list[list[int]], n: int) -> list[list[int]]:
    """Each prompt row n times in a row: result row b * n + i is prompt b's choice i."""
    return [r for r in rows for _ in range(n)]


def _plain_ints(t) -> bool:
    """A non-empty list or tuple of Python ints only (no bool): valid as it is, without the checks per
    item (they took ~40 ms of host time for a 16K-token prompt, which stalled a server step)."""
    return type(t) in (list, tuple) and len(t) > 0 and set(map(type, t)) == {int}


def _is_sequence(t) -> bool:
    """A list, tuple, range or other Sequence, or an array of rank >= 1; not text, not a mapping,
    set or iterator (unordered, or consumed by reading)."""
    if isinstance(t, (np.ndarray, jax.Array)):
        return t.ndim >= 1
    return isinstance(t, collections.abc.Sequence) and not isinstance(t, (str, bytes))


def _is_int(t) -> bool:
    return isinstance(t, (int, np.integer)) and not isinstance(t, (bool, np.bool_))


def _check_target(target) -> None:
    if not hasattr(target, "config") or not hasattr(target.config, "vocab_size"):
        raise ValueError(f"target must be a models.Target, got {type(target).__name__}")


def _default_stop_ids(target) -> tuple[int, ...]:
    for name in ("eos_token_ids", "eos_token_id"):
        v = getattr(target.config, name, None)
        if v is not None:
            return tuple(int(t) for t in (v if isinstance(v, (list, tuple)) else [v]))
    return ()


def validate_inputs(target, assistant, rows, request: sampling.SamplingParams, *, block_size, eos_token_ids,
                    verify_pad, cache_size, drafter=None):
    """Every check that can fail, on the host, before anything is compiled or run; the request's
    own ranges were checked when it was built, here what depends on the model. `drafter`: the
    resolved drafter (`drafters.resolve`; None: classic). Returns (the run's LoopConfig before the
    exactness probe, stop ids)."""
    _check_target(target)
    vocab = int(target.config.vocab_size)
    check_block_size(block_size, getattr(target.config, "max_position_embeddings", None))
    verify.resolve_verify_pad(verify_pad, None)  # its range now: resolved with the model's config below
    if request.stop:
        raise ValueError("stop strings need a tokenizer: pass their token ids as stop_token_ids (the server "
                         "applies stop strings)")
    max_new_tokens = request.max_new_tokens
    for t, _ in request.logit_bias:
        if t >= vocab:
            raise ValueError(f"logit_bias has token id {t} outside the vocabulary [0, {vocab})")
    for i, row in enumerate(rows):
        lo, hi = min(row), max(row)
        if lo < 0 or hi >= vocab:
            bad = lo if lo < 0 else hi
            raise ValueError(f"prompt row {i} has token id {bad} outside the vocabulary [0, {vocab})")
    stop = []
    for name, ids in (("eos_token_ids", eos_token_ids), ("stop_token_ids", request.stop_token_ids)):
        ids = [ids] if _is_int(ids) else list(ids or ())
        for t in ids:
            if not _is_int(t):
                raise ValueError(f"{name} must hold integer token ids, got {t!r}")
            if not 0 <= t < vocab:
                raise ValueError(f"{name} has token id {t} outside the vocabulary [0, {vocab})")
        stop += [int(t) for t in ids]
    if assistant is not None:
        if not hasattr(assistant, "config") or not hasattr(assistant.config, "backbone_hidden_size"):
            raise ValueError(f"assistant must be a models.Assistant, got {type(assistant).__name__}")
        models.check_fit(assistant.config, target.config)
    longest = max(len(r) for r in rows)
    ctx = getattr(target.config, "max_position_embeddings", None)
    if ctx is not None and longest + max_new_tokens > ctx:
        raise ValueError(f"prompt of {longest} tokens + max_new_tokens {max_new_tokens} = {longest + max_new_tokens} "
                         f"positions, past the model's context of {ctx} (max_position_embeddings)")
    cfg = LoopConfig.resolve(block_size=block_size, batch=len(rows), prompt_len=longest, max_new_tokens=max_new_tokens,
                             drafting=drafter is not None, verify_pad=verify_pad, matmul=target.matmul,
                             cache_size=cache_size)
    return cfg, tuple(stop)


# --------------------------------------------------------------------------------------------
# generate


@dataclasses.dataclass(frozen=True)
class Plan:
    """A validated generation request, ready to run: the Generator, its drafter (None when
    classic) and input arrays, and why speculation was dropped or shrunk. `generate` runs it in
    one decode call, `streaming.stream_generate` in chunks; `result` reports either."""

    gen: Generator
    params: Any                         # the drafter's params the programs take (the assistant, or None)
    inputs: tuple                       # (prompt, lengths, key, limit, stop_ids, rows)
    batch: int
    verify_width: int
    fallback: str | None
    probe_logit_diff: float | None
    backend: str | None = None          # DispatchConfig.describe of the target's matmul

    def result(self, state, prefill_s: float, decode_s: float) -> GenerationResult:
        out, n_out, rounds, row_rounds, drafted, accepted, hist, lps = jax.device_get(
            (state.out, state.n_out, state.rounds, state.row_rounds, state.drafted, state.accepted, state.hist,
             (state.lp, state.top_ids, state.top_lp)))
        batch, spec = self.batch, self.gen.spec
        tokens = [out[b, :n_out[b]].tolist() for b in range(batch)]
        logprobs = None
        if lps[0] is not None:
            lp, top_ids, top_lp = lps
            logprobs = [loop.logprob_entries(lp[b, :n_out[b]], top_ids[b, :n_out[b]], top_lp[b, :n_out[b]])
                        for b in range(batch)]
        new_tokens = int(n_out.sum())
        row_r = int(row_rounds.sum())
        drafted, accepted = int(drafted.sum()), int(accepted.sum())
        drafter = spec.drafter
        counters = drafter.counters(jax.device_get(state.draft)) if drafter is not None else {}
        stats = GenerationStats(
            mode="speculative" if spec.speculative else "classic",
            block_size=spec.block_size, verify_width=self.verify_width,
            rounds=int(rounds), row_rounds=row_r, drafted=drafted, accepted=accepted,
            acceptance_rate=accepted / drafted if drafted else 0.0,
            mean_accepted_len=accepted / row_r if row_r else 0.0,
            tokens_per_round=(new_tokens - batch) / row_r if row_r else 0.0,
            accepted_hist=[int(x) for x in hist], new_tokens=new_tokens,
            prefill_s=prefill_s, decode_s=decode_s,
            decode_tokens_per_s=new_tokens / decode_s if decode_s > 0 else float("inf"),
            fallback=self.fallback, probe_logit_diff=self.probe_logit_diff, backend=self.backend,
            drafter=None if drafter is None else drafter.kind, draft_stats=counters)
        return GenerationResult(tokens=tokens, stats=stats, logprobs=logprobs)


DEFAULT_MAX_NEW_TOKENS = 128  # generate's budget when the request names none


def request_of(params: sampling.SamplingParams | None = None, **knobs) -> sampling.SamplingParams:
    """generate's request: `params` or the keyword knobs (`SamplingParams.build`), with generate's
    defaults for what it leaves open (max_new_tokens 128, seed 0)."""
    r = sampling.SamplingParams.build(params, **knobs)
    return dataclasses.replace(r, max_new_tokens=r.max_new_tokens or DEFAULT_MAX_NEW_TOKENS,
                               seed=0 if r.seed is None else r.seed)


def plan(target, prompt_ids, request: sampling.SamplingParams, *, assistant=None, block_size: int = 4,
         eos_token_ids: Sequence[int] | None = None, verify_pad=None, cache_size: int | None = None,
         exactness_probe: bool = True, rounds_per_chunk: int | None = None, drafter=None, n: int = 1) -> Plan:
    """A request (`request_of`) -> a Plan: every input check (on the host, before anything is
    compiled), then every program the call needs compiled at once (`programs.compile_all`), the
    exactness probe (T = 0), the Generator and its input arrays. `rounds_per_chunk`: streaming's
    plan (its fixed-round decode program instead of the decode loop). `drafter`, `n`: see `generate`."""
    _check_target(target)  # first: the default stop ids below read its config
    n = check_choices(n, request.seed)
    prompts = _as_batch(prompt_ids)
    rows = choice_rows(prompts, n)
    if eos_token_ids is None:
        eos_token_ids = _default_stop_ids(target)
    drafter = drafters.resolve(drafter, assistant)
    cfg, stop = validate_inputs(
        target, assistant, rows, request, block_size=block_size, eos_token_ids=eos_token_ids,
        verify_pad=verify_pad, cache_size=cache_size, drafter=drafter)

    def generator(c: LoopConfig):
        gen = make_generate(block_size=c.block_size, max_new_tokens=c.budget, verify_pad=c.verify_pad,
                            cache_size=c.cache_size, params=request, drafter=drafter)
        return gen, gen.inputs(prompts, max_new_tokens=request.max_new_tokens, eos_token_ids=stop, seed=request.seed,
                               prompt_width=c.prompt_width, choices=n)

    # Compile what the K asked for needs (probe, prefill, decode) at once, before the probe runs;
    # when the probe then lowers K, the smaller K's programs compile on their own.
    gen, inputs = generator(cfg)
    temperature = request.temperature
    probes = (verify.probe_programs(target, cfg.batch, cfg.block_size, cfg.verify_width)
              if cfg.probes(temperature, exactness_probe) else [])
    programs.compile_all(gen.all_programs(target, assistant, *inputs, rounds_per_chunk=rounds_per_chunk) + probes)
    run = cfg.probed(target, temperature, exactness_probe)
    if run.block_size != cfg.block_size:
        gen, inputs = generator(run)
    return Plan(gen=gen, params=gen.params(assistant), inputs=inputs, batch=run.batch,
                verify_width=run.verify_width, fallback=run.fallback, probe_logit_diff=run.probe_logit_diff,
                backend=getattr(getattr(target, "matmul", None), "describe", None))


def generate(target, prompt_ids, *, assistant=None, params: sampling.SamplingParams | None = None,
             block_size: int = 4, eos_token_ids: Sequence[int] | None = None, verify_pad=None,
             cache_size: int | None = None, exactness_probe: bool = True, drafter=None, n: int = 1,
             **knobs) -> GenerationResult:
    """Generate up to `max_new_tokens` tokens per prompt row with `target`, speculatively when an
    `assistant` or a `drafter` is given (block_size K in 1..MAX_BLOCK_SIZE: K-1 drafts + one K-wide
    verify per round), classically otherwise. Greedy at temperature 0 (byte-identical to classic
    decoding), else lossless sampling with temperature / top_k / top_p.

    drafter: None (the MTP `assistant` when one is given, else classic decoding), "mtp" (needs the
    assistant), "ngram" (prompt lookup: drafts the continuation of the latest earlier occurrence of
    the last n tokens in the prompt and output; no model, pays on text that copies its prompt), "hybrid"
    (per row and round: prompt lookup where the last 2-3 tokens occurred before, else the assistant;
    needs it), or a drafter object (`jaxspec.drafters.ngram.Drafter(n_min=2, n_max=4)`). Stats say
    which ran.

    prompt_ids: one sequence of ints or a list of them (a batch; rows may differ in length).
    params: the request, a `jaxspec.SamplingParams`; its fields as keywords build one (or replace params'):
      max_new_tokens (default 128), temperature, top_k, top_p, seed (default 0), stop_token_ids,
      draft ("sample": draw drafts from q, or "argmax"; T > 0 only), logit_bias ({token id: value
      in [-100, 100]} added to the logits, greedy too, at most 300), logprobs (None, or N in 0..20:
      the result's `logprobs` holds each token's log-probability under the target's logits
      (log_softmax, before bias and temperature) and the N most likely tokens'), presence_penalty /
      frequency_penalty (OpenAI's, over the generated tokens, in [-2, 2]), repetition_penalty (HF's,
      over prompt + generated tokens, in [0.01, 100]; 1 is off).
    eos_token_ids: None takes the target config's EOS ids when it has any. Generation of a row stops
    after the first EOS or stop token (kept in the output).
    verify_pad: None (the target's `matmul.verify_pad`), a bool, or a width.
    cache_size: KV positions per row (None: just enough).
    exactness_probe: at T = 0, check once per shape that a K-wide verify is bit-identical to K
    single steps and fall back to classic decoding with a warning when it is not.
    n: choices per prompt row, 1..16 (OpenAI's n): the result has n rows per prompt row, prompt b's
    choice i at row b * n + i, drawn with seed + i (what that prompt alone gives with seed + i; at
    temperature 0 every choice is the greedy text). The stats count every row.
    A new temperature / top_k / top_p / bias / penalty value compiles nothing: they are runtime inputs.
    """
    p = plan(target, prompt_ids, request_of(params, **knobs), assistant=assistant, block_size=block_size,
             eos_token_ids=eos_token_ids, verify_pad=verify_pad, cache_size=cache_size,
             exactness_probe=exactness_probe, drafter=drafter, n=n)
    state, prefill_s, decode_s = p.gen.run(target, p.params, *p.inputs)
    return p.result(state, prefill_s, decode_s)
