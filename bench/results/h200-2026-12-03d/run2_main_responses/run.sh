#!/usr/bin/env bash
# thirtieth session: main with the Responses API: figures of record (no regression)
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH NO_WHEELS=1
o=$OUT/r8; mkdir -p $o
R=bench/data/requests.jsonl
run() { local name=$1 limit=$2; shift 2; local t=$(date +%s)
  timeout "$limit" "$@" > "$o/$name.log" 2>&1; echo "$name rc=$? $(( $(date +%s) - t ))s" | tee -a "$o/session.log"; }
run single_stream 120 python3 bench/single_stream.py --models llama2-7b smollm2-135m llama3-8b --peers none --runs 3 --out $o/single_stream.json
run serve_offline_llama3-8b 70 python3 bench/serve.py --mode offline --shape llama3-8b --requests $R --dtype bfloat16 --max-num-seqs 1024 --max-num-batched-tokens 16384 --max-graph-batch 512 --out $o/serve_offline_llama3-8b.json
run serve_offline_llama2-7b 60 python3 bench/serve.py --mode offline --shape llama2-7b --requests $R --dtype bfloat16 --max-num-seqs 512 --max-num-batched-tokens 8192 --max-graph-batch 512 --out $o/serve_offline_llama2-7b.json
tar czf $OUT/r.tgz -C $OUT r8
tar czf $OUT/r.tgz -C $OUT r8
cat $o/session.log
python3 - <<'P'
import json, os, glob
o = os.environ["OUT"] + "/r8"
try:
    d = json.load(open(o + "/single_stream.json"))
    print("copy TB/s", d["copy_bandwidth_tbs"])
    for m, e in d["models"].items():
        print(m, round(e["engine"]["decode_tok_s"], 1), round(e["engine"]["decode_tok_s"] / e["roofline_tok_s"], 4),
              "startup", round(e["engine"]["startup_s"], 1), "ttft ms", round(e["engine"]["ttft_s"] * 1e3, 2))
except Exception as e: print("single", e)
for f in sorted(glob.glob(o + "/serve_offline_*.json")):
    d = json.load(open(f)); print(os.path.basename(f), d.get("completed"), d.get("failed"), round(d.get("request_throughput", 0), 2))
P
