#!/usr/bin/env bash
# Layer timings on one GPU (GPU 0), with nothing else running on the machine (any nvidia-h200 kind).
# Runs: host CPU time per call at 8192x8192, r = 384 (cpu_overhead.py); the layer benchmark,
# nn.Linear / PEFT DoRA / doracheck side by side (bench_layer.py -> $R/layer_h200.csv; extra
# arguments go to it); the same 8192x8192, r = 384 point under the side-by-side timer
# (doracheck bench); a torch.profiler table of one training step (profile_step.py).
# Usage: bash benchmarks/layer_bench.sh [bench_layer.py arguments, e.g. --shapes 8192x8192r384]
set -u
source benchmarks/gpu_common.sh
export CUDA_VISIBLE_DEVICES=0
step cpu_overhead 60 $PY benchmarks/cpu_overhead.py 8192 384
step bench_layer 150 $PY benchmarks/bench_layer.py --csv "$R/layer_h200.csv" "$@"
step bench_side_by_side 60 $PY -m doracheck bench --shapes 8192x8192r384 --tokens 1,4096
step profile 60 $PY benchmarks/profile_step.py 4096,14336,384,4096 8192,8192,384,1 8192,8192,384,4096
head -n 8 "$R/cpu_overhead.log"; grep -E "^8192x8192 r384" "$R/bench_layer.log"; cat "$R/bench_side_by_side.log"
finish
