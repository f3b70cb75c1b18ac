# Which kernels make a slow compiled-step process slow (issue 17; twentieth pass: the same library
# at 53 ms in one process and 64 ms in another, not host-bound). MODES_PROCS processes (default 4)
# of profile_model_step.py --mode compiled for doracheck, each timing 10 unprofiled steps first,
# then kernel_mode_diff.py over them. About 40 s a process on the H200.
set -u
source benchmarks/gpu_common.sh
export CUDA_VISIBLE_DEVICES=0
cd benchmarks
for i in $(seq 1 "${MODES_PROCS:-4}"); do
  step modes_profile_$i 120 $PY profile_model_step.py --impls doracheck_bf16 --mode compiled --steps 3 --time-steps 10 \
    --json-out "$R/profile_compiled_$i.json"
done
$PY kernel_mode_diff.py "$R"/profile_compiled_*.json --top 20 | tee "$R/kernel_mode_diff.txt"
mkdir -p "$OUT/r"; cp "$R"/profile_compiled_*.json "$R/kernel_mode_diff.txt" "$R/steps.txt" "$R/gpus.txt" "$OUT/r/" 2>/dev/null
cat "$R/steps.txt"
