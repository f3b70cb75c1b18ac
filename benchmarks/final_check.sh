#!/usr/bin/env bash
# Last device call of the session (issue 17): the fp32 CUDA-graph test of the norm buffers, the
# eager step + fused AdamW rows the README quotes.
set -u
source benchmarks/gpu_common.sh
export CUDA_VISIBLE_DEVICES=0
step gpu_tests 70 $PY -m pytest -m gpu -q -p no:cacheprovider -rs tests/test_inference_norms.py
cd benchmarks
step step_eager 100 $PY bench_step.py --all --impls peft_lora_bf16,doracheck_bf16,doracheck_fp32,peft_dora_fp32 --modes eager_gc --csv "$R/step_eager.csv"
cd ..
grep -v DEBUG "$R/gpu_tests.log" | tail -n 3
tail -n 6 "$R/step_eager.log"
finish
