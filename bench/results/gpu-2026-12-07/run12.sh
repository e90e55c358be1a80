#!/usr/bin/env bash
# Fifty-third session, one short call (~2.5 minutes warm on an H100; carry [".whl"]). Usage: run12.sh OUT
# Two H100 tables side by side, Llama-2-7B single stream in fresh processes: the landed one (run7's searches;
# measured_tiles), run10b's (the fixed search; --pin-tiles), autotuned, autotuned, run10b's, landed.
# `run12.sh OUT short` (~1.3 minutes warm): landed, run10b's, run10b's, landed.
# On a GPU without a packaged table (an H200) it runs run7.sh OUT 7b instead.
set -uo pipefail
. bench/results/gpu-2026-12-07/call.sh run12 "$1"
if ! python3 -c "import sys, torch; from bento_pagedllm.kernels import gemv; sys.exit(not gemv.measured_tiles(torch.cuda.get_device_name()))"; then
  finish; exec bash bench/results/gpu-2026-12-07/run7.sh "$1" 7b
fi
order="landed run10b autotuned autotuned run10b landed"; [ "${2:-}" = short ] && order="landed run10b run10b landed"
n=0; for v in $order; do n=$((n + 1))
  case $v in run10b) flags="--pin-tiles bench/results/gpu-2026-12-07/run10b/NVIDIA_H100_80GB_HBM3.json";;
    autotuned) flags=--no-measured-tiles;; *) flags=;; esac
  step single_stream_${n}_$v 90 python3 bench/single_stream.py --models llama2-7b --peers none --runs 2 $flags \
    --out $w/single_stream_${n}_$v.json
done
finish
