#!/usr/bin/env bash
# Fifty-third session, one call (~8-9 minutes warm; carry [".whl"]). Usage: run11.sh OUT
# run10.sh (this GPU's one-row table searched, packaged on the device, tested, then table against autotuned in
# fresh single-stream processes), then run9.sh's batch part (Llama-3-8B's one-, 16- and 32-row tiles searched,
# then the 500-request offline workload: main, that search's table pinned, again, main), each archived apart
# (run10.tgz, run9.tgz): a call cut by its limit keeps what finished.
bash bench/results/gpu-2026-12-07/run10.sh "$1"
bash bench/results/gpu-2026-12-07/run9.sh "$1" batch
