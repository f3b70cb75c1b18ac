#!/usr/bin/env bash
# Device call (nvidia-h200-x2). A) the layer benchmark alone on the machine (GPU 0); B) in
# parallel: GPU 0 the model benchmark, a profile and verify (the sm90 table); GPU 1 the gpu tests
# (errors recorded), the compile diagnosis and the planner's predicted-vs-measured tables;
# C) both GPUs: FSDP2 (issue 8) against one GPU, the stale-cache demonstration, and timing.
set -u
source benchmarks/h200_common.sh
step bench_layer 150 env CUDA_VISIBLE_DEVICES=0 $PY benchmarks/bench_layer.py --csv "$R/layer_h200.csv"
(
  export CUDA_VISIBLE_DEVICES=0
  step bench_model 110 $PY benchmarks/bench_model.py --csv "$R/model_h200.csv"
  step profile 40 $PY benchmarks/profile_step.py 4096,14336,384,4096 8192,8192,384,4096
  step verify 70 $PY -m doracheck verify --quick
) &
(
  export CUDA_VISIBLE_DEVICES=1
  step gpu_tests 150 env DORACHECK_RECORD_ERRORS="$R/errors" $PY -m pytest -m gpu -q -p no:cacheprovider -rs tests/test_kernels_gpu.py
  step compile_diag 40 $PY benchmarks/compile_diag.py
  step plan 70 $PY -m doracheck bench --plan --shapes 4096x4096r8,4096x4096r64,4096x4096r1024,8192x8192r384 --tokens 1,256,4096,16384 --dtype bf16 --reps 10 --csv "$R/plan_h200.csv"
  step plan_fp32 40 $PY -m doracheck bench --plan --shapes 4096x4096r8,4096x4096r1024 --tokens 256,4096,16384 --dtype fp32 --reps 5 --csv "$R/plan_fp32_h200.csv"
) &
wait
TR="$PY -m torch.distributed.run --standalone --nproc_per_node 2 benchmarks/fsdp_train.py"
step fsdp_check 50 $TR --mode check --steps 50
step fsdp_unsafe 50 $TR --mode check --steps 50 --unsafe-keep-norm-cache
MED="--mode time --steps 13 --vocab 32000 --hidden 2048 --intermediate 5632 --layers 4 --heads 16 --kv-heads 4 --rank 64 --seq 2048 --batch 2"
step fsdp_time_doracheck 50 $TR $MED --impl doracheck
step fsdp_time_peft 50 $TR $MED --impl peft
tail -n 3 "$R/gpu_tests.log"; tail -n 2 "$R/verify.log"; tail -n 1 "$R/plan.log" "$R/plan_fp32.log"
finish
