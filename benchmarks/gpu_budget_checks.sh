#!/usr/bin/env bash
# The budgets work (issue 15) on the H200: the GPU tests against the a-priori (ρ-scaled) and
# baseline-ratio budgets (no family rows), doracheck verify in every dtype, the small planted
# errors' margins on the Triton path, and which op breaks whole-layer bitwise determinism.
set -u
source benchmarks/h200_common.sh
step gpu_tests 300 env DORACHECK_RECORD_ERRORS="$R/errors" $PY -m pytest -m gpu -q -p no:cacheprovider -rsx tests/test_kernels_gpu.py \
  tests/test_autocast.py tests/test_zero_magnitude.py tests/test_training_loops.py
step verify 120 $PY -m doracheck verify --quick
step determinism 120 $PY benchmarks/determinism_probe.py
tail -n 4 "$R/gpu_tests.log"; grep -E "FAIL|passed|exit" "$R/verify.log" | head; cat "$R/determinism.log" | tail -12
finish
