#!/usr/bin/env bash
# GPU correctness checks; two jobs at once, on two GPUs (nvidia-h200-x2) or sharing one. One part per device call (each fits
# the 600 s limit); logs go to /tmp/results, packed into $OUT/results.tgz (gpu_common.sh).
# Usage: bash benchmarks/gpu_check.sh [tests|verify|suite]   (default: tests)
#   tests   GPU 1: every GPU-marked test (pytest -m gpu; per-case errors recorded under
#           $R/errors for the budget rows). GPU 0 meanwhile: compute-sanitizer memcheck over every
#           kernel path at small shapes (gpu_smoke.py --small), then which registered op
#           torch.compile computes differently from eager (compile_diag.py).
#   verify  GPU 0: doracheck verify --quick and doracheck calibrate. GPU 1 meanwhile: model-level
#           equivalence with PEFT (equivalence_model.py -> $R/equivalence.json).
#   suite   the CI command, pytest -n auto, over both GPUs (xdist worker gwN pinned to GPU N mod 2;
#           the NCCL FSDP2 test runs only here).
set -u
PART=${1:-tests}
case "$PART" in tests|verify|suite) ;; *) echo "usage: bash benchmarks/gpu_check.sh [tests|verify|suite]" >&2; exit 2 ;; esac
source benchmarks/gpu_common.sh
case "$PART" in
tests)
  (
    export CUDA_VISIBLE_DEVICES=$SECOND_GPU
    step gpu_tests 300 env DORACHECK_RECORD_ERRORS="$R/errors" $PY -m pytest -m gpu -q -p no:cacheprovider -rsx tests
  ) &
  (
    export CUDA_VISIBLE_DEVICES=0
    step memcheck 200 compute-sanitizer --tool memcheck --error-exitcode 3 $PY benchmarks/gpu_smoke.py --small
    step compile_diag 60 $PY benchmarks/compile_diag.py
  ) &
  wait
  tail -n 4 "$R/gpu_tests.log"; grep -E "ERROR SUMMARY" "$R/memcheck.log"; cat "$R/compile_diag.log"
  ;;
verify)
  (
    export CUDA_VISIBLE_DEVICES=0
    step verify 120 $PY -m doracheck verify --quick
    step calibrate 90 $PY -m doracheck calibrate --cases 32 --json
  ) &
  (
    export CUDA_VISIBLE_DEVICES=$SECOND_GPU
    step equivalence 200 $PY benchmarks/equivalence_model.py --json-out "$R/equivalence.json"
  ) &
  wait
  tail -n 25 "$R/verify.log"; tail -n 40 "$R/equivalence.log"
  ;;
suite)
  step pytest_n_auto 300 $PY -m pytest -n auto -q -p no:cacheprovider -rs
  tail -n 4 "$R/pytest_n_auto.log"
  ;;
esac
finish
