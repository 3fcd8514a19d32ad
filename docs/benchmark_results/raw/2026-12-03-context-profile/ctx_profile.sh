export PYTHONPATH=$PWD
mkdir -p /tmp/r
for c in 128 32768 131072; do
  s=$(date +%s)
  timeout 200 python3 benchmarks/profile_forward.py --target 12b --context $c --steps 4 --commit $(git rev-parse --short HEAD 2>/dev/null || echo wip) --out /tmp/p$c > /tmp/r/p$c.log 2>&1
  echo "ctx $c rc=$? $(( $(date +%s)-s ))s"; grep -A12 "^Wall per" /tmp/p$c/profile.md | head -14
  cp /tmp/p$c/profile.md /tmp/r/profile-$c.md; cp /tmp/p$c/profile.json /tmp/r/profile-$c.json
done
tar czf $OUT/ctx.tgz -C /tmp/r .
