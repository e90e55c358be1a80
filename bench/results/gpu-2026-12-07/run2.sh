#!/usr/bin/env bash
# Forty-eighth session: both waiting experiments in one call (~8 min warm), for a device that rarely starts.
# Carry [".whl", "ab"] (ab/main8, ab/etb, ab/mainf, ab/pollf). run1's short mode (issue 5: one offline pair,
# the attention alone, the GPU tests with etb), then gpu-2026-12-06j's run6 (issue 4: o polling a count).
out=$1; here=$(dirname "$0")
bash "$here/run1.sh" "$out" short
bash "$here/../gpu-2026-12-06j/run6.sh" "$out"
