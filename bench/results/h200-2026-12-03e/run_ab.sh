#!/usr/bin/env bash
# thirty-first session: o's whole row block loaded before the dependent-launch wait (PRELOAD4), single stream ABBA
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH
o=$OUT/r; mkdir -p $o
run() { local name=$1 limit=$2; shift 2; local t=$(date +%s)
  timeout "$limit" "$@" > "$o/$name.log" 2>&1; echo "$name rc=$? $(( $(date +%s) - t ))s" | tee -a "$o/session.log"; }
n=0
for v in ${ORDER:-head p4n4w8 p4n2w4 p4n1w4 p4n1w4 p4n2w4 p4n4w8 head}; do n=$((n + 1))
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
for f in $o/prof_*_steps.txt; do echo == $f; head -40 $f; done
