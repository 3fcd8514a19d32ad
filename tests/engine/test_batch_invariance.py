"""One request, one text (issue 67): a request's tokens are the same from jaxspec.generate (as the
CLI calls it), stream_generate and a BatchEngine of 1, 2, 4 or 8 slots with other requests beside
it, greedy and seeded sampled, on the CPU's XLA path.

The model is tiny but has the dimension that made the real Gemma 3 270M (hidden 640) differ: a
256-wide hidden state. XLA's CPU code sums a reduce of 4096 elements or more through YNNPACK and a
smaller one itself, in another order; a batch-1 decode block's norms (4 rows, 1024 elements) took
one path and every wider batch's (16 rows, 4096) the other. jaxspec's programs now compile with
`kernels.xla.program_options` (only dots go to YNNPACK), and `dense_attention` sums its softmax in
fixed 64-key blocks, so a row's bits depend neither on its batch nor on how many empty cache slots
follow its keys (the engine's capacity here is not generate's). Both tests fail without either.
Activations in float32: a last-bit difference shows in the logits' bits."""
import jax
import jax.numpy as jnp
import numpy as np

import jaxspec
from jaxspec import models
from jaxspec.engine import sampling
from jaxspec.engine.batching import BatchEngine
from jaxspec.engine.streaming import stream_generate
from jaxspec.kernels.xla import program_options
from support.pairs import make_pair
from support.seeds import seeded_int, seeded_rng

TARGET, _ = make_pair(seed=5, layers=2, hidden_size=256)
VOCAB = TARGET.config.vocab_size
MODE = sampling.SamplingMode(sample=True, logprobs=0)  # the engine's one program: greedy and sampled rows
STEPS = 8  # decode steps of the forward test: the longer prompts wrap their sliding layers' 21-slot rings
CAPACITY = 64  # what generate derives here
WIDE = 160  # the engine's and the wider forwards' capacity: more key slots, the same keys


def _prompt(rng):
    return rng.integers(2, VOCAB, int(rng.integers(3, 14))).tolist()


def _jit(f):  # as jaxspec's own programs are compiled
    return jax.jit(f, compiler_options=program_options() or None)


@_jit
def _prefill(target, ids, n, cache):
    valid = jnp.arange(ids.shape[1])[None] < n
    return models.forward(target, ids, cache, valid=valid)[2].replace(lengths=jnp.full((1,), n, jnp.int32))


@_jit
def _step(target, ids, cache):
    logits, _, cache = models.forward(target, ids, cache)
    return logits[:, 0], cache


def test_a_rows_logits_are_the_same_bits_in_any_batch():
    """The forward of a decode step: row 0's logits at batch 1 and a 64-position cache, and at batch
    1, 2, 4 and 8 (computed as [1, 4], [2, 8], [4, 4] and [8, 2] tokens: the row bucket) and a
    160-position cache, the other rows holding other prompts and tokens at other lengths, bit for
    bit, for some steps. Each row's cache is its prompt's prefill alone (as the engine prefills a
    request)."""
    rng = seeded_rng()
    prompts = [_prompt(rng) for _ in range(8)]
    rows = {}
    for cap in (CAPACITY, WIDE):
        for p in prompts:  # one prefill program: right-padded to 16, the length set after (as loop.prefill)
            ids = np.zeros((1, 16), np.int32)
            ids[0, :len(p)] = p
            rows.setdefault(cap, []).append(
                _prefill(TARGET, jnp.asarray(ids), len(p), models.init_cache(TARGET.config, 1, cap, TARGET.dtype)))
    steps = rng.integers(2, VOCAB, (STEPS, 8)).astype(np.int32)
    got = {}
    for cap, b in ((CAPACITY, 1), (WIDE, 1), (WIDE, 2), (WIDE, 4), (WIDE, 8)):
        cache = jax.tree.map(lambda *xs: jnp.concatenate(xs, axis=xs[0].ndim - 4 if xs[0].ndim >= 4 else 0),
                             *rows[cap][:b])
        got[cap, b] = []
        for s in range(STEPS):
            logits, cache = _step(TARGET, jnp.asarray(steps[s, :b, None]), cache)
            got[cap, b].append(np.asarray(logits[0]))
    for key in got:
        for s in range(STEPS):
            np.testing.assert_array_equal(got[key][s], got[CAPACITY, 1][s],
                                          err_msg=f"step {s}: batch {key[1]}, {key[0]} positions against batch 1, {CAPACITY}")


def _drain(engine, requests):
    """Admit (prompt, budget, params) requests as slots free up, the first ones a step before the
    rest (so later requests join a running batch); {index: (tokens, logprobs)}."""
    waiting, where, out = list(enumerate(requests)), {}, {}
    first = True
    while waiting or engine.live:
        while waiting and engine.free:
            i, (ids, n, params) = waiting.pop(0)
            where[engine.admit(ids, n, params=params, owner=i)] = i
            out[i] = ([], [])
            if first:
                break
        first = False
        for ev in engine.step():
            toks, lps = out[where[ev.slot]]
            toks += ev.tokens
            lps += [lp for lp, _ in ev.logprobs or []]
    return out


def test_a_request_is_one_text_from_every_entry_point():
    """One greedy and one seeded sampled request: jaxspec.generate called as the CLI calls it (its
    keywords, classic decoding) is the reference, tokens and each token's log-probability bits;
    stream_generate gives them; so does a BatchEngine of 1, 2, 4 and 8 slots, its capacity not
    generate's, with other requests (greedy and sampled, other prompts and budgets) running beside
    and admitted around it."""
    rng = seeded_rng()
    n = 20
    prompt = _prompt(rng)
    greedy = sampling.SamplingParams(max_new_tokens=n, logprobs=0)
    sampled = sampling.SamplingParams(max_new_tokens=n, temperature=0.8, seed=seeded_int(1 << 31), logprobs=0)
    want = {}
    for name, params in (("greedy", greedy), ("sampled", sampled)):
        cli = dict(params=params, block_size=4, eos_token_ids=(), verify_pad=None, drafter=None)  # cmd_generate's
        result = jaxspec.generate(TARGET, [prompt], **cli)
        want[name] = (result.tokens[0], [lp for lp, _ in result.logprobs[0]])
        streamed = [t for chunk in stream_generate(TARGET, [prompt], rounds_per_chunk=3, **cli) for t in chunk.tokens[0]]
        assert streamed == want[name][0], name
    assert len(want["greedy"][0]) == len(want["sampled"][0]) == n
    assert want["greedy"][0] != want["sampled"][0]

    for slots in (1, 2, 4, 8):
        others = [(_prompt(rng), int(rng.integers(4, n + 1)),
                   sampling.SamplingParams(temperature=float(rng.choice([0.0, 0.7])), seed=seeded_int(1 << 31),
                                           logprobs=0))
                  for _ in range(slots + 1)]
        requests = others[:slots - 1] + [(prompt, n, greedy), (prompt, n, sampled)] + others[slots - 1:]
        engine = BatchEngine(TARGET, None, slots=slots, max_new_tokens=n, capacity=WIDE, block_size=1,
                             eos_token_ids=(), modes=(MODE,))
        got = _drain(engine, requests)
        for name, i in (("greedy", slots - 1), ("sampled", slots)):
            assert got[i][0] == want[name][0], f"{name} at {slots} slots"
            assert got[i][1] == want[name][1], f"{name}'s log-probabilities at {slots} slots against generate's"
