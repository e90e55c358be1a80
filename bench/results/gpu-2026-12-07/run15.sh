#!/usr/bin/env bash
# Fifty-fifth session, the lean core of run10.sh for a call with ~4 minutes of device time left (an H200; carry
# [".whl"]). Usage: run15.sh OUT
# Llama-2-7B only: its one-row search, packaged alone (bento_pagedllm/kernels/tiles/<GPU>.json, copied into the
# results; the 8B's own keys then stay with the autotuner), then fresh single-stream processes: table,
# autotuned, autotuned, table. Then the same for Llama-3-8B's processes if time is left.
set -uo pipefail
. bench/results/gpu-2026-12-07/call.sh run15 "$1"
step llama2-7b_search 150 python3 bench/tile_search.py --model llama2-7b --out $w/llama2-7b_search.json
step package 30 python3 bench/tile_search.py --package $w/llama2-7b_search.json \
  --note "run15 (bench/results/gpu-2026-12-07): one-row search, Llama-2-7B alone"
cp bento_pagedllm/kernels/tiles/*.json $w/
pack
for m in llama2-7b llama3-8b; do
  n=0; for v in table autotuned autotuned table; do n=$((n + 1))
    step ${m}_${n}_$v 90 python3 bench/single_stream.py --models $m --peers none --runs 2 \
      $([ $v = autotuned ] && echo --no-measured-tiles) --out $w/${m}_${n}_$v.json
    pack
  done
done
finish
