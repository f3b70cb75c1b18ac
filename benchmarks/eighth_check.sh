#!/usr/bin/env bash
# Issue 17, eighth session. Parts (comma-separated):
#   tests, memcheck, verify      the GPU tests, compute-sanitizer memcheck on the kernel cases, verify --quick
#   compiled_ab                  compiled decode (static KV cache, reduce-overhead), PEFT LoRA and this
#                                checkout alternating, one process each: lora, dc, lora, dc (settles the
#                                seventh session's 0.70x against 0.98x, which came from two hosts)
#   decode, decode_rep, decode_old  eager decode, PEFT LoRA and doracheck interleaved in one process
#                                (this checkout; _old: the library in .old/, another process)
#   layerhost, layerhost_old     decode_layer_host.py: one layer's T = 1 call and its pieces
#   abstep, abstep_old           ab_step.py: eager step + fused AdamW (GC), LoRA and doracheck in one process
#   decode_flags                 decode_ab.py: LoRA and doracheck, each also with the process's cuBLAS reduction flags off
#   compiled_diag                compiled decode in two modes (about 288 and 358-410 tok/s): profile_decode.py
#                                --graph-logs, doracheck in three processes and LoRA in one, Inductor's logs kept
#   plan_tests                   only tests/test_decode_plan_gpu.py, plain and under memcheck
#   profile_eager                profile_decode.py --eager --cprofile, PEFT LoRA and doracheck (one process each)
# .old/ holds `git archive` of the commit to compare against (ignored by git, named in carry).
set -u
source benchmarks/gpu_common.sh
export CUDA_VISIBLE_DEVICES=0
PARTS=",${1:-tests,memcheck,verify},"
install_old
GPU_TESTS="tests/test_norm_graphs.py tests/test_kernels_gpu.py tests/test_training_loops.py tests/test_autocast.py tests/test_zero_magnitude.py tests/test_inference_norms.py tests/test_compile_fullgraph.py tests/test_decode_plan_gpu.py"
if [[ $PARTS == *,tests,* ]]; then
  # shellcheck disable=SC2086
  step gpu_tests 260 $PY -m pytest -m gpu -q -n 4 -p no:cacheprovider -rs $(ls $GPU_TESTS 2>/dev/null)
fi
if [[ $PARTS == *,memcheck,* ]]; then
  step memcheck 200 compute-sanitizer --tool memcheck --error-exitcode 9 $PY -m pytest -m gpu -q -p no:cacheprovider \
    "${MEMCHECK_IDS[@]}" \
    $(ls tests/test_decode_plan_gpu.py 2>/dev/null)
fi
if [[ $PARTS == *,plan_tests,* ]]; then
  step plan_tests 120 $PY -m pytest -m gpu -q -p no:cacheprovider -rs tests/test_decode_plan_gpu.py
  step plan_memcheck 150 compute-sanitizer --tool memcheck --error-exitcode 9 $PY -m pytest -m gpu -q -p no:cacheprovider tests/test_decode_plan_gpu.py
fi
cd benchmarks
if [[ $PARTS == *,profile_eager,* ]]; then
  step profile_eager_lora 120 $PY profile_decode.py --eager --cprofile --new-tokens 32 --impl peft_lora_bf16 --out "$R/profile_decode_eager_lora.txt"
  step profile_eager_dc 120 $PY profile_decode.py --eager --cprofile --new-tokens 32 --impl doracheck_bf16 --out "$R/profile_decode_eager_dc.txt"
fi
if [[ $PARTS == *,compiled_diag,* ]]; then
  for i in 1 2 3; do
    step compiled_diag_dc_$i 150 $PY profile_decode.py --graph-logs --new-tokens 32 --impl doracheck_bf16 --out "$R/profile_decode_compiled_dc_$i.txt"
  done
  step compiled_diag_lora 150 $PY profile_decode.py --graph-logs --new-tokens 32 --impl peft_lora_bf16 --out "$R/profile_decode_compiled_lora.txt"
  grep -h "wall ms per token" "$R"/profile_decode_compiled_*.txt
fi
if [[ $PARTS == *,compiled_ab,* ]]; then
  for i in 1 2; do
    step compiled_lora_$i 150 $PY bench_step.py --impl peft_lora_bf16 --mode decode_compiled --reps 10 --row-out "$R/decode_compiled_ab.csv"
    step compiled_dc_$i 150 $PY bench_step.py --impl doracheck_bf16 --mode decode_compiled --reps 10 --row-out "$R/decode_compiled_ab.csv"
  done
fi
if [[ $PARTS == *,decode,* ]]; then
  step decode_new 120 $PY decode_ab.py --new-tokens 64 --rounds 5 --csv "$R/decode_new.csv"
  [[ $PARTS == *,decode_rep,* ]] && step decode_rep 120 $PY decode_ab.py --new-tokens 64 --rounds 5 --csv "$R/decode_rep.csv"
  [[ $PARTS == *,decode_old,* && -n ${OLD:-} ]] && step decode_old 120 $OLD $PY decode_ab.py --new-tokens 64 --rounds 5 --csv "$R/decode_old.csv"
fi
if [[ $PARTS == *,decode_flags,* ]]; then
  step decode_flags 150 $PY decode_ab.py --new-tokens 64 --rounds 4 --configs "lora;dc;lora:flags=off;dc:flags=off" --csv "$R/decode_flags.csv"
fi
if [[ $PARTS == *,layerhost,* ]]; then
  step layerhost_new 90 $PY decode_layer_host.py --out "$R/decode_layer_host_new.txt"
  [[ $PARTS == *,layerhost_old,* && -n ${OLD:-} ]] && step layerhost_old 90 $OLD $PY decode_layer_host.py --out "$R/decode_layer_host_old.txt"
fi
if [[ $PARTS == *,abstep,* ]]; then
  step abstep_new 150 $PY ab_step.py --rounds 5 --steps 4 --csv "$R/ab_step_new.csv" --configs "lora;dc"
  [[ $PARTS == *,abstep_old,* && -n ${OLD:-} ]] && step abstep_old 150 $OLD $PY ab_step.py --rounds 5 --steps 4 --csv "$R/ab_step_old.csv" --configs "lora;dc"
fi
cd ..
if [[ $PARTS == *,verify,* ]]; then
  step verify 120 doracheck verify --quick
fi
check_summary
tail -n 2 "$R/plan_tests.log" 2>/dev/null; grep -E "ERROR SUMMARY|passed|failed" "$R/plan_memcheck.log" 2>/dev/null | tail -n 2
grep -h -E "^# |wall ms|profiled:|armed_forward|ArmedPlan|_checked_forward|InferCompose|function calls" "$R/profile_decode_eager_lora.txt" "$R/profile_decode_eager_dc.txt" 2>/dev/null | cut -c1-160 | head -n 30
cut -d, -f1-6,9 "$R/decode_compiled_ab.csv" 2>/dev/null
tail -n 6 "$R/decode_flags.log" 2>/dev/null
tail -n 4 "$R/decode_rep.log" 2>/dev/null
tail -n 4 "$R/decode_new.log" "$R/decode_old.log" "$R/abstep_new.log" "$R/abstep_old.log" 2>/dev/null
head -n 19 "$R/decode_layer_host_new.txt" 2>/dev/null | tail -n 18
head -n 19 "$R/decode_layer_host_old.txt" 2>/dev/null | tail -n 18
finish
