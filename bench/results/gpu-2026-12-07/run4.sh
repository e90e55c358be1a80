#!/usr/bin/env bash
# Fiftieth session: (1) run3's short mode (cap1 against main8, the attention alone at 159-478 sequences);
# (2) `bench/read_ceiling.py --matrices`: a read-only kernel over each one-row projection's bytes (Llama-2-7B,
# Llama-3-8B), timed as bench/gemv.py times the projection kernels, beside them on the same copies; then the
# 4 GiB read ceiling for the machine. Any sm_90 card; carry [".whl", "ab"]. ~5 minutes warm. Usage: run4.sh OUT
set -uo pipefail
out=$1; mkdir -p "$out"; w=/tmp/w4; rm -rf $w; mkdir -p $w
pack() { tar czf "$out/run4.tgz" -C $w . 2>/dev/null; }
nvidia-smi --query-gpu=name,memory.total,clocks.max.memory --format=csv > $w/card.txt 2>&1
(while sleep 15; do pack; done) & packer=$!
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
step() { local name=$1 limit=$2; shift 2; local t=$(date +%s)
  timeout $limit "$@" > $w/$name.log 2>&1; echo "$name rc=$? $(( $(date +%s) - t ))s" >> $w/session.log; }
step read_matrices 300 python3 bench/read_ceiling.py --matrices --out $w/read_matrices.json
pack
step run3 120 bash bench/results/gpu-2026-12-07/run3.sh $w/run3 short
pack
step read_ceiling 150 python3 bench/read_ceiling.py --out $w/read_ceiling.json
kill $packer; pack
