#!/usr/bin/env bash
# Device call (nvidia-h200-x2): host-overhead diagnosis alone on the machine first, then the GPU
# correctness work in parallel: GPU 1 runs the gpu tests (errors recorded for the sm90 budget
# rows), verify and calibrate; GPU 0 runs the model-level equivalence of issue 6.
set -u
source benchmarks/h200_common.sh
step cpu_overhead 60 $PY benchmarks/cpu_overhead.py
step profile 60 $PY benchmarks/profile_step.py 1,4096
(
  export CUDA_VISIBLE_DEVICES=1
  step gpu_tests 240 env DORACHECK_RECORD_ERRORS="$R/errors" $PY -m pytest -m gpu -q -p no:cacheprovider -rs tests/test_kernels_gpu.py tests/test_worker_pinning.py
  step verify 60 $PY -m doracheck verify --quick
  step calibrate 90 $PY -m doracheck calibrate --cases 32 --json
) &
(
  export CUDA_VISIBLE_DEVICES=0
  step equivalence 200 $PY benchmarks/equivalence_model.py --json-out "$R/equivalence.json"
) &
wait
tail -n 5 "$R/gpu_tests.log"
finish
