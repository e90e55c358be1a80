#!/usr/bin/env bash
# Fifty-third session, prepared for the next H200 call (~7 minutes warm; carry [".whl"]). Usage: run13.sh OUT
# run10.sh (the H200's one-row table searched, packaged on the device, the pin tests, then single stream table
# against autotuned, both models), then the 500-request offline workload, Llama-3-8B (issue 5), with that table
# (measured_tiles) against --no-measured-tiles, fresh processes, ABBA: the one-row table must not cost the
# batch path anything (batch-1 steps are rare there). Archives run10.tgz and run13.tgz.
set -uo pipefail
bash bench/results/gpu-2026-12-07/run10.sh "$1"
. bench/results/gpu-2026-12-07/call.sh run13 "$1"
n=0; for v in table autotuned autotuned table; do n=$((n + 1))
  step offline_8b_${n}_$v 100 python3 bench/serve.py --mode offline --shape llama3-8b --requests bench/data/requests.jsonl \
    --dtype bfloat16 --max-num-seqs 512 --max-num-batched-tokens 8192 --max-graph-batch 512 \
    $([ $v = autotuned ] && echo --no-measured-tiles) --out $w/offline_8b_${n}_$v.json
done
finish
