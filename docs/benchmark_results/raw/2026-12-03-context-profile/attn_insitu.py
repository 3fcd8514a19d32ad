"""Why is decode_attention d512 at 131K 341 us per call inside the 12B forward but 125 us alone?
Variants: plain arrays; a stacked [8, B, C, 1, D] cache read with layer=i; k_pos all visible vs the
forward's (EMPTY past the length)."""
import json, os, sys, time
import jax, jax.numpy as jnp, numpy as np
sys.path.insert(0, os.getcwd()); sys.path.insert(0, os.path.join(os.getcwd(), "benchmarks"))
from harness import median_time
from pallas_kernels.decode_attention import decode_attention
EMPTY = int(np.iinfo(np.int32).max)
ctx = 131072; C = ctx + 256; D = 512; L = 8
key = jax.random.key(0)
k1, k2, k3 = jax.random.split(key, 3)
q = jax.random.normal(k1, (1, 1, 16, D), jnp.float32).astype(jnp.bfloat16)
ks = jax.random.normal(k2, (L, 1, C, 1, D), jnp.float32).astype(jnp.bfloat16)
vs = jax.random.normal(k3, (L, 1, C, 1, D), jnp.float32).astype(jnp.bfloat16)
qp = jnp.asarray([[ctx]], jnp.int32)
kp_all = jnp.arange(C, dtype=jnp.int32)[None]
kp_len = jnp.where(kp_all < ctx, kp_all, EMPTY)
out = []
def rec(name, s):
    r = dict(variant=name, us=s * 1e6, tbs=2 * ctx * D * 2 / s / 1e12); print(json.dumps(r), flush=True); out.append(r)
# 1. plain arrays, one layer per call, 8 calls over 8 different layers' copies in one jit
plain = [(ks[i], vs[i]) for i in range(L)]
f1 = jax.jit(lambda q, kv, kp: [decode_attention(q, k, v, qp, kp) for k, v in kv])
rec("plain x8, k_pos visible", median_time(f1, q, plain, kp_all, warmup=2, repeats=15) / L)
rec("plain x8, k_pos EMPTY past length", median_time(f1, q, plain, kp_len, warmup=2, repeats=15) / L)
# 2. stacked, layer index static per call
f2 = jax.jit(lambda q, ks, vs, kp: [decode_attention(q, ks, vs, qp, kp, layer=jnp.int32(i)) for i in range(L)])
rec("stacked layer=i x8", median_time(f2, q, ks, vs, kp_len, warmup=2, repeats=15) / L)
# 3. stacked, chained through q and inside a fori_loop over layers (the scan's pattern)
def chain(q, ks, vs, kp):
    def body(i, qq):
        o = decode_attention(qq, ks, vs, qp, kp, layer=i)
        return (o * 0.5 + qq).astype(qq.dtype)
    return jax.lax.fori_loop(0, L, body, q)
f3 = jax.jit(chain)
rec("stacked, fori_loop over layers, chained", median_time(f3, q, ks, vs, kp_len, warmup=2, repeats=15) / L)
# 4. the same with the cache carried and written each step (as the forward's scan does)
def chain_w(q, ks, vs, kp):
    def body(i, carry):
        qq, ks, vs = carry
        row = qq[:, :, :1, :].astype(ks.dtype).reshape(1, 1, 1, D)
        ks = jax.lax.dynamic_update_slice(ks, row[None], (i, 0, ctx, 0, 0))
        vs = jax.lax.dynamic_update_slice(vs, row[None], (i, 0, ctx, 0, 0))
        o = decode_attention(qq, ks, vs, qp, kp, layer=i)
        return (o * 0.5 + qq).astype(qq.dtype), ks, vs
    return jax.lax.fori_loop(0, L, body, (q, ks, vs))
f4 = jax.jit(chain_w, donate_argnums=(1, 2))
def run4(q, kp):
    global ks, vs
    r = f4(q, ks, vs, kp); ks, vs = r[1], r[2]; return r[0]
rec("stacked, fori_loop, cache carried + written (donated)", median_time(run4, q, kp_len, warmup=2, repeats=15) / L)
f5 = jax.jit(chain_w)
rec("stacked, fori_loop, cache carried + written (not donated)", median_time(f5, q, ks, vs, kp_len, warmup=2, repeats=15) / L)
with open(os.path.join(os.environ["OUT"], "attn_insitu.jsonl"), "w") as f:
    for r in out: f.write(json.dumps(r) + "\n")
