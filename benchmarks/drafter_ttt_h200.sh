#!/usr/bin/env bash
# The on-policy, training-time-test drafter for Gemma 3 270M on one H200, one <= 10-minute call per stage
# (docs/train-assistant.md). The data stay in /tmp/ttt-data between the calls (the machine keeps /tmp
# while it stays warm); what comes back is under $OUT.
#
#   bash benchmarks/drafter_ttt_h200.sh data     # prompts, the target's continuations, its top-16 log-probs (<= 9 min)
#   bash benchmarks/drafter_ttt_h200.sh train    # training, in-loop evaluation, best drafter, results.json (~9 min)
#   bash benchmarks/drafter_ttt_h200.sh round    # the round in the loop: classic step, no-draft round, drafter round
#
# TARGET: what loads the target (default gemma-3-270m: the `gemma3` extra's GGUF; or a path such as
# /tmp/gemma-3-270m-q4_k_m.gguf). Extra flags after the stage go to the stage's command.
set -euo pipefail
stage="${1:?usage: drafter_ttt_h200.sh data|train [flags...]}"
shift
TARGET="${TARGET:-gemma-3-270m}"
DATA="${DATA:-/tmp/ttt-data}"
OUT="${OUT:?OUT must name the folder whose files come back}"
PY="${PYTHON:-python}"
# the round stage's drafter: $OUT is empty in every call, so the folder the train stage brought back,
# put in the working tree (it travels with it), e.g. DRAFTER=jaxspec/data/drafters/gemma-3-270m
DRAFTER="${DRAFTER:-$OUT/drafter}"
case "$stage" in
  data)
    # 65,536 prompts: the H200 of 2026-12-04 continued 512 rows by 128 greedy tokens in ~0.47 s and
    # sampled 64 tokens in ~1.3 s, so 32,768 rows take ~2.5 of the 9 minutes, and the train stage's
    # ~310 s of steps pass over them ~7 times at the first recipe's 41 ms a step, more with the lighter
    # trimmed head (that drafter's held-out loss went flat after ~5 passes); the stage stops cleanly
    # at --minutes with the rows it has
    "$PY" -m jaxspec.train.onpolicy_data --target "$TARGET" --target-name gemma-3-270m --work "$DATA" \
        --prompts 65536 --new-tokens 128 --sampled-share 0.5 --temperature 0.8 --top-logits 16 --minutes 9 "$@" \
        2>&1 | tee "$OUT/data_log.txt"
    cp "$DATA/info.json" "$OUT/data_info.json"
    ;;
  train)
    [ -f "$DATA/data.npz" ] || { echo "no $DATA/data.npz: run the data stage first (on this warm machine)" >&2; exit 2; }
    "$PY" -m jaxspec.train.ttt --target "$TARGET" --target-name gemma-3-270m --data "$DATA" --out "$OUT/drafter" \
        --draft-vocab 32768 --unroll 3 --ce-weight 0.5 --batch 32 --eval-every 1000 --eval-prompts 8 --minutes 9 "$@" \
        2>&1 | tee "$OUT/train_log.txt"  # the log comes back whole (the call's output keeps only its tail)
    # the drafter's files must come back (<= 16 MiB each) and ship (<= 12 MiB of weights)
    "$PY" - "$OUT/drafter/results.json" <<'PYEOF'
import json, sys
r = json.load(open(sys.argv[1]))
h = r["heldout"]
print(f"held-out {h['prompts']} prompts ({h['skipped_for_time']} skipped for time): {h['tokens_per_round']} "
      f"tokens/round, per position {h['per_position_acceptance']}, identical {h['identical']}, speedup "
      f"{h['speedup']}, coverage {r['coverage']}, step costs {r['step_costs']}")
assert r["k_ran"] == 4 and h["all_identical"], (r["k_ran"], h["identical"])
assert r["drafter"]["within_limit"], r["drafter"]
# a result over part of the held-out set reads like one over all of it: say so in the exit status
assert h["skipped_for_time"] == 0, f"{h['skipped_for_time']} held-out prompts skipped for time"
PYEOF
    ;;
  round)
    [ -d "$DRAFTER" ] || { echo "no drafter at $DRAFTER (DRAFTER=...)" >&2; exit 2; }
    "$PY" benchmarks/drafter_round_bench.py --target "$TARGET" --drafter "$DRAFTER" --dtype bfloat16 \
        --new-tokens 128 --reps 5 --out "$OUT/round.json" "$@"
    ;;
  *) echo "unknown stage $stage (data | train | round)" >&2; exit 2 ;;
esac
