"""`n` choices from `jaxspec.generate` (issue 68): prompt b's choice i is what that prompt alone
gives with seed + i, speculative (the K that ran asserted) and sampled; bad n fails before compute."""
import re

import numpy as np
import pytest

import jaxspec
from jaxspec.engine import programs, sampling
from support.pairs import pair
from support.seeds import seeded_rng

K = 3


def _run(t, a, prompts, seed, n=1):
    return jaxspec.generate(t, prompts, assistant=a, block_size=K, max_new_tokens=12, temperature=0.9,
                            top_p=0.95, seed=seed, n=n, eos_token_ids=[])


def test_choice_i_is_the_prompt_alone_with_seed_plus_i():
    t, a = pair()
    rng = seeded_rng()
    seed = int(rng.integers(0, 2**40))
    prompts = [rng.integers(1, 256, 9).tolist(), rng.integers(1, 256, 13).tolist()]
    n = 3
    r = _run(t, a, prompts, seed, n=n)
    assert r.stats.mode == "speculative" and r.stats.block_size == K
    assert len(r.tokens) == len(prompts) * n
    for b, p in enumerate(prompts):
        for i in range(n):
            alone = _run(t, a, [p], seed + i)
            assert alone.stats.block_size == K
            assert r.tokens[b * n + i] == alone.tokens[0], (b, i, seed)
    # the choices are separate draws, not one draw copied (12 tokens of a 256-token vocabulary at T = 0.9)
    assert len({tuple(r.tokens[i]) for i in range(n)}) > 1, seed


@pytest.mark.parametrize("n,seed,what", [(0, 0, "n must be an integer in [1, 16]"),
                                         (17, 0, "n must be an integer in [1, 16]"),
                                         (True, 0, "n must be"),
                                         (2, sampling.SEED_LIMIT - 1, "past the largest seed")])
def test_bad_n_is_refused_before_compute(monkeypatch, n, seed, what):
    t, a = pair()
    monkeypatch.setattr(programs, "compile_all", lambda *x, **k: pytest.fail("compiled before the check"))
    with pytest.raises(ValueError, match=re.escape(what)):
        _run(t, a, [[1, 2, 3]], seed, n=n)
