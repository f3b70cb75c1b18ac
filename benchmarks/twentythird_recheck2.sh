# Twenty-third pass: the GPU groups test after its count was made independent of address reuse
# (norm_graphs.clear() between its two runs), run in one process and under xdist. About 2 device minutes.
set -u
source benchmarks/gpu_common.sh
export CUDA_VISIBLE_DEVICES=0
step gpu_groups 150 $PY -m pytest -m gpu -q -p no:cacheprovider -rs tests/test_norm_groups.py tests/test_peft_integration.py
step gpu_groups_xdist 150 $PY -m pytest -m gpu -q -n 4 -p no:cacheprovider -rs tests/test_norm_groups.py tests/test_train_plan.py tests/test_training_loops.py
rm -rf "$OUT/partial"; mkdir -p "$OUT/r"; cp "$R/gpu_groups.log" "$R/gpu_groups_xdist.log" "$OUT/r/" 2>/dev/null
for f in gpu_groups gpu_groups_xdist; do grep -v DEBUG "$R/$f.log" | grep -E "passed|failed|^FAILED|^ERROR|^E " | tail -8; done
cat "$R/steps.txt"
