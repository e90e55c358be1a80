#!/usr/bin/env bash
# Builds, on the CPU machine, what run1.sh carries to the GPU (gitignored, so every session rebuilds them):
# ab/main (main's package), ab/poll (the thirty-sixth session's polled combine, with its tests and bench),
# ab/relaxed (poll + relaxed GPU-scope loads), ab/fma (variant_fma.diff: the one-row projections' products and
# squares summed by explicit FMAs, ~20% fewer instructions in their loops), and .whl (`make gpu-wheels`). Then one call:
#   run: `bash bench/results/h200-2026-12-05c/run1.sh $OUT/run1`, kind nvidia-h200, carry [".whl", "ab"]
# (about 4-5 minutes: 256 s on an H100 with fma too; run2.sh alone, carrying .whl only, is the probes for any GPU, about 4 minutes).
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
variants=bench/results/h200-2026-12-05b
rm -rf ab && mkdir -p ab/main ab/poll ab/relaxed ab/fma
git archive HEAD bento_pagedllm | tar -x -C ab/main
git archive HEAD bento_pagedllm tests bench pyproject.toml | tar -x -C ab/poll
git apply --directory=ab/poll $variants/variant_polled_combine.diff
cp -r ab/poll/bento_pagedllm ab/relaxed/
git apply --directory=ab/relaxed $variants/probe_relaxed_loads.diff
git archive HEAD bento_pagedllm | tar -x -C ab/fma
git apply --directory=ab/fma bench/results/h200-2026-12-05c/variant_fma.diff
[ -n "$(ls .whl/*.whl 2>/dev/null)" ] || make gpu-wheels
du -sh ab .whl
