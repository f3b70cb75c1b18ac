# Twenty-first pass (issue 17): the straight-line planned call against the library just before it
# (.old = git archive of that commit, carried), ab_step.py (PEFT LoRA beside each) in four
# processes alternating new, old, new, old on one host. About 3 device minutes.
set -u
source benchmarks/gpu_common.sh
install_old
cd benchmarks
for i in 1 2; do
  step new_$i 200 $PY ab_step.py --configs 'lora;dc:graphs=1' --rounds 6 --steps 4 --csv "$R/ab_new_$i.csv"
  step old_$i 200 $OLD $PY ab_step.py --configs 'lora;dc:graphs=1' --rounds 6 --steps 4 --csv "$R/ab_old_$i.csv"
done
rm -rf "$OUT/partial"; mkdir -p "$OUT/r"; cp "$R"/ab_new_*.csv "$R"/ab_old_*.csv "$R/gpus.txt" "$OUT/r/"
for f in new_1 old_1 new_2 old_2; do echo "== $f"; grep -h "^lora\|^dc" "$R/$f.log"; done
cat "$R/steps.txt"
