# Issue 17, twenty-first pass: how close the eager step gets to PEFT LoRA with doracheck's Python
# taken away (bare_layer_probe.BareFunction, a yardstick), beside the library, in one process,
# two processes. About 3 device minutes.
set -u
source benchmarks/gpu_common.sh
cd benchmarks
step bare_check 300 $PY bare_layer_probe.py
for i in 1 2; do
  step bare_ab_$i 300 $PY ab_step.py --configs 'lora;dc:graphs=1;dc:bare=1;dc:bare=fwd;dc:bare=bwd' --rounds 6 --steps 4 --csv "$R/ab_step_bare_$i.csv"
done
mkdir -p "$OUT/r"; cat "$R"/bare_*.log > "$OUT/r/bare_probe.txt"; cp "$R"/ab_step_bare_*.csv "$R/gpus.txt" "$OUT/r/"
grep -h "vs library\|^lora\|^dc" "$R"/bare_*.log
cat "$R/steps.txt"
