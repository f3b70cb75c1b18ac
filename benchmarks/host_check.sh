#!/usr/bin/env bash
# Host overhead of the eager training step, on one GPU (issue 17), in one device call.
# Usage: bash benchmarks/host_check.sh [chunks]
#   chunks: the compile / CUDA-graph GPU tests, a cProfile of the doracheck model step, and the
#     eager step + fused AdamW with the backward's token-chunk budget at 16, 64, 128 MiB.
# Its second part ("launch", run once on 2026-12-01: direct Triton launches against launches
# through triton, chunk budgets 16/32/64 MiB; results/host_check_h200.txt) went with
# kernels/fast_launch.py, which it measured and which was not kept.
set -u
PART=${1:-chunks}
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
fi
grep -h "'value'" "$R"/step_*.log | cut -c1-170
finish
