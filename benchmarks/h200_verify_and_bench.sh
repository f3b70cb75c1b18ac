#!/usr/bin/env bash
# One device call on a 2-GPU H200 machine (nvidia-h200-x2): the GPU verification of issues 3, 4, 6, 8
# and the benchmarks, batched so the machine is held once. Results go to $OUT/results.tgz; the short
# table of outcomes is printed last. Every step is bounded by `timeout`, so the call ends in time.
# Usage (device tool): bash benchmarks/h200_verify_and_bench.sh
set -u
source benchmarks/h200_common.sh
# Phase A: the whole test suite spread over both GPUs (issue 8: gwN pinned to GPU N mod 2), and
# memcheck of every kernel path at small shapes beside it.
step pytest_n_auto 220 $PY -m pytest -n auto -q -p no:cacheprovider -rs &
P1=$!
( export CUDA_VISIBLE_DEVICES=1; step memcheck 200 compute-sanitizer --tool memcheck --error-exitcode 3 $PY benchmarks/gpu_smoke.py --small ) &
wait
# Phase B: benchmarks alone on GPU 0; verify, calibrate and model equivalence on GPU 1.
(
  export CUDA_VISIBLE_DEVICES=0
  step bench_layer 150 $PY benchmarks/bench_layer.py --csv "$R/layer_h200.csv"
  step bench_model 150 $PY benchmarks/bench_model.py --csv "$R/model_h200.csv"
) &
(
  export CUDA_VISIBLE_DEVICES=1
  step verify 55 $PY -m doracheck verify --quick
  step verify_json 55 $PY -m doracheck verify --quick --json
  step calibrate 60 $PY -m doracheck calibrate --cases 16 --json
  step equivalence 120 $PY benchmarks/equivalence_model.py --json-out "$R/equivalence.json"
) &
wait
tail -n 3 "$R"/pytest_n_auto.log; grep -E "ERROR SUMMARY" "$R/memcheck.log"
finish
