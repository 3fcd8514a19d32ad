"""Token selection: greedy, temperature / top-k / top-p / min-p sampling, logit bias, repetition
penalties (penalties.py), log-probabilities, and the lossless speculative accept/resample step.

Everything here is batched, vectorized and jit-friendly: no Python control flow depends on array
values. What a compiled program can do is static (`SamplingMode`: may rows sample, filter, carry
a bias or penalties, report log-probabilities); the values are per-row runtime arrays (`RowParams`:
one temperature, top_k, top_p, min_p, bias and penalties per row, temperature 0 = a greedy row). So one program serves
every setting, and rows with different settings share a batch: a new temperature compiles nothing.

The speculative step is modified rejection sampling (Leviathan et al. / Chen et al.): draft token
`d` drawn from `q` is accepted with probability `min(1, p(d) / q(d))`; at the first rejection the
token is resampled from `normalize(max(0, p - q))`; when every draft is accepted the bonus token is
drawn from `p`. The emitted sequence then has exactly the target's distribution `p`. Argmax drafting
is the special case `q = one_hot(argmax)`. Greedy rows walk the argmax (`greedy_accept`) in the same
program: a row's choice between the two is a select, so a greedy row is exactly classic decoding.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxspec.engine import penalties

DRAFT_MODES = ("sample", "argmax")
SEED_LIMIT = 1 << 64  # seeds are integers in [0, 2**64): the two 32-bit words of a threefry key
# Below this a temperature is refused: logits / T overflows float32 (1e-45 made every row token 0).
MIN_TEMPERATURE = 1e-3
BIAS_LIMIT = 100.0   # |logit_bias| values, as OpenAI's API
PENALTY_LIMIT = 2.0  # |presence_penalty|, |frequency_penalty|, as OpenAI's API
# repetition_penalty's range: logit / r and logit * r must stay finite in float32 (HF only asks r > 0)
REPETITION_RANGE = (0.01, 100.0)
MAX_CHOICES = 16     # n: completions per request (the server's and the CLI's; each its own row)
BIAS_SLOTS = 300     # logit_bias entries per row (OpenAI's limit); static width of RowParams.bias
TOP_LOGPROBS = 20    # alternatives per position a logprobs program reports at most (OpenAI's limit)


@dataclasses.dataclass(frozen=True)
class Range:
    """A request knob's bounds: lo..hi (hi None: no upper bound; lo excluded when `lo_open`), an
    integer (Python or numpy, not a bool) or any finite number."""

    lo: float
    hi: float | None
    integer: bool
    lo_open: bool = False

    def holds(self, v) -> bool:
        # an integer is compared as it is: math.isfinite would convert it to a float, which overflows
        # past 1e308 (a JSON integer of 309 digits)
        if not (_is_int(v) if self.integer else _is_int(v) or _is_number(v) and math.isfinite(v)):
            return False
        return (v > self.lo if self.lo_open else v >= self.lo) and (self.hi is None or v <= self.hi)

    def describe(self) -> str:
        kind = "an integer" if self.integer else "a number"
        if self.hi is None:
            return f"{kind} >= {self.lo}"
        return f"{kind} in ({self.lo}, {self.hi}]" if self.lo_open else f"{kind} in [{self.lo}, {self.hi}]"


# Each request knob's range, stated once: SamplingParams checks it where a request is built, the
# server's schema and the CLI's flags read it from here (top_k once had 2**30 in one, 2**31-1 in the
# other). temperature has one more rule: 0 (greedy) or >= MIN_TEMPERATURE.
RANGES = {
    "temperature": Range(0.0, None, integer=False),
    "top_k": Range(1, 2**31 - 1, integer=True),      # an int32 per row
    "top_p": Range(0.0, 1.0, integer=False, lo_open=True),
    "min_p": Range(0.0, 1.0, integer=False),
    "seed": Range(0, SEED_LIMIT - 1, integer=True),
    "max_new_tokens": Range(1, None, integer=True),
    "logprobs": Range(0, TOP_LOGPROBS, integer=True),
    "logit_bias": Range(-BIAS_LIMIT, BIAS_LIMIT, integer=False),  # each value
    "presence_penalty": Range(-PENALTY_LIMIT, PENALTY_LIMIT, integer=False),
    "frequency_penalty": Range(-PENALTY_LIMIT, PENALTY_LIMIT, integer=False),
    "repetition_penalty": Range(*REPETITION_RANGE, integer=False),
    "n": Range(1, MAX_CHOICES, integer=True),  # not a SamplingParams field: the server and the CLI fan out
}
MAX_STOPS = 4          # stop strings per request (OpenAI's limit)
MAX_STOP_CHARS = 256   # characters per stop string


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """One request: how tokens are chosen and when generation ends. Checked once, here (ValueError
    naming the field and its range, `RANGES`); `generate`, `stream_generate`, `make_generate`,
    `BatchEngine.admit`, the CLI and the server take it (their keywords build one).

    temperature: 0 is greedy (argmax; top_k/top_p ignored), else >= MIN_TEMPERATURE.
    top_k / top_p: None (off), or keep the k most likely tokens / the smallest nucleus of mass top_p.
    logit_bias: (token id, value) pairs (or a mapping) added to the logits before anything else
    (greedy rows too), values in [-100, 100], at most BIAS_SLOTS of them.
    draft: "sample" draws draft tokens from the filtered draft distribution q (default, lossless,
    best acceptance); "argmax" drafts the draft model's argmax (q one-hot; also lossless).
    max_new_tokens: the budget (None: the entry point's default; generate's is 128).
    seed: an integer in [0, 2**64) (None: the entry point's default; generate's is 0, a batch
    engine draws one from its own seed, the server a random one).
    stop: stop strings (at most MAX_STOPS of 1..MAX_STOP_CHARS characters; text needs a tokenizer:
    the server applies them); stop_token_ids: token ids that end a row (kept in the output).
    logprobs: None, or N in 0..TOP_LOGPROBS: report each token's log-probability and the N most
    likely tokens' (under the target's logits, before bias and temperature).
    min_p: None (off) or in [0, 1]: drop the tokens whose probability (after temperature) is below
    min_p times the most likely one's (vLLM's and HF's min-p).
    presence_penalty / frequency_penalty: in [-2, 2] (0: off), OpenAI's: logit[t] -= presence *
    (count[t] > 0) + frequency * count[t], count[t] the times t was generated so far.
    repetition_penalty: in [0.01, 100] (1: off), HF's: for every token of the prompt and the output,
    logit / r where the logit is >= 0, logit * r where it is negative. The penalties apply after
    logit_bias, before temperature and filtering (greedy rows too; `penalties.py`).

    The per-row values (temperature, top_k, top_p, min_p, logit_bias, the penalties) are runtime
    inputs of a program (`RowParams`); `per_row()` is the request without the rest.
    """

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    draft: str = "sample"
    logit_bias: tuple = ()
    max_new_tokens: int | None = None
    seed: int | None = None
    stop: tuple = ()
    stop_token_ids: tuple = ()
    logprobs: int | None = None
    min_p: float | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0

    def __post_init__(self):
        validate_sampling(self.temperature, self.top_k, self.top_p, self.draft)
        put = functools.partial(object.__setattr__, self)
        put("temperature", float(self.temperature))
        if self.top_k is not None:  # a numpy integer is accepted and kept as a Python int
            put("top_k", int(self.top_k))
        if self.top_p is not None:
            put("top_p", float(self.top_p))
        if self.min_p is not None:
            put("min_p", _checked("min_p", self.min_p))
        for name, off in (("presence_penalty", 0.0), ("frequency_penalty", 0.0), ("repetition_penalty", 1.0)):
            v = getattr(self, name)  # None: off
            put(name, off if v is None else _checked(name, v))
        put("logit_bias", validate_bias(self.logit_bias))
        if self.max_new_tokens is not None:
            put("max_new_tokens", _checked("max_new_tokens", self.max_new_tokens))
        if self.seed is not None:
            put("seed", validate_seed(self.seed))
        if self.logprobs is not None:
            put("logprobs", _checked("logprobs", self.logprobs, " (alternatives per token)"))
        put("stop", validate_stop(self.stop))
        ids = [self.stop_token_ids] if _is_int(self.stop_token_ids) else self.stop_token_ids
        try:
            ids = tuple(ids or ())
        except TypeError:
            raise ValueError(f"stop_token_ids must hold integer token ids, got {ids!r}"[:300]) from None
        for t in ids:
            if not _is_int(t):
                raise ValueError(f"stop_token_ids must hold integer token ids, got {t!r}"[:300])
            if t < 0:
                raise ValueError(f"stop_token_ids has token id {t} outside the vocabulary")
        put("stop_token_ids", tuple(int(t) for t in ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def mode(self, logprobs: int | None = None) -> "SamplingMode":
        """The least a program needs for these parameters (and `logprobs` alternatives; None: the
        request's own `logprobs`)."""
        logprobs = self.logprobs if logprobs is None else logprobs
        return SamplingMode(sample=not self.greedy,
                            filter=not self.greedy and (self.top_k is not None or self.top_p is not None
                                                        or bool(self.min_p)),
                            bias=bool(self.logit_bias), logprobs=-1 if logprobs is None else int(logprobs),
                            draft=self.draft, penalties=self.penalised)

    @property
    def penalised(self) -> bool:
        """Whether any repetition control is on (its program needs `SamplingMode.penalties`)."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    def per_row(self) -> "SamplingParams":
        """The per-row sampling values alone (what a Generator's defaults and `RowParams` hold):
        the request fields (budget, seed, stops, logprobs) reset, so equal settings compare equal."""
        return dataclasses.replace(self, max_new_tokens=None, seed=None, stop=(), stop_token_ids=(), logprobs=None)

    @classmethod
    def build(cls, params: "SamplingParams | None" = None, **knobs) -> "SamplingParams":
        """`params` with the keyword knobs a caller passed in place of its fields (the entry points'
        thin convenience), or a request built from the knobs alone; checked once, here."""
        if params is None:
            return cls(**knobs)
        if not isinstance(params, cls):
            raise ValueError(f"params must be a jaxspec.SamplingParams, got {type(params).__name__}")
        return dataclasses.replace(params, **knobs) if knobs else params


def _checked(name: str, value, why: str = ""):
    """`value` (an int or a float per `RANGES[name]`); ValueError naming `name` and its range."""
    r = RANGES[name]
    if not r.holds(value):
        raise ValueError(f"{name} must be None or {r.describe()}{why}, got {value!r}"[:300])
    return int(value) if r.integer else float(value)


def validate_stop(stop) -> tuple:
    """Stop strings as a tuple: None (none), one string, or a list or tuple of at most MAX_STOPS
    non-empty strings of at most MAX_STOP_CHARS characters; ValueError otherwise."""
    stop = (stop,) if isinstance(stop, str) else () if stop is None else stop
    stop = tuple(stop) if isinstance(stop, (list, tuple)) else None  # not a dict's keys, not 0 or False as none
    if stop is None or len(stop) > MAX_STOPS or not all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS
                                                         for s in stop):
        raise ValueError(f"stop must be a non-empty string of at most {MAX_STOP_CHARS} characters or a list of at "
                         f"most {MAX_STOPS} of them")
    return stop


@dataclasses.dataclass(frozen=True)
class SamplingMode:
    """What a compiled program can do; static (part of the loop's spec). Rows ask for less freely:
    a greedy row in a `sample` program is exactly a greedy row in a greedy one.

    sample: rows may have temperature > 0 (False: argmax only, no random numbers drawn).
    filter: rows may use top_k / top_p / min_p (a sort of the vocabulary per distribution).
    bias: rows may carry a logit_bias (BIAS_SLOTS entries per row).
    penalties: rows may have presence / frequency / repetition penalties (the loop then keeps each
      row's token counts, `penalties.Counts`: [B, V] each; a program without it keeps nothing).
    logprobs: -1 none; N >= 0: the log-probability of every emitted token under the target's logits
      (before bias and temperature) and the N most likely tokens with theirs.
    """

    sample: bool = False
    filter: bool = False
    bias: bool = False
    logprobs: int = -1
    draft: str = "sample"
    penalties: bool = False

    def __post_init__(self):
        if self.filter and not self.sample:
            raise ValueError("SamplingMode: filter needs sample")
        if not -1 <= self.logprobs <= TOP_LOGPROBS:
            raise ValueError(f"SamplingMode: logprobs must be in -1..{TOP_LOGPROBS}, got {self.logprobs}")
        if self.draft not in DRAFT_MODES:
            raise ValueError(f"draft={self.draft!r}: expected one of {DRAFT_MODES}")

    @property
    def greedy(self) -> bool:
        """Every row greedy: no distribution is ever computed."""
        return not self.sample

    def covers(self, need) -> bool:
        """Whether this program runs what `need` (a SamplingMode, or SamplingParams) asks."""
        need = need.mode() if isinstance(need, SamplingParams) else need
        return ((self.sample or not need.sample) and (self.filter or not need.filter)
                and (self.bias or not need.bias) and self.logprobs >= need.logprobs
                and (self.penalties or not need.penalties)
                and (self.draft == need.draft or not need.sample))


FULL_MODE = SamplingMode(sample=True, filter=True, bias=True, logprobs=TOP_LOGPROBS, penalties=True)


@struct.dataclass
class RowParams:
    """Per-row sampling values, runtime inputs of a program (`row_params` builds them)."""

    temperature: jax.Array  # float32 [B]; 0: the row is greedy
    top_k: jax.Array        # int32 [B]; 0: off
    top_p: jax.Array        # float32 [B]; 1: off
    min_p: jax.Array        # float32 [B]; 0: off
    bias_ids: jax.Array     # int32 [B, NB] (NB = BIAS_SLOTS when the mode has bias, else 0)
    bias: jax.Array         # float32 [B, NB]; unused entries 0
    presence: jax.Array     # float32 [B]; 0: off (read only by a program with penalties)
    frequency: jax.Array    # float32 [B]; 0: off
    repetition: jax.Array   # float32 [B]; 1: off


def row_params(params: Sequence[SamplingParams], mode: SamplingMode, xp=jnp) -> RowParams:
    """RowParams for one SamplingParams per row; ValueError when `mode` cannot run one of them.
    `xp=np`: host arrays (the batch engine's admission keeps them on the host: reading device
    arrays back would wait for every step already queued on the device)."""
    for i, p in enumerate(params):
        if not mode.covers(p):
            raise ValueError(f"row {i}'s sampling {p} needs a program with {p.mode()}, this one is {mode}")
    b, nb = len(params), BIAS_SLOTS if mode.bias else 0
    ids, vals = np.zeros((b, nb), np.int32), np.zeros((b, nb), np.float32)
    for i, p in enumerate(params):
        for j, (t, v) in enumerate(p.logit_bias):
            ids[i, j], vals[i, j] = t, v
    return RowParams(temperature=xp.asarray([p.temperature for p in params], np.float32),
                     top_k=xp.asarray([p.top_k or 0 for p in params], np.int32),
                     top_p=xp.asarray([1.0 if p.top_p is None else p.top_p for p in params], np.float32),
                     min_p=xp.asarray([p.min_p or 0.0 for p in params], np.float32),
                     bias_ids=xp.asarray(ids), bias=xp.asarray(vals),
                     presence=xp.asarray([p.presence_penalty for p in params], np.float32),
                     frequency=xp.asarray([p.frequency_penalty for p in params], np.float32),
                     repetition=xp.asarray([p.repetition_penalty for p in params], np.float32))


def validate_sampling(temperature, top_k, top_p, draft="sample") -> None:
    """Raise ValueError for parameters no sampler accepts. Numbers may be Python or numpy
    numbers (not bools); top_k an integer."""
    if not _is_number(temperature):
        raise ValueError(f"temperature must be a number >= 0, got {temperature!r}")
    if not math.isfinite(temperature) or temperature < 0:
        raise ValueError(f"temperature must be a finite number >= 0, got {temperature}")
    if 0 < temperature < MIN_TEMPERATURE:
        raise ValueError(f"temperature must be 0 (greedy) or >= {MIN_TEMPERATURE}, got {temperature}")
    if top_k is not None:
        _checked("top_k", top_k)
    if top_p is not None:
        _checked("top_p", top_p)
    if draft not in DRAFT_MODES:
        raise ValueError(f"draft={draft!r}: expected one of {DRAFT_MODES}")


def validate_bias(logit_bias) -> tuple:
    """A logit bias (a mapping or (id, value) pairs) as a sorted tuple of (int id, float value);
    ValueError for ids that are not integers >= 0, values outside [-100, 100] or too many entries."""
    items = logit_bias.items() if isinstance(logit_bias, dict) else logit_bias
    try:
        items = list(items or ())
    except TypeError:
        raise ValueError(f"logit_bias must map token ids to numbers, got {type(logit_bias).__name__}") from None
    if len(items) > BIAS_SLOTS:
        raise ValueError(f"logit_bias has {len(items)} entries, at most {BIAS_SLOTS} are allowed")
    out = {}
    for item in items:
        if not (isinstance(item, (tuple, list)) and len(item) == 2):
            raise ValueError(f"logit_bias entries must be (token id, value) pairs, got {item!r}")
        t, v = item
        if not _is_int(t) or t < 0:
            raise ValueError(f"logit_bias token ids must be integers >= 0, got {t!r}")
        if not RANGES["logit_bias"].holds(v):
            raise ValueError(f"logit_bias values must be numbers in [-100, 100], got {v!r} for token {t}")
        out[int(t)] = float(v)
    return tuple(sorted(out.items()))


def _is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def _is_number(x) -> bool:
    return _is_int(x) or isinstance(x, (float, np.floating))


def validate_seed(seed) -> int:
    """The seed as a Python int. ValueError unless it is an integer (Python or numpy, not a bool)
    with 0 <= seed < 2**64."""
    if not _is_int(seed):
        raise ValueError(f"seed must be an integer in [0, 2**64), got {seed!r}")
    s = int(seed)
    if not RANGES["seed"].holds(s):
        raise ValueError(f"seed must be an integer in [0, 2**64) (0 .. {SEED_LIMIT - 1}), got {s}")
    return s


def seed_key_data(seed) -> np.ndarray:
    """`jax.random.key_data(seed_key(seed))` as a host array, computed on the host under JAX's
    default threefry2x32 (its two 32-bit words); with another PRNG it is read back from the device."""
    s = validate_seed(seed)
    if jax.config.jax_default_prng_impl == "threefry2x32":
        return np.asarray([s >> 32, s & 0xFFFFFFFF], np.uint32)
    return np.asarray(jax.random.key_data(seed_key(s)))


def seed_key(seed) -> jax.Array:
    """The PRNG key of a seed in [0, 2**64) (`validate_seed`): distinct seeds give distinct keys.
    With JAX's default threefry2x32 the key data is the seed's two 32-bit words [seed >> 32,
    seed & 0xFFFFFFFF], so a seed < 2**32 gives `jax.random.key(seed)` (the same samples as
    before seeds above 2**32 were accepted; `jax.random.key` alone reduces them mod 2**32). With
    another default PRNG implementation: `jax.random.key(seed & 0xFFFFFFFF)`, folded with the high
    word when it is not 0."""
    s = validate_seed(seed)
    if jax.config.jax_default_prng_impl == "threefry2x32":
        return jax.random.wrap_key_data(seed_key_data(s), impl="threefry2x32")
    hi, lo = s >> 32, s & 0xFFFFFFFF
    key = jax.random.key(lo)
    return jax.random.fold_in(key, hi) if hi else key


# --------------------------------------------------------------------------------------------
# Keys: one for the batch, or one per row


def split(key: jax.Array, n: int) -> jax.Array:
    """`[n]` keys from one key, or `[n, B]` from per-row keys `[B]` (each row split on its own)."""
    if jnp.ndim(key) == 0:
        return jax.random.split(key, n)
    return jnp.swapaxes(jax.vmap(lambda k: jax.random.split(k, n))(key), 0, 1)


def uniform(key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """float32 uniforms in [0, 1) of `shape` (leading axis: rows). From per-row keys `[B]`, row b's
    come from key b alone, the same values a one-row batch with that key draws: a row's samples do
    not depend on the other rows (continuous batching's slots)."""
    if jnp.ndim(key) == 0:
        return jax.random.uniform(key, shape, jnp.float32)
    return jax.vmap(lambda k: jax.random.uniform(k, (1, *shape[1:]), jnp.float32)[0])(key)


# --------------------------------------------------------------------------------------------
# Filtering: logits -> probabilities, row by row


def _per_row(v: jax.Array, ndim: int) -> jax.Array:
    """[B] -> [B, 1, ..., 1] with `ndim` axes (broadcasts against [B, ..., V])."""
    return v.reshape(v.shape + (1,) * (ndim - 1))


def biased(logits: jax.Array, rows: RowParams, mode: SamplingMode) -> jax.Array:
    """The logits [B, ..., V] with each row's logit_bias added (float32 when the mode has a bias;
    unchanged otherwise, so a greedy program's argmax sees the model's own logits)."""
    if not mode.bias:
        return logits
    x = logits.astype(jnp.float32)
    b, v = x.shape[0], x.shape[-1]
    dense = jnp.zeros((b, v), jnp.float32).at[jnp.arange(b)[:, None], rows.bias_ids].add(rows.bias)
    return x + dense.reshape((b,) + (1,) * (x.ndim - 2) + (v,))


def adjusted(logits: jax.Array, rows: RowParams, mode: SamplingMode, counts: penalties.Counts | None = None,
             drafts: jax.Array | None = None) -> jax.Array:
    """`biased` logits [B, V] or [B, K, V], then each row's penalties when the mode has them
    (`penalties.apply`: `counts` the rows' token counts; a verify block's position j also counts
    drafts[:, :j])."""
    x = biased(logits, rows, mode)
    if not mode.penalties:
        return x
    if counts is None:
        raise ValueError("a program with penalties needs the rows' token counts")
    return penalties.apply(x, counts, rows.presence, rows.frequency, rows.repetition, drafts)


def filter_logits(logits: jax.Array, rows: RowParams, mode: SamplingMode) -> jax.Array:
    """Temperature-scaled logits (float32) with tokens outside each row's top-k / top-p / min-p set to -inf.
    A greedy row (temperature 0) is scaled by 1 (its distribution is computed, never used).

    top-k keeps every token whose scaled logit is >= the k-th largest (ties at the boundary are
    kept). top-p (nucleus) keeps the smallest prefix of the descending-probability order (within
    top-k) whose mass reaches top_p (the most likely token is always kept; ties at the boundary are
    kept). min-p keeps every token whose probability is >= min_p times the most likely one's:
    p_i >= min_p * p_max is x_i >= x_max + log(min_p) (the softmax's normalizer cancels), and the
    most likely token survives top-k and top-p, so the order of the three does not matter. One
    descending sort of the vocabulary serves them; a program without `filter` skips it.
    """
    t = jnp.where(rows.temperature > 0, rows.temperature, 1.0)
    x = logits.astype(jnp.float32) / _per_row(t, logits.ndim)
    if not mode.filter:
        return x
    vocab, nd = x.shape[-1], x.ndim
    neg_inf = jnp.float32(-jnp.inf)
    s = -jnp.sort(-x, axis=-1)
    k = jnp.where(rows.top_k > 0, jnp.minimum(rows.top_k, vocab), vocab)
    thr_k = jnp.take_along_axis(s, jnp.broadcast_to(_per_row(k - 1, nd), s.shape[:-1] + (1,)), axis=-1)
    s = jnp.where(s >= thr_k, s, neg_inf)
    p_sorted = jax.nn.softmax(s, axis=-1)
    mass_before = jnp.cumsum(p_sorted, axis=-1) - p_sorted
    top_p = _per_row(rows.top_p, nd)
    # A prefix; index 0 always kept explicitly: a top_p below float32's normal range (down to 5e-324,
    # 0 once converted, or flushed to 0 as a subnormal) would otherwise keep nothing, i.e. everything.
    first = jnp.arange(vocab) == 0
    keep = (mass_before < top_p) | (top_p >= 1.0) | first
    n_keep = jnp.sum(keep, axis=-1, keepdims=True)
    thr_p = jnp.take_along_axis(s, n_keep - 1, axis=-1)
    thr_min = s[..., :1] + jnp.log(_per_row(rows.min_p, nd))  # min_p 0: log 0 = -inf keeps every token
    return jnp.where(x >= jnp.maximum(jnp.maximum(thr_k, thr_p), thr_min), x, neg_inf)


def probs_from_logits(logits: jax.Array, rows: RowParams, mode: SamplingMode) -> jax.Array:
    """The sampling distribution (float32, sums to 1 over the last axis) of each row's setting,
    from (biased) logits [B, ..., V]."""
    return jax.nn.softmax(filter_logits(logits, rows, mode), axis=-1)


# --------------------------------------------------------------------------------------------
# Sampling from explicit probabilities with explicit uniforms (inverse CDF)


def sample_from_probs(probs: jax.Array, u: jax.Array) -> jax.Array:
    """Inverse-CDF sample: the index i with cdf[i-1] <= u * total < cdf[i] over the last axis.

    probs: [..., V] non-negative (need not be normalized; total > 0); u: [...] in [0, 1).
    Never returns a zero-probability index (rounding at the top end is clamped to the last index
    with positive mass). Deterministic given u, which is what makes the step testable exactly.
    """
    probs = probs.astype(jnp.float32)
    cdf = jnp.cumsum(probs, axis=-1)
    total = cdf[..., -1]
    target = u.astype(jnp.float32) * total
    idx = jnp.sum((cdf <= target[..., None]).astype(jnp.int32), axis=-1)
    vocab = probs.shape[-1]
    positive = probs > 0
    last_positive = vocab - 1 - jnp.argmax(jnp.flip(positive, axis=-1), axis=-1)
    return jnp.minimum(idx, last_positive).astype(jnp.int32)


def choose(key: jax.Array, logits: jax.Array, rows: RowParams, mode: SamplingMode,
           counts: penalties.Counts | None = None) -> jax.Array:
    """One token per row of `logits` [B, V]: argmax for a greedy row, else a sample from its
    filtered distribution (both after bias and penalties, `adjusted`). Returns int32 [B]."""
    x = adjusted(logits, rows, mode, counts)
    greedy = jnp.argmax(x, axis=-1).astype(jnp.int32)
    if mode.greedy:
        return greedy
    probs = probs_from_logits(x, rows, mode)
    return jnp.where(rows.temperature > 0, sample_from_probs(probs, uniform(key, probs.shape[:-1])), greedy)


def token_logprobs(logits: jax.Array, tokens: jax.Array, n_top: int):
    """log_softmax of the model's logits [B, K, V] (float32; no bias, no temperature) at `tokens`
    [B, K], and the n_top most likely tokens per position: (logprob [B, K], top ids [B, K, n_top],
    top logprobs [B, K, n_top])."""
    x = logits.astype(jnp.float32)
    lse = jax.nn.logsumexp(x, axis=-1)
    lp = jnp.take_along_axis(x, tokens[..., None], axis=-1)[..., 0] - lse
    if n_top == 0:
        shape = x.shape[:-1] + (0,)
        return lp, jnp.zeros(shape, jnp.int32), jnp.zeros(shape, jnp.float32)
    vals, ids = jax.lax.top_k(x, n_top)
    return lp, ids.astype(jnp.int32), vals - lse[..., None]


# --------------------------------------------------------------------------------------------
# The speculative block step


def greedy_accept(draft_tokens: jax.Array, target_logits: jax.Array):
    """Greedy walk over one verified block.

    draft_tokens: int32 [B, K-1]; target_logits: [B, K, V] (verify logits at [bonus, d_0..]).
    Returns (n_accepted [B] in 0..K-1, emitted [B, K]): the emitted block is d_0..d_{a-1} followed
    by the target's argmax at a; since d_i == argmax_i for i < a it equals argmax[:, :K] and only
    its first a+1 entries are meaningful.
    """
    target_tokens = jnp.argmax(target_logits, axis=-1).astype(jnp.int32)
    k = target_logits.shape[1]
    if k == 1:
        return jnp.zeros(target_tokens.shape[:1], jnp.int32), target_tokens
    match = draft_tokens == target_tokens[:, : k - 1]
    n_accepted = jnp.sum(jnp.cumprod(match.astype(jnp.int32), axis=1), axis=1)
    return n_accepted.astype(jnp.int32), target_tokens


def residual_probs(p: jax.Array, q: jax.Array) -> jax.Array:
    """normalize(max(0, p - q)) over the last axis; falls back to p where p - q has no positive
    mass (p == q up to rounding: then rejection has probability ~0 anyway)."""
    r = jnp.maximum(p - q, 0.0)
    total = jnp.sum(r, axis=-1, keepdims=True)
    r = jnp.where(total > 0, r, p)
    return r / jnp.sum(r, axis=-1, keepdims=True)


def speculative_accept_from_uniforms(draft_tokens, q, p, u_accept, u_resample):
    """Modified rejection sampling for a whole block, with the randomness passed in.

    draft_tokens: int32 [B, K-1], drawn from q; q: [B, K-1, V] draft distributions;
    p: [B, K, V] target distributions at the K verify positions; u_accept: [B, K-1] and
    u_resample: [B], uniforms in [0, 1).
    Draft i is accepted iff u_accept[i] * q_i(d_i) < p_i(d_i) (i.e. with probability
    min(1, p/q)); a = number of leading accepted drafts. The token at position a is drawn (inverse
    CDF with u_resample) from normalize(max(0, p_a - q_a)) when a < K-1, and from p_{K-1} when all
    drafts were accepted (q is extended with a zero row, so the same formula gives p).
    q None: point-mass drafts, q_i = one_hot(d_i) (prompt lookup's), without building it: d_i is
    accepted iff u_accept[i] < p_i(d_i), and the residual at a rejection is p_a with d_a removed.
    Returns (n_accepted [B], emitted [B, K]): d_0..d_{a-1}, then the new token at a; entries after
    a are filler.
    """
    b, k, v = p.shape
    p = p.astype(jnp.float32)
    rows = jnp.arange(b)
    if k > 1:
        p_d = jnp.take_along_axis(p[:, : k - 1], draft_tokens[..., None], axis=-1)[..., 0]
        q_d = 1.0 if q is None else jnp.take_along_axis(q.astype(jnp.float32), draft_tokens[..., None], axis=-1)[..., 0]
        accept = u_accept.astype(jnp.float32) * q_d < p_d
        n_accepted = jnp.sum(jnp.cumprod(accept.astype(jnp.int32), axis=1), axis=1).astype(jnp.int32)
    else:
        n_accepted = jnp.zeros((b,), jnp.int32)
    p_a = p[rows, n_accepted]
    if q is None:  # the rejected draft's token removed; after K-1 acceptances (index -1) nothing is
        d_ext = jnp.concatenate([draft_tokens, jnp.full((b, 1), -1, jnp.int32)], axis=1)
        d_a = d_ext[rows, n_accepted]
        q_a = (jnp.arange(v, dtype=jnp.int32)[None, :] == d_a[:, None]).astype(jnp.float32)
    elif k > 1:
        q_a = jnp.concatenate([q.astype(jnp.float32), jnp.zeros((b, 1, v), jnp.float32)], axis=1)[rows, n_accepted]
    else:
        q_a = jnp.zeros((b, v), jnp.float32)
    new_token = sample_from_probs(residual_probs(p_a, q_a), u_resample)
    pos = jnp.arange(k, dtype=jnp.int32)[None, :]
    if k > 1:
        drafts_ext = jnp.concatenate([draft_tokens, jnp.zeros((b, 1), jnp.int32)], axis=1)
    else:
        drafts_ext = jnp.zeros((b, 1), jnp.int32)
    emitted = jnp.where(pos < n_accepted[:, None], drafts_ext, new_token[:, None]).astype(jnp.int32)
    return n_accepted, emitted


def speculative_accept(key, draft_tokens, q, p):
    """`speculative_accept_from_uniforms` with uniforms drawn from `key`."""
    b, k = p.shape[:2]
    k_acc, k_res = split(key, 2)
    u_accept = uniform(k_acc, (b, max(k - 1, 0)))
    u_resample = uniform(k_res, (b,))
    return speculative_accept_from_uniforms(draft_tokens, q, p, u_accept, u_resample)


def accept(key, draft_tokens, q, logits, rows: RowParams, mode: SamplingMode, counts: penalties.Counts | None = None):
    """One verified block, each row by its own setting: (n_accepted [B], emitted [B, K]). A greedy
    row walks the argmax of its (biased, penalised) logits (`greedy_accept`), a sampled row is
    modified rejection sampling against its filtered p (`speculative_accept`; q None: point-mass
    drafts); a select picks per row. With penalties, position j's logits are penalised with
    `counts` plus the drafts before j: the p classic decoding would use there."""
    x = adjusted(logits, rows, mode, counts, draft_tokens)
    n_greedy, e_greedy = greedy_accept(draft_tokens, x)
    if mode.greedy:
        return n_greedy, e_greedy
    p = probs_from_logits(x, rows, mode)
    n_s, e_s = speculative_accept(key, draft_tokens, q, p)
    g = rows.temperature == 0
    return jnp.where(g, n_greedy, n_s), jnp.where(g[:, None], e_greedy, e_s)


def draft_choice(key, draft_logits: jax.Array, rows: RowParams, mode: SamplingMode,
                 counts: penalties.Counts | None = None):
    """A draft token per row and the distribution q it was drawn from (the one the accept step must
    use). draft_logits: [B, V]. Greedy rows (and draft="argmax"): the argmax of the biased (and,
    with `counts`, penalised) logits; sampled rows: a sample from the filtered q (draft="argmax": q =
    one_hot(argmax)). q is None in a greedy program; a greedy row's q is computed and never used."""
    x = adjusted(draft_logits, rows, mode, counts)
    top = jnp.argmax(x, axis=-1).astype(jnp.int32)
    if mode.greedy:
        return top, None
    if mode.draft == "argmax":
        return top, jax.nn.one_hot(top, x.shape[-1], dtype=jnp.float32)
    q = probs_from_logits(x, rows, mode)
    return jnp.where(rows.temperature > 0, sample_from_probs(q, uniform(key, q.shape[:-1])), top), q
