#!/usr/bin/env bash
# Training-loop checks on the H200, one part per device call.
# Usage: bash benchmarks/gpu_loop_checks.sh [tests|cost]   (default: tests)
#   part "tests": the GPU tests (the real loops in bf16 on the Triton path, autocast, the
#     zero-magnitude kernel, the kernel suite) and compute-sanitizer memcheck over the kernels
#     and the new paths.
#   part "cost": what the norm-reuse rule costs: the model benchmark (doracheck bf16, step with
#     and without fused AdamW) and the layer benchmark, with the code before the rule (.oldtree:
#     `git archive` of the commit before it, carried) and after, in one run on one machine.
set -u
source benchmarks/gpu_common.sh
if [ "${1:-tests}" = tests ]; then
  step gpu_tests 300 $PY -m pytest -m gpu -q -p no:cacheprovider -rs tests/test_kernels_gpu.py tests/test_training_loops.py \
    tests/test_autocast.py tests/test_zero_magnitude.py
  step memcheck_smoke 120 compute-sanitizer --tool memcheck --error-exitcode 3 $PY benchmarks/gpu_smoke.py --small
  step memcheck_new 150 compute-sanitizer --tool memcheck --error-exitcode 3 $PY -m pytest -m gpu -q -p no:cacheprovider \
    tests/test_zero_magnitude.py tests/test_autocast.py tests/test_training_loops.py -k "gpu and (two_active or zero or lost or autocast)"
  tail -n 4 "$R/gpu_tests.log"; tail -n 3 "$R/memcheck_smoke.log"; tail -n 3 "$R/memcheck_new.log"
else
  MODEL="--impls peft_dora_bf16,doracheck_bf16 --new-tokens 16 --reps 10"
  LAYER="--shapes 8192x8192r384 --tokens 4096 --impls linear,doracheck_bf16"
  for tree in new old; do
    if [ $tree = old ]; then (cd .oldtree && $PY -m pip install --no-deps --no-build-isolation -q -e .) || exit 1; fi
    for opt in none adamw_fused; do
      step model_${tree}_$opt 150 $PY benchmarks/bench_model.py $MODEL --optimizer $opt --csv "$R/model_${tree}_$opt.csv"
    done
    step layer_$tree 100 $PY benchmarks/bench_layer.py $LAYER --csv "$R/layer_$tree.csv"
  done
  $PY -m pip install --no-deps --no-build-isolation -q -e .
  for f in "$R"/model_*.csv "$R"/layer_*.csv; do echo "== $f"; cut -d, -f1-6 "$f"; done
fi
finish
