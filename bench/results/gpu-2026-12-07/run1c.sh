#!/usr/bin/env bash
# run1.sh cut to one offline run each (main8, then etb) for the last ~250 s of device time: the per-size step
# times (gpu_timeline.decode_graph_ms_by_seqs) show a ~1% move in the 2-95-sequence steps even from one pair.
# Carry [".whl", "ab"].
set -uo pipefail
out=$1; mkdir -p "$out"; w=/tmp/w1; rm -rf $w; mkdir -p $w
pack() { tar czf "$out/run1c.tgz" -C $w .; }
nvidia-smi --query-gpu=name,memory.total,clocks.max.memory --format=csv > $w/card.txt 2>&1
(while sleep 15; do pack; done) & packer=$!
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
for v in main8 etb; do t=$(date +%s)
  PYTHONPATH=$PWD/ab/$v:/tmp/site:$PWD timeout 75 python3 bench/serve.py --mode offline --shape llama3-8b \
    --requests bench/data/requests.jsonl --dtype bfloat16 --max-num-seqs 1024 --max-num-batched-tokens 16384 \
    --max-graph-batch 512 --fused-gemv-rows 32 --out $w/serve_offline_llama3-8b_$v.json > $w/offline_$v.log 2>&1
  echo "offline_$v rc=$? $(( $(date +%s) - t ))s" >> $w/session.log; done
kill $packer; pack
