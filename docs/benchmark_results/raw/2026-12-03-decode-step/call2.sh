export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PWD/.probe
s=$(date +%s); timeout 280 python3 .probe/flash_bench.py --budget 230 --out $OUT > $OUT/flash.log 2>&1; echo "flash rc=$? $(( $(date +%s)-s ))s"
grep -v "^{" $OUT/flash.log | grep -v -i warn | tail -30
s=$(date +%s); timeout 90 python3 benchmarks/speculative_bench.py --target 12b --no-assistant --runs loop --max-tokens 32 --commit b1206d9 --out /tmp/dc > $OUT/decode-classic.log 2>&1; echo "classic rc=$? $(( $(date +%s)-s ))s"; grep -i "classic\|tok/s" $OUT/decode-classic.log | tail -5
s=$(date +%s); timeout 200 python3 benchmarks/speculative_bench.py --target 12b --assistant 12b --k-values 4 --commit b1206d9 --out /tmp/dk > $OUT/decode-k4.log 2>&1; echo "k4 rc=$? $(( $(date +%s)-s ))s"; tail -25 $OUT/decode-k4.log
cp /tmp/dc/*.md $OUT/ 2>/dev/null; for f in /tmp/dk/*.md; do cp $f $OUT/k4-$(basename $f); done 2>/dev/null; ls $OUT
