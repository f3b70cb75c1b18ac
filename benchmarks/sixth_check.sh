#!/usr/bin/env bash
# Issue 17, sixth session: decode. Parts (comma-separated): sweep (compose tiles at T <= 64),
# prepare (the norm-buffer check's host cost), decode (eager A/B, this checkout and, when .old/ is
# carried, the library as it was, each against PEFT LoRA in its own process), compiled (compiled
# decode rows, one process each), profile (profile_decode.py, compiled, LoRA and doracheck), tests, memcheck,
# verify, ab (the eager training step A/B).
# .old/ holds `git archive` of the commit to compare against (ignored by git, named in carry).
set -u
source benchmarks/gpu_common.sh
export CUDA_VISIBLE_DEVICES=0
PARTS=",${1:-sweep,prepare,decode,compiled},"
install_old
GPU_TESTS="tests/test_norm_graphs.py tests/test_kernels_gpu.py tests/test_training_loops.py tests/test_autocast.py tests/test_zero_magnitude.py tests/test_inference_norms.py tests/test_compile_fullgraph.py"
if [[ $PARTS == *,tests,* ]]; then
  # shellcheck disable=SC2086
  step gpu_tests 300 $PY -m pytest -m gpu -q -n 4 -p no:cacheprovider -rs $GPU_TESTS
fi
if [[ $PARTS == *,memcheck,* ]]; then
  # The small-T compose (T = 16 bf16, T = 1 fp32 at r = 1024) and CUDA-graph capture: 50 s under memcheck.
  # (A wider subset of 23 tests ran out of 240 s after 14.)
  step memcheck 240 compute-sanitizer --tool memcheck --error-exitcode 9 $PY -m pytest -m gpu -q -p no:cacheprovider \
    "tests/test_kernels_gpu.py::test_forward_backward_within_budget[(1031, 4099, 384, 16)-bfloat16-bfloat16]" \
    "tests/test_kernels_gpu.py::test_forward_backward_within_budget[(64, 8192, 1024, 1)-float32-float32]" \
    "tests/test_kernels_gpu.py::test_inference_is_capturable_in_a_cuda_graph_and_replays_the_parameters_of_the_moment[False]"
fi
if [[ $PARTS == *,verify,* ]]; then
  step verify 150 doracheck verify --quick
fi
cd benchmarks
if [[ $PARTS == *,sweep,* ]]; then
  step sweep 200 $PY compose_small_t.py --csv "$R/compose_small_t.csv"
fi
if [[ $PARTS == *,prepare,* ]]; then
  step prepare_new 90 $PY prepare_cost.py --device cuda --hidden 4096 --intermediate 14336 --heads 32 --kv-heads 8 --rank 384
  [[ -n ${OLD:-} ]] && step prepare_old 90 $OLD $PY prepare_cost.py --device cuda --hidden 4096 --intermediate 14336 --heads 32 --kv-heads 8 --rank 384
fi
if [[ $PARTS == *,decode,* ]]; then
  step decode_new 150 $PY decode_ab.py --new-tokens 64 --rounds 5 --csv "$R/decode_new.csv"
  [[ -n ${OLD:-} ]] && step decode_old 150 $OLD $PY decode_ab.py --new-tokens 64 --rounds 5 --csv "$R/decode_old.csv"
fi
if [[ $PARTS == *,compiled,* ]]; then
  step compiled_lora 180 $PY bench_step.py --impl peft_lora_bf16 --mode decode_compiled --reps 10 --row-out "$R/decode_compiled.csv"
  step compiled_new 180 $PY bench_step.py --impl doracheck_bf16 --mode decode_compiled --reps 10 --row-out "$R/decode_compiled.csv"
  [[ -n ${OLD:-} ]] && step compiled_old 180 $OLD $PY bench_step.py --impl doracheck_bf16 --mode decode_compiled --reps 10 --row-out "$R/decode_compiled_old.csv"
fi
if [[ $PARTS == *,profile,* ]]; then
  step profile_lora 150 $PY profile_decode.py --impl peft_lora_bf16 --out "$R/profile_decode_lora.txt"
  step profile_dc 150 $PY profile_decode.py --impl doracheck_bf16 --out "$R/profile_decode_dc.txt"
fi
if [[ $PARTS == *,ab,* ]]; then
  step ab_step 150 $PY ab_step.py --rounds 5 --steps 4 --csv "$R/ab_step.csv" --configs "lora;dc"
fi
cd ..
check_summary
tail -n 12 "$R/sweep.log" 2>/dev/null
tail -n 1 "$R/prepare_new.log" "$R/prepare_old.log" 2>/dev/null
tail -n 5 "$R/decode_new.log" "$R/decode_old.log" 2>/dev/null
cut -d, -f1-6,9 "$R/decode_compiled.csv" "$R/decode_compiled_old.csv" 2>/dev/null
grep -h -E "^# |wall ms|profiled|graph_break|unique_graphs" "$R/profile_decode_lora.txt" "$R/profile_decode_dc.txt" 2>/dev/null | cut -c1-160
tail -n 5 "$R/ab_step.log" 2>/dev/null
finish
