# Twenty-first pass (issue 17): the straight-line planned call (forward.planned_forward,
# backward.planned_backward). The GPU tests, memcheck over the kernel cases and a planned
# training run, verify --quick, then ab_step.py (PEFT LoRA, the library, the bare yardstick of
# bare_layer_probe.py) in two processes. About 6 device minutes. AB_CONFIGS, AB_ROUNDS and AB_TAG
# override the configurations, rounds and CSV names (twentysecond_check.sh).
set -u
CONFIGS=${AB_CONFIGS:-'lora;dc:graphs=1;dc:bare=1'}
ROUNDS=${AB_ROUNDS:-6}
TAG=${AB_TAG:-step}
bash benchmarks/ninth_check.sh tests,memcheck,verify > /tmp/ninth.txt 2>&1
source benchmarks/gpu_common.sh
cd benchmarks
for i in 1 2; do
  step ab_$i 200 $PY ab_step.py --configs "$CONFIGS" --rounds "$ROUNDS" --steps 4 --csv "$R/ab_${TAG}_$i.csv"
done
rm -rf "$OUT/partial" "$OUT/results.tgz"; mkdir -p "$OUT/r"; cp "$R"/ab_"${TAG}"_*.csv "$OUT/r/"; cp /tmp/ninth.txt "$OUT/r/checks.txt"; cp "$R/gpu_tests.log" "$R/memcheck.log" "$R/verify.log" "$OUT/r/" 2>/dev/null
grep -E "passed|failed|ERROR SUMMARY|properties" /tmp/ninth.txt | tail -n 8
grep -h "^lora\|^dc" "$R"/ab_*.log
cat "$R/steps.txt"
