#!/usr/bin/env bash
# Fifty-second session, one call (~5 minutes warm; any sm_90 card; carry [".whl"]). Usage: run7.sh OUT [7b]
# run6 showed the single stream's process-to-process spread is the autotuner's tile choice (pinned choices
# reproduce their source process's step time within 0.1%). Here bench/tile_search.py searches the one-row
# tiles by whole decode-step time (coordinate descent, batch-1 graph re-captured per candidate), then each
# model runs single_stream.py in fresh processes: main (autotuned), searched (pinned), searched, main.
set -uo pipefail
mode=${2:-full}
. bench/results/gpu-2026-12-07/call.sh run7 "$1"
models="llama2-7b llama3-8b"; [ "$mode" = 7b ] && models=llama2-7b
for m in $models; do
  step ${m}_search 150 python3 bench/tile_search.py --model $m --out $w/${m}_search.json
  pack
  n=0; for v in main searched searched main; do n=$((n + 1))
    pins=$([ $v = searched ] && echo "--pin-tiles $w/${m}_search.json")
    step ${m}_${n}_$v 90 python3 bench/single_stream.py --models $m --peers none --runs 2 $pins --out $w/${m}_${n}_$v.json
  done
  pack
done
finish
