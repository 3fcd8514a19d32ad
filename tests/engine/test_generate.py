"""jaxspec.generate / make_generate: greedy byte parity with classic decoding, batches, EOS and
budgets, stats, the draft plumbing, streaming, the exactness probe, padded verify, bad input.

References are independent of the loop under test: classic output is checked against a
step-by-step host loop over models.forward (one row at a time, unpadded prefill); speculative
output against classic output cut on the host; the round-by-round accepted counts against a host
implementation of the round written from the reference (section 4) with models.draft_step.

The test pair is the tiny preset with weights reshaped so that the assistant agrees with the target
often but not always (every accepted length occurs): the target's final norm gets random signs
(no "echo the last token" fixed point) and its blocks are damped, so its next token is mostly a
bigram of the current one; the assistant computes that bigram (same table and final norm, identity
pre-projection, damped blocks) plus a little of h_prev and attention.
"""
import functools
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxspec
from jaxspec import models
import importlib
G = importlib.import_module("jaxspec.engine.generate")
from jaxspec.engine import loop
from jaxspec.engine import programs
from jaxspec.engine import streaming
from jaxspec.engine import verify
from jaxspec.models import presets
from jaxspec.kernels import DispatchConfig
from support.pairs import XLA, make_pair  # noqa: F401
from support.pairs import pair  # noqa: F401

BUDGET = 32


def random_prompts(seed, lengths, vocab):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, n).tolist() for n in lengths]


PROMPT_LENGTHS = (5, 11, 2)
REF_CAPACITY = 64


@functools.lru_cache(maxsize=None)
def prompts():
    return tuple(map(tuple, random_prompts(7, PROMPT_LENGTHS, 256)))


def cut(row, limit, stops):
    row = list(row[:limit])
    for i, t in enumerate(row):
        if t in stops:
            return row[:i + 1]
    return row


# ---------------------------------------------------------------------------------------------
# Independent references


FWD = jax.jit(models.forward)
DRAFT = jax.jit(models.draft_step)


@functools.partial(jax.jit, static_argnums=3)
def _stepwise(t, feed, n_prompt, steps):
    """One row, one [1, 1] models.forward per position: the prompt teacher-forced token by token
    (no padding, no batch), then greedy."""
    cache = models.init_cache(t.config, 1, REF_CAPACITY, t.dtype)

    def step(carry, i):
        cache, prev = carry
        tok = jnp.where(i < n_prompt, feed[i], prev)
        logits, _, cache = models.forward(t, tok.reshape(1, 1), cache)
        nxt = jnp.argmax(logits[0, 0]).astype(jnp.int32)
        return (cache, nxt), nxt

    _, outs = jax.lax.scan(step, (cache, jnp.int32(0)), jnp.arange(steps))
    return outs


def stepwise_classic(t, prompt, n):
    steps = 16 + n
    feed = jnp.asarray(list(prompt) + [0] * (steps - len(prompt)), jnp.int32)
    outs = np.asarray(_stepwise(t, feed, len(prompt), steps))
    return outs[len(prompt) - 1:len(prompt) - 1 + n].tolist()


def host_speculative_rounds(t, a, prompt, k, n):
    """The greedy MTP round loop of reference section 4, on the host, one row: returns (tokens,
    accepted count per round). Draft inputs follow models.draft_step's docstring."""
    fwd, draft = FWD, DRAFT
    cache = models.init_cache(t.config, 1, REF_CAPACITY, t.dtype)
    for tok in prompt:
        logits, hidden, cache = fwd(t, jnp.asarray([[tok]], jnp.int32), cache)
    bonus, h = int(jnp.argmax(logits[0, -1])), hidden[:, -1]
    out, accepted = [bonus], []
    while len(out) < n:
        pos = cache.lengths
        drafts, tok, hh = [], jnp.asarray([bonus], jnp.int32), h
        for _ in range(k - 1):
            dl, hh = draft(a, t, cache, tok, hh, pos)
            tok = jnp.argmax(dl, -1).astype(jnp.int32)
            drafts.append(int(tok[0]))
        old = cache.lengths
        logits, hidden, cache = fwd(t, jnp.asarray([[bonus] + drafts], jnp.int32), cache)
        target = np.asarray(jnp.argmax(logits[0], -1))
        acc = 0
        while acc < k - 1 and drafts[acc] == target[acc]:
            acc += 1
        accepted.append(acc)
        out += drafts[:acc] + [int(target[acc])]
        cache = cache.replace(lengths=old + acc + 1)
        bonus, h = int(target[acc]), hidden[:, acc]
    return out[:n], accepted


# ---------------------------------------------------------------------------------------------
# Runners (compiled once per static setting; budgets and stop ids are runtime inputs)


def run(k, rows, limits=None, stops=(), seed=0, **kw):
    t, a = pair()
    gen = jaxspec.make_generate(block_size=k, max_new_tokens=BUDGET, **kw)
    prompt, lengths, key, limit, stop_ids, rows = gen.inputs([list(r) for r in rows], eos_token_ids=stops, seed=seed)
    if limits is not None:
        limit = jnp.asarray(limits, jnp.int32)
    state, _, _ = gen.run(t, a, prompt, lengths, key, limit, stop_ids, rows)  # the path generate takes
    return gen.tokens(state), jax.device_get(state)


@functools.lru_cache(maxsize=None)
def classic_full():
    return run(1, prompts())[0]


def test_classic_matches_stepwise_reference():
    """The K=1 loop on a ragged, right-padded batch equals per-row unpadded step-by-step decoding."""
    got = classic_full()
    for row, p in zip(got, prompts()):
        assert row == stepwise_classic(pair()[0], p, BUDGET)
    assert len({tuple(r) for r in got}) == len(got)
    assert all(len(set(r)) > 4 for r in got)  # the test model does not just repeat a token


def _eos_cases(full):
    """Stop-id sets taken from the reference output: tokens first seen at different offsets."""
    cases = []
    for offset in (3, 6, 13):
        ids = {r[min(offset + i, len(r) - 1)] for i, r in enumerate(full)}
        cases.append(tuple(sorted(ids)))
    return cases


@pytest.mark.parametrize("k", [2, 4, 8])  # K = 3 runs in test_pallas_backend_parity
def test_greedy_parity_blocks(k):
    """Speculative == classic, byte for byte, for a ragged batch of 3: full budget, per-row budgets
    that end mid-block, and EOS ids that hit mid-stream."""
    full = classic_full()
    spec, state = run(k, prompts())
    assert spec == full
    rr, acc, dr, hist = state.row_rounds, state.accepted, state.drafted, state.hist
    assert np.all(dr == (k - 1) * rr) and np.all(acc <= dr) and hist.sum() == rr.sum()
    assert np.all(state.n_out - 1 <= rr * k) and np.all(state.n_out - 1 >= rr)  # a + 1 tokens a round
    assert hist[1:].sum() > 0 and hist[0] > 0  # drafts both accepted and rejected
    if k <= 4:
        assert hist[k - 1] > 0  # whole blocks accepted too
    assert int(state.rounds) == rr.max()  # the loop ends when the slowest row is done

    limits = [23, 9, 17]
    spec, state = run(k, prompts(), limits=limits)
    assert spec == [cut(r, n, ()) for r, n in zip(full, limits)]
    for stops in _eos_cases(full):
        spec, state = run(k, prompts(), limits=limits, stops=stops)
        assert spec == [cut(r, n, stops) for r, n in zip(full, limits)], stops
        assert all(len(r) < n or r[-1] in stops or len(r) == n for r, n in zip(spec, limits))


def test_round_trace_matches_host_reference():
    """The jitted loop's accepted count per round equals a host implementation of the round
    (draft K-1 with models.draft_step at position = cache length, verify, walk, roll back, carry
    the verify hidden at a): this checks the draft inputs, not just the output."""
    t, a = pair()
    k, p = 4, list(prompts()[1])
    ref_tokens, ref_acc = host_speculative_rounds(t, a, p, k, BUDGET)
    spec, state = run(k, [p])
    assert spec[0] == ref_tokens
    assert int(state.row_rounds[0]) == len(ref_acc)
    assert state.hist.tolist() == np.bincount(ref_acc, minlength=k).tolist()
    assert sum(ref_acc) > 0
    # Output positions that are inside a round's block but not its last token (position 0 is the
    # prefill's token): an EOS or a budget there must cut the block.
    inside, start = [], 1
    for acc in ref_acc:
        inside += list(range(start, start + acc))
        start += acc + 1
    eos_at = [j for j in inside if ref_tokens.index(ref_tokens[j]) == j]
    assert eos_at and inside
    j = eos_at[len(eos_at) // 2]
    spec, _ = run(k, [p], stops=(ref_tokens[j],))
    assert spec[0] == ref_tokens[:j + 1]
    j = inside[-1]
    spec, _ = run(k, [p], limits=[j + 1])
    assert spec[0] == ref_tokens[:j + 1]


def test_finished_rows_do_no_counted_work():
    """Rows that finish early (budget 1, early EOS) stop counting rounds; others go on."""
    full = classic_full()
    stops = (full[1][2],)
    spec, state = run(4, prompts(), limits=[1, BUDGET, BUDGET], stops=stops)
    assert spec[0] == full[0][:1] and int(state.row_rounds[0]) == 0 and int(state.drafted[0]) == 0
    assert spec[1] == cut(full[1], BUDGET, stops)
    assert int(state.row_rounds[1]) <= 2
    assert spec[2] == cut(full[2], BUDGET, stops)
    assert int(state.row_rounds[2]) > int(state.row_rounds[1])
    # a finished row's cache length stops moving: prompt + emitted - 1 (the last token is a bonus)
    assert state.cache.lengths.tolist() == [PROMPT_LENGTHS[b] + len(spec[b]) - 1 for b in range(3)]


def test_generate_api_and_stats():
    """The public API on a batch and on a single sequence: tokens, stats, timings."""
    t, a = pair()
    rows = [list(r) for r in prompts()]
    c = jaxspec.generate(t, rows, max_new_tokens=20)
    s = jaxspec.generate(t, rows, assistant=a, max_new_tokens=20, block_size=4, exactness_probe=False)
    assert c.tokens == [r[:20] for r in classic_full()]
    assert s.tokens == c.tokens
    st = s.stats
    assert st.mode == "speculative" and st.fallback is None and c.stats.mode == "classic"
    assert st.new_tokens == 60 and st.drafted == 3 * st.row_rounds
    assert st.acceptance_rate == pytest.approx(st.accepted / st.drafted)
    assert st.mean_accepted_len == pytest.approx(st.accepted / st.row_rounds)
    assert st.tokens_per_round == pytest.approx((60 - 3) / st.row_rounds)
    assert sum(st.accepted_hist) == st.row_rounds and len(st.accepted_hist) == 4
    assert st.accepted == sum(i * n for i, n in enumerate(st.accepted_hist))
    assert st.rounds < c.stats.rounds  # fewer verify forwards than classic steps
    assert st.prefill_s > 0 and st.decode_s > 0
    assert st.decode_tokens_per_s == pytest.approx(60 / st.decode_s)
    one = jaxspec.generate(t, rows[0], assistant=a, max_new_tokens=20, block_size=4, exactness_probe=False)
    assert one.tokens == [c.tokens[0]]
    assert set(st.as_dict()) >= {"rounds", "drafted", "accepted", "acceptance_rate", "mean_accepted_len",
                                 "tokens_per_round", "accepted_hist", "prefill_s", "decode_s",
                                 "decode_tokens_per_s"}


def test_bf16_parity():
    """The real activation dtype: bf16 weights, K/V and activations."""
    t, a = make_pair(seed=3, dtype=jnp.bfloat16)
    rows = random_prompts(4, (6, 3), 256)
    c = jaxspec.generate(t, rows, max_new_tokens=24)
    s = jaxspec.generate(t, rows, assistant=a, max_new_tokens=24, block_size=4, exactness_probe=False)
    assert s.tokens == c.tokens and s.stats.accepted > 0


@pytest.mark.slow
def test_pallas_backend_parity():
    """The default (Pallas, interpret mode on CPU) matmul backend (2 layers: interpret mode is slow)."""
    t, a = make_pair(seed=5, matmul=DispatchConfig(backend="pallas"), layers=2)
    rows = random_prompts(5, (4, 6), 256)
    c = jaxspec.generate(t, rows, max_new_tokens=8)
    s = jaxspec.generate(t, rows, assistant=a, max_new_tokens=8, block_size=3, exactness_probe=False)
    assert s.tokens == c.tokens and s.stats.accepted > 0


def test_no_host_round_trip_in_decode():
    """The whole decode is one while loop on device: no host callbacks, infeed/outfeed or
    send/recv in the compiled program."""
    t, a = pair()
    gen = jaxspec.make_generate(block_size=4, max_new_tokens=BUDGET)
    args = gen.inputs([list(r) for r in prompts()])
    state = gen.prefill(t, *args)
    hlo = gen.compiled_decode_text(t, a, state)
    assert hlo.count(" while(") >= 1
    for bad in ("outfeed", "infeed", " send(", " recv(", "host_callback", "xla_python_cpu_callback",
                "xla_ffi_python"):
        assert bad not in hlo, bad


def test_logprobs_of_generate_and_its_stream():
    """generate(logprobs=2) gives per row one (logprob, 2 alternatives) per token; greedy, the token
    is the most likely alternative and its logprob is the first alternative's; the stream's chunks
    carry the same entries, in order."""
    t, a = pair()
    rows = [list(r) for r in prompts()][:2]
    kw = dict(assistant=a, max_new_tokens=10, block_size=4, exactness_probe=False, logprobs=2)
    ref = jaxspec.generate(t, rows, **kw)
    assert [len(e) for e in ref.logprobs] == [len(r) for r in ref.tokens]
    for toks, entries in zip(ref.tokens, ref.logprobs):
        for tok, (lp, alts) in zip(toks, entries):
            assert len(alts) == 2 and alts[0][0] == tok and lp == alts[0][1] and alts[0][1] >= alts[1][1]
    chunks = list(streaming.stream_generate(t, rows, rounds_per_chunk=2, **kw))
    assert [sum((c.logprobs[b] for c in chunks), []) for b in range(len(rows))] == ref.logprobs


@pytest.mark.parametrize("k,temperature", [(4, 0.0), (4, 0.8), pytest.param(1, 0.8, marks=pytest.mark.slow)])
def test_streaming_equals_generate(k, temperature):
    """stream_generate runs generate's prefill and one fixed-round decode program per chunk size (no
    other compilation) and yields, chunk by chunk, exactly generate's tokens and stats for the same
    arguments and seed, greedy and sampled; every chunk but the last ran exactly rounds_per_chunk
    rounds."""
    t, a = pair()
    rows = [list(r) for r in prompts()]
    kw = dict(assistant=a, max_new_tokens=20, block_size=k, temperature=temperature, seed=5, exactness_probe=False)
    ref = jaxspec.generate(t, rows, **kw)
    if temperature > 0:  # the seed matters: another one samples other tokens
        assert jaxspec.generate(t, rows, **{**kw, "seed": 6}).tokens != ref.tokens
    compiled = dict(programs._MEMO)
    for per_chunk in (1, 3):
        chunks = list(streaming.stream_generate(t, rows, rounds_per_chunk=per_chunk, **kw))
        new = [sig for sig in programs._MEMO if sig not in compiled]
        assert [(sig[0], sig[1][1]) for sig in new] == [("decode_rounds", per_chunk)]
        compiled = dict(programs._MEMO)
        assert chunks[0].tokens == [r[:1] for r in ref.tokens] and chunks[0].rounds == 0
        assert [c.rounds for c in chunks[1:-1]] == [per_chunk * i for i in range(1, len(chunks) - 1)]
        assert [c.done for c in chunks] == [False] * (len(chunks) - 1) + [True]
        assert [sum((c.tokens[b] for c in chunks), []) for b in range(len(rows))] == ref.tokens
        res = chunks[-1].result
        assert res.tokens == ref.tokens and chunks[-1].rounds == ref.stats.rounds
        for key in ("mode", "block_size", "rounds", "row_rounds", "drafted", "accepted", "accepted_hist",
                    "new_tokens"):
            assert getattr(res.stats, key) == getattr(ref.stats, key), key
    got = []
    res = streaming.generate_streaming(t, rows, on_tokens=got.append, rounds_per_chunk=2, **kw)
    assert res.tokens == ref.tokens
    assert [sum((c[b] for c in got), []) for b in range(len(rows))] == ref.tokens and all(any(c) for c in got)


def test_non_finite_prefill_logits_are_an_error():
    """A target whose final norm is NaN (built in memory; loading refuses such a checkpoint) gives
    NaN logits: generate, streaming and Generator.tokens raise a ValueError after the prefill
    instead of returning id-0 tokens; the programs are the finite pair's (no extra compile)."""
    t, a = pair()
    rows = [list(r) for r in prompts()]
    kw = dict(max_new_tokens=20, exactness_probe=False)
    for k in (4, 1):  # the finite pair compiles the shapes (streaming's decode program too)
        jaxspec.generate(t, rows, assistant=a, block_size=k, **kw)
        list(streaming.stream_generate(t, rows, assistant=a, block_size=k, **kw))
    compiled = dict(programs._MEMO)
    bad = t.replace(params={**t.params, "norm": jnp.full_like(t.params["norm"], jnp.nan)})
    msg = r"the target produced NaN/inf logits for the prompt \(prompt rows \[0, 1, 2\]\): its weights are likely non-finite"
    for k in (4, 1):
        with pytest.raises(ValueError, match=msg):
            jaxspec.generate(bad, rows, assistant=a, block_size=k, **kw)
        with pytest.raises(ValueError, match=msg):
            next(iter(streaming.stream_generate(bad, rows, assistant=a, block_size=k, **kw)))
    assert programs._MEMO == compiled
    gen = jaxspec.make_generate(block_size=1, max_new_tokens=BUDGET)
    with pytest.raises(ValueError, match=r"NaN/inf logits for the prompt \(prompt row 0\)"):
        gen.tokens(gen(bad, None, *gen.inputs([1, 2, 3])[:3]))
    # the rows are named one by one
    with pytest.raises(ValueError, match=r"\(prompt row 1\)"):
        loop.check_prefill(types.SimpleNamespace(finite=jnp.asarray([True, False, True])))
    loop.check_prefill(types.SimpleNamespace(finite=jnp.asarray([True, True])))


def test_seeds_map_to_distinct_keys():
    """Every integer seed in [0, 2**64) has its own key: seeds that agree mod 2**32 sample
    differently (jax.random.key alone reduces them); seeds < 2**32 keep jax.random.key's key;
    numpy integers equal Python ones. Anything else is a ValueError before any work."""
    t, a = pair()
    rows = [list(r) for r in prompts()]
    kw = dict(assistant=a, max_new_tokens=24, block_size=4, temperature=1.5)
    out = {s: jaxspec.generate(t, rows, seed=s, **kw).tokens for s in (0, 2**32, 2**32 - 1, 2**33 - 1)}
    assert out[0] != out[2**32] and out[2**32 - 1] != out[2**33 - 1]
    assert jaxspec.generate(t, rows, seed=np.uint64(2**32), **kw).tokens == out[2**32]
    gen = jaxspec.make_generate(block_size=4, max_new_tokens=BUDGET, temperature=1.5)
    data = lambda s: jax.random.key_data(gen.inputs([1], seed=s)[2]).tolist()
    for s in (0, 5, 2**32 - 1):
        assert data(s) == jax.random.key_data(jax.random.key(s)).tolist()
    assert data(2**32) == [1, 0] and data(np.int64(2**33 - 1)) == [1, 2**32 - 1]
    assert data(2**64 - 1) == [2**32 - 1, 2**32 - 1]
    for s in (-1, 2**64, 2.0**63, True, np.int8(-3), "7"):
        with pytest.raises(ValueError, match=r"seed must be an integer in \[0, 2\*\*64\)"):
            gen.inputs([1], seed=s)
        with pytest.raises(ValueError, match=r"seed must be an integer in \[0, 2\*\*64\)"):
            streaming.stream_generate(t, rows, seed=s, **kw)


def test_numpy_sampling_arguments():
    """top_k (and temperature / top_p) accept numpy numbers like every other argument: the same
    Generator and the same samples as the Python numbers."""
    t, a = pair()
    kw = dict(assistant=a, max_new_tokens=12, block_size=4, seed=3)
    ref = jaxspec.generate(t, [1, 2, 3], temperature=0.9, top_k=5, top_p=0.9, **kw).tokens
    got = jaxspec.generate(t, [1, 2, 3], temperature=np.float32(0.9).item(), top_k=np.int64(5),
                           top_p=np.float64(0.9), **kw).tokens
    assert got == ref
    assert (jaxspec.make_generate(temperature=0.9, top_k=np.int32(5)) is jaxspec.make_generate(temperature=0.9, top_k=5))
    assert type(jaxspec.make_generate(temperature=0.9, top_k=np.uint8(5)).defaults.top_k) is int


def test_decode_round_budget():
    """Generator.decode(state, max_rounds) stops after max_rounds rounds of this call (the state's
    shapes unchanged), and calls chained from the prefill end where one full decode ends."""
    t, a = pair()
    gen = jaxspec.make_generate(block_size=4, max_new_tokens=BUDGET)
    args = gen.inputs([list(r) for r in prompts()])
    full = jax.device_get(gen.decode(t, a, gen.prefill(t, *args)))
    state = gen.prefill(t, *args)
    shapes = jax.tree_util.tree_map(lambda x: (x.shape, x.dtype), state)
    calls = 0
    while not bool(state.done.all()):
        before = int(state.rounds)
        state = gen.decode(t, a, state, 2)
        calls += 1
        ran = int(state.rounds) - before
        assert ran in (1, 2) if bool(state.done.all()) else ran == 2
        assert jax.tree_util.tree_map(lambda x: (x.shape, x.dtype), state) == shapes
    assert calls == -(-int(full.rounds) // 2)
    state = jax.device_get(state)
    for name in ("out", "n_out", "rounds", "row_rounds", "accepted", "hist"):
        np.testing.assert_array_equal(getattr(state, name), getattr(full, name))
    # a zero budget runs no round
    state = gen.prefill(t, *args)
    assert int(gen.decode(t, a, state, 0).rounds) == 0
    # decode's program is built from shapes found without the prefill: they are the prefill's
    prompt, _, key, limit, stop_ids, rows = args
    def shape(x):
        return x.shape, x.dtype, getattr(x, "weak_type", False)
    got = loop.state_shapes(gen.spec, t, prompt, limit, stop_ids, key, rows)
    assert jax.tree_util.tree_map(shape, got) == jax.tree_util.tree_map(shape, gen.prefill(t, *args))


# ---------------------------------------------------------------------------------------------
# Exactness probe


def test_exactness_probe_and_fallback(monkeypatch):
    t, a = pair()
    exact, diff = verify.exactness_probe(t, 3, 4, 4)
    assert exact and diff == 0.0
    # The probe sees a last-bit difference between the wide and the single-token forward.
    real_forward = models.forward

    def nudged(target, tokens, cache, **kw):
        logits, hidden, cache = real_forward(target, tokens, cache, **kw)
        if tokens.shape[1] > 1:  # a verify's second token; padding in a step's bucket
            logits = logits.at[:, 1].multiply(1 + 2 ** -20)
        return logits, hidden, cache

    verify._PROBE_CACHE.clear()
    programs.clear()  # compiled programs are kept per shapes; these must trace the new forward
    monkeypatch.setattr(models, "forward", nudged)
    exact, diff = verify.exactness_probe(t, 3, 4, 4)
    assert not exact and 0 < diff < 1e-3
    monkeypatch.setattr(models, "forward", real_forward)
    verify._PROBE_CACHE.clear()
    programs.clear()
    # generate falls back to classic, with a warning, when the probe fails
    rows = [list(r) for r in prompts()]
    monkeypatch.setattr(verify, "exactness_probe", lambda *args, **kw: (False, 0.5))
    with pytest.warns(RuntimeWarning, match="falling back to classic"):
        s = jaxspec.generate(t, rows, assistant=a, max_new_tokens=12, block_size=4)
    assert s.stats.mode == "classic" and "probe" in s.stats.fallback
    assert s.tokens == [r[:12] for r in classic_full()]


def test_failed_probe_shrinks_k_to_the_row_bucket(monkeypatch):
    """When K fails the probe but the row bucket (where verify and decode are one shape) passes,
    generate runs the bucket's K rather than dropping speculation; output still equals classic."""
    t, a = pair(matmul=DispatchConfig(backend="xla", multirow_max_rows=8))  # B = 3: a 2-token bucket
    rows = [list(r) for r in prompts()]
    classic = jaxspec.generate(t, rows, max_new_tokens=12).tokens
    bucket = models.row_bucket(t, len(rows))
    assert 2 <= bucket < 4, "this test needs a batch whose row bucket is 2 or 3"
    asked = []

    def probe(target, batch, k, width):
        asked.append(k)
        return (k == bucket, 0.0 if k == bucket else 0.25)

    monkeypatch.setattr(verify, "exactness_probe", probe)
    with pytest.warns(RuntimeWarning, match=f"running block size {bucket} instead"):
        s = jaxspec.generate(t, rows, assistant=a, max_new_tokens=12, block_size=4)
    assert asked == [4, bucket]
    assert s.stats.mode == "speculative" and s.stats.block_size == bucket
    assert f"ran K={bucket}" in s.stats.fallback and s.stats.probe_logit_diff == 0.0
    assert s.tokens == classic
    # a bucket that fails too: classic, reporting K's own probe difference
    monkeypatch.setattr(verify, "exactness_probe", lambda target, batch, k, width: (False, 0.5 if k == 4 else 0.125))
    with pytest.warns(RuntimeWarning, match="falling back to classic"):
        c = jaxspec.generate(t, rows, assistant=a, max_new_tokens=12, block_size=4)
    assert c.stats.mode == "classic" and c.tokens == s.tokens
    assert c.stats.probe_logit_diff == 0.5 and "0.5" in c.stats.fallback


# ---------------------------------------------------------------------------------------------
# Padded verify


def test_verify_width():
    mm = DispatchConfig(backend="xla", multirow_max_rows=8)
    assert verify.verify_width(4, 1, True, mm) == 9
    assert verify.verify_width(4, 2, True, mm) == 5
    assert verify.verify_width(4, 3, True, mm) == 4  # 12 rows already take the tiled path
    assert verify.verify_width(4, 1, False, mm) == 4
    assert verify.verify_width(4, 1, 16, mm) == 16
    assert verify.verify_width(1, 1, True, mm) == 1  # classic: nothing to pad
    for b in (1, 2, 3, 5):
        w = verify.verify_width(3, b, True, mm)
        from jaxspec.kernels import select_path
        assert select_path(w * b, mm) == "qmm" and (w == 3 or select_path((w - 1) * b, mm) != "qmm")


def test_verify_pad_resolution(monkeypatch):
    """None takes the target's dispatch config (resolved from the environment when the model was
    loaded); jaxspec itself reads no environment; an explicit argument wins."""
    monkeypatch.setenv("JAXSPEC_MTP_VERIFY_PAD", "1")
    assert verify.resolve_verify_pad(None, DispatchConfig()) is False
    assert verify.resolve_verify_pad(None, None) is False
    assert verify.resolve_verify_pad(None, DispatchConfig(verify_pad=True)) is True
    assert verify.resolve_verify_pad(False, DispatchConfig(verify_pad=True)) is False
    assert verify.resolve_verify_pad(0, DispatchConfig(verify_pad=True)) is False
    assert verify.resolve_verify_pad(True, DispatchConfig()) is True
    assert verify.resolve_verify_pad(16, DispatchConfig(verify_pad=True)) == 16
    for bad in ("1", -2, 1.5):
        with pytest.raises(ValueError, match="verify_pad"):
            verify.resolve_verify_pad(bad, None)
    assert DispatchConfig.from_env().verify_pad is True  # the knob lives in the dispatch config


def test_padded_verify_forward():
    """Padded vs unpadded verify forward: same logits/hidden up to rounding (max difference
    reported), same K/V at the real positions, lengths = old + K (pad K/V dropped). Widths: the
    qmm threshold, and 20 (past the 16-row bucket of the xla matmuls and the attention, so a
    genuinely different kernel shape)."""
    t, _ = pair()
    k, batch = 4, 2
    rng = np.random.default_rng(batch)
    prefix = jnp.asarray(rng.integers(0, 256, (batch, 6)), jnp.int32)
    block = jnp.asarray(rng.integers(0, 256, (batch, k)), jnp.int32)
    cache = models.init_cache(t.config, batch, 6 + 20, t.dtype)
    _, _, cache = jax.jit(models.forward)(t, prefix, cache)
    cache = cache.replace(lengths=jnp.asarray([6, 4], jnp.int32))  # ragged rows
    f = jax.jit(verify.verify_forward, static_argnums=3)
    l0, h0, c0 = f(t, block, cache, k)
    threshold = verify.verify_width(k, batch, True, t.matmul)
    assert threshold == 9  # 18 rows: past the 16-row multirow window
    for width in (threshold, 20):
        l1, h1, c1 = f(t, block, cache, width)
        diff = float(jnp.max(jnp.abs(l0 - l1)))
        print(f"padded verify (B={batch}, K={k}, width {width}): max |logit diff| = {diff:.3g}")
        assert l1.shape == l0.shape and h1.shape == h0.shape
        np.testing.assert_allclose(np.asarray(l1), np.asarray(l0), atol=1e-4, rtol=1e-4)
        np.testing.assert_allclose(np.asarray(h1), np.asarray(h0), atol=1e-4, rtol=1e-4)
        assert c1.lengths.tolist() == c0.lengths.tolist() == (cache.lengths + k).tolist()
        for b, start in enumerate(cache.lengths.tolist()):
            for kb0, kb1 in zip(c0.k + c0.v, c1.k + c1.v):
                np.testing.assert_allclose(np.asarray(kb1[b, start:start + k]),
                                           np.asarray(kb0[b, start:start + k]), atol=1e-5, rtol=1e-5)


def test_padded_verify_token_parity():
    """B=1, K=4 padded to 17 verify rows (the tiled path's threshold) vs classic: asked for with
    verify_pad=True, and by the target's dispatch config with verify_pad=None."""
    t, a = pair()
    rows = [list(r) for r in prompts()[1:2]]
    padding = t.replace(matmul=t.matmul.replace(verify_pad=True))
    for target, pad in ((t, True), (padding, None)):
        s = jaxspec.generate(target, rows, assistant=a, max_new_tokens=24, block_size=4, verify_pad=pad,
                             exactness_probe=False)
        assert s.stats.verify_width == 17 and s.stats.mode == "speculative"
        assert s.tokens == [r[:24] for r in classic_full()[1:2]]
        assert s.stats.accepted > 0
    assert jaxspec.generate(padding, rows, assistant=a, max_new_tokens=4, block_size=4, verify_pad=False,
                            exactness_probe=False).stats.verify_width == 4


# ---------------------------------------------------------------------------------------------
# Bad input


@pytest.fixture
def no_compute(monkeypatch):
    """Fail the test if anything reaches the model or the compiler."""
    def boom(*a, **k):
        raise AssertionError("compute started before the input was rejected")
    monkeypatch.setattr(models, "forward", boom)
    monkeypatch.setattr(programs, "compile_all", boom)
    monkeypatch.setattr(verify, "exactness_probe", boom)


def _mismatched_assistant(**target_overrides):
    """An assistant built for another target (no weights needed: the check comes first)."""
    td = presets.tiny_target_dict(**target_overrides)
    acfg = models.AssistantConfig.from_dict(presets.tiny_assistant_dict(td))
    return models.Assistant(config=acfg, params={}, matmul=XLA)


@pytest.mark.parametrize("kwargs,prompt,match", [
    (dict(block_size=0), [1, 2], "block_size"),
    (dict(block_size=-3), [1, 2], "block_size"),
    (dict(block_size=5, cache_size=12, max_new_tokens=6), [1, 2, 3], r"block_size=5 is larger than the cache allows"),
    (dict(cache_size=8), list(range(1, 11)), r"prompt is longer than the cache: 10 tokens, cache_size=8"),
    (dict(), [], "empty prompt"),
    (dict(), [[1, 2], []], "empty prompt: row 1"),
    (dict(), [1, 256], r"token id 256 outside the vocabulary \[0, 256\)"),
    (dict(), [[3], [-1, 2]], r"row 1 has token id -1"),
    (dict(), [1, 2.5], "non-integer"),
    (dict(), [1, True], "non-integer"),  # a bool is an int to Python: refused as a token id
    (dict(), [[1, 2], (3, False)], "row 1 has non-integer"),
    (dict(temperature=-0.5), [1, 2], "temperature"),
    (dict(temperature=1.0, top_p=0.0), [1, 2], "top_p"),
    (dict(temperature=1.0, top_p=1.01), [1, 2], "top_p"),
    (dict(temperature=1.0, top_k=0), [1, 2], "top_k"),
    (dict(max_new_tokens=0), [1, 2], "max_new_tokens"),
    (dict(verify_pad="yes"), [1, 2], "verify_pad"),
    (dict(eos_token_ids=[-1]), [1, 2], r"eos_token_ids has token id -1 outside"),
    (dict(stop_token_ids=[300]), [1, 2], r"stop_token_ids has token id 300 outside"),
    (dict(seed=-1), [1, 2], r"seed must be an integer in \[0, 2\*\*64\) \(0 \.\. 18446744073709551615\), got -1"),
    (dict(seed=2**64), [1, 2], r"seed must be an integer in \[0, 2\*\*64\) .*got 18446744073709551616"),
    (dict(seed=2.0**63), [1, 2], r"seed must be an integer in \[0, 2\*\*64\), got 9.22"),
    (dict(seed=True), [1, 2], r"seed must be an integer in \[0, 2\*\*64\), got True"),
    (dict(temperature=1.0, top_k=np.float64(2.0)), [1, 2], "top_k"),
    (dict(max_new_tokens=200), list(range(1, 61)), r"60 tokens \+ max_new_tokens 200 = 260 .*context of 256"),
])
def test_bad_input(no_compute, kwargs, prompt, match):
    t, a = pair()
    with pytest.raises(ValueError, match=match):
        jaxspec.generate(t, prompt, assistant=a, **kwargs)


@pytest.mark.parametrize("overrides,match", [
    (dict(hidden_size=32), "backbone_hidden_size=32 != target hidden_size=64"),
    (dict(vocab_size=128), "vocab_size=128 != target vocab_size=256"),
    (dict(head_dim=8, global_head_dim=16), "head_dim"),
])
def test_assistant_mismatch(no_compute, overrides, match):
    t, _ = pair()
    with pytest.raises(ValueError, match=match):
        jaxspec.generate(t, [1, 2, 3], assistant=_mismatched_assistant(**overrides))
