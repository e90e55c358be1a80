#!/usr/bin/env bash
# Fifty-second session, prepared for the next (carry [".whl"]). Usage: run9.sh OUT [single|batch|both]
# single (~4.5 minutes warm): run7.sh OUT: the one-row search for Llama-2-7B and Llama-3-8B, each checked in
#   fresh single-stream processes (main, searched, searched, main). On a GPU without a table (the H200) that is
#   the table to be: `python bench/tile_search.py --package llama3-8b_search.json llama2-7b_search.json
#   --note "..."` writes kernels/tiles/<GPU>.json.
# batch (~6 minutes warm): Llama-3-8B's one-, 16- and 32-row tiles searched together (`--batches 1,8,16,24,32
#   --rounds 1`: a candidate re-captures only its judges' 2-4 graphs),
#   then the 500-request offline workload (issue 5's 8B target), main, searched, searched, main. NOTE: main
#   pins the GPU's packaged table where there is one (the H100's); searched pins the search's whole table.
set -uo pipefail
mode=${2:-single}
if [ "$mode" = single ] || [ "$mode" = both ]; then bash bench/results/gpu-2026-12-07/run7.sh "$1"; fi
[ "$mode" = single ] && exit 0
. bench/results/gpu-2026-12-07/call.sh run9 "$1"
step search_8b_batches 200 python3 bench/tile_search.py --model llama3-8b --batches 1,8,16,24,32 --rounds 1 --out $w/search_8b_batches.json
pack
n=0; for v in main searched searched main; do n=$((n + 1))
  pins=$([ $v = searched ] && echo "--pin-tiles $w/search_8b_batches.json")
  step offline_8b_${n}_$v 100 python3 bench/serve.py --mode offline --shape llama3-8b --requests bench/data/requests.jsonl \
    --dtype bfloat16 --max-num-seqs 512 --max-num-batched-tokens 8192 --max-graph-batch 512 $pins --out $w/offline_8b_${n}_$v.json
done
finish
