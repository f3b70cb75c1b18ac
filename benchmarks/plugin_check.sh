#!/usr/bin/env bash
# The pytest plugin on the GPU machine, as a user's CI runs it: the conformance suite against
# doracheck and against PEFT with pytest -n auto, beside doracheck verify --impl peft for the
# same verdicts; junit XML and logs under $R.
# Usage: bash benchmarks/plugin_check.sh [doracheck]   (doracheck: only the first run)
set -u
source benchmarks/gpu_common.sh
mkdir -p /tmp/plugin_run && cd /tmp/plugin_run
step plugin_doracheck 200 $PY -m pytest -p no:cacheprovider -n auto -q -rs --doracheck-impl doracheck:dora_linear --junitxml="$R/plugin_doracheck.xml"
[ "${1:-}" = doracheck ] || step plugin_peft 200 $PY -m pytest -p no:cacheprovider -n auto -q -rs --doracheck-impl doracheck.properties.impl_peft:peft_dora_linear --junitxml="$R/plugin_peft.xml"
[ "${1:-}" = doracheck ] || step verify_peft 150 $PY -m doracheck verify --impl peft --quick
cd - >/dev/null
for f in plugin_doracheck plugin_peft verify_peft; do [ -f "$R/$f.log" ] && { echo "== $f"; tail -n 25 "$R/$f.log"; }; done
finish
