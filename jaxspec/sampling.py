"""Token selection: greedy, temperature / top-k / top-p sampling, and the lossless
speculative accept/resample step.

Everything here is batched, vectorized and jit-friendly: no Python control flow depends on array
values. Sampling parameters are static (a frozen, hashable `SamplingParams`), so one compiled
function serves one setting.

The speculative step is modified rejection sampling (Leviathan et al. / Chen et al.): draft token
`d` drawn from `q` is accepted with probability `min(1, p(d) / q(d))`; at the first rejection the
token is resampled from `normalize(max(0, p - q))`; when every draft is accepted the bonus token is
drawn from `p`. The emitted sequence then has exactly the target's distribution `p`. Argmax drafting
is the special case `q = one_hot(argmax)`.
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

DRAFT_MODES = ("sample", "argmax")
SEED_LIMIT = 1 << 64  # seeds are integers in [0, 2**64): the two 32-bit words of a threefry key


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How tokens are chosen. `temperature == 0` is greedy (argmax; top_k/top_p ignored).

    draft: "sample" draws draft tokens from the filtered draft distribution q (default, lossless,
    best acceptance); "argmax" drafts the draft model's argmax (q one-hot; also lossless).
    """

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    draft: str = "sample"

    def __post_init__(self):
        validate_sampling(self.temperature, self.top_k, self.top_p, self.draft)
        if self.top_k is not None:  # a numpy integer is accepted and kept as a Python int
            object.__setattr__(self, "top_k", int(self.top_k))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def validate_sampling(temperature, top_k, top_p, draft="sample") -> None:
    """Raise ValueError for parameters no sampler accepts. Numbers may be Python or numpy
    numbers (not bools); top_k an integer."""
    if not _is_number(temperature):
        raise ValueError(f"temperature must be a number >= 0, got {temperature!r}")
    if not math.isfinite(temperature) or temperature < 0:
        raise ValueError(f"temperature must be a finite number >= 0, got {temperature}")
    if top_k is not None:
        if not _is_int(top_k) or top_k < 1:
            raise ValueError(f"top_k must be None or an integer >= 1, got {top_k!r}")
    if top_p is not None:
        if not _is_number(top_p) or not (0.0 < top_p <= 1.0):
            raise ValueError(f"top_p must be None or a number in (0, 1], got {top_p!r}")
    if draft not in DRAFT_MODES:
        raise ValueError(f"draft={draft!r}: expected one of {DRAFT_MODES}")


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
    if not 0 <= s < SEED_LIMIT:
        raise ValueError(f"seed must be an integer in [0, 2**64) (0 .. {SEED_LIMIT - 1}), got {s}")
    return s


def seed_key(seed) -> jax.Array:
    """The PRNG key of a seed in [0, 2**64) (`validate_seed`): distinct seeds give distinct keys.
    With JAX's default threefry2x32 the key data is the seed's two 32-bit words [seed >> 32,
    seed & 0xFFFFFFFF], so a seed < 2**32 gives `jax.random.key(seed)` (the same samples as
    before seeds above 2**32 were accepted; `jax.random.key` alone reduces them mod 2**32). With
    another default PRNG implementation: `jax.random.key(seed & 0xFFFFFFFF)`, folded with the high
    word when it is not 0."""
    s = validate_seed(seed)
    hi, lo = s >> 32, s & 0xFFFFFFFF
    if jax.config.jax_default_prng_impl == "threefry2x32":
        return jax.random.wrap_key_data(np.asarray([hi, lo], np.uint32), impl="threefry2x32")
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
# Filtering: logits -> probabilities


def filter_logits(logits: jax.Array, params: SamplingParams) -> jax.Array:
    """Temperature-scaled logits (float32) with tokens outside top-k / top-p set to -inf.

    top-k keeps every token whose scaled logit is >= the k-th largest (ties at the boundary are
    kept). top-p (nucleus) keeps the smallest prefix of the descending-probability order whose mass
    reaches top_p (the most likely token is always kept; ties at the boundary are kept). With both,
    top-k is applied first and top-p renormalizes within it.
    """
    if params.greedy:
        raise ValueError("filter_logits is for temperature > 0; greedy decoding uses argmax")
    x = logits.astype(jnp.float32) / jnp.float32(params.temperature)
    vocab = x.shape[-1]
    neg_inf = jnp.float32(-jnp.inf)
    top_k = params.top_k if params.top_k is not None and params.top_k < vocab else None
    top_p = params.top_p if params.top_p is not None and params.top_p < 1.0 else None
    if top_k is None and top_p is None:
        return x
    if top_k is not None:
        # Descending values of the k best; their last one is the threshold.
        sorted_desc = jax.lax.top_k(x, top_k)[0]
        x = jnp.where(x >= sorted_desc[..., -1:], x, neg_inf)
    else:
        sorted_desc = -jnp.sort(-x, axis=-1)
    if top_p is not None:
        # Probabilities of the candidates in descending order (within top-k when set).
        p_sorted = jax.nn.softmax(sorted_desc, axis=-1)
        mass_before = jnp.cumsum(p_sorted, axis=-1) - p_sorted
        keep = mass_before < jnp.float32(top_p)  # a prefix; index 0 always kept
        n_keep = jnp.sum(keep, axis=-1, keepdims=True)
        threshold = jnp.take_along_axis(sorted_desc, n_keep - 1, axis=-1)
        x = jnp.where(x >= threshold, x, neg_inf)
    return x


def probs_from_logits(logits: jax.Array, params: SamplingParams) -> jax.Array:
    """The sampling distribution (float32, sums to 1 over the last axis) for temperature > 0."""
    return jax.nn.softmax(filter_logits(logits, params), axis=-1)


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


def sample(key: jax.Array, logits: jax.Array, params: SamplingParams) -> jax.Array:
    """One token per row of `logits` [..., V]: argmax when greedy, else a sample from the filtered
    distribution. Returns int32 [...]."""
    if params.greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    probs = probs_from_logits(logits, params)
    return sample_from_probs(probs, uniform(key, probs.shape[:-1]))


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
    Returns (n_accepted [B], emitted [B, K]): d_0..d_{a-1}, then the new token at a; entries after
    a are filler.
    """
    b, k, v = p.shape
    p = p.astype(jnp.float32)
    q = q.astype(jnp.float32)
    if k > 1:
        p_d = jnp.take_along_axis(p[:, : k - 1], draft_tokens[..., None], axis=-1)[..., 0]
        q_d = jnp.take_along_axis(q, draft_tokens[..., None], axis=-1)[..., 0]
        accept = u_accept.astype(jnp.float32) * q_d < p_d
        n_accepted = jnp.sum(jnp.cumprod(accept.astype(jnp.int32), axis=1), axis=1).astype(jnp.int32)
        q_ext = jnp.concatenate([q, jnp.zeros((b, 1, v), jnp.float32)], axis=1)
    else:
        n_accepted = jnp.zeros((b,), jnp.int32)
        q_ext = jnp.zeros((b, 1, v), jnp.float32)
    rows = jnp.arange(b)
    p_a = p[rows, n_accepted]
    q_a = q_ext[rows, n_accepted]
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


def draft_choice(key, draft_logits: jax.Array, params: SamplingParams):
    """A draft token and the distribution q it was drawn from (the one the accept step must use).

    draft_logits: [B, V]. Greedy: argmax, q unused (returned as None). Sampling with draft="sample":
    a sample from the filtered q; draft="argmax": the argmax with q = one_hot(argmax).
    """
    if params.greedy:
        return jnp.argmax(draft_logits, axis=-1).astype(jnp.int32), None
    if params.draft == "argmax":
        tok = jnp.argmax(draft_logits, axis=-1).astype(jnp.int32)
        return tok, jax.nn.one_hot(tok, draft_logits.shape[-1], dtype=jnp.float32)
    q = probs_from_logits(draft_logits, params)
    return sample_from_probs(q, uniform(key, q.shape[:-1])), q
