# Twenty-second pass (issue 17): norm groups (doracheck/norm_groups.py). The GPU tests of the
# training plans, norm graphs, groups and training loops; then ab_step.py (eager GC step + fused
# AdamW, configurations interleaved in one process, two processes): LoRA, the library with each
# planned layer's norm alone (groups=0) and from its group (groups=1), and the bare yardstick;
# then py-spy samples of the library's step (the py-spy wheel in .tools/, carried). About 5 device minutes.
set -u
source benchmarks/gpu_common.sh
export CUDA_VISIBLE_DEVICES=0
step gpu_tests_groups 300 $PY -m pytest -m gpu -q -n 4 -p no:cacheprovider -rs tests/test_norm_groups.py \
  tests/test_train_plan.py tests/test_norm_graphs.py tests/test_training_loops.py
cd benchmarks
for i in 1 2; do
  step ab_$i 200 $PY ab_step.py --configs 'lora;dc:groups=0;dc:groups=1;dc:bare=1' --rounds 6 --steps 4 --csv "$R/ab_groups_$i.csv"
done
$PY -m pip install -q --no-deps ../.tools/py_spy*.whl >"$R/pyspy_install.log" 2>&1 || cat "$R/pyspy_install.log"
step sample_groups 200 py-spy record --nonblocking --format raw --rate 250 -o "$R/stacks_groups.txt" -- \
  $PY host_sample_step.py --impl doracheck_bf16 --steps 150 --warmup 5
$PY stack_summary.py "$R/stacks_groups.txt" --rate 250 --steps 155 --top 90 >"$R/summary_groups.txt"; gzip -f "$R/stacks_groups.txt"
rm -rf "$OUT/partial"; mkdir -p "$OUT/r"; cp "$R"/ab_groups_*.csv "$R/summary_groups.txt" "$R/gpu_tests_groups.log" "$OUT/r/"
cp "$R"/ab_*.log "$OUT/r/" 2>/dev/null
grep -E "passed|failed|^FAILED|^ERROR" "$R/gpu_tests_groups.log" | tail -6
for f in ab_1 ab_2; do echo "== $f"; grep -h "^lora\|^dc\|norm groups" "$R/$f.log"; done
grep "per step" "$R/sample_groups.log"; sed -n 1,12p "$R/summary_groups.txt" | cut -c1-120
grep -E "norm_and_scale|planned_forward|planned_backward|norm_groups|graphed_norm" "$R/summary_groups.txt" | head -12 | cut -c1-120
cat "$R/steps.txt"
