"""Training pieces shared by the drafter recipes: the default pair's (`jaxspec.train.default_pair`)
and the general one for any supported target (`jaxspec.train.assistant`).

* logging with a run clock (`log`, `reset_clock`) and `Metrics` (a JSON file rewritten on every set);
* the models code batched over every position of a window, as training differentiates it:
  `target_logits` (the teacher's forward), `assistant_hidden` / `assistant_forward` (the layers
  `models.draft_step` runs, for many queries at once), `unrolled_hidden` / `unrolled_drafts` (K - 1
  draft steps teacher-forced and unrolled, the assistant carrying its own h_next), and `self_check`
  (the batched forward against `models.draft_step` chained as the loop runs it);
* initialisation, AdamW (`make_tx`), the warm-up + cosine schedule (`lr_at`) and the time-budgeted
  step loop (`run_phase`).

Everything here runs the XLA paths (`TRAIN_MATMUL`): training differentiates it, and the Pallas
attention kernels have no JVP. Importing this module computes nothing.
"""
from __future__ import annotations

import json
import math
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxspec import models
from jaxspec.kernels import DispatchConfig
from jaxspec.engine.loop import DRAFT_POSITION_OFFSET
from jaxspec.models.layers import linear
from jaxspec.models.params import LINEAR
from jaxspec.progress import bar

TRAIN_MATMUL = DispatchConfig(backend="xla", dense=False)  # training reads the quantized weights, never CPU-dense ones
_CLOCK = {"start": time.time()}


def reset_clock() -> float:
    """Restart the clock `log` prints (a recipe's main() calls it first); returns the new start."""
    _CLOCK["start"] = time.time()
    return _CLOCK["start"]


def log(msg: str) -> None:
    print(f"[{time.time() - _CLOCK['start']:7.1f}s] {msg}", flush=True)


class Metrics:
    def __init__(self, path: str, keep: bool = False):
        self.path, self.d = path, {}
        if keep and os.path.isfile(path):
            with open(path) as f:
                self.d = json.load(f)

    def set(self, key, value):
        self.d[key] = value
        self.write()

    def write(self):
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.d, f, indent=1, sort_keys=False, default=_json_default)
        os.replace(tmp, self.path)


def _json_default(o):
    if isinstance(o, np.generic):
        return o.item()
    if isinstance(o, np.ndarray):
        return o.tolist()
    return str(o)


def to_dtype(tree, dtype):
    return jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)


def init_params(shapes: dict, key, n_layers: int) -> dict:
    """Float32 params for `shapes` (models.target_shapes / assistant_shapes): linear ~ N(0, 1/K) and the
    embedding ~ N(0, 0.02^2) (with a tied head a larger table makes the current token's own logit huge);
    norms 1, except q/k norms = head_dim^-1/4 (attention has scale 1.0: unit-variance logits at init) and
    the post-attention / post-FFN norms = (2 L)^-1/2 (each block starts as a small residual update)."""
    params = {}
    for j, name in enumerate(sorted(shapes)):
        shape, kind = shapes[name]
        leaf = name.split(".")[-1]
        if kind == LINEAR:
            std = 0.02 if name == "embed_tokens" else 1.0 / math.sqrt(shape[1])
            params[name] = std * jax.random.normal(jax.random.fold_in(key, j), shape, jnp.float32)
        elif leaf in ("q_norm", "k_norm"):
            params[name] = jnp.full(shape, shape[0] ** -0.25, jnp.float32)
        elif leaf in ("post_attention_layernorm", "post_feedforward_layernorm"):
            params[name] = jnp.full(shape, (2 * n_layers) ** -0.5, jnp.float32)
        else:
            params[name] = jnp.ones(shape, jnp.float32)
    return params


def make_tx(weight_decay: float, params: dict):
    """AdamW's update direction (b2 0.95, global-norm clip 1, decay on 2-D weights only); the learning
    rate is applied by the step, so the schedule can be calibrated after the step count is known."""
    mask = jax.tree.map(lambda p: p.ndim == 2, params)
    return optax.chain(optax.clip_by_global_norm(1.0), optax.scale_by_adam(b1=0.9, b2=0.95, eps=1e-8),
                       optax.add_decayed_weights(weight_decay, mask))


def lr_at(step: int, total: int, peak: float, warmup: int, final_frac: float = 0.1) -> float:
    """Linear warmup over `warmup` steps, then cosine to final_frac * peak at `total` (warmup values do
    not depend on `total`, so steps taken before the step count is calibrated are reproducible)."""
    if step < warmup:
        return peak * (step + 1) / warmup
    frac = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (final_frac + (1 - final_frac) * 0.5 * (1 + math.cos(math.pi * frac)))


def sample_windows(data, key, n: int, length: int):
    starts = jax.random.randint(key, (n,), 0, data.shape[0] - length + 1)
    return jax.vmap(lambda s: jax.lax.dynamic_slice(data, (s,), (length,)))(starts)


def token_nll(logits, labels):
    lp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return -jnp.take_along_axis(lp, labels[..., None], axis=-1)[..., 0]


def target_logits(tcfg, params, tokens, dtype):
    """Cache-free causal scoring through models.forward -> (logits, post-norm hidden, cache)."""
    t = models.Target(config=tcfg, params=to_dtype(params, dtype), matmul=TRAIN_MATMUL)
    # ring=False: the teacher-forced assistant reads every position's window, not only the last ones
    cache = models.init_cache(tcfg, tokens.shape[0], tokens.shape[1], dtype, ring=False)
    return models.forward(t, tokens, cache)


def assistant_hidden(acfg, tcfg, ap: dict, teacher_params: dict, tok, h_prev, kv: dict, lengths, position):
    """`models.draft_step`'s layers for many queries at once: tok [B, Q] (embedded with the target's
    table), h_prev [B, Q, H_target], kv `models.shared_kv` of the target's cache, lengths [B, Q] (the
    committed cache length each query sees, models.visible_keys), position [B, Q] (RoPE).
    Returns (hn [B, Q, H_assistant] the final-normed hidden the head reads, h_next [B, Q, H_target])."""
    assistant = models.Assistant(config=acfg, params=ap, matmul=TRAIN_MATMUL)
    teacher = models.Target(config=tcfg, params=teacher_params, matmul=TRAIN_MATMUL)
    hn = models.assistant_stack(assistant, teacher, tok, h_prev, kv, lengths, position)
    return hn, linear(hn, ap["post_projection"], assistant.matmul)


def head_logits(acfg, ap: dict, hn):
    """Every token's logit from `hn` through the assistant's plain head (its tied table or lm_head):
    what draft_step computes without ordered embeddings, and, with them, the exact logits of the
    tokens its centroids select (float32 [..., V])."""
    head = ap["embed_tokens"] if acfg.tie_word_embeddings else ap["lm_head"]
    return linear(hn, head, TRAIN_MATMUL).astype(jnp.float32)


def assistant_forward(acfg, tcfg, ap: dict, teacher_params: dict, tok, h_prev, kv: dict, lengths, position):
    """assistant_hidden, then the plain head: (logits f32 [B, Q, V], h_next [B, Q, H_target]);
    self_check compares it with models.draft_step before training."""
    hn, h_next = assistant_hidden(acfg, tcfg, ap, teacher_params, tok, h_prev, kv, lengths, position)
    return head_logits(acfg, ap, hn), h_next


def unrolled_hidden(acfg, tcfg, ap, teacher_params, tokens, hidden, cache, steps: int):
    """Teacher-forced, unrolled draft steps over every position t of `tokens` [B, S] whose labels exist:
    queries t = 0..S-1-steps see keys < t+1; step j reads token t+1+j and (j = 0) the target hidden at t
    or (j > 0) its own previous h_next, and predicts what the target predicts at t+1+j.
    Returns one final-normed hidden [B, S - steps, H_assistant] per step (the head's input)."""
    b, s = tokens.shape
    q = s - steps
    lengths = jnp.broadcast_to(jnp.arange(1, q + 1, dtype=jnp.int32)[None], (b, q))
    position = lengths + DRAFT_POSITION_OFFSET  # the loop's query position for a cache of `lengths`
    kv = models.shared_kv(tcfg, cache)
    h = hidden[:, :q]
    outs = []
    for j in range(steps):
        hn, h_next = assistant_hidden(acfg, tcfg, ap, teacher_params, tokens[:, 1 + j:1 + j + q], h, kv,
                                      lengths, position)
        outs.append(hn)
        h = h_next.astype(hidden.dtype)  # the loop carries h_next in the target hidden's dtype
    return outs


def unrolled_drafts(acfg, tcfg, ap, teacher_params, tokens, hidden, cache, steps: int):
    """unrolled_hidden through the plain head: one logits array [B, S - steps, V] per step."""
    return [head_logits(acfg, ap, hn) for hn in unrolled_hidden(acfg, tcfg, ap, teacher_params, tokens, hidden,
                                                                 cache, steps)]


def self_check(acfg, tcfg, ap32, teacher32, seq_tokens, steps: int) -> float:
    """Max |logit diff| between assistant_forward (batched, as trained) and models.draft_step (as the
    loop runs it) over `steps` chained draft steps at a few positions, float32. With ordered
    embeddings draft_step scores only the tokens of its top clusters (the rest hold a filler below
    them): those are compared."""
    tokens = jnp.asarray(seq_tokens, jnp.int32)[None]
    s = tokens.shape[1]
    _, hidden, cache = jax.jit(lambda p, x: target_logits(tcfg, p, x, jnp.float32))(teacher32, tokens)
    outs = jax.jit(lambda ap, tp, x, h, c: unrolled_drafts(acfg, tcfg, ap, tp, x, h, c, steps))(
        ap32, teacher32, tokens, hidden, cache)
    target = models.Target(config=tcfg, params=teacher32, matmul=TRAIN_MATMUL)
    assistant = models.Assistant(config=acfg, params=ap32, matmul=TRAIN_MATMUL)
    draft = jax.jit(models.draft_step)
    q = s - steps
    worst = 0.0
    for t in sorted({0, q // 2, q - 1}):
        c = cache.replace(lengths=jnp.asarray([t + 1], jnp.int32))
        pos = jnp.asarray([t + 1 + DRAFT_POSITION_OFFSET], jnp.int32)
        h = hidden[:, t]
        for j in range(steps):
            lg, h = draft(assistant, target, c, tokens[:, t + 1 + j], h, pos)
            scored = lg[0] > jnp.min(lg[0]) if acfg.use_ordered_embeddings else jnp.ones(lg.shape[1], bool)
            diff = jnp.where(scored, jnp.abs(lg[0] - outs[j][0, t]), 0.0)
            worst = max(worst, float(jnp.max(diff)))
    return worst


# ------------------------------------------------------------------------------------------------
# Time-budgeted training loop


def run_phase(name, step_call, *, budget_s, end_by, max_steps, fixed_steps, peak, warmup, calib=10, log_every=25,
              on_eval=None, n_evals=0, progress: bool | None = False):
    """step_call(step, lr) -> (loss, aux) device values. Step 0 compiles. The step count is then
    `fixed_steps`, else calibrated after `calib` timed steps to fit min(budget_s, end_by - now) seconds
    of training, capped by max_steps. The loop also stops by wall clock (checked every step, blocking
    every log_every steps). `progress`: a bar over the steps on stderr with the last loss read
    (jaxspec.progress.bar's `enabled`: None when stderr is a terminal; off by default, the script
    asks for it). Returns a summary."""
    tc = time.time()
    loss, aux = step_call(0, lr_at(0, 1, peak, warmup))
    loss = float(loss)
    t0 = time.time()
    compile_s = t0 - tc
    budget_s = min(budget_s, end_by - t0)
    log(f"{name}: step 0 (compile + run) {compile_s:.1f}s, loss {loss:.4f}; training budget {budget_s:.0f}s")
    if budget_s < 5 and fixed_steps is None:
        raise RuntimeError(f"{name}: no time left to train ({budget_s:.0f}s): raise --deadline or lower budgets")
    done = 1
    history = [(0, loss)]
    if fixed_steps is not None:
        total = max(1, int(fixed_steps))
        step_s = None
    else:
        n = max(0, min(calib, max_steps - 1, warmup - 1))
        t1 = time.time()
        for s in range(done, done + n):
            loss, aux = step_call(s, lr_at(s, 1, peak, warmup))
        loss = float(loss)
        done += n
        step_s = (time.time() - t1) / max(1, n)
        left = budget_s - (time.time() - t0)
        total = int(min(max_steps, done + max(0, left) * 0.97 / max(step_s, 1e-6)))
        total = max(total, done)
        log(f"{name}: {step_s * 1e3:.1f} ms/step -> {total} steps (budget {budget_s:.0f}s, cap {max_steps})")
    eval_at = set()
    if on_eval and n_evals:
        eval_at = {max(1, round(total * (i + 1) / n_evals)) for i in range(n_evals)}
    evals = []
    cut = False
    last_log = time.time()
    eval_s = 0.0  # time spent in on_eval does not count against the training budget
    # The loss shown is the one the loop reads anyway (every log_every steps): no extra device sync.
    with bar(total=total, initial=done, desc=name, unit="step", enabled=progress) as b:
        while done < total:
            if time.time() - t0 - eval_s > budget_s + 5.0:
                cut = True
                with b.external_write_mode():  # the log lines (stdout) print between bar redraws
                    log(f"{name}: wall budget reached at step {done}/{total}: stopping")
                break
            loss, aux = step_call(done, lr_at(done, total, peak, warmup))
            done += 1
            b.update(1)
            if done % log_every == 0 or done == total or done in eval_at:
                lv = float(loss)
                history.append((done, lv))
                b.set_postfix_str(f"loss {lv:.4f}")
                if time.time() - last_log > 5 or done == total:
                    extra = "" if aux is None else " " + " ".join(f"{x:.3f}" for x in jax_list(aux))
                    with b.external_write_mode():
                        log(f"{name}: step {done}/{total} loss {lv:.4f}{extra} "
                            f"lr {lr_at(done - 1, total, peak, warmup):.2e}")
                    last_log = time.time()
            if done in eval_at:
                te = time.time()
                with b.external_write_mode():
                    evals.append((done, on_eval(done)))
                eval_s += time.time() - te
    if on_eval and (not evals or evals[-1][0] != done):
        evals.append((done, on_eval(done)))
    final = float(loss)
    wall = time.time() - t0
    log(f"{name}: {done} steps in {wall:.1f}s, final loss {final:.4f}")
    return dict(steps=done, planned_steps=total, cut_by_wall_clock=cut, compile_s=round(compile_s, 2),
                train_budget_s=round(budget_s, 1),
                step_ms=None if step_s is None else round(step_s * 1e3, 2), wall_s=round(wall, 1),
                final_loss=final, loss_history=history, evals=evals, final_aux=None if aux is None else jax_list(aux))


def jax_list(x):
    return [float(v) for v in np.asarray(x).reshape(-1)]
