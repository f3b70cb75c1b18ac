#!/usr/bin/env bash
# The planner's predicted-against-measured tables (doracheck bench --plan --timed: the candidates of
# a row timed side by side on shared inputs; the timing mode's own choice judged on the row's
# independent measurement). One part per device call.
# Usage: bash benchmarks/planner_bench.sh [tables|repeat]   (default: tables)
#   tables  two GPUs (nvidia-h200-x2): GPU 0 the bf16 table over 6 shapes x T 1, 256, 4096, 16384
#           (48 rows) -> $R/plan_h200.csv; GPU 1 meanwhile the fp32 table -> $R/plan_fp32_h200.csv,
#           its CPU threads capped so the host-bound rows on GPU 0 keep their cores.
#   repeat  the bf16 table again, alone on the machine -> $R/plan_h200_validate.csv.
# python benchmarks/plan_reeval.py benchmarks/results/plan_*.csv re-evaluates saved tables offline.
set -u
PART=${1:-tables}
case "$PART" in tables|repeat) ;; *) echo "usage: bash benchmarks/planner_bench.sh [tables|repeat]" >&2; exit 2 ;; esac
source benchmarks/gpu_common.sh
SHAPES=4096x4096r8,4096x4096r64,4096x4096r1024,8192x8192r384,4096x14336r16,14336x4096r128
case "$PART" in
tables)
  (
    export CUDA_VISIBLE_DEVICES=0
    step plan_bf16 330 $PY -m doracheck bench --plan --timed --shapes $SHAPES --tokens 1,256,4096,16384 --dtype bf16 --csv "$R/plan_h200.csv"
  ) &
  (
    export CUDA_VISIBLE_DEVICES=$SECOND_GPU OMP_NUM_THREADS=8
    step plan_fp32 120 $PY -m doracheck bench --plan --timed --shapes 4096x4096r8,4096x4096r1024 --tokens 256,4096,16384 --dtype fp32 --csv "$R/plan_fp32_h200.csv"
  ) &
  wait
  tail -n 2 "$R/plan_fp32.log"; tail -n 2 "$R/plan_bf16.log"
  ;;
repeat)
  export CUDA_VISIBLE_DEVICES=0
  step plan_bf16_validate 330 $PY -m doracheck bench --plan --timed --shapes $SHAPES --tokens 1,256,4096,16384 --dtype bf16 --csv "$R/plan_h200_validate.csv"
  tail -n 2 "$R/plan_bf16_validate.log"
  ;;
esac
finish
