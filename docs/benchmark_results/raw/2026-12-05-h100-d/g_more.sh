# the two calls after g_final.sh (whose round stage failed: drafter_round_bench.py did not find jaxspec
# without PYTHONPATH; fixed since), same warm machine. Call 1: the round, new drafter, heads 32,768 and 8,192
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1; G=/tmp/gemma-3-270m-q4_k_m.gguf
python3 benchmarks/drafter_round_bench.py --target $G --drafter /tmp/drafter --dtype bfloat16 --new-tokens 128 --reps 5 \
  --vocab 32768 8192 --out $OUT/round.json   # -> round_32768_8192.json
# call 2: the held-out bench at heads 16,384 and 4,096, then the round at 16,384 / 8,192 / 4,096
for n in 16384 4096; do
  python3 benchmarks/drafter_heldout_bench.py --target $G --assistant /tmp/drafter --draft-vocab $n --out $OUT/heldout_new$n.json
done
python3 benchmarks/drafter_round_bench.py --target $G --drafter /tmp/drafter --dtype bfloat16 --new-tokens 128 --reps 5 \
  --vocab 16384 8192 4096 --out $OUT/round2.json   # -> round_16384_8192_4096.json
