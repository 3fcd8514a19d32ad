"""The target's verify forward, optionally padded, and the start-up exactness probe.

Padded verify (reference section 6): the [B, K] verify block is padded with token 0 to a width P
where the quantized matmul dispatch picks its tiled path (`select_path(P * B) == "qmm"`), or to an
explicit width. A `valid` mask hides the pad positions' keys (pad queries still see the real keys,
so no row is fully masked); logits and hidden are sliced back to K and the cache length is set to
old + K, so the pad positions' K/V are dropped (and overwritten later). Mathematically exact, not
bit-exact in general: the tiled kernel sums in a different order.
"""
from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec import models
from jaxspec.kernels import ROW_TILE, DispatchConfig, select_path
from jaxspec.kernels.xla import program_options

from jaxspec.engine import programs

PAD_TOKEN = 0
# An explicit verify_pad width: padding exists to reach the tiled GEMM (past ROW_TILE rows); more
# than four row tiles (the GEMM's default 64-row tile) only adds work.
MAX_VERIFY_WIDTH = 4 * ROW_TILE


def resolve_verify_pad(verify_pad, matmul: DispatchConfig | None) -> bool | int:
    """None -> the target's `matmul.verify_pad` (resolved from the environment once, when the model
    was loaded). True: pad to the qmm threshold; an int: pad to that width (must be >= block_size,
    checked by the caller, at most MAX_VERIFY_WIDTH); False/0: no padding."""
    if verify_pad is None:
        return bool((DispatchConfig() if matmul is None else matmul).verify_pad)
    if isinstance(verify_pad, (bool, np.bool_)):
        return bool(verify_pad)
    if isinstance(verify_pad, (int, np.integer)):
        if not 0 <= verify_pad <= MAX_VERIFY_WIDTH:
            raise ValueError(f"verify_pad must be an integer in 0..{MAX_VERIFY_WIDTH}, got {verify_pad!r}")
        return int(verify_pad) if verify_pad > 0 else False
    raise ValueError(f"verify_pad must be None, a bool or an int width, got {verify_pad!r}")


def qmm_threshold_width(block_size: int, batch: int, matmul: DispatchConfig | None) -> int:
    """The smallest width P >= block_size with `select_path(P * batch) == "qmm"`."""
    config = DispatchConfig() if matmul is None else matmul
    width = block_size
    while select_path(width * batch, config) != "qmm":
        width += 1
    return width


def verify_width(block_size: int, batch: int, verify_pad, matmul: DispatchConfig | None) -> int:
    """The static verify width for `verify_pad` (see resolve_verify_pad): K when off, or when K <= 1."""
    verify_pad = resolve_verify_pad(verify_pad, matmul)
    if block_size <= 1 or verify_pad is False:
        return block_size
    if verify_pad is True:
        return qmm_threshold_width(block_size, batch, matmul)
    return max(int(verify_pad), block_size)


def verify_forward(target, tokens: jax.Array, cache, width: int | None = None):
    """Target forward over `tokens` [B, K] at the cache's lengths, padded to `width` when larger.

    Returns (logits [B, K, V] float32, hidden [B, K, H], cache with lengths = old + K).
    """
    b, k = tokens.shape
    width = k if width is None else width
    if width < k:
        raise ValueError(f"verify width {width} < block {k}")
    if width == k:
        return models.forward(target, tokens, cache)
    old = cache.lengths
    padded = jnp.concatenate([tokens, jnp.full((b, width - k), PAD_TOKEN, tokens.dtype)], axis=1)
    valid = jnp.broadcast_to(jnp.arange(width) < k, (b, width))
    logits, hidden, cache = models.forward(target, padded, cache, valid=valid)
    return logits[:, :k], hidden[:, :k], cache.replace(lengths=old + k)


# --------------------------------------------------------------------------------------------
# Exactness probe


def _probe_forward(target, tokens, n, cache):
    """`models.forward` of the first `n` (traced) of `tokens [B, W]`, the rest padding: at W = the
    row bucket this is the forward a [B, n] decode or verify block runs (forward pads to the bucket
    the same way), so one compiled program serves the prefix, the verify and every single step."""
    b, w = tokens.shape
    valid = jnp.broadcast_to(jnp.arange(w) < n, (b, w))
    logits, hidden, new = models.forward(target, tokens, cache, valid=valid)
    return logits, hidden, new.replace(lengths=cache.lengths + n)


def _padded(tokens, width):
    return jnp.pad(tokens, ((0, 0), (0, width - tokens.shape[1])), constant_values=PAD_TOKEN)


_PROBE_CACHE: dict = {}


def _cache_dtype(target):
    """K/V are stored in the target's activation dtype (models.Target.dtype)."""
    return jnp.dtype(target.dtype)


def probe_key(target, batch, block_size, width):
    leaves = jax.tree_util.tree_leaves(target)
    return (jax.tree_util.tree_structure(target), tuple((l.shape, str(l.dtype)) for l in leaves),
            batch, block_size, width)


def _probe_setup(target, batch: int, block_size: int, width: int, prefix_len: int = 5):
    """(row bucket, prefix length, verify width, `() -> empty cache`) of one probe: the prefix runs
    at the steps' width (no program of its own), the verify at the steps' width too when it fits."""
    bucket = models.row_bucket(target, batch)
    prefix_len = min(prefix_len, bucket)
    wide = max(width, bucket)
    return bucket, prefix_len, wide, lambda: models.init_cache(
        target.config, batch, prefix_len + wide + block_size, _cache_dtype(target))


def probe_programs(target, batch: int, block_size: int, width: int) -> list:
    """The probe's forward programs (`programs.Program`), one per width: one in all when K fits
    the row bucket. Each traces `models.forward` afresh when it is compiled (not served by jit's
    cache of an earlier function), so the probe checks the forward as it is now."""
    bucket, _, wide, new_cache = _probe_setup(target, batch, block_size, width)
    cache = jax.eval_shape(new_cache)
    out = []
    for w in dict.fromkeys((bucket, wide)):
        args = (target, jax.ShapeDtypeStruct((batch, w), jnp.int32), jax.ShapeDtypeStruct((), jnp.int32), cache)

        def lower(args=args):
            def exactness_probe(t, tokens, n, c):  # the name JAX logs (compile_cache.CompileLog)
                return _probe_forward(t, tokens, n, c)
            return jax.jit(exactness_probe, compiler_options=program_options() or None).lower(*args)
        out.append(programs.Program("exactness_probe", None, args, lower))
    return out


def exactness_probe(target, batch: int, block_size: int, width: int, *, seed: int = 1234) -> tuple[bool, float]:
    """Compare the logits and hidden of one K-wide verify (padded to `width`) with K single-token
    steps on a random prefix, bit for bit. Returns (exact, max |logit difference|). Cached per
    (target structure and shapes, batch, K, width): kernels, not values, decide bitwise equality."""
    key = probe_key(target, batch, block_size, width)
    if key in _PROBE_CACHE:
        return _PROBE_CACHE[key]
    bucket, prefix_len, wide, new_cache = _probe_setup(target, batch, block_size, width)
    cache = new_cache()
    compiled = dict(zip(dict.fromkeys((bucket, wide)),
                        programs.compile_all(probe_programs(target, batch, block_size, width))))
    vocab = int(target.config.vocab_size)
    rng = np.random.default_rng(seed)
    prefix = jnp.asarray(rng.integers(0, vocab, (batch, prefix_len)), jnp.int32)
    block = jnp.asarray(rng.integers(0, vocab, (batch, block_size)), jnp.int32)
    step = compiled[bucket]
    _, _, cache = step(target, _padded(prefix, bucket), jnp.int32(prefix_len), cache)
    wide_logits, wide_hidden, _ = compiled[wide](target, _padded(block, wide), jnp.int32(block_size), cache)
    steps = []
    for j in range(block_size):  # the steps go on from the cache the verify read
        lg, hd, cache = step(target, _padded(block[:, j:j + 1], bucket), jnp.int32(1), cache)
        steps.append((lg[:, :1], hd[:, :1]))
    (wl, wh), steps = jax.device_get(((wide_logits[:, :block_size], wide_hidden[:, :block_size]), steps))
    sl, sh = (np.concatenate(parts, axis=1) for parts in zip(*steps))
    exact = bool(np.array_equal(wl, sl) and np.array_equal(wh, sh))
    diff = float(np.max(np.abs(wl.astype(np.float64) - sl.astype(np.float64))))
    _PROBE_CACHE[key] = (exact, diff)
    return exact, diff


def warn_inexact(block_size, width, diff, instead: int | None = None):
    then = (f"running block size {instead} instead, where verify and decode share one shape" if instead
            else "falling back to classic decoding")
    warnings.warn(f"jaxspec: a {block_size}-wide verify (width {width}) is not bit-identical to "
                  f"{block_size} single-token steps on this target (max |logit diff| {diff:.3g}); "
                  f"greedy speculative decoding would not be byte-identical to classic decoding, {then}",
                  RuntimeWarning, stacklevel=3)
