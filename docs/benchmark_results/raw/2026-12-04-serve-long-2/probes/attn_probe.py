"""Issue 56 probe (H200): flash_attention of a prefill chunk late in a long cache, by k_split.

Global layer (16 q heads, 1 kv head, D 512, d_split 2) and sliding layer (16/8, D 256, window 1024,
keys = ring 1041 ++ chunk), T queries at positions ctx..ctx+T. 8 layers' K/V (distinct buffers, as
the model reads them), times per layer: median of 15 after 3 warm-ups.
"""
import json
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.kernels.flash_attention import EMPTY, flash_attention, key_split

OUT = os.environ.get("OUT", "/tmp/out")
rows = []


def bench(f, *a, reps=15):
    for _ in range(3):
        jax.block_until_ready(f(*a))
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(f(*a))
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def case(kind, t, ctx, splits):
    if kind == "global":
        hq, hkv, d, window, c = 16, 1, 512, None, 16480
        kpos = np.arange(c, dtype=np.int32)
        kpos[ctx + t:] = EMPTY
    else:
        hq, hkv, d, window, ring = 16, 8, 256, 1024, 1041
        c = ring + t
        old = np.arange(ctx - ring, ctx, dtype=np.int32)
        old[old < 0] = EMPTY
        kpos = np.concatenate([old, np.arange(ctx, ctx + t, dtype=np.int32)])
    keys = jax.random.split(jax.random.key(t + ctx), 3)
    q = jax.random.normal(keys[0], (1, t, hq, d), jnp.bfloat16)
    ks = jax.random.normal(keys[1], (8, 1, c, hkv, d), jnp.bfloat16)
    vs = jax.random.normal(keys[2], (8, 1, c, hkv, d), jnp.bfloat16)
    qp = jnp.arange(ctx, ctx + t, dtype=jnp.int32)[None]
    kp = jnp.asarray(kpos)[None]
    ref = None
    for s in splits:
        f = jax.jit(lambda q, ks, vs, qp, kp, s=s: [flash_attention(q, ks, vs, qp, kp, window, layer=i, k_split=s)
                                                   for i in range(8)])
        try:
            out = f(q, ks, vs, qp, kp)
            err = 0.0 if ref is None else float(jnp.max(jnp.abs(out[3].astype(jnp.float32) - ref)))
            if ref is None:
                ref = out[3].astype(jnp.float32)
            ms = bench(f, q, ks, vs, qp, kp) * 1e3 / 8
        except Exception as e:  # noqa: BLE001
            ms, err = float("nan"), repr(e)[:200]
        flops = 4 * t * min(ctx + t, c if window is None else window + t) * hq * d
        row = dict(kind=kind, t=t, ctx=ctx, k_split=s, default=key_split(hq * (2 if d == 512 else 1) * -(-t // 128), -(-c // 64)),
                   ms_per_layer=ms, tflops=flops / ms / 1e9 if ms == ms else None, max_diff_vs_first=err)
        rows.append(row)
        print(json.dumps(row), flush=True)


for t in (128, 256, 512):
    for ctx in (1024, 8192, 16000 - 512):
        case("global", t, ctx, (1, 2, 4, 8, 16))
for t in (128, 512):
    case("sliding", t, 8192, (1, 2, 4))
json.dump(rows, open(os.path.join(OUT, "attn_probe.json"), "w"), indent=1)
