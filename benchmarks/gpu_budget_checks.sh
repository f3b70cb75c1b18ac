#!/usr/bin/env bash
# Budget checks on the H200: the GPU tests against the a-priori (ρ-scaled) and
# baseline-ratio budgets (no family rows), doracheck verify in every dtype, the small planted
# errors' margins on the Triton path, and which op breaks whole-layer bitwise determinism.
set -u
# Usage: bash benchmarks/gpu_budget_checks.sh [tests|margins|all]  (two parts fit the 600 s call limit)
PART=${1:-all}
source benchmarks/gpu_common.sh
if [ "$PART" != margins ]; then
step gpu_tests 300 env DORACHECK_RECORD_ERRORS="$R/errors" $PY -m pytest -m gpu -q -p no:cacheprovider -rsx tests/test_kernels_gpu.py \
  tests/test_autocast.py tests/test_zero_magnitude.py tests/test_training_loops.py
step verify 120 $PY -m doracheck verify --quick
step determinism 120 $PY benchmarks/determinism_probe.py
fi
if [ "$PART" != tests ]; then
step margins 240 env PYTHONPATH=tests:${PYTHONPATH:-} $PY benchmarks/mutant_margins.py --device cuda
step memcheck_planner 200 compute-sanitizer --tool memcheck --error-exitcode 3 $PY -m pytest -m gpu -q -p no:cacheprovider \
  tests/test_kernels_gpu.py -k "planner_variant or cross_term_at_every_rank"
fi
for f in gpu_tests verify determinism margins memcheck_planner; do [ -f "$R/$f.log" ] && { echo "== $f"; tail -n 25 "$R/$f.log"; }; done
finish
