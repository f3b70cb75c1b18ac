# Twenty-third pass (issue 17): the must-show rows measured under torch.profiler at this commit
# (the planned call and the norm groups landed after the twentieth session's profile): host CPU
# of the eager step (GC, fused AdamW) against PEFT LoRA's, and the layer Function's self CPU per
# call; then host_breakdown.py (one layer's host cost by part). About 3 device minutes.
set -u
source benchmarks/gpu_common.sh
cd benchmarks
step profile_eager 240 $PY profile_model_step.py --impls peft_lora_bf16,doracheck_bf16 --mode eager_gc --steps 3 \
  --time-steps 10 --json-out "$R/profile_eager.json"
step host_breakdown 200 $PY host_breakdown.py --out "$R/host_breakdown.txt"
cd ..
rm -rf "$OUT/partial"; mkdir -p "$OUT/r"
cp "$R/profile_eager.log" "$R/profile_eager.json" "$R/host_breakdown.log" "$R/gpus.txt" "$OUT/r/" 2>/dev/null
cp "$R/host_breakdown.txt" "$OUT/r/" 2>/dev/null
grep -v "^ *[0-9.]* ms  x" "$R/profile_eager.log" | head -n 20
grep -E "^== |Function|PlannedFrom" "$R/profile_eager.log"
head -n 40 "$R/host_breakdown.log"
cat "$R/steps.txt"
