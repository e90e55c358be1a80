#!/usr/bin/env bash
# The GPU figures of BENCHMARKS.md, as run on the lent H200 from the source tree (no bentoml there:
# wheels travel in .whl/ and .whl-bento/). Usage: bash bench/h200_session.sh PART OUTDIR
set -uo pipefail
part=$1; out=$2; mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD
R=bench/data/requests.jsonl
BIG="--max-num-seqs 512 --max-num-batched-tokens 8192 --max-graph-batch 512"
run() { local name=$1 limit=$2; shift 2; local t=$(date +%s)
  timeout "$limit" "$@" > "$out/$name.log" 2>&1; echo "$name rc=$? $(( $(date +%s) - t ))s"; }
case $part in
  throughput)
    run serve_offline_llama2-7b 110 python3 bench/serve.py --mode offline --shape llama2-7b --requests $R --dtype bfloat16 $BIG --out "$out/serve_offline_llama2-7b.json"
    run serve_offline_llama3-8b 110 python3 bench/serve.py --mode offline --shape llama3-8b --requests $R --dtype bfloat16 $BIG --out "$out/serve_offline_llama3-8b.json"
    run single_stream_peers 200 python3 bench/single_stream.py --models smollm2-135m llama2-7b --peers eager,compile --runs 2 --out "$out/single_stream_peers.json"
    run transformers_cb_llama2-7b 170 python3 bench/serve.py --mode transformers --shape llama2-7b --requests $R --out "$out/transformers_cb_llama2-7b.json"
    ;;
  peers)
    run single_stream_peers 230 python3 bench/single_stream.py --models smollm2-135m llama2-7b --peers eager,compile --runs 2 --out "$out/single_stream_peers.json"
    for pc in on off; do flag=$([ $pc = off ] && echo --no-prefix-caching)
      run prefix_${pc} 60 python3 bench/serve.py --mode async --shape llama2-7b --requests bench/data/requests_rate20.jsonl --limit 200 --shared-prefix-tokens 1000 --dtype bfloat16 $flag --out "$out/prefix_${pc}_llama2-7b.json"; done
    run transformers_cb_llama2-7b 260 python3 bench/serve.py --mode transformers --shape llama2-7b --requests $R --out "$out/transformers_cb_llama2-7b.json"
    ;;
  final)
    for pc in on off; do flag=$([ $pc = off ] && echo --no-prefix-caching)
      run prefix_${pc} 50 python3 bench/serve.py --mode async --shape llama2-7b --requests bench/data/requests_rate20.jsonl --limit 200 --shared-prefix-tokens 1000 --dtype bfloat16 $flag --out "$out/prefix_${pc}_llama2-7b.json"; done
    run serve_offline_llama2-7b 60 python3 bench/serve.py --mode offline --shape llama2-7b --requests $R --dtype bfloat16 $BIG --out "$out/serve_offline_llama2-7b.json"
    run serve_offline_llama3-8b 60 python3 bench/serve.py --mode offline --shape llama3-8b --requests $R --dtype bfloat16 $BIG --out "$out/serve_offline_llama3-8b.json"
    run single_stream_7b 200 python3 bench/single_stream.py --models llama2-7b --peers compile --runs 2 --out "$out/single_stream_llama2-7b.json"
    ;;
esac
for f in "$out"/*.json; do echo "== $f"; grep -E '"(completed|duration_s|request_throughput|output_throughput|idle_fraction|decode_tok_s|roofline_tok_s|engine_vs_[a-z_]+|median)"' "$f"; done
