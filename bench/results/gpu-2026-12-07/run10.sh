#!/usr/bin/env bash
# Fifty-third session, one call (~6 minutes warm; an H200, or any sm_90 card without a packaged table; carry
# [".whl"]). Usage: run10.sh OUT
# The H200's tile table measured and checked as it ships: the one-row search for Llama-2-7B and Llama-3-8B
# (as run7), the table packaged on the device (tile_search.py --package; bento_pagedllm/kernels/tiles/<GPU>.json, copied
# into the results), the GPU tests of the pins, then each model in fresh single-stream processes: table
# (EngineArgs.measured_tiles, the default), autotuned (--no-measured-tiles), autotuned, table.
# `run10.sh OUT lean` (~3.5 minutes warm, for a short budget): Llama-2-7B's search alone, packaged alone (the 8B's
# own keys stay with the autotuner), no pin tests, then the same processes.
set -uo pipefail
. bench/results/gpu-2026-12-07/call.sh run10 "$1"
lean=$([ "${2:-}" = lean ] && echo 1)
# NOTE: packaged 7B last: where both models share a key, the last result's tile wins
searched="llama2-7b llama3-8b"; packaged="llama3-8b llama2-7b"; [ $lean ] && searched=llama2-7b packaged=llama2-7b
for m in $searched; do
  step ${m}_search 150 python3 bench/tile_search.py --model $m --out $w/${m}_search.json
  pack
done
step package 30 python3 bench/tile_search.py --package $(for m in $packaged; do echo $w/${m}_search.json; done) \
  --note "run10 (bench/results/gpu-2026-12-07): one-row search, packaged in the order $packaged"
cp bento_pagedllm/kernels/tiles/*.json $w/
[ $lean ] || step gpu_tests_pinned 120 python3 -m pytest -q -x -p no:cacheprovider tests/gpu/test_kernels_gpu.py -k "pinned or measured_tiles"
pack
for m in llama2-7b llama3-8b; do
  n=0; for v in table autotuned autotuned table; do n=$((n + 1))
    step ${m}_${n}_$v 90 python3 bench/single_stream.py --models $m --peers none --runs 2 \
      $([ $v = autotuned ] && echo --no-measured-tiles) --out $w/${m}_${n}_$v.json
  done
  pack
done
finish
