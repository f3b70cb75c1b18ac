set -u
source benchmarks/gpu_common.sh
export CUDA_VISIBLE_DEVICES=0
cd benchmarks
for i in 1 2; do
  step modes_dc_$i 150 $PY compiled_step_modes.py --impl doracheck_bf16 --steps 30 --label proc$i --csv "$R/compiled_step_modes.csv"
  [[ $i == 1 ]] && step modes_lora 150 $PY compiled_step_modes.py --impl peft_lora_bf16 --steps 30 --label proc1 --csv "$R/compiled_step_modes.csv"
done
step profile_compiled 240 $PY profile_model_step.py --impls peft_lora_bf16,doracheck_bf16 --mode compiled --steps 3 --top-gpu 30 --json-out "$R/profile_step_compiled.json"
mkdir -p $OUT/r; cp "$R"/modes_*.log "$R"/profile_compiled.log "$R"/*.csv "$R"/*.json "$R/steps.txt" "$R/gpus.txt" $OUT/r/ 2>/dev/null
grep -h "^impl=" "$R"/modes_*.log | cut -c1-260
grep -v -E "^(DEBUG|WARNING|INFO)" "$R/profile_compiled.log" | grep -E "^==" 
cat "$R/steps.txt"
