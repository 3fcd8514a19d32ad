"""`jaxspec serve --max-batch N` against the memory (jaxspec.engine.memory): the estimate's terms
against the arrays the engine allocates (shapes only, nothing compiled), and the CLI's refusal
before anything loads. The estimate's factors were measured (peak RSS and XLA's memory_analysis,
in serve_memory's docstring): compiling a step to measure here would take a minute on CI."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec import cli, models
from jaxspec.engine import loop, sampling
from jaxspec.engine import memory as serve_memory
from jaxspec.engine.generate import PROMPT_BUCKET, make_generate, stop_array
from jaxspec.models import presets
from jaxspec.engine.memory import (HOST_RUNTIME, LOGIT_COPIES, POOL_BLOCK, STEP_CACHE_COPIES, batch_memory, largest_batch,
                                  largest_pool)
from support.seeds import seeded_rng
from support.serve_cli import memory_of, serve_fails


def _nbytes(tree) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))  # a key: its two uint32


@pytest.fixture(scope="module")
def tiny_cfg():
    rng = seeded_rng()
    vocab = int(rng.integers(200, 400))
    td = presets.tiny_target_dict(vocab_size=vocab, num_hidden_layers=2,
                                  layer_types=["sliding_attention", "full_attention"])
    return models.TargetConfig.from_dict(td)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_terms_match_the_engines_arrays(tiny_cfg, dtype):
    """Cache: the bytes of init_cache's arrays; logits: LOGIT_COPIES float32 [B, K + 1, V]; the step's
    temporaries: STEP_CACHE_COPIES caches; outputs: at least the decode state's other arrays (its
    tokens, logprobs, top-20 alternatives, sampling rows) as the full sampling mode lays them out."""
    rng = seeded_rng()
    b, k, cap = int(rng.integers(3, 40)), int(rng.integers(1, 6)), int(rng.integers(64, 300))
    w = int(rng.integers(1 << 20, 1 << 24))
    need = batch_memory(tiny_cfg, b, k, dtype, w, capacity=cap, host=False)
    cache = jax.eval_shape(lambda: models.init_cache(tiny_cfg, b, cap, dtype))
    assert need.cache == _nbytes(cache)
    assert need.logits == LOGIT_COPIES * np.zeros((b, k + 1, tiny_cfg.vocab_size), np.float32).nbytes
    assert need.step == int(STEP_CACHE_COPIES * need.cache)
    assert (need.weights, need.runtime) == (w, 0)
    # The engine's own state (batching.BatchEngine: blank_state of the full mode, a budget below the
    # capacity), shapes only: its arrays beside the cache fit the outputs term, not 3x over.
    target = jax.eval_shape(lambda: presets.random_model(tiny_cfg, jax.random.key(0), dtype=dtype))
    gen = make_generate(block_size=k, max_new_tokens=cap // 2, cache_size=cap, mode=sampling.FULL_MODE)
    state = jax.eval_shape(lambda: loop.blank_state(gen.spec, target, b, PROMPT_BUCKET, stop_array((1,)),
                                                     jax.random.split(jax.random.key(0), b), gen.rows(b)))
    rest = _nbytes(state) - _nbytes(state.cache)
    assert rest <= need.state <= 3 * rest
    assert need.total == need.cache + need.state + need.step + need.logits + need.weights


def test_host_memory_counts_the_process(tiny_cfg):
    """On a CPU the runtime, the compiler and XLA's dequantized weights share the memory."""
    dev = batch_memory(tiny_cfg, 8, 4, jnp.bfloat16, 1 << 24, capacity=256, host=False)
    host = batch_memory(tiny_cfg, 8, 4, jnp.bfloat16, 1 << 24, capacity=256, host=True)
    assert host.total - dev.total == HOST_RUNTIME + 2 * (1 << 24)
    assert "runtime and compiler" in host.describe() and "runtime" not in dev.describe()


def test_serve_refuses_a_batch_over_the_host_memory(capsys, monkeypatch):
    """The default pair at --max-batch 4096 on a 12 GiB CPU: the old estimate (cache + 3 logits +
    weights, 5.8 GiB) let it through, and its warm-up passed 12 GiB (issue 51). Refused in one line
    naming the limit and the terms, exit 2, before loading; a batch that fits goes on to load."""
    port = memory_of(monkeypatch, 12 << 30, "host memory")
    err = serve_fails(capsys, "--max-batch", "4096", "--port", port)
    for part in ("--max-batch 4096", "10.8 GiB of host memory (12.0 GiB less a tenth", "KV cache", "step temporaries",
                 "runtime and compiler", "lower --max-batch (at most "):
        assert part in err, err
    assert cli.main(["serve", "--max-batch", "64", "--port", port]) == 1  # fits: it goes on to load
    assert "a model was about to be loaded" in capsys.readouterr().err



def test_largest_batch_is_the_last_that_fits(tiny_cfg):
    """What the refusal offers instead: the largest batch whose estimate fits, checked one by one."""
    rng = seeded_rng()
    k, w, cap, host = int(rng.integers(1, 6)), int(rng.integers(1, 1 << 24)), int(rng.integers(64, 4096)), \
        bool(rng.integers(0, 2))

    def total(n):
        return batch_memory(tiny_cfg, n, k, jnp.bfloat16, w, capacity=cap, host=host).total
    limit = total(int(rng.integers(2, 500))) + int(rng.integers(0, 1000))
    n = largest_batch(limit, tiny_cfg, k, jnp.bfloat16, w, capacity=cap, host=host, most=4096)
    assert total(n) <= limit < total(n + 1)
    assert largest_batch(total(1) - 1, tiny_cfg, k, jnp.bfloat16, w, capacity=cap, host=host, most=4096) == 0


def test_a_pool_counts_the_paged_engines_arrays(tiny_cfg):
    """With kv_positions (serve --kv-positions) the KV cache is the paged engine's: the pool of that
    many positions, the slots' rings and block tables (init_paged_cache's arrays at the request's
    capacity); the step's temporaries follow it, the other terms are the slots'."""
    rng = seeded_rng()
    b, k, cap, req = int(rng.integers(2, 9)), int(rng.integers(1, 6)), 256, int(rng.integers(300, 900))
    kv = POOL_BLOCK * int(rng.integers(1, 200))
    need = batch_memory(tiny_cfg, b, k, jnp.bfloat16, 1 << 20, capacity=cap, host=False, request_capacity=req,
                        kv_positions=kv)
    per_request = -(-req // PROMPT_BUCKET) * PROMPT_BUCKET
    arrays = jax.eval_shape(lambda: models.init_paged_cache(tiny_cfg, b, per_request, kv // POOL_BLOCK, POOL_BLOCK,
                                                            jnp.bfloat16))
    assert POOL_BLOCK == PROMPT_BUCKET  # the scheduler's blocks
    assert need.cache == _nbytes(arrays) and need.step == int(STEP_CACHE_COPIES * need.cache)
    slots = batch_memory(tiny_cfg, b, k, jnp.bfloat16, 1 << 20, capacity=cap, host=False, request_capacity=req)
    assert (need.logits, need.state, need.views, need.weights) == (slots.logits, slots.state, slots.views,
                                                                  slots.weights)
    assert f"a pool of {kv} positions for {b} slots" in need.describe()

    def total(pool):
        return batch_memory(tiny_cfg, b, k, jnp.bfloat16, 1 << 20, capacity=cap, host=False, request_capacity=req,
                            kv_positions=pool).total
    limit = need.total + int(rng.integers(0, 1 << 16))
    fit = largest_pool(limit, tiny_cfg, b, k, jnp.bfloat16, 1 << 20, capacity=cap, host=False, request_capacity=req,
                       most=1 << 20)
    assert fit % POOL_BLOCK == 0 and total(fit) <= limit < total(fit + POOL_BLOCK)


def test_serve_checks_kv_positions_against_the_memory(capsys, monkeypatch):
    """--kv-positions is the pool the memory check counts (not --max-batch x 4096): past the memory
    it is refused before loading, in one line naming the flag and the largest pool that fits;
    that pool goes on to load, one block more does not."""
    port = memory_of(monkeypatch, 12 << 30, "host memory")
    err = serve_fails(capsys, "--kv-positions", str(1 << 26), "--max-batch", "4", "--port", port)
    for part in ("--kv-positions 67108864 with --max-batch 4", "a pool of 67108864 positions for 4 slots",
                 "10.8 GiB of host memory (12.0 GiB less a tenth", "lower --kv-positions (at most "):
        assert part in err, err
    fit = int(re.search(r"at most (\d+)\)", err).group(1))
    assert fit % 16 == 0 and fit >= 4 * 4096  # the default pool fits where --max-batch 64 does
    assert cli.main(["serve", "--kv-positions", str(fit), "--max-batch", "4", "--port", port]) == 1  # fits: it loads
    assert "a model was about to be loaded" in capsys.readouterr().err
    assert "lower --kv-positions" in serve_fails(capsys, "--kv-positions", str(fit + 16), "--max-batch", "4",
                                                 "--port", port)


# ---- issue 65: the memory the run may fill, not the whole host --------------------------------------
PROBE_HOST = 25276194816  # the 23.5 GiB host where --max-batch 4096 (estimated 21.9 GiB) passed


def test_serve_checks_the_memory_the_host_can_spare(capsys, monkeypatch):
    """The default pair at --max-batch 4096: its estimate (which bounds the warm-up's peak) fitted
    the probe's whole 23.5 GiB host, and the warm-up grew past what the machine could spare. On a
    CPU it is checked against the host memory less a tenth for the system, the memory cgroup's
    limit and what is available now (each named when it is the bound): refused in one line before
    loading; the largest batch offered goes on to load."""
    port = memory_of(monkeypatch, PROBE_HOST, "host memory")
    err = serve_fails(capsys, "--max-batch", "4096", "--port", port)
    assert "more than the 21.2 GiB of host memory (23.5 GiB less a tenth for the system): lower --max-batch" in err
    monkeypatch.setattr(serve_memory, "cgroup_limit", lambda: 8 << 30)
    err = serve_fails(capsys, "--max-batch", "4096", "--port", port)
    assert "more than the 8.0 GiB of host memory (this process's memory cgroup limit)" in err
    monkeypatch.setattr(serve_memory, "available_now", lambda: 5 << 30)  # others hold the rest
    err = serve_fails(capsys, "--max-batch", "4096", "--port", port)
    assert "more than the 5.0 GiB of host memory available now (of 23.5 GiB; other processes hold the rest)" in err
    fits = int(re.search(r"at most (\d+)\)", err).group(1))
    assert 64 < fits < 4096 and f"--max-batch {fits + 1} needs" in serve_fails(
        capsys, "--max-batch", str(fits + 1), "--port", port)
    assert cli.main(["serve", "--max-batch", str(fits), "--port", port]) == 1  # fits: it goes on to load
    assert "a model was about to be loaded" in capsys.readouterr().err


def test_cgroup_limit_reads_v1_and_v2(tmp_path):
    """The lowest memory limit on the process's cgroup path, v2 (`memory.max`, "max": none) or v1
    (`memory.limit_in_bytes`, 2**63 rounded to a page: none); None without a memory controller."""
    rng = seeded_rng()
    a, b = (int(x) << 20 for x in rng.integers(64, 1 << 14, 2))
    fs = tmp_path / "fs"
    for where, text in (("a", str(a)), ("a/b", str(b)), ("a/b/c", "max")):
        (fs / where).mkdir(parents=True)
        (fs / where / "memory.max").write_text(text + "\n")
    proc = tmp_path / "cgroup"
    proc.write_text("0::/a/b/c\n")
    assert serve_memory.cgroup_limit(str(proc), str(fs)) == min(a, b)
    (fs / "memory" / "x").mkdir(parents=True)
    (fs / "memory" / "x" / "memory.limit_in_bytes").write_text(str(a))
    (fs / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712")
    proc.write_text("4:memory:/x\n3:cpu:/y\n")
    assert serve_memory.cgroup_limit(str(proc), str(fs)) == a
    (fs / "memory" / "x" / "memory.limit_in_bytes").write_text("9223372036854771712")
    assert serve_memory.cgroup_limit(str(proc), str(fs)) is None
    proc.write_text("3:cpu:/y\n")
    assert serve_memory.cgroup_limit(str(proc), str(fs)) is None


def test_prefix_ring_snapshots_are_counted(tiny_cfg):
    """With prefix reuse the estimate counts the engine's ring snapshots (prefix_cache.RingSnapshots:
    default_snapshots(slots) copies of a slot's rings) within a tenth, plus a block table row each;
    none without reuse, or when the window covers a request (no ring: every layer is paged)."""
    from jaxspec.engine.prefix_cache import RingSnapshots, default_snapshots

    b = int(seeded_rng().integers(1, 6))
    kw = dict(capacity=256, host=False, request_capacity=256, kv_positions=1024)
    with_ = batch_memory(tiny_cfg, b, 4, jnp.bfloat16, 1 << 20, prefix_cache=True, **kw)
    snaps = RingSnapshots(models.init_paged_cache(tiny_cfg, b, 256, 64, POOL_BLOCK, jnp.bfloat16),
                          default_snapshots(b))
    real = _nbytes((snaps.k, snaps.v, snaps.pos))
    assert real <= with_.snapshots <= 1.1 * real
    assert with_.total - batch_memory(tiny_cfg, b, 4, jnp.bfloat16, 1 << 20, **kw).total == with_.snapshots
    short = dict(kw, request_capacity=16)
    assert batch_memory(tiny_cfg, b, 4, jnp.bfloat16, 1 << 20, prefix_cache=True, **short).snapshots == 0
    big = models.TargetConfig.from_dict(presets.TARGETS["12b"])  # 341 MB of rings a slot, 4 copies at 4 slots
    at_12b = batch_memory(big, 4, 4, jnp.bfloat16, 7 << 30, prefix_cache=True, **dict(kw, request_capacity=32768))
    assert "prefix ring snapshots 1.3 GiB" in at_12b.describe()


def test_reuse_keeps_32_slots_of_the_12b_within_an_h100(monkeypatch):
    """`serve --max-batch 32` at 12B shapes (7 GiB of 4-bit weights, a GPU's serve defaults) passes the
    memory check on an 80 GB H100 (JAX's default limit there: 0.75 x 81,559 MiB) with prefix reuse on,
    as it does with reuse off; two ring snapshots a slot (20.3 GiB) had it refused, and the standard
    serve sweep ran out of that H100's memory. Between the two estimates, the snapshots are what is
    refused, naming how many fit (`--ring-snapshots N`, counted): N passes, N + 1 does not; reuse off
    still fits."""
    import dataclasses

    from jaxspec.serve.config import ServeConfig

    tcfg = models.TargetConfig.from_dict(presets.TARGETS["12b"])
    h100 = int(0.75 * 81559 * 2**20)
    on = ServeConfig(max_batch=32).resolved("gpu")
    off = dataclasses.replace(on, prefix_cache=False)
    need = {c: batch_memory(tcfg, 32, on.block_size, jnp.bfloat16, 7 << 30,
                            **cli._serve_memory_kw(tcfg, c, host=False)).total for c in (on, off)}
    assert on.prefix_cache and need[off] < need[on] <= h100
    for limit, refused in ((h100, ()), ((need[on] + need[off]) // 2, (on,))):
        monkeypatch.setattr(cli, "memory_limit", lambda limit=limit: (limit, "GPU memory", False))
        for config in (on, off):
            if config in refused:
                with pytest.raises(cli.UsageError, match="--max-batch 32 needs .*prefix ring snapshots") as e:
                    cli._check_batch_memory(tcfg, config, on.block_size, jnp.bfloat16, 7 << 30)
                n = int(re.search(r"--ring-snapshots (\d+) \(", str(e.value)).group(1))
                assert 0 < n < 16 and str(e.value).endswith("or --no-prefix-cache")
                cli._check_batch_memory(tcfg, dataclasses.replace(config, ring_snapshots=n), on.block_size,
                                        jnp.bfloat16, 7 << 30)
                with pytest.raises(cli.UsageError):
                    cli._check_batch_memory(tcfg, dataclasses.replace(config, ring_snapshots=n + 1), on.block_size,
                                            jnp.bfloat16, 7 << 30)
            else:
                cli._check_batch_memory(tcfg, config, on.block_size, jnp.bfloat16, 7 << 30)
