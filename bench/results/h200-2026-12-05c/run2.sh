#!/usr/bin/env bash
# The probes of run1.sh alone (no ab/ trees): the read ceiling, ncu on a 7B layer's one-row projections, a
# read-only stream and a copy, and bench/gemv.py at one row (gate/up in three row layouts, and its matrix read as
# a plain norm projection). For whichever GPU a call gets.
set -uo pipefail
out=$1; mkdir -p $out; w=/tmp/w; mkdir -p $w; here=bench/results/h200-2026-12-05c
pack() { tar czf $out/run2.tgz -C $w --exclude='*.ncu-rep' .; }
step() { local name=$1 limit=$2; shift 2; local t=$(date +%s)
  timeout $limit "$@" > $w/$name.log 2>&1; echo "$name rc=$? $(( $(date +%s) - t ))s" | tee -a $w/session.log; pack; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD:$PWD/bench
nvidia-smi > $w/nvidia-smi.txt 2>&1
step read_ceiling 120 python3 bench/read_ceiling.py --out $w/read_ceiling.json
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
step ncu 150 $NCU --clock-control none --nvtx --nvtx-include "profiled/" --section SpeedOfLight \
  --section MemoryWorkloadAnalysis --section WarpStateStats --section Occupancy --section LaunchStats \
  --section SchedulerStats -f -o $w/ncu python3 $here/ncu_kernels.py
$NCU --import $w/ncu.ncu-rep --page details > $w/ncu_details.txt 2>&1
$NCU --import $w/ncu.ncu-rep --page raw --csv > $w/ncu_raw.csv 2>&1; gzip -f $w/ncu_raw.csv; pack
step gemv 150 python3 bench/gemv.py --rows 1 --shapes llama2-7b --interleave 0,4,128 --out $w/gemv.json
