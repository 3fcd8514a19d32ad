"""The batch engine's row views on the CPU's XLA path (jaxspec.engine.batching, models.narrow): a step
reads only the power-of-two bucket of positions its decoding rows can touch, not a request's whole
table, and a request's tokens stay what jaxspec.generate gives it alone, bitwise, as it grows from
one bucket into the next (views within the sliding layers' rings cut them too). The tiny pair;
capacity 1,024, so the whole table is never the bucket.
(Under pytest XLA compiles at -O0, tests/conftest.py: there generate's and the engine's log-probabilities
agree bit for bit; at the default level this tiny model's logits differ in the last bits, with views cut
or not: from -O1 on XLA's CPU code contracts a * b + c into one FMA inside a fused kernel, and the
engine's programs fuse the model otherwise than generate's. Without FMA (--xla_cpu_max_isa=AVX) they
agree at the default level too; the real Gemma 3 270M's and the default pair's agree at the default level
in bfloat16, the default pair's in float32 do not: benchmarks/engine_bits_bench.py,
docs/benchmark_results/first-impression-cpu-2026-12-05.md.)"""
import jax
import jax.numpy as jnp
import numpy as np

import jaxspec
from jaxspec import models
from jaxspec.engine import batching, compile_cache, sampling
from jaxspec.engine.batching import BatchEngine
from jaxspec.engine.loop_config import VIEW_BUCKET, view_bucket
from support.pairs import make_pair
from support.seeds import seeded_int, seeded_rng

# A 240-position window: 257-slot rings (models.ring_size), which the 256-position view cuts (plain buffers
# of 256 slots) and the 512 one does not; the requests below wrap them.
TARGET, ASSISTANT = make_pair(seed=11, layers=2, max_position_embeddings=2048, sliding_window=240)
VOCAB = TARGET.config.vocab_size
CAPACITY, BLOCK = 1024, 16
MODE = sampling.SamplingMode(sample=True, logprobs=0)  # one program a view: greedy and sampled rows


def test_view_bucket_is_the_power_of_two_above_whole_blocks_within_the_capacity():
    assert [view_bucket(n, 4096, 16) for n in (1, 256, 257, 600, 2049, 5000)] == [256, 256, 512, 1024, 4096, 4096]
    assert view_bucket(300, 384, 16) == 384  # never past the capacity
    assert view_bucket(1, 4096, 100) == 300  # whole blocks
    assert VIEW_BUCKET == 256


def _run(engine, requests):
    """Admit every (prompt, budget, params) at once, step until all finish; [(tokens, logprobs)] in order."""
    out = {engine.admit(ids, n, params=params): ([], []) for ids, n, params in requests}
    while engine.live:
        for ev in engine.step():
            out[ev.slot][0].extend(ev.tokens)
            out[ev.slot][1].extend(lp for lp, _ in ev.logprobs or [])
    return [out[s] for s in sorted(out)]


def _engine(**kw):
    return BatchEngine(TARGET, None, slots=2, max_new_tokens=250, capacity=CAPACITY, block_tokens=BLOCK,
                       block_size=1, eos_token_ids=(), modes=(MODE,), rounds_per_step=4, **kw)


def test_requests_growing_across_views_equal_generate_and_compile_a_program_per_view(monkeypatch):
    """A greedy request of a short prompt and a long budget, and a seeded sampled one of a long prompt
    beside it, both crossing 256 positions: the steps run the 256- and then the 512-position view,
    never the 1,024 of the table, one program each. The greedy request's tokens and log-probabilities
    are generate's bits, and both requests' are what the same engine gives reading the whole table
    (the code before views were cut), bitwise."""
    rng = seeded_rng()
    greedy = sampling.SamplingParams(logprobs=0)
    sampled = sampling.SamplingParams(temperature=0.8, seed=seeded_int(1 << 31), logprobs=0)
    requests = [(rng.integers(2, VOCAB, 9).tolist(), 250, greedy),
                (rng.integers(2, VOCAB, int(rng.integers(220, 235))).tolist(), 40, sampled)]
    engine = _engine()
    with compile_cache.CompileLog() as log:
        got = _run(engine, requests)
    assert sorted(engine.view_steps) == [256, 512]  # below 256 first, then past it; never the whole table
    assert [name for name in log.names() if name == "decode_rounds"] == ["decode_rounds"] * 2
    short = jaxspec.generate(TARGET, [requests[0][0]], params=greedy, max_new_tokens=250, block_size=1,
                             eos_token_ids=(), drafter=None)
    assert got[0] == (short.tokens[0], [lp for lp, _ in short.logprobs[0]])
    monkeypatch.setattr(batching, "narrow_views", lambda target: False)
    whole = _engine()
    assert _run(whole, requests) == got
    assert sorted(whole.view_steps) == [CAPACITY]


def test_a_narrowed_forward_is_the_whole_caches_bitwise():
    """models.narrow / models.widen at the forward: decode steps and a verify on a paged cache cut to
    the rows' first 64 positions (the table, and the 257-slot rings made 64-slot buffers) give the
    logits and hidden states the whole cache gives (its other blocks and slots full of stale
    values), and so does the MTP assistant's draft step, which reads the target's cache through the
    same views (models.shared_kv); widened back, the cache holds what the whole one holds at every
    written position, so the steps after it on the whole cache are the same bits too."""
    rng = seeded_rng()
    cap, block, pool = 512, 16, 80
    cache = models.init_paged_cache(TARGET.config, 2, cap, pool, block, jnp.float32)
    assert cache.pos is not None and cache.pos.shape[1] == 257 and models.cuts_rings(cache, 64)
    table = np.full((2, cap // block), pool, np.int32)
    table[:, :4] = rng.permutation(pool)[:8].reshape(2, 4)  # 4 blocks each: 64 positions
    stale = lambda x: jnp.asarray(rng.normal(size=x.shape), x.dtype)  # noqa: E731
    cache = cache.replace(k=tuple(stale(x) for x in cache.k), v=tuple(stale(x) for x in cache.v),
                          table=jnp.asarray(table))
    fwd, step = jax.jit(models.forward), jax.jit(models.draft_step)
    prompt = jnp.asarray(rng.integers(2, VOCAB, (2, 32)), jnp.int32)
    lengths = np.array([30, 19])
    valid = jnp.arange(32)[None, :] < jnp.asarray(lengths)[:, None]
    _, _, cache = fwd(TARGET, prompt, cache, valid=valid)
    whole = widened = cache.replace(lengths=jnp.asarray(lengths, jnp.int32))
    for width, cut in ((1, True), (4, True), (1, True), (2, False)):
        tokens = jnp.asarray(rng.integers(2, VOCAB, (2, width)), jnp.int32)
        a = fwd(TARGET, tokens, whole)
        if cut:
            small = models.narrow(widened, 64)
            assert small.table.shape == (2, 4) and small.pos is None and small.k[0].shape[-3] == 64
            b = fwd(TARGET, tokens, small)
            token, h = tokens[:, 0], a[1][:, -1]
            drafts = [step(ASSISTANT, TARGET, c, token, h, c.lengths) for c in (a[2], b[2])]
            for x, y in zip(*drafts):
                np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
            widened = models.widen(widened, b[2])
        else:  # the widened cache, whole again
            b = fwd(TARGET, tokens, widened)
            widened = b[2]
        for x, y in zip(a[:2], b[:2]):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
        whole = a[2]
