#!/usr/bin/env bash
# The loop users run, on one GPU: training steps with optimizer.step() (fused AdamW), eager with
# checkpointing and compiled, decode eager and compiled (bench_step.py, one process per row), and
# a torch.profiler breakdown of the eager step (profile_model_step.py).
# Usage: bash benchmarks/loop_bench.sh PARTS   (comma-separated, in this order; default all)
#   tests     GPU tests of the compiled / CUDA-graph paths and the inference norm buffers
#   decode    decode rows, eager and compiled (PEFT LoRA, doracheck)
#   compiled  compiled step + fused AdamW rows (PEFT LoRA, doracheck, PEFT DoRA)
#   eager     eager step + fused AdamW rows (GC; PEFT LoRA, PEFT DoRA bf16/fp32, doracheck bf16/fp32)
#             and the torch.profiler breakdown
set -u
PARTS=",${1:-tests,decode,compiled,eager},"
has() { [[ "$PARTS" == *",$1,"* ]]; }
source benchmarks/gpu_common.sh
export CUDA_VISIBLE_DEVICES=0
if has tests; then
  step gpu_tests 120 $PY -m pytest -m gpu -q -p no:cacheprovider -rs tests/test_inference_norms.py \
    tests/test_kernels_gpu.py -k "compile or cuda_graph or reduce_overhead or follow"
fi
cd benchmarks
run_rows() {  # NAME SECONDS IMPLS MODES
  step "$1" "$2" $PY bench_step.py --all --impls "$3" --modes "$4" --csv "$R/$1.csv"
}
if has decode; then
  run_rows decode_eager 100 peft_lora_bf16,doracheck_bf16 decode_eager
  run_rows decode_compiled 200 peft_lora_bf16,doracheck_bf16 decode_compiled
fi
if has compiled; then
  run_rows step_compiled 240 peft_lora_bf16,doracheck_bf16,peft_dora_bf16 compiled
fi
if has eager; then
  run_rows step_eager 160 peft_lora_bf16,peft_dora_bf16,peft_dora_fp32,doracheck_bf16,doracheck_fp32 eager_gc
  step profile_eager 120 $PY profile_model_step.py --impls peft_lora_bf16,doracheck_bf16 --mode eager_gc --json-out "$R/profile_eager.json"
fi
cd ..
[ -f "$R/gpu_tests.log" ] && { grep -v DEBUG "$R/gpu_tests.log" | tail -n 4; }
for f in decode_eager decode_compiled step_compiled step_eager profile_eager; do
  [ -f "$R/$f.log" ] && { echo "== $f"; tail -n 12 "$R/$f.log"; }
done
finish
