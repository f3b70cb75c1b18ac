# Twenty-third pass (issue 17): norm-group passes anchored to the forward's frame, and a base
# model joining only its own model's pass (review fixes). The GPU tests of the files the change
# touches, then one ab_step.py process (groups off and on). About 4 device minutes.
set -u
source benchmarks/gpu_common.sh
export CUDA_VISIBLE_DEVICES=0
step gpu_tests_recheck 240 $PY -m pytest -m gpu -q -n 4 -p no:cacheprovider -rs tests/test_norm_groups.py \
  tests/test_train_plan.py tests/test_norm_graphs.py tests/test_training_loops.py tests/test_inference_norms.py \
  tests/test_compile_fullgraph.py tests/test_decode_plan_gpu.py tests/test_peft_integration.py
cd benchmarks
step ab_1 150 $PY ab_step.py --configs 'lora;dc:groups=0;dc:groups=1' --rounds 8 --steps 4 --csv "$R/ab_groups_recheck_1.csv"
rm -rf "$OUT/partial"; mkdir -p "$OUT/r"; cp "$R"/ab_groups_recheck_1.csv "$R/gpu_tests_recheck.log" "$R/ab_1.log" "$R/gpus.txt" "$OUT/r/" 2>/dev/null
grep -E "passed|failed|^FAILED|^ERROR" "$R/gpu_tests_recheck.log" | tail -6
grep -h "^lora\|^dc\|norm groups" "$R/ab_1.log"
cat "$R/steps.txt"
