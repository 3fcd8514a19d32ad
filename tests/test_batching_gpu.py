"""GPU-only (skipped without a GPU): the shipped default pair on the Pallas kernels, 8 slots, each
slot with its own sampling (greedy, temperatures, top_p, top_k, a logit bias), speculative K = 4.
Every request's tokens equal `jaxspec.generate`'s for it alone (batch 1, its seed), and the greedy
ones equal classic decoding: on the GPU a row's arithmetic must not depend on its batch mates or on
which of the engine's step programs ran it. Recorded run: docs/benchmark_results/serve-h200-2026-12-03.md."""
import pytest

import jaxspec
from jaxspec import default_pair as dp
from jaxspec.batching import BatchEngine
from jaxspec.sampling import SamplingParams

pytestmark = pytest.mark.gpu

SETTINGS = [SamplingParams(), SamplingParams(temperature=0.7), SamplingParams(temperature=1.0, top_p=0.9),
            SamplingParams(), SamplingParams(temperature=0.8, top_k=20), SamplingParams(temperature=1.2, top_p=0.5),
            SamplingParams(logit_bias=((10, 5.0),)), SamplingParams(temperature=0.9, top_k=50, top_p=0.95)]


@pytest.mark.skipif(not dp.default_pair_available(), reason="the default pair is not installed")
def test_mixed_settings_in_one_batch_equal_each_run_alone():
    target, assistant, _ = dp.load_default_pair()
    prompts = [p["ids"] for p in dp.heldout_prompts()[:len(SETTINGS)]]
    engine = BatchEngine(target, assistant, slots=len(SETTINGS), max_new_tokens=48, capacity=1024, block_size=4)
    got, where = {}, {}
    for i, (ids, params) in enumerate(zip(prompts, SETTINGS)):
        where[engine.admit(ids, 48, seed=100 + i, params=params)] = i
        got[i] = []
    while engine.live:
        for ev in engine.step():
            got[where[ev.slot]] += ev.tokens
    assert sum(engine.steps[1:]) > 0
    for i, (ids, p) in enumerate(zip(prompts, SETTINGS)):
        alone = jaxspec.generate(target, ids, assistant=assistant, max_new_tokens=48, block_size=engine.block_size,
                                 temperature=p.temperature, top_k=p.top_k, top_p=p.top_p, logit_bias=p.logit_bias,
                                 seed=100 + i, eos_token_ids=engine.eos).tokens[0]
        assert got[i] == alone, (i, p)
        if p.greedy and not p.logit_bias:
            assert got[i] == jaxspec.generate(target, ids, max_new_tokens=48, block_size=1,
                                              eos_token_ids=engine.eos).tokens[0]
