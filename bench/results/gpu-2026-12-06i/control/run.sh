#!/usr/bin/env bash
# The same-machine control of run1 (the call right after it, same warm H100): main's Triton attention, profiled.
set -uo pipefail
out=$1; mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD
timeout 120 python3 bench/single_stream.py --models llama2-7b --peers none --runs 1 --profile-dir "$out/prof" \
  --out "$out/single_stream_main.json" > "$out/single_stream_main.log" 2>&1
python3 bench/results/h200-2026-12-05/starts.py "$out/prof/profile_llama2-7b.trace.json" > "$out/starts_main.txt"
rm -rf "$out/prof"
