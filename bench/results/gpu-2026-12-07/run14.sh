#!/usr/bin/env bash
# Fifty-fourth session, the one call to send for kind nvidia-h200 (carry [".whl"], timeout 600): such calls are
# often served by an H100. Usage: run14.sh OUT [lean]
# An H200: run13.sh (its tile table searched, packaged and measured against the autotuner, single stream and
# the 8B offline workload; ~7 minutes warm), or with `lean` run10.sh OUT lean (the 7B's table alone, single
# stream; ~3.5 minutes warm, for a short budget). Any other card: its name in OUT/card.txt and nothing else
# (run12.sh's H100 comparison ran in the fifty-fifth session, run12a); give such a machine back at once.
set -uo pipefail
mkdir -p "$1"; nvidia-smi --query-gpu=name --format=csv,noheader | tee "$1/card.txt"
grep -q H200 "$1/card.txt" || exit 0
if [ "${2:-}" = lean ]; then exec bash bench/results/gpu-2026-12-07/run10.sh "$1" lean; fi
exec bash bench/results/gpu-2026-12-07/run13.sh "$1"
