# Twenty-first pass (issue 17): the straight-line planned call against the planned call before it
# (bare_layer_probe.GeneralPlannedFunction) and the bare yardstick, in ONE process each (hosts
# differ by up to 50% in host speed between processes), two processes. About 2 device minutes.
set -u
source benchmarks/gpu_common.sh
cd benchmarks
step bare_check 200 $PY bare_layer_probe.py
for i in 1 2; do
  step ab_$i 200 $PY ab_step.py --configs 'lora;dc:graphs=1;dc:bare=general;dc:bare=1' --rounds 6 --steps 4 --csv "$R/ab_general_$i.csv"
done
rm -rf "$OUT/partial"; mkdir -p "$OUT/r"; cp "$R"/ab_general_*.csv "$R/bare_check.log" "$OUT/r/"
grep -h "vs library" "$R/bare_check.log"
for f in ab_1 ab_2; do echo "== $f"; grep -h "^lora\|^dc" "$R/$f.log"; done
cat "$R/steps.txt"
