"""Train the MTP drafter by training-time test on on-policy data, measured in the loop as it trains.

    python -m jaxspec.train.onpolicy_data --target T --work DATA        # first: the data
    python -m jaxspec.train.ttt --target T --data DATA --out DIR [--draft-vocab 32768] [--unroll 3]

The drafter (one Q-only layer of the target's width over its K/V, `assistant.assistant_config`,
no ordered-embeddings head) is unrolled on its own drafts through the loop's own draft chain with a
KL to the target's top-k distribution at each drafted position (`jaxspec.train.ttt_loss`),
--unroll draft steps deep (K - 1 = 3 at K = 4). --draft-vocab N (> 0) trims its head to the N tokens
the target wrote most often in the data's training continuations (`counts`): a token outside them is
never drafted, the verify still decides; the coverage of the held-out continuations is measured.

Every --eval-every steps the drafter as it stands drafts for --eval-prompts held-out prompts through
the real speculative loop (greedy, K = 4, against classic decoding: identical output and K asserted)
and the best tokens/round so far is kept. The best is saved (--bits linear weights; no embedding
table, no head rows: the ids only, the rows come from the target's table at load) to --out, reloaded,
and measured on every held-out prompt; results.json holds the command, the data, the steps, the wall
time, tokens/round, per-position acceptance, coverage, step costs and file sizes.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec import models
from jaxspec.kernels import DispatchConfig, QuantizedWeight, dequantize
from jaxspec.models.dense import prepared
from jaxspec.train import assistant as ta
from jaxspec.train import assistant_inputs as inputs
from jaxspec.train import shared
from jaxspec.train.shared import init_params, log, lr_at, make_tx
from jaxspec.train.ttt_loss import head_index, make_loss

PROG = "python -m jaxspec.train.ttt"
EVAL_K = 4
MAX_DRAFTER_MIB = 12.0


def trimmed_vocab(counts: np.ndarray, n: int, always=()) -> np.ndarray:
    """The n most frequent tokens (ties by id), `always` (BOS, EOS) first."""
    always = [int(a) for a in always if 0 <= int(a) < len(counts)][:n]
    order = np.argsort(-counts, kind="stable")
    rest = order[~np.isin(order, always)][:n - len(always)]
    return np.concatenate([np.asarray(always, np.int64), rest]).astype(np.int32)


def coverage(ids: np.ndarray, rows: np.ndarray, prompt_len: int) -> float:
    """Share of the continuation tokens of `rows` that lie in `ids`."""
    return float(np.isin(rows[:, prompt_len:], ids).mean())


def loop_eval(target, assistant, prompts, new_tokens: int, end_by: float | None = None) -> dict:
    """Greedy speculative decoding at K = EVAL_K against classic on each prompt; raises if an output
    differs or a prompt ran at another K (the exactness probe fell back): tokens/round, per position."""
    st = ta.acceptance_stats(target, assistant, prompts, new_tokens, block_size=EVAL_K, eos=[], end_by=end_by)
    if not st["all_identical"]:
        raise AssertionError(f"speculative output differs from classic: {st['identical']}")
    modes = {p["mode"] for p in st["per_prompt"]}
    if modes - {"speculative"}:
        raise AssertionError(f"a held-out prompt did not run speculatively at K = {EVAL_K}: modes {modes}")
    return st


def build_parser():
    p = inputs.Parser(prog=PROG, description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", required=True)
    p.add_argument("--target-name", default=None)
    p.add_argument("--data", required=True, help="what python -m jaxspec.train.onpolicy_data wrote (--work)")
    p.add_argument("--out", required=True)
    p.add_argument("--draft-vocab", type=int, default=32768, help="trimmed head size (0: the whole vocabulary)")
    p.add_argument("--unroll", type=int, default=3, help="draft steps unrolled in training (K - 1)")
    p.add_argument("--ce-weight", type=float, default=0.0, help="plus cross-entropy on the row's own token")
    p.add_argument("--layers", type=int, default=1)
    p.add_argument("--ffn", type=int, default=4096)
    p.add_argument("--batch", type=int, default=None, help="rows per step (GPU 32, CPU 4)")
    p.add_argument("--steps", type=int, default=None, help="default: as many as --minutes allows")
    p.add_argument("--max-steps", type=int, default=50000)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--eval-every", type=int, default=500)
    p.add_argument("--eval-prompts", type=int, default=8, help="held-out prompts per in-training evaluation")
    p.add_argument("--eval-new-tokens", type=int, default=64)
    p.add_argument("--minutes", type=float, default=9.5, help="the whole call")
    p.add_argument("--eval-reserve", type=float, default=None,
                   help="seconds kept for the end: save, step costs, final evaluation (default: measured)")
    p.add_argument("--bits", type=int, default=8, choices=(0, 4, 8))
    p.add_argument("--seed", type=int, default=0)
    return p


def main(argv=None) -> int:
    return inputs.cli(PROG, _run, argv)


def _check(args, on_gpu: bool):
    for k, v in dict(batch=32 if on_gpu else 4).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    for flag in ("unroll", "layers", "ffn", "batch", "eval_every", "eval_prompts", "eval_new_tokens", "warmup"):
        if getattr(args, flag) < 1:
            raise inputs.UsageError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if args.draft_vocab < 0 or (args.steps is not None and args.steps < 1):
        raise inputs.UsageError("--draft-vocab must be >= 0 and --steps >= 1")
    if not (math.isfinite(args.lr) and args.lr > 0 and args.minutes > 0 and args.ce_weight >= 0):
        raise inputs.UsageError("--lr and --minutes must be > 0, --ce-weight >= 0")
    path = os.path.join(args.data, "data.npz")
    if not os.path.isfile(path):
        raise inputs.UsageError(f"--data {args.data!r} holds no data.npz: run python -m jaxspec.train.onpolicy_data "
                                f"--work {args.data} first")
    try:
        z = np.load(path)
        data = {k: z[k] for k in ("rows", "top_ids", "top_lp", "heldout_rows", "counts")}
        # each held-out prompt's length (a short one is right-padded to the prompt width); data
        # written before the lengths were kept hold full-width prompts only
        data["heldout_lengths"] = (z["heldout_lengths"] if "heldout_lengths" in z.files else
                                   np.full(len(data["heldout_rows"]), data["heldout_rows"].shape[1], np.int32))
        with open(os.path.join(args.data, "info.json")) as f:
            info = json.load(f)
    except Exception as e:
        raise inputs.damaged(path, e) from None
    p = info["prompt_tokens"]
    if data["rows"].shape[1] - p <= args.unroll or data["top_ids"].shape[1] != data["rows"].shape[1] - p:
        raise inputs.UsageError(f"the data's rows ({data['rows'].shape}) do not fit --unroll {args.unroll}")
    if len(data["rows"]) < 2 * args.batch:
        raise inputs.UsageError(f"{len(data['rows'])} rows are too few for --batch {args.batch}")
    if args.draft_vocab > len(data["counts"]):
        raise inputs.UsageError(f"--draft-vocab {args.draft_vocab} > the vocabulary ({len(data['counts'])})")
    inputs.check_out(args.out)
    return data, info


def _run(argv) -> int:
    start = shared.reset_clock()
    args = build_parser().parse_args(argv)
    on_gpu = jax.default_backend() == "gpu"
    data, info = _check(args, on_gpu)
    end = start + 60.0 * args.minutes
    os.makedirs(args.out, exist_ok=True)
    dtype = jnp.bfloat16 if on_gpu else jnp.float32
    name = ta.target_name_of(args.target, args.target_name)
    target = models.load_target(args.target, dtype=dtype, matmul=DispatchConfig.from_env(backend="auto", dense=False))
    tcfg = target.config
    # training reads the quantized weights; the loop runs on what inference loads: on a CPU the weights
    # made dense once (`models.dense.prepared`), else every decode step dequantized all of them (a
    # 1.3 s target step against ~0.25 s, measured on the 270M) and the evaluations, the step costs
    # and the speedup in results.json were those of a target nobody runs. A GPU keeps the one target.
    run_target = target if on_gpu else prepared(target.replace(matmul=DispatchConfig.from_env(backend="auto")))
    P = info["prompt_tokens"]
    rows, top_ids, top_lp = data["rows"], data["top_ids"], data["top_lp"]
    seq = rows.shape[1]
    held_prompts = [list(map(int, r[:min(P, n)])) for r, n in zip(data["heldout_rows"], data["heldout_lengths"])]
    log(f"ttt: target {name} ({tcfg.num_hidden_layers} layers, vocab {tcfg.vocab_size}); {len(rows)} rows of {seq}, "
        f"{len(held_prompts)} held-out prompts, {jax.devices()[0]}")

    # ---- the drafter and its head ------------------------------------------------------------------
    acfg = ta.assistant_config(tcfg, args.layers, args.ffn, 0, 1)
    vocab = None
    if args.draft_vocab and args.draft_vocab < tcfg.vocab_size:
        always = list(tcfg.eos_token_ids or ())  # a stop token the target writes can be drafted
        vocab = trimmed_vocab(data["counts"], args.draft_vocab, always)
    cov = dict(draft_vocab=0 if vocab is None else len(vocab),
               heldout=1.0 if vocab is None else coverage(vocab, data["heldout_rows"], P),
               train=1.0 if vocab is None else coverage(vocab, rows, P))
    log(f"draft head: {cov['draft_vocab'] or tcfg.vocab_size} tokens; coverage of the target's held-out "
        f"continuations {cov['heldout']:.4f}, training {cov['train']:.4f}")
    table = target.params["embed_tokens"]
    table = dequantize(table, dtype) if isinstance(table, QuantizedWeight) else table.astype(dtype)
    frozen, acfg_run = {"embed_tokens": table}, acfg
    if vocab is not None:  # the trimmed head as models.with_draft_vocab builds it: the table's rows at the ids
        frozen.update(draft_vocab=jnp.asarray(vocab), draft_head=table[jnp.asarray(vocab)])
        acfg_run = dataclasses.replace(acfg, draft_vocab_size=len(vocab))
    index_of = head_index(tcfg.vocab_size, vocab)
    loss_fn = make_loss(acfg_run, tcfg, P, seq, args.unroll, dtype, args.ce_weight, index_of)
    key = jax.random.PRNGKey(args.seed)
    p = init_params(ta.trainable_shapes(acfg), jax.random.fold_in(key, 1), args.layers)
    tx = make_tx(args.weight_decay, p)
    o = tx.init(p)
    tp = ta.teacher_target(target).params
    rows_d, ids_d, lp_d = jnp.asarray(rows), jnp.asarray(top_ids), jnp.asarray(top_lp)

    # the data are arguments: closed over, jit embeds arrays as constants in the program (JAX 0.10.2
    # here: 67 MB of int32 made 134 MB of HLO text and a 50x slower compile), and the full data stage
    # writes ~430 MB
    @jax.jit
    def train_step(p, o, frozen, tp, rows_d, ids_d, lp_d, step, lr):
        idx = jax.random.randint(jax.random.fold_in(jax.random.fold_in(key, 2), step), (args.batch,), 0,
                                 rows_d.shape[0])
        (loss, aux), g = jax.value_and_grad(loss_fn, has_aux=True)(p, frozen, tp, rows_d[idx], ids_d[idx], lp_d[idx])
        u, o = tx.update(g, o, p)
        return jax.tree.map(lambda w, d: w - lr * d, p, u), o, loss, aux

    def drafter(params, dt=dtype, tgt=run_target):
        a = ta.to_assistant(acfg, params, {"embed_tokens": tgt.params["embed_tokens"]}, None, dt)
        return a if vocab is None else models.with_draft_vocab(a, vocab)

    evals, best = [], None

    def evaluate(step):
        nonlocal best
        t = time.time()
        st = loop_eval(run_target, drafter(p), held_prompts[:args.eval_prompts], args.eval_new_tokens)
        evals.append(dict(step=step, tokens_per_round=st["tokens_per_round"],
                          per_position=st["per_position_acceptance"], seconds=round(time.time() - t, 1)))
        if best is None or st["tokens_per_round"] > best[1]:
            best = (step, st["tokens_per_round"], jax.tree.map(np.asarray, p))
        log(f"step {step}: held-out tokens/round {st['tokens_per_round']} per position {st['per_position_acceptance']}"
            f" (best {best[1]} at step {best[0]}; {time.time() - t:.1f}s)")

    # the first evaluation compiles the classic and speculative programs: the one recorded (and timed,
    # for the step count below) is the second
    loop_eval(run_target, drafter(p), held_prompts[:args.eval_prompts], args.eval_new_tokens)
    evaluate(0)
    # what the end keeps: the last step's evaluation, saving, reloading (its speculative program
    # compiles again), the step costs and the final evaluation of every held-out prompt, at the pace
    # just measured (a fixed 150 s fit 24 prompts at the first recipe's H200 pace, 4.1 s each, and
    # would have skipped some of 32)
    per_prompt = evals[0]["seconds"] / min(args.eval_prompts, len(held_prompts))
    n_eval = min(args.eval_prompts, len(held_prompts)) + 1.25 * len(held_prompts)  # a quarter's margin
    # plus, fixed: save, reload and step costs (~30 s on the H200 of 2026-12-04) and the loaded
    # drafter's and the short prompts' programs. The H100 of 2026-12-05 spent 57 s on the whole end
    # (32 prompts): a 150 s floor left ~90 s of the call idle, 100 s keeps a 43 s margin
    reserve = args.eval_reserve if args.eval_reserve is not None else max(
        100.0 if on_gpu else 120.0, (90.0 if on_gpu else 120.0) + per_prompt * n_eval)
    end_train = end - reserve
    log(f"evaluation {per_prompt:.1f}s a prompt: {reserve:.0f}s kept for the end ({len(held_prompts)} prompts)")
    step, total, history = 0, args.steps, []
    n_cal = max(1, min(10, args.warmup - 1))  # timed steps, within the warm-up (its lr does not need total)
    t_train = t_cal = time.time()
    while step < (total or args.max_steps):
        if time.time() > end_train:
            log(f"time is up at step {step}")
            break
        lr = lr_at(step, total or args.max_steps, args.lr, args.warmup)
        p, o, loss, aux = train_step(p, o, frozen, tp, rows_d, ids_d, lp_d, jnp.int32(step), jnp.float32(lr))
        step += 1
        if step == 1:
            float(loss)
            log(f"train step compiled + run in {time.time() - t_train:.1f}s")
            t_cal = time.time()
        if total is None and step == 1 + n_cal:  # the step count the time allows, once
            float(loss)
            per = (time.time() - t_cal) / n_cal
            left = end_train - time.time()
            # each step carries 1/eval_every of an evaluation: counting the evaluations of the steps
            # left at `per` alone charged evaluations to steps the evaluations themselves displace
            # (a quarter of the steps at 20 ms a step and 10 s an evaluation every 1,000; every step
            # but the calibration's on a CPU dry run evaluating every 10)
            eval_s = evals[-1]["seconds"] + 1.0
            n_more = max(0.0, left) * 0.95 / (per + eval_s / args.eval_every)
            total = int(min(args.max_steps, step + n_more))
            log(f"{per * 1e3:.1f} ms/step -> {total} steps ({n_more / args.eval_every:.0f} evaluations of "
                f"{evals[-1]['seconds']}s)")
        if step % 50 == 0 or step == total:
            lv = float(loss)
            if not math.isfinite(lv):
                raise inputs.UsageError(f"training diverged at step {step} (loss {lv}): lower --lr")
            history.append((step, round(lv, 5)))
            a = np.asarray(aux)
            if step % 200 == 0:
                log(f"step {step}/{total} loss {lv:.4f} draft==argmax {' '.join(f'{x:.3f}' for x in a[0::3])}")
        if step % args.eval_every == 0 and time.time() < end_train:
            t_eval = time.time()
            evaluate(step)
            t_cal += time.time() - t_eval  # the calibration times training steps, not an evaluation among them
    if not evals or evals[-1]["step"] != step:
        evaluate(step)
    train_s = time.time() - t_train

    # ---- save the best, reload, measure it on every held-out prompt ---------------------------------
    best_params = jax.tree.map(jnp.asarray, best[2])
    files = ta.save_drafter(args.out, drafter(best_params, jnp.bfloat16, target), target, name, args.bits)
    mib = sum(v for k, v in files.items() if k.endswith(".safetensors")) / 2 ** 20
    log(f"saved the best drafter (step {best[0]}, {best[1]} tokens/round) to {args.out}: {mib:.2f} MiB of weights")
    loaded = models.load_assistant(args.out, target=run_target, dtype=dtype)
    # the step costs before the final evaluation, which `end` bounds: after it they carried the call
    # ~20 s past --minutes (their compile, on the H200 of 2026-12-04)
    costs = ta.step_costs(run_target, loaded)
    final = loop_eval(run_target, loaded, held_prompts, args.eval_new_tokens, end_by=end)
    results = dict(command=[PROG] + list(argv if argv is not None else sys.argv[1:]), data=info,
                   drafter=dict(layers=args.layers, ffn=args.ffn, unroll=args.unroll, ce_weight=args.ce_weight,
                                bits=args.bits, weights_mib=round(mib, 3), within_limit=mib <= MAX_DRAFTER_MIB),
                   coverage=cov, training=dict(steps=step, planned=total, batch=args.batch, lr=args.lr,
                                               seconds=round(train_s, 1), loss_history=history[-100:]),
                   evals=evals, best_step=best[0], heldout=final, step_costs=costs,
                   k_ran=EVAL_K, seconds=round(time.time() - start, 1), device=str(jax.devices()[0]))
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(results, f, indent=1, default=str)
    log(f"held-out ({final['prompts']} prompts, K={EVAL_K}, identical {final['identical']}): tokens/round "
        f"{final['tokens_per_round']}, per position {final['per_position_acceptance']}, speedup {final['speedup']}; "
        f"step costs {costs}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
