"""Continuous batching (jaxspec.engine.batching.BatchEngine) on the tiny pair (CPU, XLA matmuls): requests
admitted into free slots between rounds, each request's output equal to jaxspec.generate on it alone
whatever shares the batch (greedy: speculative and classic; sampled: with its seed), cancelled slots
reused, bad input refused before any compute."""
import numpy as np
import pytest

import jaxspec
from jaxspec.engine.batching import BatchEngine
from support.pairs import make_pair

TARGET, ASSISTANT = make_pair(seed=7, layers=2)


def _requests(seed, n, vocab):
    rng = np.random.default_rng(seed)
    return [(rng.integers(2, vocab, int(rng.integers(2, 12))).tolist(), int(rng.integers(3, 24))) for _ in range(n)]


def _drain(engine, requests, cancel_after=None):
    """Admit requests as slots free up, step until all finish; {request index: tokens}."""
    waiting, out, where, steps = list(enumerate(requests)), {}, {}, 0
    while waiting or engine.live:
        while waiting and engine.free:
            i, (ids, n) = waiting.pop(0)
            where[engine.admit(ids, n, owner=i)] = i
            out[i] = []
        for ev in engine.step():
            out[where[ev.slot]] += ev.tokens
        steps += 1
        if cancel_after is not None and steps == cancel_after:
            slot = next(s for s, o in enumerate(engine.owner) if o is not None)
            engine.cancel(slot)
            out.pop(where[slot])
    return out


@pytest.mark.parametrize("block_size", [4, 1], ids=["speculative", "classic"])
def test_each_request_equals_generate_alone(block_size):
    requests = _requests(block_size, 7, TARGET.config.vocab_size)
    assistant = ASSISTANT if block_size > 1 else None
    engine = BatchEngine(TARGET, assistant, slots=3, max_new_tokens=24, capacity=64, block_size=block_size)
    assert engine.block_size == block_size and engine.fallback is None
    got = _drain(engine, requests)
    for i, (ids, n) in enumerate(requests):
        alone = jaxspec.generate(TARGET, [ids], assistant=assistant, max_new_tokens=n, block_size=block_size)
        assert got[i] == alone.tokens[0], f"request {i}"
    if block_size > 1:
        assert int(np.asarray(engine.state.accepted).sum()) > 0  # the assistant drafted something useful


def test_cancel_frees_the_slot_and_the_rest_are_unchanged():
    requests = _requests(11, 5, TARGET.config.vocab_size)
    engine = BatchEngine(TARGET, ASSISTANT, slots=2, max_new_tokens=24, capacity=64)
    got = _drain(engine, requests, cancel_after=2)
    assert len(got) == 4 and engine.live == 0
    for i, toks in got.items():
        ids, n = requests[i]
        assert toks == jaxspec.generate(TARGET, [ids], assistant=ASSISTANT, max_new_tokens=n).tokens[0]


def test_sampled_requests_follow_their_seeds():
    """Each slot samples from its own key: a seeded request in a batch is what generate gives it alone
    with that seed (speculative, temperature 0.8, top-k 20), and within its budget."""
    requests = _requests(5, 5, TARGET.config.vocab_size)
    engine = BatchEngine(TARGET, ASSISTANT, slots=3, max_new_tokens=24, capacity=64, temperature=0.8, top_k=20)
    waiting, got, where = list(enumerate(requests)), {}, {}
    while waiting or engine.live:
        while waiting and engine.free:
            i, (ids, n) = waiting.pop(0)
            where[engine.admit(ids, n, seed=100 + i)] = i
            got[i] = []
        for ev in engine.step():
            got[where[ev.slot]] += ev.tokens
    for i, (ids, n) in enumerate(requests):
        alone = jaxspec.generate(TARGET, [ids], assistant=ASSISTANT, max_new_tokens=n, temperature=0.8, top_k=20,
                                 seed=100 + i)
        assert got[i] == alone.tokens[0], f"request {i}"
        assert 1 <= len(got[i]) <= n


def test_bad_input_is_refused_before_compute():
    engine = BatchEngine(TARGET, None, slots=1, max_new_tokens=8, capacity=32, block_size=1)
    with pytest.raises(ValueError, match="token ids"):
        engine.admit([], 4)
    with pytest.raises(ValueError, match="token ids"):
        engine.admit([3, TARGET.config.vocab_size], 4)
    with pytest.raises(ValueError, match="does not fit"):
        engine.admit([3, 4], 9)
    with pytest.raises(ValueError, match="does not fit"):
        engine.admit(list(range(2, 30)), 8)
    with pytest.raises(ValueError, match="got dict"):  # generate's rule: its keys are no prompt
        engine.admit({3: 0, 4: 0}, 4)
    engine.admit([3, 4], 4)
    with pytest.raises(ValueError, match="slots are taken"):
        engine.admit([3, 4], 4)
    for bad in (-1, 1, True, np.int64(1), np.bool_(False), 0.0):  # -1 once cancelled the last slot (Python's
        with pytest.raises(ValueError, match=r"slot must be an integer in \[0, 1\)"):  # negative index)
            engine.cancel(bad)
    assert engine.live == 1
    engine.cancel(np.int64(0))  # a numpy integer is a slot (it was refused, naming the valid slot as bad)
    assert engine.live == 0 and engine.free == 1
    with pytest.raises(ValueError, match="capacity"):
        BatchEngine(TARGET, None, slots=1, max_new_tokens=40, capacity=32)
    with pytest.raises(ValueError, match="slots"):
        BatchEngine(TARGET, None, slots=0, max_new_tokens=8)
    with pytest.raises(ValueError, match="block_size"):
        BatchEngine(TARGET, ASSISTANT, slots=1, max_new_tokens=8, block_size=0)


def test_first_token_comes_with_the_first_step_and_a_budget_of_one_ends_there():
    """With no other stream to report, the prefill's token is reported by the first step after
    admission (before any round's tokens, which come a step later, pipelined); a request with
    max_new_tokens=1 finishes at that step and frees its slot. Both tokens are generate's."""
    (ids, _), (ids2, _) = _requests(3, 2, TARGET.config.vocab_size)
    engine = BatchEngine(TARGET, ASSISTANT, slots=2, max_new_tokens=24, capacity=64)
    a, b = engine.admit(ids, 6), engine.admit(ids2, 1)
    events = {ev.slot: ev for ev in engine.step()}
    first = jaxspec.generate(TARGET, [ids], assistant=ASSISTANT, max_new_tokens=6).tokens[0]
    assert events[a].tokens == first[:1] and not events[a].done and events[a].rounds == 0
    assert events[b].done and events[b].tokens == jaxspec.generate(TARGET, [ids2], max_new_tokens=1).tokens[0]
    assert engine.live == 1 and engine.free == 1
    got = list(events[a].tokens)
    while engine.live:
        got += [t for ev in engine.step() for t in ev.tokens]
    assert got == first


def test_beside_a_running_stream_a_first_token_comes_a_step_later_with_its_first_rounds():
    """Reading a first token waits for the prefill chunk just queued: beside a running stream it is
    read a step later, so the stream's tokens never wait for another request's prefill. The step that
    ran the new request's prefill reports the stream only; the next one reports the new request once,
    its first token ahead of its first rounds' tokens. Both requests are generate's."""
    (ids, _), (ids2, _) = _requests(4, 2, TARGET.config.vocab_size)
    engine = BatchEngine(TARGET, ASSISTANT, slots=2, max_new_tokens=24, capacity=64)
    a = engine.admit(ids, 12)
    got = {a: [t for ev in engine.step() for t in ev.tokens]}  # a's first token, nothing else to report
    got[a] += [t for ev in engine.step() for t in ev.tokens]  # a is streaming
    b = engine.admit(ids2, 6)
    events = engine.step()  # b's prefill ran here
    assert [ev.slot for ev in events] == [a]
    got[a] += events[0].tokens
    events = engine.step()
    mine = [ev for ev in events if ev.slot == b]
    assert len(mine) == 1 and len(mine[0].tokens) > 1 and mine[0].rounds == 1
    got[b] = list(mine[0].tokens)
    for ev in events:
        if ev.slot == a:
            got[a] += ev.tokens
    while engine.live:
        for ev in engine.step():
            got[ev.slot] += ev.tokens
    assert got[a] == jaxspec.generate(TARGET, [ids], assistant=ASSISTANT, max_new_tokens=12).tokens[0]
    assert got[b] == jaxspec.generate(TARGET, [ids2], assistant=ASSISTANT, max_new_tokens=6).tokens[0]


def test_more_slots_than_the_multirow_window_stay_exact():
    """5 slots x K = 4 is 20 verify rows, past the 16-row window where a row's arithmetic is the
    same at any row count. The engine's exactness probe keeps K where verify and decode agree (on
    the H200 it lowers it; here the probe passes), and every request is what generate gives it alone."""
    requests = _requests(21, 6, TARGET.config.vocab_size)
    engine = BatchEngine(TARGET, ASSISTANT, slots=5, max_new_tokens=24, capacity=64, block_size=4)
    assert engine.block_size > 1
    got = _drain(engine, requests)
    for i, (ids, n) in enumerate(requests):
        assert got[i] == jaxspec.generate(TARGET, [ids], assistant=ASSISTANT, max_new_tokens=n).tokens[0], i


def test_nan_prefill_logits_come_back_as_the_slots_error():
    """Admission only queues the prefill (nothing waits for it): NaN prefill logits (the final norm
    made NaN, in memory) are reported by the next step as that slot's error event, and the slot is free."""
    import jax.numpy as jnp

    (ids, n), = _requests(5, 1, TARGET.config.vocab_size)
    bad = TARGET.replace(params={**TARGET.params, "norm": jnp.full_like(TARGET.params["norm"], jnp.nan)})
    engine = BatchEngine(bad, None, slots=2, max_new_tokens=24, capacity=64, block_size=1, exactness_probe=False)
    slot = engine.admit(ids, n)
    events = engine.step()
    assert [(ev.slot, ev.done, ev.tokens) for ev in events] == [(slot, True, [])] and "NaN/inf" in events[0].error
    assert engine.live == 0 and engine.free == 2


def test_admission_writes_every_per_row_field():
    """A slot's new request overwrites every per-row field of the state (issue 55): the fields are
    read from DecodeState itself, so one added later (a new sampling value in RowParams, a counter)
    is covered without naming it. Random values everywhere; after `packed_prefill.put_lanes` of three
    lanes (a prompt's last chunk into slot 1, a middle chunk into slot 3, an unused lane) slot 1 is the
    new request's on every leaf, slot 3 took its cache rows only, the other rows and the shared fields
    are unchanged, and the unused lane wrote nothing."""
    import dataclasses

    import jax
    import jax.numpy as jnp
    from jaxspec.engine import loop, packed_prefill, sampling
    from jaxspec.engine.generate import PROMPT_BUCKET
    from support.seeds import seeded_rng

    rng = seeded_rng()
    engine = BatchEngine(TARGET, None, slots=4, max_new_tokens=8, capacity=32, block_size=1)
    spec = engine.gen.spec

    def randomized(state):
        def fill(x):
            if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
                return jax.random.split(jax.random.key(int(rng.integers(1 << 30))), x.shape[0])
            if x.dtype == jnp.bool_:
                return jnp.asarray(rng.integers(0, 2, x.shape).astype(bool))
            if jnp.issubdtype(x.dtype, jnp.integer):
                return jnp.asarray(rng.integers(-1000, 1000, x.shape), x.dtype)
            return jnp.asarray(rng.normal(size=x.shape), x.dtype)
        return jax.tree.map(fill, state)

    def leaves(state):
        flat = jax.tree_util.tree_flatten_with_path(state)[0]
        return {jax.tree_util.keystr(p): np.asarray(jax.random.key_data(x) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key)
                                                    else x) for p, x in flat}

    slot, last = jnp.asarray([1, 3, 4], jnp.int32), jnp.asarray([True, False, True])
    old = randomized(engine.state)
    lanes = packed_prefill._lane_cache(engine.state.cache, slot, slot < 4)
    one = randomized(loop.blank_state(spec, TARGET, 3, PROMPT_BUCKET, engine.stop_ids,
                                      jax.random.split(sampling.seed_key(3), 3), engine.gen.rows(3), cache=lanes))
    # the block pools are every row's (a prefill chunk writes into them): taken whole from `one`
    pools = {f".cache.{kv}[{j}]" for kv in "kv" for j in engine.state.cache.paged}
    before, new_row = leaves(old), leaves(one)
    after = leaves(jax.jit(packed_prefill.put_lanes)(old, one, slot, last))
    assert set(after) == set(before) == set(new_row)
    assert set(loop.row_fields()) | set(loop.SHARED_FIELDS) == {f.name for f in dataclasses.fields(loop.DecodeState)}
    checked = 0
    for path, got in after.items():
        was, row = before[path], new_row[path]
        if any(path.startswith(f".{f}") for f in loop.SHARED_FIELDS):
            np.testing.assert_array_equal(got, was, err_msg=path)
            continue
        if path in pools:
            np.testing.assert_array_equal(got, row, err_msg=path)
            checked += 1
            continue
        axes = [i for i, (a, b) in enumerate(zip(was.shape, row.shape)) if a != b]
        assert len(axes) == 1 and was.shape[axes[0]] == 4 and row.shape[axes[0]] == 3, (path, was.shape, row.shape)
        ax = axes[0]
        for s in range(4):
            want = was.take(s, axis=ax)
            if s == 1 or (s == 3 and path.startswith(".cache")):
                want = row.take(0 if s == 1 else 1, axis=ax)
            np.testing.assert_array_equal(got.take(s, axis=ax), want, err_msg=f"{path} row {s}")
        checked += 1
    assert pools and checked >= 20  # every per-row leaf: cache K/V of each layer (pools, rings, table), tokens, counters, key, RowParams, logprobs


def test_admission_reads_nothing_back_from_the_device():
    """admit() builds its host values on the host: a step already queued keeps the device busy while
    the host admits the next request (the engine's pipelining). Reading a fresh device array back
    waits for every computation queued before it: here a long one (~1 s of matmuls on 2 cores) is
    queued, and it must still be running when admit() returns (a ~1 ms host call; before the fix
    admit waited for it). The request then runs as generate runs it alone."""
    import jax
    import jax.numpy as jnp

    engine = BatchEngine(TARGET, ASSISTANT, slots=3, max_new_tokens=24, capacity=64, block_size=4)
    long = jax.jit(lambda x: jax.lax.fori_loop(0, 30, lambda i, y: jnp.tanh(y @ y), x))
    x = jnp.full((1024, 1024), 0.01, jnp.float32)
    long(x).block_until_ready()  # compiled
    held = long(x)
    ids = [5, 9, 2, 7]
    engine.admit(ids, 8, seed=11)
    assert not held.is_ready(), "admit() waited for the computation queued before it"
    held.block_until_ready()
    tokens = []
    while engine.live:
        for ev in engine.step():
            tokens += ev.tokens
    assert tokens == jaxspec.generate(TARGET, [ids], assistant=ASSISTANT, max_new_tokens=8).tokens[0]
