# Twentieth session: where the eager step's host time goes on today's host (host_breakdown.py with
# the planned path's rows; cProfile of the model step, doracheck and PEFT LoRA).
set -u
source benchmarks/gpu_common.sh
export CUDA_VISIBLE_DEVICES=0
cd benchmarks
step breakdown 200 $PY host_breakdown.py --out "$R/host_breakdown.txt"
step cprofile_dc 150 $PY host_cprofile_step.py --impl doracheck_bf16 --steps 4
step cprofile_lora 150 $PY host_cprofile_step.py --impl peft_lora_bf16 --steps 4
mkdir -p $OUT/r; cp "$R/host_breakdown.txt" "$R/cprofile_dc.log" "$R/cprofile_lora.log" "$R/gpus.txt" $OUT/r/ 2>/dev/null
head -n 45 "$R/host_breakdown.txt" | cut -c1-120
grep -E "per step under cProfile" "$R"/cprofile_*.log
cat "$R/steps.txt"
