#!/usr/bin/env bash
# Issue 17, fifth session: the decode graphs (doracheck/decode_graphs.py) on the GPU: their tests, the
# inference-norm GPU tests with them on, and the eager decode A/B (PEFT LoRA; doracheck without and with them).
set -u
source benchmarks/gpu_common.sh
export CUDA_VISIBLE_DEVICES=0
step decode_tests 45 $PY -m pytest -m gpu -q -p no:cacheprovider -rs tests/test_decode_graphs.py
DORACHECK_DECODE_GRAPHS=1 step inference_norms_on 45 $PY -m pytest -m gpu -q -p no:cacheprovider -rs tests/test_inference_norms.py
cd benchmarks
step decode_ab 50 $PY decode_ab.py --new-tokens 32 --rounds 3 --csv "$R/decode_ab.csv"
cd ..
for f in decode_tests inference_norms_on; do grep -E "^(FAILED|ERROR)|^E  |passed|failed" "$R/$f.log" | tail -n 6; done
tail -n 8 "$R/decode_ab.log"
finish
