#!/usr/bin/env bash
# Fifty-fourth session, the one call to send for kind nvidia-h200 (carry [".whl"], timeout 600): such calls are
# often served by an H100. Usage: run14.sh OUT
# An H200: run13.sh (its tile table searched, packaged and measured against the autotuner, single stream and
# the 8B offline workload; ~7 minutes warm). Any other card: run12.sh OUT short (~1.3 minutes warm; on an H100,
# its shipped table against run7's; on a card without a table, run10.sh).
set -uo pipefail
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
  exec bash bench/results/gpu-2026-12-07/run13.sh "$1"
fi
exec bash bench/results/gpu-2026-12-07/run12.sh "$1" short
