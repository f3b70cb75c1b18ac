#!/usr/bin/env bash
# Fourth device session: the planner measured side by side (timing.time_interleaved) over a wider
# grid, with the timing mode's own choice judged on an independent measurement (issue 7); the gpu
# tests and memcheck on the code as it stands (the last review fixes were checked on the CPU only).
# Part 1 (nvidia-h200-x2): GPU 0 the bf16 planner table alone; GPU 1 the fp32 table, then the gpu
# tests and memcheck (CPU threads capped so the host-bound rows on GPU 0 keep their cores).
# Part 2: the CI command over both GPUs (pytest -n auto), then the bf16 table again, alone, as an
# independent repeat of part 1's.
set -u
source benchmarks/h200_common.sh
SHAPES=4096x4096r8,4096x4096r64,4096x4096r1024,8192x8192r384,4096x14336r16,14336x4096r128
if [ "${1:-1}" = 1 ]; then
  (
    export CUDA_VISIBLE_DEVICES=0
    step plan_bf16 330 $PY -m doracheck bench --plan --timed --shapes $SHAPES --tokens 1,256,4096,16384 --dtype bf16 --csv "$R/plan_h200.csv"
  ) &
  (
    export CUDA_VISIBLE_DEVICES=1 OMP_NUM_THREADS=8
    step plan_fp32 90 $PY -m doracheck bench --plan --timed --shapes 4096x4096r8,4096x4096r1024 --tokens 256,4096,16384 --dtype fp32 --csv "$R/plan_fp32_h200.csv"
    step gpu_tests 200 env DORACHECK_RECORD_ERRORS="$R/errors" $PY -m pytest -m gpu -q -p no:cacheprovider -rs tests/test_kernels_gpu.py
    step memcheck 200 compute-sanitizer --tool memcheck --error-exitcode 3 $PY benchmarks/gpu_smoke.py --small
  ) &
  wait
  tail -n 3 "$R/gpu_tests.log"; tail -n 3 "$R/memcheck.log"; tail -n 2 "$R/plan_fp32.log"; tail -n 2 "$R/plan_bf16.log"
elif [ "${1:-1}" = 3 ]; then  # after review fixes: timed dispatch, nn.Linear timed in the same rounds
  step gpu_tests_planner 200 $PY -m pytest -m gpu -q -p no:cacheprovider -rs tests/test_kernels_gpu.py -k "timed_planning or within_budget and 4096"
  step bench_plan_small 120 $PY -m doracheck bench --plan --timed --shapes 4096x4096r64 --tokens 256,4096 --dtype bf16 --csv "$R/plan_small.csv"
  step bench_plain 60 $PY -m doracheck bench --shapes 8192x8192r384 --tokens 1,4096
  tail -n 2 "$R/gpu_tests_planner.log"; cat "$R/bench_plan_small.log" | cut -c1-220; cat "$R/bench_plain.log"
elif [ "${1:-1}" = 4 ]; then  # after the gloo/NCCL teardown barrier in fsdp_train.py and the last planner edits
  step fsdp_and_planner 300 $PY -m pytest -q -p no:cacheprovider -rs tests/test_fsdp.py tests/test_planner.py tests/test_timing.py tests/test_kernels_gpu.py -k "fsdp or planner or timing or timed"
  tail -n 3 "$R/fsdp_and_planner.log"
else
  step pytest_n_auto 230 $PY -m pytest -n auto -q -p no:cacheprovider -rs
  step plan_bf16_validate 300 $PY -m doracheck bench --plan --timed --shapes $SHAPES --tokens 1,256,4096,16384 --dtype bf16 --csv "$R/plan_h200_validate.csv"
  tail -n 3 "$R/pytest_n_auto.log"; tail -n 2 "$R/plan_bf16_validate.log"
fi
finish
