"""attention_inputs (split-K fold, q/k/v RMSNorm, RoPE and the K/V cache write in one launch) against
its jnp reference and a float64 one; rows bitwise independent of the row count; dropped columns;
a stacked cache written in place; bad input; the Triton lowering at the 12B's shapes. On CPU the
kernel runs in interpret mode; the gpu-marked test runs it compiled."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from support.gpu_lowering import TRITON_CALL, lower_for_cuda
from jaxspec.kernels.attention_inputs import attention_inputs, attention_inputs_reference

INTERPRET = not any(d.platform == "gpu" for d in jax.devices())
EPS = 1e-6


def _inputs(seed, *, s=3, b=2, t=3, hq=4, hkv=2, d=32, c=11, dtype=jnp.bfloat16, own_v=True, stack=None):
    """Random partials, scales, RoPE tables of random positions, random caches and columns (one
    dropped column per row when T > 1)."""
    rng = np.random.default_rng(seed)
    f = lambda *shape: rng.standard_normal(shape).astype(np.float32)  # noqa: E731
    part_dtype = jnp.float32 if s > 1 else dtype  # as the GEMV returns them
    qp = jnp.asarray(f(s, b, t, hq * d), part_dtype)
    kp = jnp.asarray(f(s + 1, b, t, hkv * d), jnp.float32)  # another split than q's
    vp = jnp.asarray(f(s, b, t, hkv * d), part_dtype) if own_v else None
    qs, ks = (jnp.asarray(1 + 0.3 * f(d), dtype) for _ in range(2))
    ang = rng.integers(0, 5000, (b, t, 1)) * (1.0 / 10000 ** (np.arange(d // 2) / (d // 2)))
    ang = np.concatenate([ang, ang], axis=-1)
    cos, sin = jnp.asarray(np.cos(ang), dtype), jnp.asarray(np.sin(ang), dtype)
    lead = () if stack is None else (stack,)
    kc, vc = (jnp.asarray(f(*lead, b, c, hkv, d), dtype) for _ in range(2))
    cols = np.stack([rng.permutation(c + 2)[:t] for _ in range(b)]).astype(np.int32)  # c, c + 1: dropped
    if t > 1:
        cols[:, -1] = np.array([c, -1] * b)[:b]
    return qp, kp, vp, qs, ks, cos, sin, kc, vc, jnp.asarray(cols)


def _float64(qp, kp, vp, qs, ks, cos, sin, kc, vc, cols, layer=None, norm_v=True):
    """The float64 math on the rounded projections (fold, norm, RoPE), caches written in numpy."""
    d = cos.shape[-1]
    dt = cos.dtype
    c64 = lambda a: np.asarray(jnp.asarray(a, jnp.float32), np.float64)  # noqa: E731
    fold = lambda p: c64(jnp.sum(p.astype(jnp.float32), 0).astype(dt))  # noqa: E731

    def norm(x, s):
        x = x.reshape(*x.shape[:2], -1, d)
        y = x / np.sqrt((x * x).mean(-1, keepdims=True) + EPS)
        return y if s is None else y * c64(s)

    def rope(x):
        rot = np.concatenate([-x[..., d // 2:], x[..., :d // 2]], -1)
        return x * c64(cos)[:, :, None] + rot * c64(sin)[:, :, None]

    q = rope(norm(fold(qp), qs))
    kr = fold(kp)
    v_raw = kr if vp is None else fold(vp)
    k, v = rope(norm(kr, ks)), norm(v_raw, None) if norm_v else v_raw.reshape(*v_raw.shape[:2], -1, d)
    kc, vc = c64(kc), c64(vc)
    for bi in range(cols.shape[0]):
        for ti in range(cols.shape[1]):
            col = int(cols[bi, ti])
            if 0 <= col < kc.shape[-3]:
                at = (bi, col) if layer is None else (layer, bi, col)
                kc[at], vc[at] = k[bi, ti], v[bi, ti]
    return q, kc, vc


def _close(got, want, dtype):
    got = np.asarray(jnp.asarray(got, jnp.float32), np.float64)
    tol = 1e-5 if dtype == jnp.float32 else 2.0 ** -7
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol * np.abs(want).max())


def _run(args, layer=None, **kw):
    return attention_inputs(*args, eps=EPS, layer=layer, interpret=INTERPRET, **kw)


CASES = [  # dtype, S, B, T, Hq, Hkv, D, own_v, stacked
    (jnp.float32, 3, 2, 3, 4, 2, 32, True, None),
    (jnp.bfloat16, 1, 1, 4, 4, 1, 64, False, None),
    (jnp.bfloat16, 4, 2, 2, 2, 2, 16, True, 3),
    (jnp.bfloat16, 2, 3, 1, 8, 4, 32, False, 2),
]


@pytest.mark.parametrize("case", CASES)
def test_matches_reference_and_float64(case):
    dtype, s, b, t, hq, hkv, d, own_v, stack = case
    args = _inputs(sum(map(hash, (s, b, t, hq, d))) % 1000, s=s, b=b, t=t, hq=hq, hkv=hkv, d=d, dtype=dtype,
                   own_v=own_v, stack=stack)
    layer = None if stack is None else jnp.int32(stack - 1)
    got = _run(args, layer)
    ref = attention_inputs_reference(*args, eps=EPS, layer=layer)
    want = _float64(*args, layer=None if stack is None else stack - 1)
    for g, r, w in zip(got, ref, want):
        assert g.shape == r.shape and g.dtype == r.dtype
        _close(g, w, dtype)
        _close(g, np.asarray(jnp.asarray(r, jnp.float32), np.float64), dtype)
    # columns dropped or not written keep their old contents bit for bit
    kc_old = np.asarray(jnp.asarray(args[7], jnp.float32))
    written = np.zeros(kc_old.shape[:-2], bool)
    for bi, row in enumerate(np.asarray(args[9])):
        for col in row:
            if 0 <= col < written.shape[-1]:
                written[(bi, col) if stack is None else (stack - 1, bi, col)] = True
    untouched = ~written
    np.testing.assert_array_equal(np.asarray(jnp.asarray(got[1], jnp.float32))[untouched], kc_old[untouched])


@pytest.mark.parametrize("own_v", [True, False])
def test_raw_v(own_v):
    """norm_v=False (Gemma 3: no v norm): v is written as projected, k and q as before."""
    args = _inputs(11 + own_v, own_v=own_v, stack=2 if own_v else None, dtype=jnp.float32)
    layer = jnp.int32(1) if own_v else None
    got = _run(args, layer, norm_v=False)
    ref = attention_inputs_reference(*args, eps=EPS, layer=layer, norm_v=False)
    want = _float64(*args, layer=1 if own_v else None, norm_v=False)
    for g, r, w in zip(got, ref, want):
        _close(g, w, jnp.float32)
        _close(g, np.asarray(r, np.float64), jnp.float32)
    normed = _run(args, layer)[2]
    assert not np.allclose(np.asarray(normed), np.asarray(got[2]))  # the flag changes v


def test_q_only():
    qp, _, _, qs, _, cos, sin, *_ = _inputs(5)
    q, kc, vc = attention_inputs(qp, None, None, qs, None, cos, sin, None, None, None, eps=EPS,
                                 interpret=INTERPRET)
    assert kc is None and vc is None
    _close(q, attention_inputs_reference(qp, None, None, qs, None, cos, sin, None, None, None, eps=EPS)[0],
           jnp.bfloat16)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_rows_bitwise_independent_of_the_row_count(dtype):
    """A [B, T] call gives each row exactly what a [B, 1] call with that row alone gives."""
    qp, kp, vp, qs, ks, cos, sin, kc, vc, cols = _inputs(7, t=4, dtype=dtype)
    q, kc_all, vc_all = _run((qp, kp, vp, qs, ks, cos, sin, kc, vc, cols))
    for i in range(4):
        one = lambda a: a[:, :, i:i + 1]  # noqa: E731
        q1, kc1, vc1 = _run((one(qp), one(kp), one(vp), qs, ks, cos[:, i:i + 1], sin[:, i:i + 1], kc, vc,
                             cols[:, i:i + 1]))
        np.testing.assert_array_equal(np.asarray(q1[:, 0], np.float32), np.asarray(q[:, i], np.float32))
        for bi in range(cols.shape[0]):
            col = int(cols[bi, i])
            if 0 <= col < kc.shape[1]:
                np.testing.assert_array_equal(np.asarray(kc1[bi, col], np.float32), np.asarray(kc_all[bi, col],
                                                                                              np.float32))
                np.testing.assert_array_equal(np.asarray(vc1[bi, col], np.float32), np.asarray(vc_all[bi, col],
                                                                                              np.float32))


@pytest.mark.parametrize("change, match", [
    (dict(q_parts=lambda a: a[0]), "q_parts must be"),
    (dict(cos=lambda a: a[:, :1]), "cos/sin"),
    (dict(q_scale=lambda a: a[:3]), "q_scale"),
    (dict(k_parts=lambda a: a[:, :1]), "k_parts must be"),
    (dict(v_parts=lambda a: a[..., :8]), "v_parts"),
    (dict(k_cache=lambda a: a[:, :, :1]), "k_cache and v_cache"),
    (dict(cols=lambda a: a.astype(jnp.float32)), "cols must be int32"),
])
def test_bad_input_raises(change, match):
    names = ["q_parts", "k_parts", "v_parts", "q_scale", "k_scale", "cos", "sin", "k_cache", "v_cache", "cols"]
    args = dict(zip(names, _inputs(3)))
    for name, fn in change.items():
        args[name] = fn(args[name])
    with pytest.raises(ValueError, match=match):
        attention_inputs(**args, eps=EPS, interpret=INTERPRET)


# ---- the 12B's shapes: sliding (16 x 256 q heads, 8 kv heads) and global (16 x 512, one kv head = v)
REAL = [  # S_q, S_kv, T, Hq, Hkv, D, own_v, C, stacked
    (8, 8, 8, 16, 8, 256, True, 1041, 8),
    (8, 8, 8, 16, 1, 512, False, 4096, None),
]


def _real(case, dtype=jnp.bfloat16):
    sq, skv, t, hq, hkv, d, own_v, c, stack = case
    make = jnp.zeros
    lead = () if stack is None else (stack,)
    return (make((sq, 1, t, hq * d), jnp.float32), make((skv, 1, t, hkv * d), jnp.float32),
            make((skv, 1, t, hkv * d), jnp.float32) if own_v else None, make((d,), dtype), make((d,), dtype),
            make((1, t, d), dtype), make((1, t, d), dtype), make((*lead, 1, c, hkv, d), dtype),
            make((*lead, 1, c, hkv, d), dtype), make((1, t), jnp.int32))


@pytest.mark.parametrize("case", REAL)
def test_lowers_to_triton_for_cuda(case):
    args = _real(case)
    stacked = case[-1] is not None
    if stacked:
        fn = lambda *a: attention_inputs(*a[:-1], eps=EPS, layer=a[-1])  # noqa: E731
        args = (*args, jnp.zeros((), jnp.int32))
    else:
        fn = functools.partial(attention_inputs, eps=EPS)
    names = [i for i, a in enumerate(args) if a is not None]
    call = lambda *present: fn(*[present[names.index(i)] if i in names else None  # noqa: E731
                                 for i in range(len(args))])
    assert TRITON_CALL in lower_for_cuda(call, *[args[i] for i in names])


@pytest.mark.gpu
@pytest.mark.parametrize("case", REAL)
def test_gpu_real_shapes(case):
    sq, skv, t, hq, hkv, d, own_v, c, stack = case
    args = _inputs(11, s=sq, b=1, t=t, hq=hq, hkv=hkv, d=d, c=c, own_v=own_v, stack=stack)
    layer = None if stack is None else jnp.int32(stack - 1)
    got = attention_inputs(*args, eps=EPS, layer=layer)
    for g, w in zip(got, _float64(*args, layer=None if stack is None else stack - 1)):
        _close(g, w, jnp.bfloat16)


# ---- in the model: quantized projections whose GEMV splits K, so the kernel folds real partials
@pytest.mark.slow
def test_model_on_the_kernel_matches_the_xla_path():
    """A scanned tiny target (hidden 256, 4-bit g32: the q/k/v GEMV splits K in two; a K = V global
    layer) on the Pallas GEMV and attention kernels against the XLA path: prefill, a decode step and a
    verify agree to float32 rounding; the verify is bitwise the kernel path's own decode steps."""
    from jaxspec import models
    from jaxspec.models import presets
    from jaxspec.models.config import TargetConfig
    from jaxspec.kernels import DispatchConfig
    from jaxspec.kernels.launch import gemv_tiling

    cfg = TargetConfig.from_dict(presets.tiny_target_dict(
        hidden_size=256, num_hidden_layers=4, layer_types=presets.layer_pattern(4, 2), attention_k_eq_v=True))
    assert gemv_tiling((cfg.num_attention_heads * cfg.head_dim * 2, cfg.hidden_size), 32).split_k > 1
    params = presets.random_params(models.target_shapes(cfg), jax.random.key(9), dtype=jnp.float32,
                                   quantize={"bits": 4, "group_size": 32})
    xla = models.make_target(cfg, params, DispatchConfig(backend="xla"))
    kern = xla.replace(matmul=DispatchConfig(backend="pallas", interpret=True, attention="pallas"))
    ids = jnp.asarray(np.random.default_rng(9).integers(0, 256, (2, 12)), jnp.int32)
    fwd = jax.jit(models.forward)
    outs = []
    for t in (xla, kern):
        cache = models.init_cache(cfg, 2, 32, jnp.float32)
        lp, _, cache = fwd(t, ids[:, :8], cache)
        ld, _, cache = fwd(t, ids[:, 8:9], cache)
        lv, _, after = fwd(t, ids[:, 9:12], cache)
        outs.append((lp, ld, lv, cache, after))
    for a, b in zip(outs[0][:3], outs[1][:3]):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-4, atol=1e-4)
    for a, b in zip(outs[0][4].k + outs[0][4].v, outs[1][4].k + outs[1][4].v):  # the 12 committed columns
        np.testing.assert_allclose(np.asarray(b)[..., :12, :, :], np.asarray(a)[..., :12, :, :], rtol=1e-4, atol=1e-4)
    cache, steps = outs[1][3], []
    for j in range(9, 12):
        lg, _, cache = fwd(kern, ids[:, j:j + 1], cache)
        steps.append(lg)
    np.testing.assert_array_equal(np.asarray(outs[1][2]), np.asarray(jnp.concatenate(steps, 1)))
