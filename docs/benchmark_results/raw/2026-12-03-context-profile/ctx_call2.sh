export PYTHONPATH=$PWD
C=$(git rev-parse --short HEAD)
s=$(date +%s)
timeout 430 python3 benchmarks/context_bench.py --target 12b --assistant 12b --context 128,32768,131072 --spec-context 32768 --max-tokens 32 --repeats 1 --time-budget 360 --commit $C --out /tmp/ctx > /tmp/ctx.log 2>&1
echo "context_bench rc=$? $(( $(date +%s)-s ))s"; grep -v -i warn /tmp/ctx.log | tail -15
for c in 131072 32768; do
  timeout 70 python3 benchmarks/profile_forward.py --target 12b --context $c --steps 4 --commit $C --out /tmp/p$c > /tmp/p$c.log 2>&1
  echo "profile $c rc=$?"; grep "^Wall per" /tmp/p$c/profile.md; grep "decode_attention\|MemcpyD2D" /tmp/p$c/profile.md
  cp /tmp/p$c/profile.md /tmp/ctx/profile-$c.md 2>/dev/null; cp /tmp/p$c/profile.json /tmp/ctx/profile-$c.json 2>/dev/null
done
cp /tmp/ctx.log /tmp/ctx/; rm -rf /tmp/ctx/trace /tmp/ctx/*/trace; tar czf $OUT/ctx2.tgz --exclude='*.png' -C /tmp/ctx .
