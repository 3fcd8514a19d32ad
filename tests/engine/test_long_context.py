"""Long context: sliding layers keep a ring of window + max_block + 1 slots (models/cache.py), long
blocks run the blocked (online-softmax) attention (models/layers.py). Checked against the einsum
reference, a full-capacity cache, HF transformers, classic decoding and per-row runs; the cache
memory formula of docs/models.md against the arrays; the context-length input check."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxspec
from jaxspec import models
from jaxspec.models import layer_scan
from jaxspec.models import layers, presets
from jaxspec.models.config import FULL, SLIDING
from jaxspec.kernels import ROW_TILE, DispatchConfig

XLA = DispatchConfig(backend="xla")
S, F = SLIDING, FULL
W = 8
RING = W + ROW_TILE + 1  # 25
CAP = 96
# window 8, K=V, per-layer inputs, KV sharing (a shared sliding layer reads the ring), softcap.
CFG = models.TargetConfig.from_dict(presets.tiny_target_dict(
    num_hidden_layers=5, layer_types=[S, F, S, F, S], attention_k_eq_v=True, hidden_size_per_layer_input=8,
    vocab_size_per_layer_input=256, num_kv_shared_layers=1, sliding_window=W))
fwd = jax.jit(models.forward)


@functools.lru_cache(maxsize=None)
def target():
    return presets.random_model(CFG, jax.random.PRNGKey(3), dtype=jnp.float32, quantize=None, matmul=XLA)


def rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


def rand_ids(seed, shape):
    return jnp.asarray(np.random.default_rng(seed).integers(0, CFG.vocab_size, size=shape), jnp.int32)


def nbytes(tree):
    return sum(int(np.prod(x.shape)) * jnp.dtype(x.dtype).itemsize for x in jax.tree_util.tree_leaves(tree))


# ---------------------------------------------------------------------------------------------
# The ring and the memory formula


@pytest.mark.parametrize("capacity,dtype", [(4096, jnp.bfloat16), (4096, jnp.float32), (20, jnp.bfloat16),
                                            (RING, jnp.float32), (RING + 1, jnp.float32)])
def test_ring_size_and_memory_formula(capacity, dtype):
    cache = jax.eval_shape(lambda: models.init_cache(CFG, 3, capacity, dtype))
    assert nbytes(cache) == models.cache_bytes(CFG, 3, capacity, dtype)
    ring = capacity > RING
    entries = layer_scan.cache_entries(CFG)  # the layers of each buffer (a stack for scanned ones)
    assert sorted(i for layers in entries for i in layers) == list(CFG.cache_layers)
    for j, layers in enumerate(entries):
        want = RING if ring and CFG.is_sliding(layers[0]) else capacity
        assert cache.k[j].shape[-3] == cache.v[j].shape[-3] == want
        assert cache.k[j].shape[:-4] == ((len(layers),) if j < layer_scan.stacked_entries(CFG) else ())
    assert (cache.pos is not None) == ring
    if capacity == 4096:  # a sliding layer holds O(window) positions, a full one the capacity
        sliding = [j for j, layers in enumerate(entries) if CFG.is_sliding(layers[0])]
        assert all(cache.k[j].shape[-3] == W + ROW_TILE + 1 for j in sliding)
        assert cache.pos.shape == (3, RING)
    full = jax.eval_shape(lambda: models.init_cache(CFG, 3, capacity, dtype, ring=False))
    assert all(x.shape[-3] == capacity for x in full.k) and full.pos is None
    assert nbytes(full) == models.cache_bytes(CFG, 3, capacity, dtype, ring=False)


def test_memory_formula_12b():
    """The docs/models.md example: the 12B at 128K (B = 1, bf16)."""
    cfg = presets.target_config("12b")
    got = models.cache_bytes(cfg, 1, 131072)
    assert got == nbytes(jax.eval_shape(lambda: models.init_cache(cfg, 1, 131072)))
    assert got < models.cache_bytes(cfg, 1, 131072, ring=False) / 4


# ---------------------------------------------------------------------------------------------
# Blocked attention


def _attention_case(seed, b, t, c, hq, hkv, d, dtype):
    key = jax.random.PRNGKey(seed)
    kq, kk, kv, kp = jax.random.split(key, 4)
    q = jax.random.normal(kq, (b, t, hq, d)).astype(dtype)
    k = jax.random.normal(kk, (b, c, hkv, d)).astype(dtype)
    v = jax.random.normal(kv, (b, c, hkv, d)).astype(dtype)
    start = np.array([c - t, c - t - 5])[:b]
    q_pos = jnp.asarray(start[:, None] + np.arange(t)[None], jnp.int32)
    k_pos = np.broadcast_to(np.arange(c), (b, c)).copy()
    rng = np.random.default_rng(seed)
    k_pos[:, rng.permutation(c)[:c // 4]] = models.EMPTY  # hidden slots anywhere (ring / padding)
    k_pos = np.asarray(rng.permuted(k_pos, axis=1), np.int32)  # slots in any order (a ring)
    return q, k, v, q_pos, jnp.asarray(k_pos)


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 2e-6), (jnp.bfloat16, 2e-2)])
@pytest.mark.parametrize("window", [None, 7])
def test_blocked_attention_matches_dense(dtype, tol, window):
    q, k, v, q_pos, k_pos = _attention_case(0, 2, 37, 70, 4, 2, 16, dtype)
    ref = layers.dense_attention(q, k, v, layers.visible(q_pos, k_pos, window))
    got = jax.jit(functools.partial(layers.blocked_attention, window=window, q_block=8, k_block=16))(
        q, k, v, q_pos, k_pos)
    assert got.shape == ref.shape and got.dtype == ref.dtype
    assert rel_err(got, ref) < tol
    # the entry point picks blocked above ROW_TILE queries and the einsum path at or below it
    short = layers.attention(q[:, :ROW_TILE], k, v, q_pos[:, :ROW_TILE], k_pos, window)
    np.testing.assert_array_equal(np.asarray(short.astype(jnp.float32)),
                                  np.asarray(layers.dense_attention(q[:, :ROW_TILE], k, v, layers.visible(
                                      q_pos[:, :ROW_TILE], k_pos, window)).astype(jnp.float32)))


def test_blocked_attention_memory_is_not_quadratic():
    """T = 4096 queries over 4096 keys: the compiled temporaries are far below the [T, C] scores."""
    b, t, hq, hkv, d = 1, 4096, 4, 2, 16
    sds = jax.ShapeDtypeStruct
    args = (sds((b, t, hq, d), jnp.float32), sds((b, t, hkv, d), jnp.float32), sds((b, t, hkv, d), jnp.float32),
            sds((b, t), jnp.int32), sds((b, t), jnp.int32))
    compiled = jax.jit(lambda *a: layers.attention(*a, None)).lower(*args).compile()
    temp = compiled.memory_analysis().temp_size_in_bytes
    scores = t * t * hq * 4
    assert temp < scores / 16, (temp, scores)


# ---------------------------------------------------------------------------------------------
# The ring through models.forward


def test_ring_prefill_and_decode_match_full_cache():
    """A 60-token prompt (7.5 windows, > the ring) then 12 decode steps, on a ring cache vs a
    full-capacity one: the same logits up to float32 rounding; the ring holds the last positions."""
    t, ids = target(), rand_ids(1, (2, 72))
    ref = fwd(t, ids, models.init_cache(CFG, 2, CAP, jnp.float32, ring=False))[0]
    lg, _, cache = fwd(t, ids[:, :60], models.init_cache(CFG, 2, CAP, jnp.float32))
    assert cache.pos is not None
    assert sorted(np.asarray(cache.pos[0]).tolist()) == list(range(60 - RING, 60))
    assert rel_err(lg, ref[:, :60]) < 1e-4  # f32 rounding: other key blocks
    dec = []
    for j in range(60, 72):
        step, _, cache = fwd(t, ids[:, j:j + 1], cache)
        dec.append(step)
    assert rel_err(jnp.concatenate(dec, 1), ref[:, 60:]) < 1e-4  # f32 rounding: other key blocks


def test_ring_ragged_prefill_keeps_each_rows_window():
    """Right-padded prompts of true lengths 50 and 9 (junk padding, `valid`), lengths lowered to the
    true ones, then decode: each row matches its own unpadded sequence on a full cache."""
    t = target()
    lens = np.array([50, 9])
    seqs = rand_ids(4, (2, 56))
    ref = fwd(t, seqs, models.init_cache(CFG, 2, CAP, jnp.float32, ring=False))[0]
    valid = jnp.arange(50)[None, :] < jnp.asarray(lens)[:, None]
    prompt = jnp.where(valid, seqs[:, :50], rand_ids(5, (2, 50)))
    lg_p, _, cache = fwd(t, prompt, models.init_cache(CFG, 2, CAP, jnp.float32), valid=valid)
    cache = cache.replace(lengths=jnp.asarray(lens, jnp.int32))
    dec = []
    for j in range(5):
        tok = jnp.take_along_axis(seqs, jnp.asarray(lens)[:, None] + j, axis=1)
        lg, _, cache = fwd(t, tok, cache)
        dec.append(lg[:, 0])
    for r, n in enumerate(lens):
        assert rel_err(lg_p[r, :n], ref[r, :n]) < 1e-4  # f32 rounding: other key blocks
        assert rel_err(jnp.stack([d[r] for d in dec]), ref[r, n:n + 5]) < 1e-4  # f32 rounding: other key blocks


def test_ring_verify_bitwise_equals_decode_steps_across_the_wrap():
    """Rows at lengths 21 and 46 of a ring of 25 slots: a [2, 4] verify, then a rollback to +1
    (rejected drafts left in the ring), twice, each bitwise equal to 4 single [2, 1] steps; the
    blocks cross slot 0 of the ring."""
    t = target()
    ids = rand_ids(6, (2, 48))
    valid = jnp.arange(48)[None, :] < jnp.asarray([21, 46])[:, None]
    _, _, cache = fwd(t, ids, models.init_cache(CFG, 2, CAP, jnp.float32), valid=valid)
    cache = cache.replace(lengths=jnp.asarray([21, 46], jnp.int32))
    for rnd in range(3):
        block = rand_ids(10 + rnd, (2, 4))
        v_logits, v_hidden, v_cache = fwd(t, block, cache)
        c, d_logits, d_hidden = cache, [], []
        for j in range(4):
            lg, h, c = fwd(t, block[:, j:j + 1], c)
            d_logits.append(lg)
            d_hidden.append(h)
        np.testing.assert_array_equal(np.asarray(v_logits), np.asarray(jnp.concatenate(d_logits, 1)))
        np.testing.assert_array_equal(np.asarray(v_hidden), np.asarray(jnp.concatenate(d_hidden, 1)))
        np.testing.assert_array_equal(np.asarray(v_cache.pos), np.asarray(c.pos))
        cache = v_cache.replace(lengths=cache.lengths + 1)  # keep one token: three drafts rejected


# ---------------------------------------------------------------------------------------------
# The loop: speculative == classic across the wrap, ragged batches, input checks


@functools.lru_cache(maxsize=None)
def pair():
    return presets.tiny_pair(3, context=512, dtype=jnp.float32, matmul=XLA)


def _gen(rows, **kw):
    t, a = pair()
    return jaxspec.generate(t, rows, assistant=a, eos_token_ids=(), **kw)


def test_speculative_equals_classic_across_the_wrap():
    """A 70-token prompt (the tiny pair's window is 4: its ring has 21 slots) and 60 new tokens:
    many rounds with rejected drafts roll back across the ring's wrap; greedy speculative output is
    the classic output, and the exactness probe passes (no fallback)."""
    t, _ = pair()
    rows = np.random.default_rng(8).integers(0, t.config.vocab_size, (1, 70)).tolist()
    classic = _gen(rows, max_new_tokens=60, block_size=1)
    spec = _gen(rows, max_new_tokens=60, block_size=4)
    assert spec.stats.fallback is None
    assert 0 < spec.stats.accepted < spec.stats.drafted  # some drafts rejected: rollbacks happened
    assert spec.tokens == classic.tokens


def test_ragged_batch_equals_per_row_runs():
    """Prompts of 9 and 60 tokens (one longer than the ring) in one batch == each row alone."""
    t, _ = pair()
    rng = np.random.default_rng(9)
    rows = [rng.integers(0, t.config.vocab_size, n).tolist() for n in (9, 60)]
    for k in (1, 4):
        batched = _gen(rows, max_new_tokens=24, block_size=k)
        alone = [_gen([r], max_new_tokens=24, block_size=k).tokens[0] for r in rows]
        assert batched.tokens == alone


def test_context_past_max_position_embeddings_is_rejected_before_compute(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("compute started before the input was rejected")
    monkeypatch.setattr(models, "forward", boom)
    t, a = pair()
    with pytest.raises(ValueError, match="max_position_embeddings"):
        jaxspec.generate(t, [[5] * 500], assistant=a, max_new_tokens=13)


# ---------------------------------------------------------------------------------------------
# HF transformers parity (window 8, prompts of 3-5 windows)


@pytest.fixture(scope="module")
def hf_case(tmp_path_factory):
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers", minversion="5.24")
    from support.hf_models import hf_assistant, hf_target
    tdict = presets.tiny_target_dict(layer_types=[S, F, S, S], sliding_window=W, max_position_embeddings=512)
    hf_t = hf_target(tdict, seed=11)
    tdir = tmp_path_factory.mktemp("lc_target")
    hf_t.save_pretrained(tdir)
    hf_a = hf_assistant(presets.tiny_assistant_dict(tdict), seed=12)
    adir = tmp_path_factory.mktemp("lc_assistant")
    hf_a.save_pretrained(adir)
    t = models.load_target(str(tdir), dtype=jnp.float32, matmul=XLA)
    a = models.load_assistant(str(adir), dtype=jnp.float32, matmul=XLA, target=t)
    return dict(torch=torch, hf_t=hf_t, hf_a=hf_a, target=t, assistant=a)


@pytest.mark.parametrize("n", [3 * W, 5 * W])
def test_hf_parity_long_prompt_on_the_ring(hf_case, n):
    """Prompts of 3 and 5 windows through a ring cache (capacity 128, ring 25): prefill logits,
    then decode steps, and two draft steps reading the ring, against HF float32 eager."""
    torch, t, a = hf_case["torch"], hf_case["target"], hf_case["assistant"]
    ids = np.random.default_rng(n).integers(0, t.config.vocab_size, (2, n + 6))
    with torch.no_grad():
        out = hf_case["hf_t"](torch.as_tensor(ids[:, :n]), output_hidden_states=True, return_shared_kv_states=True)
        full = hf_case["hf_t"](torch.as_tensor(ids)).logits.numpy()
    cache = models.init_cache(t.config, 2, 128, jnp.float32)
    lg, hidden, cache = fwd(t, jnp.asarray(ids[:, :n], jnp.int32), cache)
    assert cache.pos is not None and cache.k[0].shape[-3] == RING
    assert rel_err(lg, out.logits.numpy()) < 1e-4
    c, dec = cache, []
    for j in range(n, n + 6):
        step, _, c = fwd(t, jnp.asarray(ids[:, j:j + 1], jnp.int32), c)
        dec.append(step)
    assert rel_err(jnp.concatenate(dec, 1), full[:, n:]) < 1e-4
    # the assistant reads the ring (positions n - W - 1 .. n - 1 of the sliding layer)
    shared = {k: (v[0], v[1]) for k, v in out.shared_kv_states.items()}
    token = np.random.default_rng(n + 1).integers(0, t.config.vocab_size, (2,))
    h_ours, h_ref = hidden[:, -1], out.hidden_states[-1][:, -1].numpy()
    for _ in range(2):
        logits, h_next = jax.jit(models.draft_step)(a, t, cache, jnp.asarray(token, jnp.int32), h_ours,
                                                    jnp.full((2,), n, jnp.int32))
        emb = hf_case["hf_t"].get_input_embeddings()(torch.as_tensor(token)[:, None])
        x = torch.cat([emb, torch.as_tensor(np.asarray(h_ref))[:, None]], dim=-1)
        with torch.no_grad():
            o = hf_case["hf_a"](inputs_embeds=x, position_ids=torch.full((2, 1), n), shared_kv_states=shared)
        assert rel_err(logits, o.logits[:, 0].numpy()) < 1e-4
        assert rel_err(h_next, o.last_hidden_state[:, 0].numpy()) < 1e-4
        token = np.asarray(jnp.argmax(logits, -1))
        h_ours, h_ref = h_next, o.last_hidden_state[:, 0].numpy()


def test_hf_greedy_equals_speculative_and_classic(hf_case):
    """A 4-window prompt, 24 new tokens: HF greedy (full recompute each step) == classic == K = 4
    speculative (whose rollbacks cross the ring's wrap)."""
    torch, t, a = hf_case["torch"], hf_case["target"], hf_case["assistant"]
    prompt = np.random.default_rng(77).integers(0, t.config.vocab_size, 4 * W).tolist()
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(24):
            seq.append(int(hf_case["hf_t"](torch.as_tensor([seq])).logits[0, -1].argmax()))
    hf = seq[len(prompt):]
    classic = jaxspec.generate(t, [prompt], max_new_tokens=24, eos_token_ids=())
    spec = jaxspec.generate(t, [prompt], assistant=a, max_new_tokens=24, block_size=4, eos_token_ids=())
    assert classic.tokens[0] == hf
    assert spec.stats.fallback is None and spec.tokens == classic.tokens


# ---------------------------------------------------------------------------------------------
# The attention kernels inside the model (Pallas interpret mode on the CPU)

KERNELS = XLA.replace(attention="pallas")


def test_model_on_attention_kernels_matches_the_xla_path():
    """The same weights with attention="pallas" (decode_attention for blocks <= ROW_TILE,
    flash_attention above): a ragged 2-row prefill longer than the ring, then decode steps and a
    [2, 4] verify across the wrap, against the XLA path (float32 rounding), and the kernel path's
    verify bitwise equal to its own single steps."""
    t = target()
    tk = t.replace(matmul=KERNELS)
    ids = rand_ids(21, (2, 48))
    valid = jnp.arange(48)[None, :] < jnp.asarray([30, 48])[:, None]
    caches = []
    for m in (t, tk):
        lg, _, c = fwd(m, ids, models.init_cache(CFG, 2, CAP, jnp.float32), valid=valid)
        caches.append((lg, c.replace(lengths=jnp.asarray([30, 48], jnp.int32))))
    (lg_x, cache_x), (lg_k, cache_k) = caches
    for r, n in enumerate((30, 48)):
        assert rel_err(lg_k[r, :n], lg_x[r, :n]) < 1e-4
    block = rand_ids(22, (2, 4))
    v_x, _, _ = fwd(t, block, cache_x)
    v_k, _, _ = fwd(tk, block, cache_k)
    assert rel_err(v_k, v_x) < 1e-4
    c, steps = cache_k, []
    for j in range(4):
        lg, _, c = fwd(tk, block[:, j:j + 1], c)
        steps.append(lg)
    np.testing.assert_array_equal(np.asarray(v_k), np.asarray(jnp.concatenate(steps, 1)))


def test_speculative_equals_classic_on_attention_kernels():
    """The tiny pair on the kernels (target and assistant): greedy speculative == classic across
    the ring's wrap with the exactness probe passing, and both == the XLA path's classic output."""
    t, a = pair()
    tk, ak = t.replace(matmul=KERNELS), a.replace(matmul=KERNELS)
    rows = np.random.default_rng(23).integers(0, t.config.vocab_size, (1, 40)).tolist()
    run = lambda tt, aa, k: jaxspec.generate(tt, rows, assistant=aa, eos_token_ids=(), max_new_tokens=24,  # noqa: E731
                                             block_size=k)
    classic, spec = run(tk, ak, 1), run(tk, ak, 4)
    assert spec.stats.fallback is None
    assert spec.stats.accepted < spec.stats.drafted
    assert spec.tokens == classic.tokens == run(t, a, 1).tokens


def test_attention_takes_the_xla_path_for_a_head_dim_the_kernels_cannot_tile():
    """head_dim 24 (not a power of two): attention on the kernel config gives the XLA path's bits."""
    ks = jax.random.split(jax.random.PRNGKey(31), 3)
    shapes = [(1, 3, 4, 24), (1, 40, 2, 24), (1, 40, 2, 24)]
    q, k, v = (jax.random.normal(kk, s, jnp.float32) for kk, s in zip(ks, shapes))
    q_pos = jnp.asarray([[37, 38, 39]], jnp.int32)
    k_pos = jnp.arange(40, dtype=jnp.int32)[None]
    got = layers.attention(q, k, v, q_pos, k_pos, 8, matmul=KERNELS)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(layers.attention(q, k, v, q_pos, k_pos, 8)))
