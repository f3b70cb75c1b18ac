#!/usr/bin/env bash
# One GPU session, from the repository root of the device machine: installs the checkout, then runs
# the parts asked for, each step bounded by `timeout`, logged to $OUT/logs/STEP.log; the drivers
# append their rows to benchmarks/results/<driver>.csv, copied to $OUT/results/ after every step
# (copy them back over benchmarks/results/). Prints a short table last: step, exit code, seconds,
# the step's last word (pytest's summary, memcheck's error summary, a driver's last line).
#
#   bash benchmarks/run_all.sh [PARTS]       PARTS: comma-separated, default `all`
#     check        = tests,memcheck,verify
#     tests        pytest -n auto -rfE --durations=25 (the whole suite, GPU tests included)
#     memcheck     compute-sanitizer memcheck over the kernel tests ($MEMCHECK_TESTS, -k $MEMCHECK_K)
#     verify       doracheck verify --quick
#     layer kernels memory model decode compiled profile equivalence planner   the drivers of the same names
#     ab           ab.py $AB_A $AB_B (checkout folders carried to the machine, or revisions where .git is), with
#                  each side's host profile per part in $OUT/host_profiles.tgz
#     fsdp         fsdp.py under torchrun on 2 GPUs (nvidia-h200-x2): check, then time doracheck and PEFT
#     all          every part (a whole session: more than one 600 s device call)
# A device call has 600 s; these groups each fit one: tests | memcheck,verify | layer,kernels,memory |
# model,decode | compiled | ab | profile,equivalence | planner | fsdp.
# BENCH_COMMIT names the commit in the rows (the copy on the device machine has no .git).
# BENCH_ARGS is added to every driver's command line (BENCH_ARGS=--smoke SKIP_INSTALL=1 PY=python checks
# this script on a CPU machine: tiny shapes, rows to a temporary folder).
set -u
# shellcheck disable=SC2086  # $PY, $BENCH_ARGS and the memcheck tests split into words on purpose
PARTS=",${1:-all},"
[[ $PARTS == *,check,* ]] && PARTS="$PARTS,tests,memcheck,verify,"
[[ $PARTS == *,all,* ]] && PARTS=",tests,memcheck,verify,layer,kernels,memory,model,decode,compiled,ab,profile,equivalence,planner,fsdp,"
has() { [[ $PARTS == *",$1,"* ]]; }
OUT=${OUT:-/tmp/doracheck-bench}
mkdir -p "$OUT/logs" "$OUT/results"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
BENCH_COMMIT=${BENCH_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
export BENCH_COMMIT
PY=${PY:-python}
BENCH_ARGS=${BENCH_ARGS:-}
STEPS="$OUT/steps.txt"
: >"$STEPS"

step() {  # step NAME SECONDS CMD...
  local name=$1 secs=$2 t0=$SECONDS rc note
  shift 2
  timeout "$secs" "$@" >"$OUT/logs/$name.log" 2>&1
  rc=$?
  note=$(grep -E "[0-9]+ (passed|failed)|ERROR SUMMARY|^summary:|^pass |no tests ran" "$OUT/logs/$name.log" | tail -n 1)
  [[ -z $note ]] && note=$(grep -v -E '^\s*$|^rows appended' "$OUT/logs/$name.log" | tail -n 1)
  printf '%-12s rc=%-3s %5ss  %s\n' "$name" "$rc" "$((SECONDS - t0))" "${note:0:100}" | tee -a "$STEPS"
  cp benchmarks/results/*.csv "$OUT/results/" 2>/dev/null
  return 0
}

if [[ -z ${SKIP_INSTALL:-} ]]; then
  $PY -m pip install --no-deps --no-build-isolation -q -e . >"$OUT/logs/install.log" 2>&1 || { tail -n 20 "$OUT/logs/install.log"; exit 1; }
fi
if ! $PY -c "import xdist, hypothesis, mpmath" 2>/dev/null && compgen -G ".whl/*.whl" >/dev/null; then
  $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
{
  nvidia-smi -L 2>/dev/null || echo "no nvidia-smi"
  $PY -c "import torch, triton, peft, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'peft', peft.__version__, 'transformers', transformers.__version__)"
  echo "commit $BENCH_COMMIT"
} | tee "$OUT/env.txt"

MEMCHECK_TESTS=${MEMCHECK_TESTS:-tests/kernels/test_kernels_gpu.py}
MEMCHECK_K=${MEMCHECK_K:-"(within_budget and not tma) or edge_inputs or small_t or deterministic"}
has tests && step tests 560 $PY -m pytest -n auto -rfE --durations=25 -q -p no:cacheprovider tests
# shellcheck disable=SC2086
has memcheck && step memcheck 380 compute-sanitizer --tool memcheck --error-exitcode 9 \
  $PY -m pytest -q -p no:cacheprovider -m gpu $MEMCHECK_TESTS -k "$MEMCHECK_K"
has verify && step verify 160 $PY -m doracheck verify --quick
has layer && step layer 300 $PY benchmarks/layer.py $BENCH_ARGS
has kernels && step kernels 150 $PY benchmarks/kernel_floors.py $BENCH_ARGS
has memory && step memory 120 $PY benchmarks/memory.py --tokens 4096 --chunk-mib 16,32,64 $BENCH_ARGS
has model && step model 240 $PY benchmarks/model_step.py $BENCH_ARGS
has decode && step decode 330 $PY benchmarks/decode.py $BENCH_ARGS
has compiled && step compiled 400 $PY benchmarks/compiled_step.py $BENCH_ARGS
if has ab; then
  if [[ -n ${AB_A:-} ]]; then
    step ab 560 $PY benchmarks/ab.py "$AB_A" "${AB_B:-.}" --host-profile "$OUT/host" $BENCH_ARGS
    tar -czf "$OUT/host_profiles.tgz" -C "$OUT" host 2>/dev/null && rm -rf "$OUT/host"  # one file: few come back
  else
    echo "ab: set AB_A (and AB_B, default .) to the checkouts to compare" | tee -a "$STEPS"
  fi
fi
if has profile; then
  mkdir -p "$OUT/traces"
  step profile 280 $PY benchmarks/profile_step.py --trace "$OUT/traces" --json-out "$OUT/profile.json" $BENCH_ARGS
fi
has equivalence && step equivalence 280 $PY benchmarks/equivalence.py --json-out "$OUT/equivalence.json" $BENCH_ARGS
has planner && step planner 400 $PY benchmarks/planner.py $BENCH_ARGS
if has fsdp; then
  TR="$PY -m torch.distributed.run --standalone --nproc_per_node 2 benchmarks/fsdp.py"
  MED="--mode time --steps 13 --vocab 32000 --hidden 2048 --intermediate 5632 --layers 4 --heads 16 --kv-heads 4 --rank 64 --seq 2048 --batch 2"
  step fsdp_check 120 $TR --mode check --steps 50
  # shellcheck disable=SC2086
  step fsdp_time_dc 120 $TR $MED --impl doracheck
  # shellcheck disable=SC2086
  step fsdp_time_peft 120 $TR $MED --impl peft
fi
echo
for log in layer kernels memory model decode compiled ab profile planner; do
  [[ -f "$OUT/logs/$log.log" ]] && { echo "== $log"; grep -v '^rows appended' "$OUT/logs/$log.log" | tail -n 14; }
done
echo
cat "$STEPS"
