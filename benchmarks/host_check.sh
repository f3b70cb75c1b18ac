#!/usr/bin/env bash
# Host overhead of the eager training step, on one GPU (issue 17), in one device call.
# Usage: bash benchmarks/host_check.sh [chunks|launch]
#   chunks: the compile / CUDA-graph GPU tests, a cProfile of the doracheck model step, and the
#     eager step + fused AdamW with the backward's token-chunk budget at 16, 64, 128 MiB.
#   launch: GPU tests (kernels, real loops, autocast, zero magnitude) and
#     memcheck over the direct launches; host µs per layer call with launches through triton
#     and direct; the eager step + fused AdamW, launches through triton and direct, at chunk
#     budgets 16, 32, 64 MiB, beside PEFT LoRA in the same run.
set -u
PART=${1:-launch}
source benchmarks/gpu_common.sh
export CUDA_VISIBLE_DEVICES=0
if [ "$PART" = chunks ]; then
  step gpu_compile_graph_tests 150 $PY -m pytest -m gpu -q -p no:cacheprovider -rs tests/test_kernels_gpu.py -k "compile or cuda_graph"
  cd benchmarks
  step cprofile_doracheck 90 $PY host_cprofile_step.py --impl doracheck_bf16 --steps 4
  step step_lora 60 $PY bench_step.py --impl peft_lora_bf16 --mode eager_gc --row-out "$R/chunks.csv"
  for mib in 16 64 128; do
    step step_chunk$mib 60 $PY bench_step.py --impl doracheck_bf16 --mode eager_gc --backward-chunk-mib $mib --row-out "$R/chunks.csv"
  done
  cd ..
else
  step gpu_tests 330 $PY -m pytest -m gpu -q -p no:cacheprovider -rs tests/test_kernels_gpu.py tests/test_training_loops.py \
    tests/test_autocast.py tests/test_zero_magnitude.py tests/test_fast_launch.py
  step memcheck_launch 120 compute-sanitizer --tool memcheck --error-exitcode 3 $PY -m pytest -m gpu -q -p no:cacheprovider \
    tests/test_fast_launch.py
  cd benchmarks
  DORACHECK_TRITON_LAUNCH=triton step overhead_triton 60 $PY cpu_overhead.py 4096 16
  step overhead_direct 60 $PY cpu_overhead.py 4096 16
  step step_lora 60 $PY bench_step.py --impl peft_lora_bf16 --mode eager_gc --row-out "$R/launch.csv"
  DORACHECK_TRITON_LAUNCH=triton step step_triton16 60 $PY bench_step.py --impl doracheck_bf16 --mode eager_gc \
    --backward-chunk-mib 16 --row-out "$R/launch_triton.csv"
  for mib in 16 32 64; do
    step step_direct$mib 60 $PY bench_step.py --impl doracheck_bf16 --mode eager_gc --backward-chunk-mib $mib --row-out "$R/launch_$mib.csv"
  done
  step cprofile_doracheck 90 $PY host_cprofile_step.py --impl doracheck_bf16 --steps 4
  cd ..
  tail -n 3 "$R/gpu_tests.log"; tail -n 3 "$R/memcheck_launch.log"
  grep "us CPU" "$R"/overhead_*.log
  for f in step_*.log; do tail -n 1 "$R/$f" | cut -c1-150; done 2>/dev/null
fi
grep -h "'value'" "$R"/step_*.log | cut -c1-170
finish
