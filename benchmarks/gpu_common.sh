# Sourced by the GPU drivers in benchmarks/ (gpu_check.sh, *_bench.sh, gpu_*_checks.sh), run from
# the repository root on the device machine: installs the checkout, records the GPUs and versions,
# and defines `step NAME SECONDS CMD...`, which runs a command under `timeout`, logs it to
# $R/NAME.log and appends its exit code to $R/steps.txt, and `finish`, which packs $R into
# $OUT/results.tgz and prints the step table last.
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
R=/tmp/results; mkdir -p "$R"
PY=python
$PY -m pip install --no-deps --no-build-isolation -q -e . >"$R/install.log" 2>&1 || { cat "$R/install.log"; exit 1; }
if ! $PY -c "import xdist, hypothesis, mpmath" 2>/dev/null; then
  $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
nvidia-smi -L | tee "$R/gpus.txt"
$PY -c "import torch, triton, peft, transformers; print(torch.__version__, triton.__version__, peft.__version__, transformers.__version__)" | tee -a "$R/gpus.txt"
step() {
  local name=$1 secs=$2; shift 2
  local t0=$SECONDS rc
  timeout "$secs" "$@" >"$R/$name.log" 2>&1; rc=$?
  echo "$name rc=$rc $((SECONDS - t0))s" | tee -a "$R/steps.txt"
  # Copied back after every step: a device call cut off by its time limit returns what is under
  # $OUT, and the packing in `finish` never runs then (the fourteenth session lost a benchmark so).
  if [[ -n ${OUT:-} ]]; then
    mkdir -p "$OUT/partial" && cp "$R/$name.log" "$R/steps.txt" "$OUT/partial/" 2>/dev/null
    cp "$R"/*.csv "$OUT/partial/" 2>/dev/null
  fi
  return 0
}
finish() {  # pack everything into $OUT/results.tgz and print the step table last
  tar czf "$OUT/results.tgz" -C /tmp results
  cat "$R/steps.txt"
}
# The GPU a driver's second concurrent job uses: GPU 1 on a two-GPU machine, else GPU 0 shared.
SECOND_GPU=$(( $(nvidia-smi -L | wc -l) > 1 ? 1 : 0 ))
# The kernel cases the drivers run under compute-sanitizer's memcheck (each may add its own): the
# T = 16 and odd small-T compose, small-T inference, CUDA-graph capture, fast launches, determinism,
# the dm pass (dm_finish), the norm graph that forms max(n, eps) and g, the norm's two-piece cuBLAS path,
# the persistent TMA compose (every epilogue variant, and a training step through it).
MEMCHECK_IDS=(
  "tests/test_kernels_gpu.py::test_forward_backward_within_budget[(1031, 4099, 384, 16)-bfloat16-bfloat16]"
  "tests/test_kernels_gpu.py::test_forward_backward_within_budget[(65, 1031, 17, 15)-float16-float16]"
  "tests/test_kernels_gpu.py::test_small_t_inference_forward_is_bitwise_the_training_forward[bfloat16-float32-(17, 4099, 8, 7)]"
  "tests/test_kernels_gpu.py::test_inference_is_capturable_in_a_cuda_graph_and_replays_the_parameters_of_the_moment[False]"
  "tests/test_kernels_gpu.py::test_fast_launch_reuses_tritons_kernel_and_is_bitwise_its_launch"
  "tests/test_kernels_gpu.py::test_kernels_bitwise_deterministic"
  "tests/test_kernels_gpu.py::test_dm_finish_fast_launch_is_bitwise_tritons_launch_and_skips_its_binder"
  "tests/test_zero_magnitude.py::test_dm_finish_kernel_on_the_gpu"
  "tests/test_norm_graphs.py::test_the_scaled_norm_replay_is_bitwise_norm_clamp_and_division_and_follows_m[torch.bfloat16-False]"
  "tests/test_kernels_gpu.py::test_factored_norm_within_budget[bfloat16-float32-False-r200]"
  "tests/test_kernels_gpu.py::test_tma_compose_is_the_pointer_kernel_bitwise"
  "tests/test_kernels_gpu.py::test_forward_backward_within_budget_through_the_tma_compose[bfloat16]"
)
check_summary() {  # the GPU tests', memcheck's and verify's last lines, where those steps ran
  grep -v DEBUG "$R/gpu_tests.log" 2>/dev/null | grep -E "^(FAILED|ERROR)|passed|failed" | tail -n 8
  grep -E "ERROR SUMMARY|passed|failed" "$R/memcheck.log" 2>/dev/null | tail -n 3
  tail -c 600 "$R/verify.log" 2>/dev/null; echo
}
install_old() {  # .old/ (git archive of an earlier commit, carried) installed apart; $OLD prefixes a command with it
  if [[ -d .old ]]; then
    $PY -m pip install --no-deps --no-build-isolation -q --target /tmp/old ./.old >"$R/install_old.log" 2>&1 || tail -5 "$R/install_old.log"
    OLD="env PYTHONPATH=/tmp/old${PYTHONPATH:+:$PYTHONPATH}"
    (cd benchmarks && $OLD $PY -c "import doracheck; print('old library (from benchmarks/) at', doracheck.__file__)") | tee -a "$R/gpus.txt"
  fi
  $PY -c "import doracheck; print('new library at', doracheck.__file__)" | tee -a "$R/gpus.txt"
}
