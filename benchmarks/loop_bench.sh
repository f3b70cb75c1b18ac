#!/usr/bin/env bash
# The loop users run, on one GPU: training steps with optimizer.step() (fused AdamW), eager with
# checkpointing and compiled, decode eager and compiled (bench_step.py, one process per row), and
# a torch.profiler breakdown of the eager step (profile_model_step.py). Steps are ordered by
# priority so a run cut short keeps the most important rows.
# Usage: bash benchmarks/loop_bench.sh [eager|compiled|decode|all]   (default all)
#   decode: the decode rows only (eager and compiled), plus the GPU tests of the norm buffers.
set -u
PART=${1:-all}
source benchmarks/gpu_common.sh
export CUDA_VISIBLE_DEVICES=0
if [ "$PART" = decode ]; then
  step gpu_tests 120 $PY -m pytest -m gpu -q -p no:cacheprovider -rs tests/test_inference_norms.py \
    tests/test_kernels_gpu.py -k "compile or cuda_graph or reduce_overhead or follow"
fi
cd benchmarks
run_rows() {  # NAME SECONDS IMPLS MODES
  step "$1" "$2" $PY bench_step.py --all --impls "$3" --modes "$4" --csv "$R/$1.csv"
}
if [ "$PART" = decode ]; then
  run_rows decode_eager 90 peft_lora_bf16,doracheck_bf16 decode_eager
  run_rows decode_compiled 300 peft_lora_bf16,doracheck_bf16,peft_dora_bf16 decode_compiled
fi
if [ "$PART" = eager ] || [ "$PART" = all ]; then
  run_rows step_eager 160 peft_lora_bf16,peft_dora_bf16,peft_dora_fp32,doracheck_bf16,doracheck_fp32 eager_gc
  step profile_eager 120 $PY profile_model_step.py --impls peft_lora_bf16,doracheck_bf16 --mode eager_gc --json-out "$R/profile_eager.json"
  run_rows decode_eager 80 peft_lora_bf16,doracheck_bf16 decode_eager
fi
if [ "$PART" = compiled ] || [ "$PART" = all ]; then
  run_rows step_compiled 240 peft_lora_bf16,doracheck_bf16,peft_dora_bf16 compiled
  run_rows decode_compiled 200 peft_lora_bf16,doracheck_bf16 decode_compiled
fi
cd ..
for f in gpu_tests step_eager profile_eager decode_eager step_compiled decode_compiled; do
  [ -f "$R/$f.log" ] && { echo "== $f"; tail -n 30 "$R/$f.log"; }
done
finish
