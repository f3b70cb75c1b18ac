#!/usr/bin/env bash
# Last device call (nvidia-h200-x2), after the host-overhead cuts and the norm aliasing fix:
# A) the layer benchmark alone (GPU 0); B) GPU 0: model benchmark, the planner's table;
# GPU 1: the gpu tests (compile included) and the compile diagnosis.
set -u
source benchmarks/h200_common.sh
step bench_layer 135 env CUDA_VISIBLE_DEVICES=0 $PY benchmarks/bench_layer.py --csv "$R/layer_h200.csv"
(
  export CUDA_VISIBLE_DEVICES=0
  step bench_model 110 $PY benchmarks/bench_model.py --csv "$R/model_h200.csv"
  step plan 60 $PY -m doracheck bench --plan --shapes 4096x4096r8,4096x4096r64,4096x4096r1024,8192x8192r384 --tokens 1,256,4096,16384 --dtype bf16 --reps 8 --csv "$R/plan_h200.csv"
) &
(
  export CUDA_VISIBLE_DEVICES=1
  step gpu_tests 130 env DORACHECK_RECORD_ERRORS="$R/errors" $PY -m pytest -m gpu -q -p no:cacheprovider -rs tests/test_kernels_gpu.py
  step compile_diag 30 $PY benchmarks/compile_diag.py
) &
wait
tail -n 3 "$R/gpu_tests.log"; tail -n 1 "$R/plan.log"; grep -E "^factored_norm" "$R/compile_diag.log"
finish
