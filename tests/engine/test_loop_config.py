"""LoopConfig: K, the verify width and the cache capacity, resolved once, against the documented
rules written out here (no model: the probe and the row bucket are stubbed, nothing compiles)."""
import itertools
import types

import pytest

import jaxspec
from jaxspec import models
from jaxspec.engine import verify
from jaxspec.kernels import DispatchConfig
from jaxspec.engine.loop_config import LoopConfig

# The documented rules' constants, as numbers: the narrowest prompt bucket (a row tile), the smallest
# budget bucket, the capacity rounding, the size past which buckets are multiples of it.
PROMPT, BUDGET, ROUND, STEP = 16, 32, 64, 1024
MATMULS = (DispatchConfig(backend="xla", multirow_max_rows=8), DispatchConfig(backend="xla", verify_pad=True),
           DispatchConfig(backend="xla", multirow=False, verify_pad=True))


def up(x, m):
    return (x + m - 1) // m * m


def bucket(n, floor):
    """The smallest of floor, 2 floor, 4 floor, ... that holds n; past STEP, n rounded up to STEP."""
    if n > STEP:
        return up(n, STEP)
    b = floor
    while b < n:
        b *= 2
    return b


def width_rule(k, batch, pad, mm):
    """K unless it drafts and padding is on; True: the fewest rows >= K whose K * batch leave the
    multirow window for the tiled matmul (rows > multirow_max_rows); an int: that width, at least K."""
    pad = mm.verify_pad if pad is None else pad
    if k <= 1 or pad is False or pad == 0:
        return k
    if pad is True:
        return max(k, mm.multirow_max_rows // batch + 1)
    return max(pad, k)


def capacity_rule(prompt_len, n, width):
    """The cache a run allocates: the prompt and the budget padded to their buckets, the last
    round's width past the last non-bonus token, rounded up to 64."""
    return up(bucket(prompt_len, PROMPT) + bucket(n, BUDGET) - 1 + width, ROUND)


def test_resolve_matches_the_rules():
    """K 1..8, verify_pad None/False/True/widths, batch 1 and 4, several prompts and budgets, with
    and without an assistant, derived and explicit cache sizes: every resolved number, and the
    compiled program's own sizes (LoopSpec), equal the rules; an explicit cache too small for the
    prompt + budget - 1 + width is refused, naming cache_size."""
    checked = refused = 0
    for k, pad, batch, p, n, mm, drafting in itertools.product(
            range(1, 9), (None, False, True, 0, 6, 12), (1, 4), (1, 17, 40), (1, 33, 100), MATMULS, (True, False)):
        run_k = k if drafting else 1
        w = width_rule(run_k, batch, pad, mm)
        cfg = LoopConfig.resolve(block_size=k, batch=batch, prompt_len=p, max_new_tokens=n, drafting=drafting,
                                 verify_pad=pad, matmul=mm)
        assert (cfg.block_size, cfg.asked, cfg.verify_width) == (run_k, run_k, w), (k, pad, batch, mm)
        assert (cfg.prompt_width, cfg.budget) == (bucket(p, PROMPT), bucket(n, BUDGET))
        assert cfg.capacity == capacity_rule(p, n, w) and cfg.cache_size is None
        spec = jaxspec.make_generate(block_size=cfg.block_size, max_new_tokens=cfg.budget,
                                     verify_pad=cfg.verify_pad, cache_size=cfg.cache_size).spec
        pre = spec.prefill_spec(cfg.prompt_width, batch, mm)
        assert spec.width(batch, mm) == w and pre.capacity == cfg.capacity and pre.max_block == max(16, w)
        for cache in (p + n - 1 + w, p + n - 2 + w):
            if cache < p:
                continue
            if p + n - 1 + w <= cache:
                c = LoopConfig.resolve(block_size=k, batch=batch, prompt_len=p, max_new_tokens=n, drafting=drafting,
                                       verify_pad=pad, matmul=mm, cache_size=cache)
                assert (c.capacity, c.verify_width, c.prompt_width) == (cache, w, min(bucket(p, PROMPT), cache))
                assert c.room(p) == n  # exactly full
                checked += 1
            else:
                with pytest.raises(ValueError, match="cache_size"):
                    LoopConfig.resolve(block_size=k, batch=batch, prompt_len=p, max_new_tokens=n,
                                       drafting=drafting, verify_pad=pad, matmul=mm, cache_size=cache)
                refused += 1
    assert checked and refused
    for p, n in itertools.product((64, 65, 1024, 1025, 5000), (32, 129, 1024, 1100, 3000)):  # the rule's edges
        cfg = LoopConfig.resolve(block_size=4, batch=1, prompt_len=p, max_new_tokens=n, verify_pad=False)
        assert (cfg.prompt_width, cfg.budget, cfg.capacity) == (bucket(p, PROMPT), bucket(n, BUDGET),
                                                                capacity_rule(p, n, 4)), (p, n)
    for bad in (0, True, 2.0, "64"):
        with pytest.raises(ValueError, match="cache_size must be"):
            LoopConfig.resolve(block_size=4, batch=1, prompt_len=3, max_new_tokens=8, cache_size=bad)
    with pytest.raises(ValueError, match="prompt is longer than the cache"):
        LoopConfig.resolve(block_size=4, batch=1, prompt_len=30, max_new_tokens=8, cache_size=20)


def _target(context, mm):
    return types.SimpleNamespace(config=types.SimpleNamespace(max_position_embeddings=context), matmul=mm)


@pytest.mark.parametrize("batch,bucket", [(1, 2), (4, 3)])
def test_probe_lowers_k_and_the_sizes_follow(monkeypatch, batch, bucket):
    """A failed exactness probe at the asked K reruns it at the row bucket and runs that K (its own
    width and derived capacity); a failed bucket too: classic (K = 1, width 1). T > 0, an explicit
    no-probe or no assistant: no probe, K as resolved."""
    mm = DispatchConfig(backend="xla", verify_pad=True, multirow_max_rows=8)
    asked = []
    monkeypatch.setattr(models, "row_bucket", lambda target, b: bucket)
    for k, p, n in itertools.product((4, 5, 8), (3, 20), (7, 64)):
        cfg = LoopConfig.resolve(block_size=k, batch=batch, prompt_len=p, max_new_tokens=n, verify_pad=None, matmul=mm)
        target = _target(None, mm)

        def probe(target, b, kk, width):
            asked.append((kk, width))
            return kk == bucket, 0.25 if kk != bucket else 0.0

        monkeypatch.setattr(verify, "exactness_probe", probe)
        asked.clear()
        with pytest.warns(RuntimeWarning):
            run = cfg.probed(target, 0.0, True)
        w = width_rule(bucket, batch, True, mm)
        assert asked == [(k, width_rule(k, batch, True, mm)), (bucket, w)]
        assert (run.block_size, run.asked, run.verify_width) == (bucket, k, w)
        assert run.capacity == capacity_rule(p, n, w) and f"ran K={bucket}" in run.fallback

        monkeypatch.setattr(verify, "exactness_probe", lambda *a: (False, 0.5))
        with pytest.warns(RuntimeWarning):
            run = cfg.probed(target, 0.0, True)
        assert (run.block_size, run.verify_width, run.capacity) == (1, 1, capacity_rule(p, n, 1))
        assert run.probe_logit_diff == 0.5 and "probe failed" in run.fallback

        monkeypatch.setattr(verify, "exactness_probe", None)  # must not be called
        for t, probe_on in ((0.7, True), (0.0, False)):
            kept = cfg.probed(target, t, probe_on)
            assert (kept.block_size, kept.verify_width, kept.capacity, kept.fallback) == \
                (cfg.block_size, cfg.verify_width, cfg.capacity, None)
    solo = LoopConfig.resolve(block_size=1, batch=batch, prompt_len=3, max_new_tokens=8, matmul=mm)
    assert solo.probed(_target(None, mm), 0.0, True).fallback == "block_size=1: nothing to draft"
    classic = LoopConfig.resolve(block_size=4, batch=batch, prompt_len=3, max_new_tokens=8, drafting=False, matmul=mm)
    assert classic.probed(_target(None, mm), 0.0, True).fallback is None


def test_for_slots(monkeypatch):
    """BatchEngine's sizes: the capacity (default: the context capped at 8192) must hold budget + K + 1;
    the room for a prompt is the largest budget whose prompt + budget - 1 + width fits it."""
    monkeypatch.setattr(verify, "exactness_probe", lambda *a: (True, 0.0))
    assistant = object()
    for mm, slots, k, context in itertools.product(MATMULS, (1, 4), (1, 3, 6), (None, 512, 100_000)):
        cfg = LoopConfig.for_slots(_target(context, mm), assistant, slots=slots, block_size=k, max_new_tokens=64,
                                   capacity=None)
        w = width_rule(k, slots, None, mm)
        assert cfg.capacity == min(context or 8192, 8192) and (cfg.block_size, cfg.verify_width) == (k, w)
        assert cfg.budget == 64 and cfg.prompt_width == PROMPT
        for p in (1, 100, cfg.capacity):
            assert cfg.room(p) == cfg.capacity + 1 - p - w
        none = LoopConfig.for_slots(_target(context, mm), None, slots=slots, block_size=k, max_new_tokens=64,
                                    capacity=300)
        assert (none.block_size, none.verify_width, none.capacity) == (1, 1, 300)
    target = _target(None, MATMULS[0])
    assert LoopConfig.for_slots(target, assistant, slots=2, block_size=4, max_new_tokens=10, capacity=15).capacity == 15
    for bad in (14, 15.0, True):
        with pytest.raises(ValueError, match=r"capacity must be an integer >= max_new_tokens \+ block_size \+ 1 = 15"):
            LoopConfig.for_slots(target, assistant, slots=2, block_size=4, max_new_tokens=10, capacity=bad)


def test_cli_memory_check_capacity():
    """The CLI's memory check (before the model loads: unpadded) sizes the cache generate allocates."""
    from jaxspec import cli

    for p, n, k in itertools.product((1, 16, 17, 300), (1, 32, 33, 500), (1, 4, 8)):
        assert cli.cache_capacity(p, n, k) == capacity_rule(p, n, k)
        assert cli.cache_capacity(p, n, k, drafting=False) == capacity_rule(p, n, 1)


def test_for_slots_paged(monkeypatch):
    """The paged engine's sizes: a default capacity is the capped context rounded up to the block, an
    explicit one must be a multiple of it; `positions` (what a request's blocks hold) is the inverse
    of `room`, whatever capacity room is asked against."""
    monkeypatch.setattr(verify, "exactness_probe", lambda *a: (True, 0.0))
    assistant = object()
    for mm, context, block in itertools.product(MATMULS, (None, 250, 512, 100_000), (1, 16, 48)):
        cfg = LoopConfig.for_slots(_target(context, mm), assistant, slots=3, block_size=4, max_new_tokens=64,
                                   capacity=None, block_tokens=block)
        assert cfg.capacity == up(min(context or 8192, 8192), block)
        w = width_rule(4, 3, None, mm)
        for p, n in itertools.product((1, 17, 100), (1, 40)):
            assert cfg.positions(p, n) == p + n - 1 + w
            for held in (cfg.capacity, 160):
                assert cfg.room(p, held) == held + 1 - p - w
                assert cfg.positions(p, cfg.room(p, held)) == held  # the largest budget fills it exactly
    with pytest.raises(ValueError, match="multiple of block_tokens 16"):
        LoopConfig.for_slots(_target(None, MATMULS[0]), assistant, slots=1, block_size=4, max_new_tokens=8,
                             capacity=72, block_tokens=16)
