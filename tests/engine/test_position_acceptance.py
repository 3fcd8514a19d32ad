"""Per-position acceptance (GenerationStats.position_accepted: how often draft 1, 2, 3 is kept)
against an independent count: classic greedy tokens replayed round by round against the drafts the
assistant makes from a fresh prefill of the same prefix (models.forward + models.draft_step, no
loop code), the way the loop's rounds advance (keep the drafts up to the first disagreement, plus one)."""
import jax
import jax.numpy as jnp
import numpy as np

import jaxspec
from jaxspec import models
from jaxspec.kernels import DispatchConfig
from support.seeds import seeded_int, seeded_rng

K, N = 4, 24


def _replay(target, assistant, prompt, classic, budget):
    """(rounds, position counts [K-1]) of greedy speculative decoding of `budget` tokens, counted by
    replaying `classic` (the prompt's greedy continuation, at least budget + K tokens)."""
    seq = list(prompt) + list(classic)
    width = len(seq)
    cache0 = models.init_cache(target.config, 1, width + 64, target.dtype)
    fwd = jax.jit(models.forward)
    step = jax.jit(models.draft_step)
    n, out, rounds, counts = len(prompt), 1, 0, [0] * (K - 1)
    while out < budget:
        valid = jnp.arange(width)[None, :] < n
        _, hidden, cache = fwd(target, jnp.asarray([seq], jnp.int32), cache0, valid=valid)
        cache = cache.replace(lengths=jnp.asarray([n], jnp.int32))
        tok, h, pos = jnp.asarray([seq[n]], jnp.int32), hidden[:, n - 1], jnp.asarray([n], jnp.int32)
        accepted, agree = 0, True
        for i in range(K - 1):
            logits, h = step(assistant, target, cache, tok, h, pos)
            tok = jnp.argmax(logits, -1).astype(jnp.int32)
            agree = agree and int(tok[0]) == seq[n + 1 + i]
            accepted += agree
        for i in range(accepted):
            counts[i] += 1
        rounds += 1
        out += min(accepted + 1, budget - out)
        n += accepted + 1
    return rounds, counts


def test_position_acceptance_matches_a_replay_of_classic_tokens():
    target, assistant = models.presets.tiny_pair(seed=seeded_int(1 << 30), dtype=jnp.float32,
                                                 matmul=DispatchConfig(backend="xla"))
    rng = seeded_rng()
    prompts = [rng.integers(3, target.config.vocab_size, size=7).tolist() for _ in range(4)]
    spec = jaxspec.generate(target, prompts, assistant=assistant, max_new_tokens=N, block_size=K,
                            eos_token_ids=[], exactness_probe=False)
    classic = jaxspec.generate(target, prompts, max_new_tokens=N + K, eos_token_ids=[])
    assert spec.tokens == [c[:N] for c in classic.tokens]
    st = spec.stats
    rounds, counts = 0, np.zeros(K - 1, int)
    for prompt, cont in zip(prompts, classic.tokens):  # the stats sum over rows
        r, c = _replay(target, assistant, prompt, cont, N)
        rounds, counts = rounds + r, counts + c
    print(f"accepted_hist {st.accepted_hist}; per-position accepted {st.position_accepted} of {st.row_rounds} "
          f"row-rounds; replay {counts.tolist()} of {rounds}")
    assert sum(1 for n in st.accepted_hist if n) >= 2, "every round accepted alike: positions not told apart"
    assert st.row_rounds == rounds and st.position_accepted == counts.tolist()
    assert st.position_acceptance == [c / rounds for c in counts]
    assert sum(counts) == st.accepted  # acceptance is a prefix: a round's a drafts are positions 1..a
    d = st.as_dict()
    assert d["position_accepted"] == counts.tolist() and d["position_acceptance"] == st.position_acceptance
