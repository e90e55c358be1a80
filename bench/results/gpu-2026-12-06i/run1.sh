#!/usr/bin/env bash
# The thirty-fifth session's unrun question (bench/results/h200-2026-12-05/run4.sh, cut to one profiled run
# each): does a thread-block-cluster launch start early under dependent launch when its clusters are smaller?
# ab/single_stream.py and ab/timeline.py: 9a84f74's; ab/cf4, ab/cf2: 9a84f74's package + variant_cluster_decode.diff + probe_cluster_cf4.diff (cf2: clusters of 2)
set -uo pipefail
out=$1; mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total --format=csv > "$out/card.txt"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD
for v in cf4 cf2; do t=$(date +%s)
  PYTHONPATH=$PWD/ab/$v:$PYTHONPATH timeout 100 python3 ab/single_stream.py --models llama2-7b --peers none --runs 1 \
    --profile-dir "$out/prof_$v" --out "$out/single_stream_$v.json" > "$out/single_stream_$v.log" 2>&1
  echo "single $v rc=$? $(( $(date +%s) - t ))s" >> "$out/session.log"
  python3 bench/results/h200-2026-12-05/starts.py "$out/prof_$v/profile_llama2-7b.trace.json" > "$out/starts_$v.txt" 2>&1
  rm -rf "$out/prof_$v"; done
