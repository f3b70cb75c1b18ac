#!/usr/bin/env bash
# Issue 17, after the norm graphs and the 32 MiB backward chunks: the changed GPU tests, decode
# eager and compiled (PEFT LoRA vs doracheck, one process per row) and the eager step A/B.
set -u
source benchmarks/gpu_common.sh
export CUDA_VISIBLE_DEVICES=0
step gpu_tests 150 $PY -m pytest -m gpu -q -p no:cacheprovider -rs tests/test_norm_graphs.py tests/test_kernels_gpu.py tests/test_autocast.py
cd benchmarks
step ab_step 70 $PY ab_step.py --rounds 6 --steps 4 --csv "$R/ab_step.csv" --configs "lora;dc:graphs=1,chunk=32;dc:graphs=0,chunk=16"
step decode_eager 100 $PY bench_step.py --all --impls peft_lora_bf16,doracheck_bf16 --modes decode_eager --csv "$R/decode_eager.csv"
step decode_compiled 200 $PY bench_step.py --all --impls peft_lora_bf16,doracheck_bf16 --modes decode_compiled --csv "$R/decode_compiled.csv"
cd ..
grep -v DEBUG "$R/gpu_tests.log" | grep -E "^(FAILED|ERROR)|passed|failed" | tail -n 8
tail -n 5 "$R/ab_step.log"
tail -n 3 "$R/decode_eager.log" "$R/decode_compiled.log"
finish
