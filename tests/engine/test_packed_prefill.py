"""The packed prefill (issue 66: one token budget a step, the chunks of every waiting prompt in one
program; CPU, XLA path, the tiny pair): a request's tokens and log-probabilities are bitwise what the
engine gives it alone, whether its chunks shared their forward with other prompts' or ran beside
padding, greedy and seeded sampled, at K = 4 in the batch (the K that ran is checked: no fallback to
classic decoding); the budget decides how many prompts advance in a step, in the order the fairness
rules give; bad budgets are refused before any compute."""
import numpy as np
import pytest

import jaxspec
from jaxspec.engine import packed_prefill
from jaxspec.engine.batching import BatchEngine
from jaxspec.engine.sampling import SamplingParams
from support.pairs import make_pair
from support.seeds import seeded_rng

TARGET, ASSISTANT = make_pair(seed=7, layers=2)
CHUNK = 32
SAMPLED = SamplingParams(temperature=0.8, top_k=20)


@pytest.fixture(scope="module")
def engine():
    # Two lanes per forward (the accelerator's packing; a CPU engine's default is one) and 8 lanes a
    # step: four prompts arriving together share forwards and span two groups.
    e = BatchEngine(TARGET, ASSISTANT, slots=4, max_new_tokens=16, capacity=128, block_size=4, prefill_chunk=CHUNK,
                    step_tokens=256, prefill_group=2, eos_token_ids=())
    assert e.block_size == 4 and e.fallback is None and e.config.block_size == 4  # the probe kept K = 4
    assert (e.lanes, e.prefill_group) == (8, 2)
    return e


def _run(engine, requests):
    """Admit every request at once, step until all finish: {request: (tokens, logprobs)}; and how many
    chunks the first step's one prefill program ran."""
    where = {engine.admit(ids, n, seed=seed, params=params, logprobs=2): i
             for i, (ids, n, seed, params) in enumerate(requests)}
    got = {i: ([], []) for i in range(len(requests))}
    chunks, programs = engine.chunks, engine.prefill_steps
    first = None
    while engine.live:
        for ev in engine.step():
            got[where[ev.slot]][0].extend(ev.tokens)
            got[where[ev.slot]][1].extend(ev.logprobs)
        if first is None:
            first = (engine.chunks - chunks, engine.prefill_steps - programs)
    return got, first


def test_rows_prefilled_together_equal_their_runs_alone(engine):
    """Four prompts arrive at once (a long one of three chunks and three short ones, two greedy and two
    sampled with seeds): the first step's one program prefills a chunk of each, two to a forward, and
    every request's tokens and logprobs are bitwise those of its run alone in the engine (its chunks
    then beside padding lanes, the prompt admitted under another load)."""
    rng = seeded_rng()
    vocab = TARGET.config.vocab_size
    lengths = [int(rng.integers(2 * CHUNK + 1, 3 * CHUNK)), int(rng.integers(2, 12)), int(rng.integers(12, CHUNK)),
               int(rng.integers(CHUNK + 1, 2 * CHUNK))]
    requests = [(rng.integers(2, vocab, n).tolist(), int(rng.integers(8, 16)), int(rng.integers(1 << 31)),
                 SAMPLED if i % 2 else SamplingParams()) for i, n in enumerate(lengths)]
    together, first = _run(engine, requests)
    assert first == (4, 1)  # one program, a chunk of each prompt
    for i, request in enumerate(requests):
        alone, first = _run(engine, [request])
        assert first == (1, 1)
        assert together[i][0] == alone[0][0], f"request {i} ({lengths[i]} prompt tokens): tokens"
        assert together[i][1] == alone[0][1], f"request {i}: logprobs"
        assert len(alone[0][0]) == request[1]
    # not vacuous: the requests differ from one another (a lane reading another's rows would show)
    assert len({tuple(t) for t, _ in together.values()}) == len(requests)


def test_the_budget_sets_how_many_prompts_advance_and_the_order_rules_which():
    """plan: as many prompts as lanes, short ones (their rest fits a chunk) first, each class in
    admission order; after a step that passed a long prompt over, the long ones first."""
    def prompt(n, done=0):
        return packed_prefill.Prompt(list(range(n)), done, np.zeros(2, np.uint32), 4, None)

    waiting = {3: prompt(100), 0: prompt(20), 2: prompt(40, done=10), 1: prompt(70, done=60)}
    assert packed_prefill.plan(waiting, 2, 32, False) == ([0, 2], True)  # 2 and 1 fit a chunk; 3 waits
    assert packed_prefill.plan(waiting, 3, 32, False) == ([0, 2, 1], True)
    assert packed_prefill.plan(waiting, 4, 32, False) == ([0, 2, 1, 3], False)
    assert packed_prefill.plan(waiting, 2, 32, True) == ([3, 0], False)  # passed over last step: long first
    # lanes left once each prompt has one: the long prompts' next chunks, oldest first (one forward a
    # lane); with two lanes a forward a prompt keeps one lane a step
    assert packed_prefill.plan(waiting, 6, 32, False) == ([0, 2, 1, 3, 3, 3], False)
    assert packed_prefill.plan(waiting, 9, 32, False) == ([0, 2, 1, 3, 3, 3, 3], False)  # 100 tokens: 4 chunks
    assert packed_prefill.plan(waiting, 6, 32, False, group=2) == ([0, 2, 1, 3], False)
    # a stop (where the engine reads a snapshot) ends the prompt's step there: chunks 0-1, not 0-3
    assert packed_prefill.plan(waiting, 9, 32, False, stops={3: 64}) == ([0, 2, 1, 3, 3], False)
    assert packed_prefill.lanes_for(2048, 128, 4 * 4 * 8) == 15  # decode rounds first, then whole chunks
    assert packed_prefill.lanes_for(256, 128, 1024) == 1  # a prompt always advances


def test_bad_budgets_are_refused_before_compute():
    for bad, why in ((24, "multiple of 16"), (0, "16..1048576"), (1.5, "16..1048576"), (True, "16..1048576")):
        with pytest.raises(ValueError, match=why):
            BatchEngine(TARGET, None, slots=1, max_new_tokens=8, capacity=64, prefill_chunk=32, step_tokens=bad)
    with pytest.raises(ValueError, match="prefill_group"):
        BatchEngine(TARGET, None, slots=1, max_new_tokens=8, capacity=64, prefill_group=0)


def test_a_long_prompt_takes_several_chunks_a_step_and_gives_the_same_tokens():
    """With one lane a forward (the default) and lanes to spare, a long prompt's chunks run in one
    step's program, each reading the KV the one before wrote, and greedy equals classic decoding;
    beside two short prompts it takes the two lanes they leave, then its last chunk the next step,
    with bitwise the same tokens and logprobs as all three in one step."""
    e = BatchEngine(TARGET, ASSISTANT, slots=4, max_new_tokens=16, capacity=128, block_size=4, prefill_chunk=CHUNK,
                    step_tokens=4 * CHUNK + 16, eos_token_ids=(),  # 4 x 4 rows of K = 4 rounds, then 4 lanes
                    prefix_cache=False)  # with ring snapshots a prompt's step stops where one is taken
    assert e.block_size == 4 and e.fallback is None and (e.lanes, e.prefill_group) == (4, 1)
    rng = seeded_rng()
    vocab = TARGET.config.vocab_size
    long = (rng.integers(2, vocab, int(rng.integers(2 * CHUNK + 1, 3 * CHUNK))).tolist(), 12, 5, SamplingParams())
    shorts = [(rng.integers(2, vocab, int(rng.integers(2, CHUNK))).tolist(), 8, 6 + i, SAMPLED) for i in range(2)]
    alone, first = _run(e, [long])
    assert first == (3, 1)  # its three chunks in the first step's one program
    assert alone[0][0] == jaxspec.generate(TARGET, [long[0]], max_new_tokens=12, block_size=1).tokens[0]
    together, first = _run(e, [long, *shorts])
    assert first == (4, 1)  # the shorts' chunks, then the long prompt's first two in the lanes left
    assert together[0] == alone[0]
