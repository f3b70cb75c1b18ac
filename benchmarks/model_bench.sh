#!/usr/bin/env bash
# Model timings on one GPU (GPU 0), with nothing else running on the machine (any nvidia-h200 kind):
# the LLaMA-style decoder with PEFT LoRA, PEFT DoRA and doracheck, training step, inference and
# decode (bench_model.py -> $R/model_h200.csv; extra arguments go to it).
# Usage: bash benchmarks/model_bench.sh [bench_model.py arguments, e.g. --optimizer adamw_fused]
set -u
source benchmarks/gpu_common.sh
export CUDA_VISIBLE_DEVICES=0
step bench_model 300 $PY benchmarks/bench_model.py --csv "$R/model_h200.csv" "$@"
cut -d, -f1-9 "$R/model_h200.csv"
finish
