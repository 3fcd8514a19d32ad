"""The batch engine's shared KV pool and chunked prefill (CPU, XLA path, the tiny pair): a prompt
longer than a chunk is prefilled over several steps while other requests decode, and every request
still gives what jaxspec.generate (a one-shot prefill) gives it alone, alone in the engine or beside
others; a request that needs more blocks than are free waits (admit refuses it, naming the pool)
without touching the running ones; a cancelled or finished request gives its blocks back. A short
prompt is prefilled ahead of a long one's remaining chunks, and the long one still advances at least
every other step."""
import pytest

import jaxspec
from jaxspec.engine.batching import BatchEngine
from support.seeds import seeded_rng
from support.pairs import make_pair

TARGET, ASSISTANT = make_pair(seed=7, layers=2)
BLOCK, CHUNK, POOL = 16, 32, 20  # 20 blocks: two long requests, not three


@pytest.fixture(scope="module")
def engine():
    # a budget of two chunks a step (after the decode rounds' 12 tokens): the order rules decide who waits
    return BatchEngine(TARGET, ASSISTANT, slots=3, max_new_tokens=24, capacity=192, block_tokens=BLOCK,
                       kv_blocks=POOL, prefill_chunk=CHUNK, step_tokens=96)


def _drain(engine, requests, cancel=None):
    """Admit in arrival order whenever a slot and the blocks are free, step until all finish;
    ({request index: tokens}, steps on which the head of the queue waited for blocks with a slot free).
    `cancel`: (request index, step) to cancel that request after that step."""
    waiting, out, where, starved, steps = list(enumerate(requests)), {}, {}, 0, 0
    while waiting or engine.live:
        while waiting and engine.can_admit(len(waiting[0][1][0]), waiting[0][1][1]):
            i, (ids, n) = waiting.pop(0)
            where[engine.admit(ids, n, owner=i)] = i
            out[i] = []
        if waiting and engine.free:
            starved += 1
            ids, n = waiting[0][1]
            with pytest.raises(ValueError, match="KV pool has .* free blocks"):
                engine.admit(ids, n)
        for ev in engine.step():
            out[where[ev.slot]] += ev.tokens
        steps += 1
        if cancel is not None and steps == cancel[1]:
            slot = engine.owner.index(cancel[0])
            held = len(engine.free_blocks)
            engine.cancel(slot)
            assert len(engine.free_blocks) > held  # its blocks are free at once, mid-prefill or not
            out.pop(cancel[0])
    assert len(engine.free_blocks) == POOL and not engine.prefilling
    return out, starved


def test_long_and_short_requests_share_the_pool_each_equal_to_generate(engine):
    rng = seeded_rng()
    vocab = TARGET.config.vocab_size
    # 11 + 8 blocks for the two long ones: the third request (3 blocks) waits with a slot free
    lengths = [int(rng.integers(140, 150)), int(rng.integers(100, 130)), 9, 5, int(rng.integers(33, 64))]
    requests = [(rng.integers(2, vocab, n).tolist(), 23 if i < 3 else int(rng.integers(8, 24)))
                for i, n in enumerate(lengths)]
    chunks = engine.chunks
    got, starved = _drain(engine, requests)
    assert engine.chunks - chunks >= sum(-(-n // CHUNK) for n in lengths)  # the long prompts took several steps
    assert starved > 0  # the third long request waited for blocks while a slot was free
    for i, (ids, n) in enumerate(requests):
        alone = jaxspec.generate(TARGET, [ids], assistant=ASSISTANT, max_new_tokens=n)
        assert got[i] == alone.tokens[0], f"request {i} ({len(ids)} prompt tokens)"
    # The long request alone in the engine: bitwise the same tokens as beside the others.
    alone, _ = _drain(engine, requests[:1])
    assert alone[0] == got[0]


def test_cancel_mid_prefill_frees_the_blocks_and_the_others_are_unchanged(engine):
    rng = seeded_rng()
    vocab = TARGET.config.vocab_size
    requests = [(rng.integers(2, vocab, n).tolist(), 12) for n in (11, 140, 7)]
    got, _ = _drain(engine, requests, cancel=(1, 2))  # after two steps: two of its five chunks
    assert set(got) == {0, 2}
    for i in (0, 2):
        ids, n = requests[i]
        assert got[i] == jaxspec.generate(TARGET, [ids], assistant=ASSISTANT, max_new_tokens=n).tokens[0]


def test_pool_and_chunk_arguments_are_checked(engine):
    assert engine.lanes == 2
    assert not engine.fits(170, 20) and engine.fits(170, 19)  # capacity 192 per request: prompt + budget + K
    with pytest.raises(ValueError, match="prefill_chunk must be a multiple of 16"):
        BatchEngine(TARGET, None, slots=1, max_new_tokens=8, capacity=64, prefill_chunk=40)
    with pytest.raises(ValueError, match="multiple of block_tokens"):
        BatchEngine(TARGET, None, slots=1, max_new_tokens=8, capacity=72, block_tokens=16)
    small = BatchEngine(TARGET, None, slots=2, max_new_tokens=8, capacity=64, kv_blocks=2, block_tokens=16)
    assert small.fits(20, 8) and not small.fits(30, 8)  # past the whole pool: never fits


def test_a_short_request_goes_ahead_of_a_long_prefill(engine):
    """Issue 56: two short requests admitted right behind a long prompt (5 chunks of 32, the last
    padded) take the step's two lanes and get their first token from the first step instead of waiting
    for the whole long prefill; the long one pays the step it was passed over. The outputs are what
    generate gives each alone."""
    rng = seeded_rng()
    vocab = TARGET.config.vocab_size
    requests = [(rng.integers(2, vocab, 140).tolist(), 6), (rng.integers(2, vocab, 9).tolist(), 6),
                (rng.integers(2, vocab, 20).tolist(), 6)]
    slots = [engine.admit(ids, n) for ids, n in requests]
    got, first, ended, steps = {s: [] for s in slots}, {}, {}, 0
    while engine.live:
        steps += 1
        for ev in engine.step():
            if ev.tokens:
                first.setdefault(ev.slot, steps)
            if ev.done:
                ended[ev.slot] = steps
            got[ev.slot] += ev.tokens
    # in admission order: both at step 5. Passed over at step 1, the long one goes first at step 2 and
    # takes both lanes (chunks 0-1), then 2-3, and its last chunk runs at step 4; its first token is
    # read then unless a short one is still reported at step 4 (its tokens must not wait for the chunk)
    ended_short = max(ended[slots[1]], ended[slots[2]])
    assert first[slots[1]] == first[slots[2]] == 1 and first[slots[0]] == (4 if ended_short < 4 else 5)
    for slot, (ids, n) in zip(slots, requests):
        assert got[slot] == jaxspec.generate(TARGET, [ids], assistant=ASSISTANT, max_new_tokens=n).tokens[0]


def test_a_long_prefill_advances_beside_a_new_short_request_every_step(engine):
    """The starvation guard: new short requests each step (budget 1: its first token ends it), two
    when two slots are free, beside a long prompt, two lanes a step. Short ones go first, but a step that passed the long one over is followed by one
    where it goes first: its prefill advances at least every other step and ends, and each short
    request still gets its first token from the step it was admitted before or the next (no other
    stream runs, so a first token is read in the step that made it)."""
    rng = seeded_rng()
    vocab = TARGET.config.vocab_size
    long_ids = rng.integers(2, vocab, 140).tolist()
    long = engine.admit(long_ids, 2)
    admitted, first, progress, step = {}, {}, [0], 0  # admitted: (slot, admission) -> step it was admitted before
    while long in engine.prefilling and step < 20:
        step += 1
        for _ in range(engine.free):
            slot = engine.admit(rng.integers(2, vocab, 9).tolist(), 1)
            admitted[slot, engine.ticket[slot]] = step
        for ev in engine.step():
            if ev.slot != long and ev.tokens:
                first[ev.slot, engine.ticket[ev.slot]] = step
        progress.append(engine.prefilling[long].done if long in engine.prefilling else len(long_ids))
    assert progress[-1] == len(long_ids) and step <= 11  # 5 chunks, each at most a step after the last
    assert all(b > a for a, b in zip(progress, progress[2:]))  # never two steps without a chunk
    assert progress[1] == 0 and len(first) >= 5  # the first step went to short ones
    assert all(first.get(r, step + 2) - s <= 1 for r, s in admitted.items() if s < step)
    while engine.live:
        engine.step()
