#!/usr/bin/env bash
# Third device session (nvidia-h200-x2), after the backward's host-op cut (chunked path) and the
# inference fast path. Part 1: host time per call, the layer benchmark alone (GPU 0), then in
# parallel the model benchmark (GPU 0) and the gpu tests + memcheck (GPU 1). Part 2: the CI
# command over both GPUs (pytest -n auto, FSDP2 test included), verify, the planner's table,
# the row-shard norm measurement and FSDP2 timing (issue 8).
set -u
source benchmarks/h200_common.sh
if [ "${1:-1}" = 3 ]; then  # with a one-kernel decode path (measured slower, reverted): layer benchmark, gpu tests, memcheck
  step bench_layer 150 env CUDA_VISIBLE_DEVICES=0 $PY benchmarks/bench_layer.py --csv "$R/layer_h200.csv"
  (
    export CUDA_VISIBLE_DEVICES=0
    step memcheck 150 compute-sanitizer --tool memcheck --error-exitcode 3 $PY benchmarks/gpu_smoke.py --small
  ) &
  (
    export CUDA_VISIBLE_DEVICES=1
    step gpu_tests 200 env DORACHECK_RECORD_ERRORS="$R/errors" $PY -m pytest -m gpu -q -p no:cacheprovider -rs tests/test_kernels_gpu.py
  ) &
  wait
  tail -n 3 "$R/gpu_tests.log"; tail -n 3 "$R/memcheck.log"; grep -E "^8192x8192 r384 T1 |^8192x8192 r384 T4096" "$R/bench_layer.log"
elif [ "${1:-1}" = 1 ]; then
  step cpu_overhead 60 env CUDA_VISIBLE_DEVICES=0 $PY benchmarks/cpu_overhead.py 8192 384
  step bench_layer 150 env CUDA_VISIBLE_DEVICES=0 $PY benchmarks/bench_layer.py --csv "$R/layer_h200.csv"
  (
    export CUDA_VISIBLE_DEVICES=0
    step bench_model 200 $PY benchmarks/bench_model.py --csv "$R/model_h200.csv"
  ) &
  (
    export CUDA_VISIBLE_DEVICES=1
    step gpu_tests 150 env DORACHECK_RECORD_ERRORS="$R/errors" $PY -m pytest -m gpu -q -p no:cacheprovider -rs tests/test_kernels_gpu.py
    step memcheck 100 compute-sanitizer --tool memcheck --error-exitcode 3 $PY benchmarks/gpu_smoke.py --small
  ) &
  wait
  tail -n 3 "$R/gpu_tests.log"; tail -n 4 "$R/memcheck.log"; head -n 8 "$R/cpu_overhead.log"
else
  step pytest_n_auto 220 $PY -m pytest -n auto -q -p no:cacheprovider -rs
  (
    export CUDA_VISIBLE_DEVICES=0
    step verify 80 $PY -m doracheck verify --quick
    step shard_cost 60 $PY benchmarks/fsdp_norm_shard_cost.py --world 2
    step kernel_timing 120 $PY benchmarks/kernel_timing.py --csv "$R/kernels_h200.csv"
  ) &
  (
    export CUDA_VISIBLE_DEVICES=1
    step plan 90 $PY -m doracheck bench --plan --shapes 4096x4096r8,4096x4096r64,4096x4096r1024,8192x8192r384 --tokens 1,256,4096,16384 --dtype bf16 --reps 8 --csv "$R/plan_h200.csv"
  ) &
  wait
  TR="$PY -m torch.distributed.run --standalone --nproc_per_node 2 benchmarks/fsdp_train.py"
  MED="--mode time --steps 13 --vocab 32000 --hidden 2048 --intermediate 5632 --layers 4 --heads 16 --kv-heads 4 --rank 64 --seq 2048 --batch 2"
  step fsdp_time_doracheck 50 $TR $MED --impl doracheck
  step fsdp_time_peft 50 $TR $MED --impl peft
  tail -n 3 "$R/pytest_n_auto.log"; tail -n 2 "$R/verify.log"; tail -n 1 "$R/plan.log"; cat "$R/shard_cost.log" | tail -n 8
fi
finish
