"""The paged KV cache (models.init_paged_cache: block pools + per-row block tables for the global
layers, rings per row) against the contiguous cache on the XLA path: the same forwards (a ragged
prefill, decode steps, a verify with rollback, a continued prefill chunk) and draft steps give bitwise
the same logits and hidden states, whichever pool blocks a row got and whatever stale values the
reused blocks hold."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec import models
from support.seeds import seeded_rng
from support.pairs import make_pair

TARGET, ASSISTANT = make_pair(seed=3, layers=2)
CAP, BLOCK, POOL = 64, 8, 40


def _paged(rng, lengths_needed):
    """A paged cache whose rows own random, disjoint pool blocks (just enough for their positions),
    the pools full of stale random values (blocks reused from earlier requests)."""
    cache = models.init_paged_cache(TARGET.config, len(lengths_needed), CAP, POOL, BLOCK, jnp.float32)
    assert cache.paged and cache.pos is not None  # global layers paged, sliding layers ringed
    perm = rng.permutation(POOL)
    table = np.full((len(lengths_needed), CAP // BLOCK), POOL, np.int32)
    at = 0
    for b, n in enumerate(lengths_needed):
        k = -(-n // BLOCK)
        table[b, :k] = perm[at:at + k]
        at += k
    stale = lambda x: jnp.asarray(rng.normal(size=x.shape), x.dtype)
    k = tuple(stale(x) if j in cache.paged else x for j, x in enumerate(cache.k))
    v = tuple(stale(x) if j in cache.paged else x for j, x in enumerate(cache.v))
    return cache.replace(k=k, v=v, table=jnp.asarray(table))


def test_paged_forward_and_drafts_equal_the_contiguous_cache_bitwise():
    rng = seeded_rng()
    vocab = TARGET.config.vocab_size
    lengths = np.array([21, 7, 30])
    flat = models.init_cache(TARGET.config, 3, CAP, jnp.float32)
    paged = _paged(rng, lengths + 34)  # room for the prompt and all that the steps below write
    fwd = jax.jit(models.forward)

    def both(tokens, **kw):
        nonlocal flat, paged
        a = fwd(TARGET, tokens, flat, **kw)
        b = fwd(TARGET, tokens, paged, **kw)
        for x, y in zip(a[:2], b[:2]):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
        flat, paged = a[2], b[2]
        return a

    prompt = jnp.asarray(rng.integers(2, vocab, (3, 32)), jnp.int32)
    valid = jnp.arange(32)[None, :] < jnp.asarray(lengths)[:, None]
    both(prompt, valid=valid, logits_at=jnp.asarray(lengths - 1, jnp.int32))
    flat, paged = (c.replace(lengths=jnp.asarray(lengths, jnp.int32)) for c in (flat, paged))
    for width in (1, 4, 1, 4, 2):  # decode steps and verifies, each rolled back by a random count
        old = flat.lengths
        both(jnp.asarray(rng.integers(2, vocab, (3, width)), jnp.int32))
        keep = old + jnp.asarray(rng.integers(1, width + 1, 3), jnp.int32)
        flat, paged = (c.replace(lengths=keep) for c in (flat, paged))
    both(jnp.asarray(rng.integers(2, vocab, (3, 18)), jnp.int32))  # a prefill chunk continuing the rows
    h = jnp.asarray(rng.normal(size=(3, TARGET.config.hidden_size)), jnp.float32)
    tok = jnp.asarray(rng.integers(2, vocab, 3), jnp.int32)
    step = jax.jit(models.draft_step)
    a = step(ASSISTANT, TARGET, flat, tok, h, flat.lengths)
    b = step(ASSISTANT, TARGET, paged, tok, h, paged.lengths)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_writes_stay_in_the_rows_own_blocks():
    """A row writes only into its blocks: the pool blocks nobody owns, and another row's, keep their
    bytes (positions past a row's blocks are dropped, not clamped onto a neighbour)."""
    rng = seeded_rng()
    paged = _paged(rng, [8, 16])
    before = [np.asarray(x) for x in paged.k]
    owned = set(np.asarray(paged.table).ravel().tolist()) - {POOL}
    tokens = jnp.asarray(rng.integers(2, 200, (2, 24)), jnp.int32)  # past row 0's one block
    _, _, after = jax.jit(models.forward)(TARGET, tokens, paged)
    for j in paged.paged:
        x, y = before[j], np.asarray(after.k[j])
        free = [i for i in range(POOL) if i not in owned]
        np.testing.assert_array_equal(x[..., free, :, :, :], y[..., free, :, :, :])
        row1 = np.asarray(paged.table)[1, :2]
        assert not np.array_equal(x[..., row1, :, :, :], y[..., row1, :, :, :])


@pytest.mark.slow
def test_the_pallas_kernels_read_the_pool_bitwise():
    """The same on the Pallas path (interpret mode on CPU): a 20-token block writes the new K/V into
    the view and flash_attention reads it; a 4-token verify (padded to the row bucket of 8, its pad
    slots hidden) and an 8-token one write them into the pool and paged_attention reads the rows'
    blocks through the table. The logits and hidden states equal the contiguous cache's bitwise."""
    from jaxspec.kernels import ROW_TILE, DispatchConfig

    pallas = DispatchConfig(backend="pallas", interpret=True, attention="pallas", paged_attention=True)
    target, _ = make_pair(seed=5, layers=2, matmul=pallas)
    assert target.matmul.attention_kernels
    rng = seeded_rng()
    flat = models.init_cache(target.config, 2, CAP, jnp.float32)
    paged = _paged(rng, [40, 40])
    fwd = jax.jit(models.forward)
    for width in (20, 4, 8):
        tokens = jnp.asarray(rng.integers(2, 200, (2, width)), jnp.int32)
        program = str(jax.make_jaxpr(models.forward)(target, tokens, paged))
        assert ("paged_attention" in program) == (width <= ROW_TILE), width
        a, b = fwd(target, tokens, flat), fwd(target, tokens, paged)
        for x, y in zip(a[:2], b[:2]):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
        flat, paged = a[2], b[2]
