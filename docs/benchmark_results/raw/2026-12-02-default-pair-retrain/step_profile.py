"""Where a default-pair training step's time goes on the GPU: time + profile target and assistant steps.
usage: step_profile.py OUT_JSONL NAME '{"batch":128,"onehot":false,"what":"target"}'"""
import dataclasses, json, os, sys, time, statistics
sys.path.insert(0, os.path.join(os.getcwd(), "benchmarks"))  # run from the repo root
import jax, jax.numpy as jnp
from jaxspec.default_pair import train as T
import models
import profile_forward as PF

out, name, cfg = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
what = cfg.get("what", "target")
s = dataclasses.replace(T.PRESETS[cfg.get("preset", "full")], batch=cfg.get("batch", 128), a_batch=cfg.get("a_batch", 64))
if cfg.get("onehot"):
    def nll(logits, labels):
        lp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
        return -jnp.sum(lp * jax.nn.one_hot(labels, lp.shape[-1], dtype=lp.dtype), axis=-1)
    T.token_nll = nll
tcfg, acfg = T.target_config(s), T.assistant_config(s)
tshapes = models.target_shapes(tcfg)
data = jax.random.randint(jax.random.key(1), (4_000_000,), 3, s.vocab, jnp.int32)
tp = T.init_params(tshapes, jax.random.key(0), tcfg.num_hidden_layers)
cdt = jnp.bfloat16
if what == "target":
    tx = T.make_tx(0.1, tp); opt = tx.init(tp)
    def loss_fn(p, tokens):
        logits, _, _ = T.target_logits(tcfg, p, tokens[:, :-1], cdt)
        return jnp.mean(T.token_nll(logits, tokens[:, 1:]))
    @jax.jit
    def step(p, o, data, i):
        tokens = T.sample_windows(data, jax.random.fold_in(jax.random.key(2), i), s.batch, s.seq + 1)
        loss, g = jax.value_and_grad(loss_fn)(p, tokens)
        u, o = tx.update(g, o, p)
        return jax.tree.map(lambda w, x: w - 1e-3 * x, p, u), o, loss
    st = [tp, opt]
    def call(i):
        st[0], st[1], l = step(st[0], st[1], data, i); return l
    tokens_per_step = s.batch * s.seq
else:
    ashapes = models.assistant_shapes(acfg) if hasattr(models, "assistant_shapes") else None
    ap = T.init_params(ashapes, jax.random.key(3), acfg.text.num_hidden_layers)
    teacher = T.to_dtype(tp, cdt)
    atx = T.make_tx(0.1, ap); aopt = atx.init(ap)
    J = s.draft_steps
    def a_loss(p, tpp, tokens):
        tlog, hidden, cache = T.target_logits(tcfg, tpp, tokens, cdt)
        tlog, hidden, cache = jax.lax.stop_gradient((tlog, hidden, cache))
        outs = T.unrolled_drafts(acfg, tcfg, T.to_dtype(p, cdt), tpp, tokens, hidden, cache, J)
        q = tokens.shape[1] - J
        losses = []
        for j, lg in enumerate(outs):
            pt = jax.nn.softmax(tlog[:, 1 + j:1 + j + q], axis=-1)
            losses.append(-jnp.mean(jnp.sum(pt * jax.nn.log_softmax(lg, axis=-1), axis=-1)))
        return sum(losses) / J
    @jax.jit
    def step(p, o, tpp, data, i):
        tokens = T.sample_windows(data, jax.random.fold_in(jax.random.key(2), i), s.a_batch, s.seq)
        loss, g = jax.value_and_grad(a_loss)(p, tpp, tokens)
        u, o = atx.update(g, o, p)
        return jax.tree.map(lambda w, x: w - 1e-3 * x, p, u), o, loss
    st = [ap, aopt]
    def call(i):
        st[0], st[1], l = step(st[0], st[1], teacher, data, i); return l
    tokens_per_step = s.a_batch * s.seq
t = time.time(); float(call(0)); comp = time.time() - t
for i in range(3):
    call(i + 1)
float(call(4))
times = []
for r in range(5):
    t = time.time()
    for i in range(4):
        l = call(10 + 4 * r + i)
    float(l)
    times.append((time.time() - t) / 4 * 1e3)
ms = statistics.median(times)
logd = f"/tmp/trace-{name}"
PF.no_command_buffers() if hasattr(PF, "no_command_buffers") else None
with jax.profiler.trace(logd, create_perfetto_trace=True):
    for i in range(3):
        l = call(100 + i)
    float(l)
ev, src = PF.kernel_events(PF.read_trace(logd))
summ = PF.summarize(ev, 3)
top = sorted(summ["by_name"].items(), key=lambda kv: -kv[1]["us"])[:40]
r = dict(name=name, cfg=cfg, ms=round(ms, 2), times=[round(x, 1) for x in times], compile_s=round(comp, 1),
         tok_s=round(tokens_per_step / ms * 1e3), busy_ms=round(summ["busy_us"] / 1e3, 2),
         by_kind={k: round(v["us"] / 1e3, 2) for k, v in summ["by_kind"].items()},
         top=[(k[:120], round(v["us"] / 1e3, 3), v["count"]) for k, v in top], xla_flags=os.environ.get("XLA_FLAGS"))
print(json.dumps({k: r[k] for k in ("name", "ms", "busy_ms", "compile_s", "tok_s")}), flush=True)
with open(out, "a") as f:
    f.write(json.dumps(r) + "\n")
