"""Target training-step time per config (random tokens), one process = one XLA_FLAGS setting."""
import dataclasses, json, sys, time
import jax, jax.numpy as jnp
from jaxspec.default_pair import train as T
import models

out = sys.argv[1]
configs = json.loads(sys.argv[2])
res = []
for c in configs:
    s = dataclasses.replace(T.FULL_SIZES, **{k: v for k, v in c.items() if k != "name"})
    tcfg = T.target_config(s)
    shapes = models.target_shapes(tcfg)
    n = sum(int(jnp.prod(jnp.array(v[0]))) for v in shapes.values())
    params = T.init_params(shapes, jax.random.key(0), tcfg.num_hidden_layers)
    tx = T.make_tx(0.1, params)
    opt = tx.init(params)
    data = jax.random.randint(jax.random.key(1), (4_000_000,), 3, s.vocab, jnp.int32)

    def loss_fn(p, tokens):
        logits, _, _ = T.target_logits(tcfg, p, tokens[:, :-1], jnp.bfloat16)
        return jnp.mean(T.token_nll(logits, tokens[:, 1:]))

    @jax.jit
    def step(p, o, data, i):
        tokens = T.sample_windows(data, jax.random.fold_in(jax.random.key(2), i), s.batch, s.seq + 1)
        loss, g = jax.value_and_grad(loss_fn)(p, tokens)
        u, o = tx.update(g, o, p)
        return jax.tree.map(lambda w, x: w - 1e-3 * x, p, u), o, loss

    t = time.time()
    params, opt, l = step(params, opt, data, 0); float(l)
    comp = time.time() - t
    for i in range(3):
        params, opt, l = step(params, opt, data, i + 1)
    float(l)
    t = time.time(); m = 15
    for i in range(m):
        params, opt, l = step(params, opt, data, i + 10)
    float(l)
    ms = (time.time() - t) / m * 1e3
    r = dict(c, params_m=round(n / 1e6, 2), ms=round(ms, 2), tok_s=round(s.batch * s.seq / ms * 1e3),
             tflops=round(6 * n * s.batch * s.seq / ms / 1e9, 1), compile_s=round(comp, 1))
    print(json.dumps(r), flush=True)
    res.append(r)
    with open(out, "a") as f:
        f.write(json.dumps(r) + "\n")
