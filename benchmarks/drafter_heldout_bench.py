"""A drafter's held-out numbers on this machine: greedy K = 4 against classic on the held-out prompts
the drafter never trained on, the K that ran and every output checked.

    python benchmarks/drafter_heldout_bench.py                                  # the shipped gemma-3-270m drafter
    python benchmarks/drafter_heldout_bench.py --assistant DIR --target GGUF    # another drafter / target file

The prompts are `jaxspec/data/drafters/<pair>/heldout_onpolicy.json` cut to --prompt-tokens tokens
(`jaxspec.train.onpolicy_data.heldout_ids`, as training's held-out set is cut). The pair loads as users load
it (`jaxspec.load_pair`: on a CPU the weights made dense once at load). Every prompt runs classic,
then speculative, decode-only timing from the loop's own stats (`jaxspec.train.assistant.
acceptance_stats`), after one untimed prompt of each that compiles both programs. An output that
differs from classic, or a prompt that ran at another K (the exactness probe fell back), is an error.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

TREE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, TREE)  # this checkout's jaxspec, not an installed one


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pair", default="gemma-3-270m")
    p.add_argument("--assistant", default=None, help="a drafter directory (default: the pair's shipped one)")
    p.add_argument("--target", default=None, help="a .gguf or checkpoint instead of the pair's (e.g. on a machine "
                   "without the gemma3 extra)")
    p.add_argument("--prompts", type=int, default=0, help="the first N held-out prompts (0: all)")
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--draft-vocab", type=int, default=0, help="cut the drafter's trimmed head to its first N ids "
                   "(jaxspec.train.ttt saves them most frequent first): what a smaller head keeps (0: as saved)")
    p.add_argument("--out", default=None, help="a JSON file for the numbers")
    args = p.parse_args(argv)

    import jax
    import numpy as np

    import jaxspec
    from jaxspec import models, pairs
    from jaxspec.models.checkpoint_files import read_config
    from jaxspec.text import load_tokenizer
    from jaxspec.train import assistant as ta
    from jaxspec.train import onpolicy_data as od
    from jaxspec.train.assistant_inputs import load_heldout
    from jaxspec.train.ttt import EVAL_K, loop_eval

    drafter_path = args.assistant or pairs.drafter_dir(args.pair)
    if args.draft_vocab:  # checked on the config, before anything loads
        n = read_config(drafter_path)[0].get("draft_vocab_size") or 0
        if not 0 < args.draft_vocab < n:
            p.error(f"--draft-vocab {args.draft_vocab}: the drafter in {drafter_path} has "
                    f"{f'a head of {n} ids' if n else 'no trimmed head'}; N must be in [1, {n})")
    if args.target is None:
        target, drafter, tok = jaxspec.load_pair(args.pair, assistant=args.assistant)
    else:
        target = models.load_target(args.target)
        drafter = models.load_assistant(drafter_path, target=target)
        tok = load_tokenizer(args.target)
    if args.draft_vocab:
        drafter = models.with_draft_vocab(drafter, np.asarray(drafter.params["draft_vocab"])[:args.draft_vocab])
    held, _ = load_heldout(None, os.path.join(pairs.drafter_dir(args.pair), od.HELDOUT_FILE))
    held = held[:args.prompts] if args.prompts else held
    prompts = od.heldout_ids(tok, held, args.prompt_tokens)
    ta.acceptance_stats(target, drafter, prompts[:1], args.new_tokens, block_size=EVAL_K, eos=[])  # compile
    t0 = time.time()
    st = loop_eval(target, drafter, prompts, args.new_tokens)
    costs = ta.step_costs(target, drafter)
    res = dict(pair=args.pair, drafter=os.path.relpath(os.path.abspath(drafter_path), TREE),
               device=str(jax.devices()[0]), backend=jax.default_backend(), jax=jax.__version__,
               cpu=platform.processor() or platform.machine(), cores=os.cpu_count(),
               date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), command="python " + " ".join(sys.argv),
               draft_vocab=drafter.config.draft_vocab_size, k_ran=EVAL_K, seconds=round(time.time() - t0, 1),
               step_costs=costs,
               **{k: v for k, v in st.items() if k != "per_prompt"},
               per_prompt=[dict(kind=h.get("kind"), source=h.get("source"), **r) for h, r in zip(held, st["per_prompt"])])
    print(f"{res['device']}, head {res['draft_vocab'] or 'whole'}: {st['prompts']} held-out prompts, K={EVAL_K}, "
          f"identical {st['identical']}: "
          f"{st['tokens_per_round']} tokens/round, per position {st['per_position_acceptance']}, decode speedup "
          f"{st['speedup']} (classic {st['classic_decode_s']} s, speculative {st['speculative_decode_s']} s); "
          f"step costs {costs}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
