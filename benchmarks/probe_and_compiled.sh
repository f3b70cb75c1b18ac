#!/usr/bin/env bash
# Issue 17: the norm repeatability probe and the compiled step + fused AdamW rows (PEFT LoRA, doracheck).
set -u
source benchmarks/gpu_common.sh
export CUDA_VISIBLE_DEVICES=0
step probe 60 $PY benchmarks/norm_repeat_probe.py
cd benchmarks
step step_compiled 200 $PY bench_step.py --all --impls peft_lora_bf16,doracheck_bf16 --modes compiled --csv "$R/step_compiled.csv"
cd ..
cat "$R/probe.log" | grep -v Warning
tail -n 3 "$R/step_compiled.log"
finish
