#!/usr/bin/env bash
# Issue 17: after the 64-wide row-dot tiles at every rank, the norm tests at every rank, the
# norm-graph tests, the compose rank probe and verify --quick.
set -u
source benchmarks/gpu_common.sh
export CUDA_VISIBLE_DEVICES=0
step gpu_tests 120 $PY -m pytest -m gpu -q -p no:cacheprovider -rs tests/test_norm_graphs.py \
  tests/test_kernels_gpu.py -k "norm or bitwise or chunked or memory"
step compose_probe 40 $PY benchmarks/compose_rank_probe.py
step verify 60 doracheck verify --quick
grep -v DEBUG "$R/gpu_tests.log" | grep -E "^(FAILED|ERROR)|^E  .*Error|passed|failed" | tail -n 8
cat "$R/compose_probe.log"
grep -E "FAIL|properties" "$R/verify.log" | tail -n 3
finish
