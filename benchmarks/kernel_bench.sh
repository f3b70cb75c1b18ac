#!/usr/bin/env bash
# Kernel timings on one GPU (GPU 0), with nothing else running on the machine (any nvidia-h200 kind):
# copy and GEMM ceilings, the factored norm and its parts at 8192x8192, r = 384, and the row-dot,
# compose and dz/dm config sweeps (kernel_timing.py -> $R/kernels_h200.csv).
# Usage: bash benchmarks/kernel_bench.sh
set -u
source benchmarks/gpu_common.sh
export CUDA_VISIBLE_DEVICES=0
step kernel_timing 180 $PY benchmarks/kernel_timing.py --csv "$R/kernels_h200.csv"
grep -E "^(ceiling|norm)" "$R/kernel_timing.log"; grep -E "^best" "$R/kernel_timing.log"
finish
