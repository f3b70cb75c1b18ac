# Twenty-second pass (issue 17): norm groups. The GPU tests (test_norm_groups.py among them),
# memcheck over the kernel cases, verify --quick, then ab_step.py (PEFT LoRA, the library with
# groups off and on, the bare yardstick) in two processes of ten rounds. About 7 device minutes.
set -u
bash benchmarks/ninth_check.sh tests,memcheck,verify > /tmp/ninth.txt 2>&1
source benchmarks/gpu_common.sh
cd benchmarks
for i in 1 2; do
  step ab_$i 200 $PY ab_step.py --configs 'lora;dc:groups=0;dc:groups=1;dc:bare=1' --rounds 10 --steps 4 --csv "$R/ab_groups_check_$i.csv"
done
rm -rf "$OUT/partial" "$OUT/results.tgz"; mkdir -p "$OUT/r"; cp "$R"/ab_groups_check_*.csv "$OUT/r/"; cp /tmp/ninth.txt "$OUT/r/checks.txt"
cp "$R/gpu_tests.log" "$R/memcheck.log" "$R/verify.log" "$OUT/r/" 2>/dev/null
grep -E "passed|failed|ERROR SUMMARY|properties" /tmp/ninth.txt | tail -n 8
for f in ab_1 ab_2; do echo "== $f"; grep -h "^lora\|^dc\|norm groups" "$R/$f.log"; done
cat "$R/steps.txt"
