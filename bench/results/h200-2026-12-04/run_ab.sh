#!/usr/bin/env bash
# thirty-second session: W tiles asked of L2 ahead in the one-row norm projections (W_AHEAD)
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH
o=$OUT/r; mkdir -p $o
run() { local name=$1 limit=$2; shift 2; local t=$(date +%s)
  timeout "$limit" "$@" > "$o/$name.log" 2>&1; echo "$name rc=$? $(( $(date +%s) - t ))s" | tee -a "$o/session.log"; }
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem,power.limit --format=csv,noheader
if [ -n "${SWEEP:-}" ]; then
  run sweep 200 python3 bench/gemv.py --sweep --rows 1 --shapes "$SWEEP" --ahead ${AHEADS:-0,1,2,4} --out $o/sweep.json
  python3 - <<'P'
import json, os
d = json.load(open(os.environ["OUT"] + "/r/sweep.json"))
print("copy", round(d["copy_bandwidth_tbs"], 3))
for r in d["rows"]:
    print(r["name"], "autotuned", round(r["autotuned_us"], 2))
    for c in r["configs"][:8]:
        print("   ", c)
    best0 = min((c for c in r["configs"] if c.get("W_AHEAD", 0) == 0), key=lambda c: c["us"])
    print("  best W_AHEAD=0:", best0)
P
fi
n=0
for v in ${ORDER:-}; do n=$((n + 1))
  P=$([ $v = head ] || echo "$PWD/ab/$v:")$PYTHONPATH
  PYTHONPATH=$P run ss_${n}_$v 100 python3 bench/single_stream.py --models ${MODELS:-llama2-7b} --peers none --runs 3 --out $o/ss_${n}_$v.json
done
if [ -n "${PROFILE:-}" ]; then for v in $PROFILE; do P=$([ $v = head ] || echo "$PWD/ab/$v:")$PYTHONPATH
  PYTHONPATH=$P run prof_$v 120 python3 bench/single_stream.py --models llama2-7b --peers none --runs 1 --profile-dir $o/prof_$v --out $o/prof_$v.json
  python3 bench/trace_steps.py $o/prof_$v/profile_llama2-7b.trace.json > $o/prof_${v}_steps.txt 2>&1; rm -f $o/prof_$v/*.trace.json; done; fi
python3 - <<'P'
import json, os, glob
o = os.environ["OUT"] + "/r"
for f in sorted(glob.glob(o + "/ss_*.json"), key=lambda f: int(f.split("ss_")[1].split("_")[0])):
    try:
        d = json.load(open(f))
        for m, e in d["models"].items():
            print(os.path.basename(f), m, round(e["engine"]["decode_tok_s"], 1), round(e["engine"]["decode_tok_s"] / e["roofline_tok_s"], 4), "copy", round(d["copy_bandwidth_tbs"], 3))
    except Exception as e: print(f, e)
P
for f in $o/prof_*_steps.txt; do echo == $f; head -20 $f; done
tail -5 $o/*.log | grep -i -B2 -A2 "error\|Traceback" | head -40
