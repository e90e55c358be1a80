#!/usr/bin/env bash
# Fifty-second session, one call (~6 minutes warm; any sm_90 card; carry [".whl"]). Usage: run6.sh OUT [7b]
# Is the single stream's process-to-process spread the autotuner's tile choice? (run5: four processes of one
# package on one H100 ran Llama-2-7B decode steps in 4.70-4.79 ms with three tile sets for gate/up and o.)
# For each model: 4 processes of main as it is (each records gemv.tuned_configs()); then the fastest and the
# slowest process's choices pinned (`single_stream.py --pin-tiles`, kernels/gemv.py::pin_tiles), alternating
# fast, slow, fast, slow. If the tiles are the cause, pinned-fast processes run like the fastest and
# pinned-slow like the slowest. First the GPU tests of pin_tiles and the projections.
set -uo pipefail
mode=${2:-full}
. bench/results/gpu-2026-12-07/call.sh run6 "$1"
step gpu_tests 90 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_kernels_gpu.py -k "pinned or projections"
pack
pick() {  # pick MODEL WHICH(max|min) OUT: the tuned_configs of the fastest / slowest main process
  python3 - "$@" <<'PY'
import glob, json, sys
model, which, out = sys.argv[1:]
runs = [json.load(open(f))["models"][model]["engine"] for f in sorted(glob.glob(f"/tmp/run6/{model}_main_*.json"))]
best = (max if which == "max" else min)(runs, key=lambda e: e["decode_tok_s"])
print(which, best["decode_tok_s"])
json.dump(best["tuned_configs"], open(out, "w"), indent=1)
PY
}
models="llama2-7b llama3-8b"; [ "$mode" = 7b ] && models=llama2-7b
for m in $models; do
  for n in 1 2 3 4; do
    step ${m}_main_$n 120 python3 bench/single_stream.py --models $m --peers none --runs 2 --out $w/${m}_main_$n.json
  done
  pick $m max $w/${m}_pins_fast.json > $w/${m}_pick.log 2>&1; pick $m min $w/${m}_pins_slow.json >> $w/${m}_pick.log 2>&1
  pack
  for n in 1 2; do for v in fast slow; do
    step ${m}_pinned_${v}_$n 90 python3 bench/single_stream.py --models $m --peers none --runs 2 \
      --pin-tiles $w/${m}_pins_$v.json --out $w/${m}_pinned_${v}_$n.json
  done; done
  pack
done
finish
