#!/usr/bin/env bash
# Issue 17, norm graphs (kernels/norm_graphs.py): GPU tests, memcheck, verify --quick, the
# chunk-budget memory check, the interleaved eager-step A/B (one process) and the profile.
set -u
source benchmarks/gpu_common.sh
export CUDA_VISIBLE_DEVICES=0
step gpu_tests 200 $PY -m pytest -m gpu -q -p no:cacheprovider -rs tests/test_norm_graphs.py tests/test_inference_norms.py \
  tests/test_kernels_gpu.py tests/test_training_loops.py tests/test_autocast.py tests/test_zero_magnitude.py
step memcheck 60 compute-sanitizer --tool memcheck --error-exitcode 3 $PY -m pytest -m gpu -q -p no:cacheprovider \
  tests/test_norm_graphs.py -k "bitwise_the_eager and bfloat16 or overwritten or stream_capture"
step verify 70 doracheck verify --quick
cd benchmarks
step ab_step 90 $PY ab_step.py --rounds 5 --steps 4 --csv "$R/ab_step.csv" \
  --configs "lora;dc:graphs=1,chunk=32;dc:graphs=0,chunk=32;dc:graphs=1,chunk=16;dc:graphs=0,chunk=16"
step profile_eager 100 $PY profile_model_step.py --impls peft_lora_bf16,doracheck_bf16 --mode eager_gc --json-out "$R/profile_eager.json"
cd ..
grep -v DEBUG "$R/gpu_tests.log" | grep -E "^(FAILED|ERROR)|passed|failed" | tail -n 8
grep -E "ERROR SUMMARY|passed|failed" "$R/memcheck.log" | tail -n 3
grep -E "FAIL|properties" "$R/verify.log" | tail -n 4
tail -n 7 "$R/ab_step.log"
grep -v DEBUG "$R/profile_eager.log" | tail -n 30
finish
