# Twenty-second pass (issue 17): where the eager step's host time goes, by py-spy samples of
# host_sample_step.py (eager GC step + fused AdamW), the library and PEFT LoRA, 150 steps each at
# 250 Hz, then stack_summary.py of each (the py-spy wheel in .tools/, carried). About 2 device minutes.
set -u
source benchmarks/gpu_common.sh
$PY -m pip install -q --no-deps .tools/py_spy*.whl >"$R/pyspy_install.log" 2>&1 || cat "$R/pyspy_install.log"
cd benchmarks
for i in ${SAMPLE_IMPLS:-doracheck_bf16 peft_lora_bf16}; do
  step sample_$i 200 py-spy record --nonblocking --format raw --rate 250 -o "$R/stacks_$i.txt" -- \
    $PY host_sample_step.py --impl $i --steps 150 --warmup 5
  $PY stack_summary.py "$R/stacks_$i.txt" --rate 250 --steps 155 --top 90 >"$R/summary_$i.txt"
  gzip -f "$R/stacks_$i.txt"
done
rm -rf "$OUT/partial"; mkdir -p "$OUT/r"; cp "$R"/summary_*.txt "$R"/stacks_*.txt.gz "$OUT/r/"
for i in ${SAMPLE_IMPLS:-doracheck_bf16 peft_lora_bf16}; do grep "per step" "$R/sample_$i.log"; head -n 30 "$R/summary_$i.txt" | cut -c1-150; done
cat "$R/steps.txt"
