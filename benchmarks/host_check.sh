#!/usr/bin/env bash
# Host overhead of the eager training step, on one GPU (issue 17), in one device call:
# the compile / CUDA-graph GPU tests, a cProfile of the doracheck model step (by Python
# function), and the eager step + fused AdamW with the backward's token-chunk budget at
# 16 (default), 64 and 128 MiB, beside PEFT LoRA in the same run.
# Usage: bash benchmarks/host_check.sh
set -u
source benchmarks/gpu_common.sh
export CUDA_VISIBLE_DEVICES=0
step gpu_compile_graph_tests 150 $PY -m pytest -m gpu -q -p no:cacheprovider -rs tests/test_kernels_gpu.py -k "compile or cuda_graph"
cd benchmarks
step cprofile_doracheck 90 $PY host_cprofile_step.py --impl doracheck_bf16 --steps 4
step step_lora 60 $PY bench_step.py --impl peft_lora_bf16 --mode eager_gc --row-out "$R/chunks.csv"
for mib in 16 64 128; do
  step step_chunk$mib 60 $PY bench_step.py --impl doracheck_bf16 --mode eager_gc --backward-chunk-mib $mib --row-out "$R/chunks.csv"
done
cd ..
tail -n 5 "$R/gpu_compile_graph_tests.log"
head -n 50 "$R/cprofile_doracheck.log" | cut -c1-160
cut -d, -f1-9 "$R/chunks.csv"
finish
