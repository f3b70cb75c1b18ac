# Twenty-first pass (issue 17): ab_step.py configurations in ONE process each (hosts differ by up
# to 50% in host speed between processes), two processes, after bare_layer_probe.py's gradient
# check. Default: the library, the planned call before the straight-line one
# (bare_layer_probe.GeneralPlannedFunction) and the bare yardstick. AB_CONFIGS and AB_TAG
# override the configurations and the CSV names (bare_probe.sh). About 2 device minutes.
set -u
CONFIGS=${AB_CONFIGS:-'lora;dc:graphs=1;dc:bare=general;dc:bare=1'}
TAG=${AB_TAG:-general}
source benchmarks/gpu_common.sh
cd benchmarks
step bare_check 200 $PY bare_layer_probe.py
for i in 1 2; do
  step ab_$i 200 $PY ab_step.py --configs "$CONFIGS" --rounds 6 --steps 4 --csv "$R/ab_${TAG}_$i.csv"
done
rm -rf "$OUT/partial"; mkdir -p "$OUT/r"; cp "$R"/ab_"${TAG}"_*.csv "$R/bare_check.log" "$OUT/r/"
grep -h "vs library" "$R/bare_check.log"
for f in ab_1 ab_2; do echo "== $f"; grep -h "^lora\|^dc" "$R/$f.log"; done
cat "$R/steps.txt"
