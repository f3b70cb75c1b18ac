#!/usr/bin/env bash
# Issue 17, ninth session: the training step's host time. Parts (comma-separated):
#   tests, memcheck, verify      the GPU tests, compute-sanitizer memcheck on the kernel cases, verify --quick
#   retest                       the GPU tests a fix was made for (zero-magnitude, compile)
#   profile                      profile_model_step.py (torch.profiler, eager GC + fused AdamW), LoRA and doracheck
#   cprofile                     host_cprofile_step.py: cProfile of doracheck's model step
#   gaps                         step_gaps.py: where the GPU waits for the host in the step, LoRA and doracheck
#   abstep, abstep_old           ab_step.py: eager step + fused AdamW (GC), LoRA and doracheck in one process
#                                (this checkout; _old: the library in .old/), alternating new, old, new, old
#                                (ABSTEP_ROUNDS: the process pairs' numbers, default "1 2")
#   phases                       phase_lag.py: host, elapsed and GPU-only ms of forward, backward and optimizer step
#   phases_reversed              the same, the models built in the other order
#   phases_plans                 phase_lag.py: LoRA, doracheck, doracheck without its training plans (twelfth session)
#   breakdown                    host_breakdown.py: host µs of each part of one layer call (4096², r 384, T 16)
#   lines                        layer_host.py: one layer's training call, host µs, LoRA and doracheck with and
#                                without plans; then py-spy line samples of a loop of each (LINES_ROWS; .tools/ carried)
#   lines_ab                     layer_host.py with this checkout and with .old/, alternating, twice
#   abplans                      ab_step.py: LoRA, doracheck, doracheck without its training plans, interleaved in one
#                                process, twice
#   decode                       decode_ab.py: eager decode, LoRA and doracheck interleaved in one process
#   decode_ab                    the same, this checkout and .old/ in alternating processes, twice
#   sample                       host_sample_step.py under py-spy (non-blocking, 250 Hz), LoRA and doracheck, and
#                                stack_summary.py of each (needs the py-spy wheel in .tools/, carried; SAMPLE_IMPLS:
#                                which, default both)
#   layer_step                   bench_layer.py at 8192², r 384, T 4096 and T 1: infer, train (no optimizer) and step
#                                (+ fused AdamW) for nn.Linear, PEFT DoRA and doracheck (thirteenth session)
#   decode_compiled              decode_ab.py --compiled: compiled decode (static cache, reduce-overhead), LoRA and
#                                doracheck interleaved in one process, twice
#   rowdot                       rowdot_order_probe.py: the norm's row-dot kernel at the model's shapes, µs and output
#                                digests, this checkout (split K 1, 2, 4) and .old/ (thirteenth session)
#   rowdot_tiles                 rowdot_tile_probe.py: candidate row-dot tiles, right and repeatable or not, and µs
#   graphs_order                 tests/test_norm_graphs.py in one process, a failed capture first (the RNG state)
#   graphs_mutant                the RNG test with the fix taken out: it must fail (rc 1)
#   profile_compiled             profile_model_step.py --mode compiled: LoRA, doracheck, PEFT DoRA (bf16), kernels by GPU time
#   normpath                     norm_path_probe.py: the norm's row-dot and cuBLAS paths and reduction tiles (fourteenth session)
#   layer_step_old               bench_layer.py --modes step for nn.Linear and doracheck from .old/, then this checkout
#                                (LAYER_OLD_IMPLS: which rows, default linear,doracheck_bf16)
#   compiled_step                bench_step.py --mode compiled (+ fused AdamW), one process per row: LoRA, PEFT DoRA,
#                                doracheck, and doracheck from .old/ (COMPILED_IMPLS: which rows)
#   normpath_ab                  norm_path_probe.py, row-dot and shipped cuBLAS paths only: bf16 adapters with this checkout
#                                and .old/ (the Gram product's A/B), fp32 adapters with this checkout (fifteenth session)
#   fp32_step                    bench_step.py --mode eager_gc + fused AdamW, fp32 adapters: PEFT DoRA, doracheck, and
#                                doracheck from .old/, one process each (fifteenth session)
#   anatomy                      layer_step_anatomy.py: one layer's step (8192², r 384, T 1 and 4096, fused AdamW),
#                                host µs per phase, syncs, profiler ops, nn.Linear and doracheck (sixteenth session)
#   cublas_tests                 the cuBLAS norm path's GPU test, every weight and adapter dtype pair (sixteenth session)
#   fusedpass, fusedpass_old     fused_pass_probe.py: compose and dz/dm tile sweeps with floors, this checkout / .old/
#                                (FUSED_ONLY=compose or grad: one of the two)
#   compile_time                 compile_time_probe.py: the compiled step's first call with empty Inductor and Triton caches,
#                                one process per row (COMPILE_TIME_IMPLS), dynamo's phase times; then doracheck's first call
#                                under cProfile (COMPILE_PROFILE_IMPLS; set it empty for none) (eighteenth session)
#   compose_variants             compose_variants_probe.py: the compose kernel's structure (early epilogue loads,
#                                persistent over TMA descriptors), floors and the shipped kernel (seventeenth session)
# .old/ holds `git archive` of the commit to compare against (ignored by git, named in carry).
set -u
source benchmarks/gpu_common.sh
export CUDA_VISIBLE_DEVICES=0
PARTS=",${1:-tests,memcheck,verify},"
install_old
GPU_TESTS="tests/test_norm_graphs.py tests/test_kernels_gpu.py tests/test_training_loops.py tests/test_autocast.py tests/test_zero_magnitude.py tests/test_inference_norms.py tests/test_compile_fullgraph.py tests/test_decode_plan_gpu.py tests/test_train_plan.py tests/test_ops_fakes.py tests/test_norm_groups.py"
if [[ $PARTS == *,tests,* ]]; then
  # shellcheck disable=SC2086
  step gpu_tests 260 $PY -m pytest -m gpu -q -n 4 -p no:cacheprovider -rs $(ls $GPU_TESTS 2>/dev/null)
fi
if [[ $PARTS == *,graphs_order,* ]]; then  # the failed capture's test before the ones that draw CUDA random numbers
  step graphs_order 150 $PY -m pytest -m gpu -q -p no:cacheprovider -rs \
    "tests/test_norm_graphs.py::test_a_failed_capture_leaves_the_default_generator_usable_and_where_it_was" \
    "tests/test_norm_graphs.py::test_a_failed_capture_leaves_the_allocator_usable_and_graphs_off" \
    "tests/test_norm_graphs.py::test_a_fused_adamw_layer_loop_is_bitwise_the_same_with_and_without_graphs" \
    tests/test_train_plan.py
fi
if [[ $PARTS == *,graphs_mutant,* ]]; then  # the RNG test must fail with the generator left in capture mode
  step graphs_mutant 120 $PY -c "import sys, pytest
from doracheck.kernels import norm_graphs
norm_graphs._end_generator_capture = lambda device: None  # the fix taken out
sys.exit(pytest.main(['-m', 'gpu', '-q', '-p', 'no:cacheprovider',
  'tests/test_norm_graphs.py::test_a_failed_capture_leaves_the_default_generator_usable_and_where_it_was']))"
fi
if [[ $PARTS == *,retest,* ]]; then  # the tests that failed in the previous call, after their fix
  step retest 200 $PY -m pytest -m gpu -q -p no:cacheprovider -rs tests/test_zero_magnitude.py \
    "tests/test_kernels_gpu.py::test_torch_compile_fullgraph_within_the_oracle_budget" tests/test_compile_fullgraph.py
fi
if [[ $PARTS == *,memcheck,* ]]; then
  step memcheck 240 compute-sanitizer --tool memcheck --error-exitcode 9 $PY -m pytest -m gpu -q -p no:cacheprovider \
    "${MEMCHECK_IDS[@]}" \
    $(ls tests/test_decode_plan_gpu.py 2>/dev/null) \
    "tests/test_train_plan.py::test_gpu_training_with_plans_is_bitwise_without_them_in_bf16[checkpointing]"
fi
cd benchmarks
if [[ $PARTS == *,profile,* ]]; then
  step profile 200 $PY profile_model_step.py --impls peft_lora_bf16,doracheck_bf16 --mode eager_gc --steps 3 --json-out "$R/profile_step.json"
fi
if [[ $PARTS == *,profile_compiled,* ]]; then
  step profile_compiled 300 $PY profile_model_step.py --impls peft_lora_bf16,doracheck_bf16,peft_dora_bf16 --mode compiled \
    --steps 3 --top-gpu 25 --json-out "$R/profile_step_compiled.json"
fi
if [[ $PARTS == *,cprofile,* ]]; then
  step cprofile 150 $PY host_cprofile_step.py --impl doracheck_bf16 --steps 4
fi
if [[ $PARTS == *,gaps,* ]]; then
  step gaps 240 $PY step_gaps.py --impls peft_lora_bf16,doracheck_bf16 --steps 2 --json-out "$R/step_gaps.json"
fi
if [[ $PARTS == *,abstep,* ]]; then
  for i in ${ABSTEP_ROUNDS:-1 2}; do
    step abstep_new_$i 150 $PY ab_step.py --rounds 5 --steps 4 --csv "$R/ab_step_new_$i.csv" --configs "lora;dc"
    [[ $PARTS == *,abstep_old,* && -n ${OLD:-} ]] && step abstep_old_$i 150 $OLD $PY ab_step.py --rounds 5 --steps 4 --csv "$R/ab_step_old_$i.csv" --configs "lora;dc"
  done
fi
if [[ $PARTS == *,phases,* ]]; then
  step phases 200 $PY phase_lag.py --impls peft_lora_bf16,doracheck_bf16 --steps 6 --csv "$R/phase_lag.csv"
fi
if [[ $PARTS == *,phases_reversed,* ]]; then  # the same, the models built in the other order
  step phases_reversed 200 $PY phase_lag.py --impls doracheck_bf16,peft_lora_bf16 --steps 6 \
    --csv "$R/phase_lag_reversed.csv"
fi
if [[ $PARTS == *,phases_plans,* ]]; then
  step phases_plans 240 $PY phase_lag.py --impls peft_lora_bf16,doracheck_bf16,doracheck_bf16:plans=0 --steps 6 \
    --csv "$R/phase_lag_plans.csv"
fi
if [[ $PARTS == *,breakdown,* ]]; then
  step breakdown 150 $PY host_breakdown.py --out "$R/host_breakdown.txt"
fi
if [[ $PARTS == *,lines,* ]]; then  # one layer's host time per call, and line by line under py-spy (needs .tools/)
  step layer_host 150 $PY layer_host.py
  $PY -m pip install -q --no-deps ../.tools/py_spy*.whl >"$R/pyspy_install.log" 2>&1
  for row in ${LINES_ROWS:-dc_fwd lora_fwd dc_step}; do
    step lines_$row 60 py-spy record --nonblocking --format raw --rate 1000 -o "$R/lines_$row.txt" -- \
      $PY layer_host.py --loop $row --seconds 15
    $PY stack_summary.py "$R/lines_$row.txt" --files doracheck,kernels,peft,torch --top 70 >"$R/lines_summary_$row.txt"
    gzip -f "$R/lines_$row.txt"
  done
fi
if [[ $PARTS == *,lines_ab,* && -n ${OLD:-} ]]; then  # layer_host.py, this checkout and .old/ alternating, twice
  for i in 1 2; do
    step layer_host_new_$i 100 $PY layer_host.py --calls 100
    step layer_host_old_$i 100 $OLD $PY layer_host.py --calls 100
  done
fi
if [[ $PARTS == *,abplans,* ]]; then
  for i in 1 2; do
    step abplans_$i 170 $PY ab_step.py --rounds 5 --steps 4 --csv "$R/ab_step_plans_$i.csv" --configs "lora;dc:chunk=32;dc:chunk=32,plans=0"
  done
fi
if [[ $PARTS == *,sample,* ]]; then  # where the host time goes, without a tracing profiler's inflation
  $PY -m pip install -q --no-deps ../.tools/py_spy*.whl >"$R/pyspy_install.log" 2>&1
  for i in ${SAMPLE_IMPLS:-peft_lora_bf16 doracheck_bf16}; do
    step sample_$i 150 py-spy record --nonblocking --format raw --rate 250 -o "$R/stacks_$i.txt" -- \
      $PY host_sample_step.py --impl $i --steps 40 --warmup 5
    $PY stack_summary.py "$R/stacks_$i.txt" --rate 250 --steps 45 --top 70 >"$R/summary_$i.txt" && gzip -f "$R/stacks_$i.txt"
  done
fi
if [[ $PARTS == *,rowdot,* ]]; then  # the norm's row-dot kernel: this checkout (split K 1, 2, 4) and .old/
  step rowdot_new 150 $PY rowdot_order_probe.py --splits 1,2,4 --label new --csv "$R/rowdot_new.csv"
  [[ -n ${OLD:-} ]] && step rowdot_old 150 $OLD $PY rowdot_order_probe.py --label old --csv "$R/rowdot_old.csv"
fi
if [[ $PARTS == *,rowdot_tiles,* ]]; then
  step rowdot_tiles 320 $PY rowdot_tile_probe.py --csv "$R/rowdot_tiles.csv"
fi
if [[ $PARTS == *,normpath,* ]]; then
  step normpath 300 $PY norm_path_probe.py --csv "$R/normpath.csv"
fi
if [[ $PARTS == *,normpath_ab,* ]]; then
  step normpath_bf16 150 $PY norm_path_probe.py --only row_dot,cublas --csv "$R/normpath_bf16.csv"
  [[ -n ${OLD:-} ]] && step normpath_bf16_old 150 $OLD $PY norm_path_probe.py --only row_dot,cublas --csv "$R/normpath_bf16_old.csv"
  step normpath_fp32 150 $PY norm_path_probe.py --adapters fp32 --only row_dot,cublas --csv "$R/normpath_fp32.csv"
fi
if [[ $PARTS == *,fp32_step,* ]]; then
  for impl in peft_dora_fp32 doracheck_fp32 old:doracheck_fp32; do
    if [[ $impl == old:* ]]; then
      [[ -n ${OLD:-} ]] && step fp32_step_old 200 $OLD $PY bench_step.py --impl ${impl#old:} --mode eager_gc \
        --optimizer adamw_fused --row-out "$R/fp32_step_old.csv"
    else
      step fp32_step_$impl 200 $PY bench_step.py --impl $impl --mode eager_gc --optimizer adamw_fused --row-out "$R/fp32_step.csv"
    fi
  done
fi
if [[ $PARTS == *,fusedpass,* ]]; then
  step fusedpass 240 $PY fused_pass_probe.py ${FUSED_ONLY:+--only $FUSED_ONLY} --csv "$R/fusedpass.csv"
fi
if [[ $PARTS == *,fusedpass_old,* && -n ${OLD:-} ]]; then
  step fusedpass_old 200 $OLD $PY fused_pass_probe.py ${FUSED_ONLY:+--only $FUSED_ONLY} --csv "$R/fusedpass_old.csv"
fi
if [[ $PARTS == *,compose_variants,* ]]; then
  step compose_variants 240 $PY compose_variants_probe.py --csv "$R/compose_variants.csv"
fi
if [[ $PARTS == *,compile_time,* ]]; then  # cold caches per process; then the first call under cProfile
  # traced:IMPL runs IMPL with DORACHECK_TRACE_KERNELS=1 (kernels traced into the graph, as before the eighteenth session)
  for impl in ${COMPILE_TIME_IMPLS:-peft_lora_bf16 peft_dora_bf16 doracheck_bf16}; do
    if [[ $impl == traced:* ]]; then
      step compile_time_traced_${impl#traced:} 240 env DORACHECK_TRACE_KERNELS=1 TORCH_LOGS=recompiles $PY compile_time_probe.py \
        --impl ${impl#traced:} --json "$R/compile_time.jsonl"
    else
      step compile_time_$impl 240 env TORCH_LOGS=recompiles $PY compile_time_probe.py --impl $impl --json "$R/compile_time.jsonl"
    fi
  done
  for impl in ${COMPILE_PROFILE_IMPLS-doracheck_bf16}; do
    step compile_profile_$impl 300 $PY compile_time_probe.py --impl $impl --cprofile "$R/compile_profile_$impl.txt"
  done
fi
if [[ $PARTS == *,compiled_step,* ]]; then
  for impl in ${COMPILED_IMPLS:-peft_lora_bf16 doracheck_bf16 old:doracheck_bf16 peft_dora_bf16}; do
    if [[ $impl == old:* ]]; then
      [[ -n ${OLD:-} ]] && step compiled_old_${impl#old:} 200 $OLD $PY bench_step.py --impl ${impl#old:} --mode compiled \
        --optimizer adamw_fused --row-out "$R/compiled_step_old.csv"
    else
      step compiled_$impl 200 $PY bench_step.py --impl $impl --mode compiled --optimizer adamw_fused --row-out "$R/compiled_step.csv"
    fi
  done
fi
if [[ $PARTS == *,layer_step,* ]]; then
  step layer_step 240 $PY bench_layer.py --shapes 8192x8192r384 --tokens 4096,1 \
    --impls linear,peft_dora_bf16,doracheck_bf16,doracheck_fp32 --csv "$R/layer_step.csv"
fi
if [[ $PARTS == *,layer_step_old,* && -n ${OLD:-} ]]; then  # the same rows from .old/, then this checkout again
  step layer_step_old 200 $OLD $PY bench_layer.py --shapes 8192x8192r384 --tokens 4096,1 --modes step \
    --impls ${LAYER_OLD_IMPLS:-linear,doracheck_bf16} --csv "$R/layer_step_old.csv"
  step layer_step_new2 200 $PY bench_layer.py --shapes 8192x8192r384 --tokens 4096,1 --modes step \
    --impls ${LAYER_OLD_IMPLS:-linear,doracheck_bf16} --csv "$R/layer_step_new2.csv"
fi
if [[ $PARTS == *,decode_compiled,* ]]; then
  for i in ${DECODE_COMPILED_RUNS:-1 2}; do
    step decode_compiled_$i 240 $PY decode_ab.py --compiled --new-tokens 64 --rounds 5 --csv "$R/decode_compiled_$i.csv"
  done
fi
if [[ $PARTS == *,decode,* ]]; then
  step decode_new 120 $PY decode_ab.py --new-tokens 64 --rounds 5 --csv "$R/decode_new.csv"
fi
if [[ $PARTS == *,decode_ab,* && -n ${OLD:-} ]]; then  # eager decode, this checkout and .old/ alternating
  for i in 1 2; do
    step decode_new_$i 120 $PY decode_ab.py --new-tokens 64 --rounds 5 --csv "$R/decode_new_$i.csv"
    step decode_old_$i 120 $OLD $PY decode_ab.py --new-tokens 64 --rounds 5 --csv "$R/decode_old_$i.csv"
  done
  for f in "$R"/decode_new_*.csv "$R"/decode_old_*.csv; do echo "$(basename "$f")"; cut -d, -f1,3,7 "$f"; done
fi
cd ..
if [[ $PARTS == *,anatomy,* ]]; then
  step anatomy 300 $PY benchmarks/layer_step_anatomy.py --out "$R/anatomy.txt"
fi
if [[ $PARTS == *,cublas_tests,* ]]; then
  step cublas_tests 120 $PY -m pytest -m gpu -q -p no:cacheprovider -rs \
    "tests/test_kernels_gpu.py::test_cublas_norm_path_is_right_repeatable_and_within_its_memory_bound"
fi
if [[ $PARTS == *,verify,* ]]; then
  step verify 120 doracheck verify --quick
fi
check_summary
grep -v DEBUG "$R/retest.log" 2>/dev/null | grep -E "^(FAILED|ERROR)|passed|failed" | tail -n 5
grep -A 13 "^== " "$R/profile.log" 2>/dev/null | cut -c1-150 | head -n 32
grep -E "per step under cProfile" "$R/cprofile.log" 2>/dev/null
head -n 40 "$R/host_breakdown.txt" 2>/dev/null
for f in "$R"/layer_host*.log; do [[ -f $f ]] && { echo "$(basename "$f")"; grep -E "^round" "$f" | tr '\n' ' '; echo; }; done
grep -v -E "^(DEBUG|WARNING|INFO)" "$R/gaps.log" 2>/dev/null | cut -c1-170 | tail -n 40
grep -v -E "^(DEBUG|WARNING|INFO|\[)" "$R/phases.log" "$R/phases_reversed.log" "$R/phases_plans.log" 2>/dev/null | grep -E "step|forward|backward|impl"
for f in "$R"/abstep_*.log "$R"/abplans_*.log; do [[ -f $f ]] && { echo "$(basename "$f")"; tail -n 7 "$f"; }; done
tail -n 4 "$R/decode_new.log" 2>/dev/null
grep -E "passed|failed" "$R/graphs_mutant.log" 2>/dev/null | tail -n 2
grep -v -E "^(DEBUG|WARNING|INFO)" "$R/profile_compiled.log" 2>/dev/null | grep -E "^==|breaks" 
grep -v DEBUG "$R/graphs_order.log" 2>/dev/null | grep -E "^(FAILED|ERROR)|passed|failed" | tail -n 5
for f in layer_step layer_step_old layer_step_new2; do [[ -f $R/$f.log ]] && { echo "$f"; grep -E "^[0-9]+x[0-9]+ r" "$R/$f.log"; }; done
grep -h -E "^(new|old) " "$R/rowdot_new.log" "$R/rowdot_old.log" 2>/dev/null
grep -v -E "^(DEBUG|WARNING|INFO)" "$R/rowdot_tiles.log" 2>/dev/null | tail -n 45
grep -v -E "^(DEBUG|WARNING|INFO)" "$R/normpath.log" 2>/dev/null | tail -n 50
for f in normpath_bf16 normpath_bf16_old normpath_fp32; do [[ -f $R/$f.log ]] && { echo "$f"; grep -E "^(row_dot|cublas)" "$R/$f.log"; }; done
[[ -f $R/compose_variants.log ]] && { echo compose_variants; cut -c1-140 "$R/compose_variants.log"; }
for f in fusedpass fusedpass_old; do [[ -f $R/$f.log ]] && { echo "$f"; grep -E "shipped|floor" "$R/$f.log" | cut -c1-120; }; done
for f in "$R"/compiled_step*.csv "$R"/fp32_step*.csv; do [[ -f $f ]] && { echo "$(basename "$f")"; cat "$f"; }; done
for f in "$R"/decode_compiled_*.log; do [[ -f $f ]] && { echo "$(basename "$f")"; tail -n 4 "$f"; }; done
for i in peft_lora_bf16 doracheck_bf16; do [[ -f $R/summary_$i.txt ]] && { grep "per step" "$R/sample_$i.log"; head -n 12 "$R/summary_$i.txt" | cut -c1-120; }; done
finish
