#!/usr/bin/env bash
# Fifty-third session, one short call (~2.5 minutes warm on an H100; carry [".whl"]). Usage: run12.sh OUT
# Two H100 tables side by side, Llama-2-7B single stream in fresh processes: the shipped one (run10b's, the
# fixed search; measured_tiles), run7's (the one it replaced; its 7B search's table, --pin-tiles), autotuned,
# autotuned, run7's, shipped. `run12.sh OUT short` (~1.3 minutes warm): shipped, run7's, run7's, shipped.
# On a GPU without a packaged table (an H200) it runs run10.sh OUT instead (that GPU's table, measured).
set -uo pipefail
. bench/results/gpu-2026-12-07/call.sh run12 "$1"
if ! python3 -c "import sys, torch; from bento_pagedllm.kernels import gemv; sys.exit(not gemv.measured_tiles(torch.cuda.get_device_name()))"; then
  finish; exec bash bench/results/gpu-2026-12-07/run10.sh "$1"
fi
order="shipped run7 autotuned autotuned run7 shipped"; [ "${2:-}" = short ] && order="shipped run7 run7 shipped"
n=0; for v in $order; do n=$((n + 1))
  case $v in run7) flags="--pin-tiles bench/results/gpu-2026-12-07/run7/llama2-7b_search.json";;
    autotuned) flags=--no-measured-tiles;; *) flags=;; esac
  step single_stream_${n}_$v 90 python3 bench/single_stream.py --models llama2-7b --peers none --runs 2 $flags \
    --out $w/single_stream_${n}_$v.json
done
finish
