"""One request, one text (issue 67): a request's tokens are the same from jaxspec.generate,
stream_generate and a BatchEngine of 1, 2, 4 or 8 slots with other requests beside it, greedy and
seeded sampled, on the CPU's XLA path.

The model is tiny but has the dimension that made the real Gemma 3 270M (hidden 640) differ: a
256-wide hidden state. XLA's CPU code sums a reduce of 4096 elements or more through YNNPACK and a
smaller one itself, in another order; a batch-1 decode block's norms (4 rows, 1024 elements) took
one path and every wider batch's (16 rows, 4096) the other, until `kernels.xla.row_sum` fixed the
order. Activations in bfloat16, as the CLI and the server run: a last-bit difference then moves a
logit by a bfloat16 step."""
import jax
import jax.numpy as jnp
import numpy as np

import jaxspec
from jaxspec import models
from jaxspec.engine import sampling
from jaxspec.engine.batching import BatchEngine
from jaxspec.engine.streaming import stream_generate
from support.pairs import make_pair
from support.seeds import seeded_int, seeded_rng

TARGET, _ = make_pair(seed=5, layers=2, hidden_size=256)
VOCAB = TARGET.config.vocab_size
MODE = sampling.SamplingMode(sample=True, logprobs=0)  # the engine's one program: greedy and sampled rows
STEPS = 12  # decode steps of the forward test: the longer prompts wrap their sliding layers' 21-slot rings
CAPACITY = 64  # the engine's, and what generate derives here: the same key counts (docs/design.md)


def _prompt(rng):
    return rng.integers(2, VOCAB, int(rng.integers(3, 14))).tolist()


@jax.jit
def _prefill(target, ids, n, cache):
    valid = jnp.arange(ids.shape[1])[None] < n
    return models.forward(target, ids, cache, valid=valid)[2].replace(lengths=jnp.full((1,), n, jnp.int32))


@jax.jit
def _step(target, ids, cache):
    logits, _, cache = models.forward(target, ids, cache)
    return logits[:, 0], cache


def test_a_rows_logits_are_the_same_bits_in_any_batch():
    """The forward of a decode step: row 0's float32 logits at batch 1, 2, 4 and 8 (computed as
    [1, 4], [2, 8], [4, 4] and [8, 2] tokens: the row bucket), the other rows holding other prompts
    and tokens at other lengths, bit for bit, for some steps. Each row's cache is its prompt's
    prefill alone (as the engine prefills a request)."""
    rng = seeded_rng()
    prompts = [_prompt(rng) for _ in range(8)]
    rows = []
    for p in prompts:  # one prefill program: right-padded to 16, the length set after (as loop.prefill)
        ids = np.zeros((1, 16), np.int32)
        ids[0, :len(p)] = p
        rows.append(_prefill(TARGET, jnp.asarray(ids), len(p), models.init_cache(TARGET.config, 1, CAPACITY, TARGET.dtype)))
    steps = rng.integers(2, VOCAB, (STEPS, 8)).astype(np.int32)
    got = {}
    for b in (1, 2, 4, 8):
        cache = jax.tree.map(lambda *xs: jnp.concatenate(xs, axis=xs[0].ndim - 4 if xs[0].ndim >= 4 else 0), *rows[:b])
        got[b] = []
        for s in range(STEPS):
            logits, cache = _step(TARGET, jnp.asarray(steps[s, :b, None]), cache)
            got[b].append(np.asarray(logits[0]))
    for b in (2, 4, 8):
        for s in range(STEPS):
            np.testing.assert_array_equal(got[b][s], got[1][s], err_msg=f"step {s}: batch {b} against batch 1")


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
    """One greedy and one seeded sampled request: generate alone is the reference; stream_generate
    gives its tokens; so does a BatchEngine of 1, 2, 4 and 8 slots with other requests (greedy and
    sampled, other prompts and budgets) running beside and admitted around it. Each token's
    log-probability (the target's logits, read back) is also the same bits at every slot count."""
    rng = seeded_rng()
    n = 20
    prompt = _prompt(rng)
    greedy = sampling.SamplingParams(max_new_tokens=n, logprobs=0)
    sampled = sampling.SamplingParams(max_new_tokens=n, temperature=0.8, seed=seeded_int(1 << 31), logprobs=0)
    want = {}
    for name, params in (("greedy", greedy), ("sampled", sampled)):
        kw = dict(max_new_tokens=n, temperature=params.temperature, seed=params.seed, eos_token_ids=())
        want[name] = jaxspec.generate(TARGET, [prompt], **kw).tokens[0]
        streamed = [t for chunk in stream_generate(TARGET, [prompt], rounds_per_chunk=3, **kw) for t in chunk.tokens[0]]
        assert streamed == want[name], name
    assert len(want["greedy"]) == len(want["sampled"]) == n
    assert want["greedy"] != want["sampled"]

    lps = {}
    for slots in (1, 2, 4, 8):
        others = [(_prompt(rng), int(rng.integers(4, n + 1)),
                   sampling.SamplingParams(temperature=float(rng.choice([0.0, 0.7])), seed=seeded_int(1 << 31),
                                           logprobs=0))
                  for _ in range(slots + 1)]
        requests = others[:slots - 1] + [(prompt, n, greedy), (prompt, n, sampled)] + others[slots - 1:]
        engine = BatchEngine(TARGET, None, slots=slots, max_new_tokens=n, capacity=CAPACITY, block_size=1,
                             eos_token_ids=(), modes=(MODE,))
        got = _drain(engine, requests)
        for name, i in (("greedy", slots - 1), ("sampled", slots)):
            tokens, lp = got[i]
            assert tokens == want[name], f"{name} at {slots} slots"
            lps.setdefault(name, lp)
            assert lp == lps[name], f"{name}'s log-probabilities at {slots} slots against 1 slot"
