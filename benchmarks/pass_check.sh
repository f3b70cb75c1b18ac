#!/usr/bin/env bash
# Issue 17, fifth session: whole-pass CUDA graphs (doracheck/pass_graphs.py) on the GPU: their own
# tests, the real-loop GPU suites with them on, memcheck, the host cost of one layer with them on,
# and the eager step A/B (PEFT LoRA; doracheck without and with pass graphs) in one process.
# Parts (comma-separated, default all): tests, suites, memcheck, host, ab.
set -u
source benchmarks/gpu_common.sh
export CUDA_VISIBLE_DEVICES=0
PARTS=",${1:-tests,suites,memcheck,host,ab},"
SUITES="tests/test_norm_graphs.py tests/test_kernels_gpu.py tests/test_training_loops.py tests/test_autocast.py tests/test_zero_magnitude.py tests/test_inference_norms.py tests/test_peft_integration.py"
if [[ $PARTS == *,tests,* ]]; then
  step pass_tests 200 $PY -m pytest -m gpu -q -p no:cacheprovider -rs tests/test_pass_graphs.py
fi
if [[ $PARTS == *,suites,* ]]; then
  # shellcheck disable=SC2086
  DORACHECK_PASS_GRAPHS=1 step suites_pass_on 300 $PY -m pytest -m gpu -q -n 4 -p no:cacheprovider -rs $SUITES
fi
if [[ $PARTS == *,memcheck,* ]]; then
  # The norm-graph test that makes a capture fail on purpose is left out: its CUDA API errors are the point.
  step memcheck 240 compute-sanitizer --tool memcheck --error-exitcode 9 $PY -m pytest -m gpu -q -p no:cacheprovider \
    tests/test_pass_graphs.py tests/test_norm_graphs.py -k "one_layer or (norm_graphs and not failed_capture)"
fi
cd benchmarks
if [[ $PARTS == *,host,* ]]; then
  DORACHECK_PASS_GRAPHS=1 step host_pass_4096 90 $PY host_breakdown.py --d-out 4096 --out "$R/host_pass_4096.txt"
fi
if [[ $PARTS == *,ab,* ]]; then
  step ab_blocked 150 $PY ab_step.py --blocked --rounds 5 --steps 4 --csv "$R/ab_blocked.csv" \
    --configs "lora;dc:graphs=1,chunk=32;dc:graphs=1,chunk=32,pass=1"
fi
cd ..
for f in pass_tests suites_pass_on; do grep -v DEBUG "$R/$f.log" 2>/dev/null | grep -E "^(FAILED|ERROR)|passed|failed" | tail -n 8; done
grep -E "ERROR SUMMARY|passed|failed" "$R/memcheck.log" 2>/dev/null | tail -n 3
head -n 8 "$R/host_pass_4096.txt" 2>/dev/null
tail -n 7 "$R/ab_blocked.log" 2>/dev/null
finish
