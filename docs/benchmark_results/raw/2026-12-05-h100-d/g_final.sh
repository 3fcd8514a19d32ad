# drafter chain, last call (after g_data.sh and g_train.sh on this warm machine): the new drafter as trained and cut to
# 8,192, and the shipped one, on the 32 held-out prompts in one call; then the round. carry: .carry/g_final.sh and
# jaxspec/data/drafters/gemma-3-270m/model.safetensors (the shipped drafter)
export PYTHONUNBUFFERED=1; G=/tmp/gemma-3-270m-q4_k_m.gguf
nvidia-smi --query-gpu=name,driver_version --format=csv | tee $OUT/gpu.txt
cp -r /tmp/drafter $OUT/drafter
for spec in "/tmp/drafter 0 new" "/tmp/drafter 8192 new8192" "jaxspec/data/drafters/gemma-3-270m 0 shipped"; do
  set -- $spec
  timeout 120 python3 benchmarks/drafter_heldout_bench.py --target $G --assistant $1 --draft-vocab $2 --out $OUT/heldout_$3.json \
    > $OUT/heldout_$3.log 2>&1; echo "$3 rc $?"; grep -v Warn $OUT/heldout_$3.log | tail -1 | cut -c1-330
done
TARGET=$G PYTHON=python3 DRAFTER=/tmp/drafter OUT=$OUT timeout 150 bash benchmarks/drafter_ttt_h200.sh round --reps 5 > $OUT/round.log 2>&1
echo "round rc $?"; grep -A3 '"drafter"' $OUT/round.json | grep -E "drafter|round_cost" | head -12
