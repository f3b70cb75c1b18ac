#!/usr/bin/env bash
# Issue 17, seventh session: generate prepared once per call (no graph break in compiled decode),
# then the eager decode layer's host time. Parts (comma-separated): tests, memcheck, verify,
# compiled (compiled decode: PEFT LoRA, this checkout, and the library in .old/ when carried; one
# process each), decode (eager decode A/B against PEFT LoRA, this checkout and .old/), layerhost
# (decode_layer_host.py: one layer's T = 1 call and its pieces, this checkout; layerhost_old adds .old/), profile
# (profile_decode.py, compiled, LoRA and doracheck), peft_tests (the GPU tests minus the kernel files),
# compiled_pair (compiled decode of PEFT LoRA and this checkout only).
# .old/ holds `git archive` of the commit to compare against (ignored by git, named in carry).
set -u
source benchmarks/gpu_common.sh
export CUDA_VISIBLE_DEVICES=0
PARTS=",${1:-tests,compiled,decode,layerhost,verify},"
install_old
[[ $PARTS == *,peft_tests,* ]] && PARTS="$PARTS,tests," && GPU_TESTS_ONLY="tests/test_training_loops.py tests/test_autocast.py tests/test_zero_magnitude.py tests/test_inference_norms.py tests/test_compile_fullgraph.py"
GPU_TESTS="tests/test_norm_graphs.py tests/test_kernels_gpu.py tests/test_training_loops.py tests/test_autocast.py tests/test_zero_magnitude.py tests/test_inference_norms.py tests/test_compile_fullgraph.py"
if [[ $PARTS == *,tests,* ]]; then
  # shellcheck disable=SC2086
  step gpu_tests 240 $PY -m pytest -m gpu -q -n 4 -p no:cacheprovider -rs ${GPU_TESTS_ONLY:-$GPU_TESTS}
fi
if [[ $PARTS == *,memcheck,* ]]; then
  step memcheck 200 compute-sanitizer --tool memcheck --error-exitcode 9 $PY -m pytest -m gpu -q -p no:cacheprovider \
    "${MEMCHECK_IDS[@]}"
fi
cd benchmarks
if [[ $PARTS == *,compiled,* || $PARTS == *,compiled_pair,* ]]; then
  step compiled_lora 150 $PY bench_step.py --impl peft_lora_bf16 --mode decode_compiled --reps 10 --row-out "$R/decode_compiled.csv"
  step compiled_new 150 $PY bench_step.py --impl doracheck_bf16 --mode decode_compiled --reps 10 --row-out "$R/decode_compiled.csv"
  [[ $PARTS == *,compiled,* && -n ${OLD:-} ]] && step compiled_old 150 $OLD $PY bench_step.py --impl doracheck_bf16 --mode decode_compiled --reps 10 --row-out "$R/decode_compiled_old.csv"
fi
if [[ $PARTS == *,decode,* ]]; then
  step decode_new 120 $PY decode_ab.py --new-tokens 64 --rounds 5 --csv "$R/decode_new.csv"
  [[ -n ${OLD:-} ]] && step decode_old 120 $OLD $PY decode_ab.py --new-tokens 64 --rounds 5 --csv "$R/decode_old.csv"
fi
if [[ $PARTS == *,profile,* ]]; then
  step profile_lora 150 $PY profile_decode.py --impl peft_lora_bf16 --out "$R/profile_decode_lora.txt"
  step profile_dc 150 $PY profile_decode.py --impl doracheck_bf16 --out "$R/profile_decode_dc.txt"
fi
if [[ $PARTS == *,layerhost,* ]]; then
  step layerhost_new 90 $PY decode_layer_host.py --out "$R/decode_layer_host_new.txt"
  # The old library has no decode_layer_host.py; it runs this checkout's script against the old package.
  [[ $PARTS == *,layerhost_old,* && -n ${OLD:-} ]] && step layerhost_old 90 $OLD $PY decode_layer_host.py --out "$R/decode_layer_host_old.txt"
fi
cd ..
if [[ $PARTS == *,verify,* ]]; then
  step verify 120 doracheck verify --quick
fi
check_summary
cut -d, -f1-6,9 "$R/decode_compiled.csv" "$R/decode_compiled_old.csv" 2>/dev/null
tail -n 5 "$R/decode_new.log" "$R/decode_old.log" 2>/dev/null
head -n 17 "$R/decode_layer_host_new.txt" 2>/dev/null | tail -n 16
head -n 5 "$R/decode_layer_host_old.txt" 2>/dev/null | tail -n 4
grep -h -E "^# |wall ms|profiled|graph_break|unique_graphs|Cache Lookup|CUDAGraphNode.record|Call CompiledFxGraph|Compiled Region" "$R/profile_decode_lora.txt" "$R/profile_decode_dc.txt" 2>/dev/null | cut -c1-150
finish
