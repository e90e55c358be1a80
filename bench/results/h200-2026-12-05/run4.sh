#!/usr/bin/env bash
# one GPU call: does a cluster launch start early under dependent launch if its clusters are smaller? The
# cluster kernel that returns after its wait (cfloor: clusters of 8), with clusters of 2 (cf2) and 4 (cf4),
# against main (Triton), single stream Llama-2-7B in ABBA order, the first four runs profiled
set -uo pipefail
out=$1; mkdir -p $out
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD
n=0; for v in main cf4 cf2 main; do n=$((n+1)); P=$([ $v = head ] || echo "$PWD/ab/$v:")$PYTHONPATH; t=$(date +%s)
  prof=$([ $n -le 3 ] && echo "--profile-dir $out/prof_${n}_$v")
  PYTHONPATH=$P timeout 150 python3 bench/single_stream.py --models llama2-7b --peers none --runs 3 $prof --out $out/single_stream_${n}_$v.json > $out/single_stream_${n}_$v.log 2>&1
  echo "single $n $v rc=$? $(( $(date +%s) - t ))s" | tee -a $out/session.log
  if [ -n "$prof" ]; then python3 bench/trace_steps.py $out/prof_${n}_$v/profile_llama2-7b.trace.json > $out/trace_${n}_$v.txt 2>&1
    python3 bench/results/h200-2026-12-05/starts.py $out/prof_${n}_$v/profile_llama2-7b.trace.json >> $out/trace_${n}_$v.txt 2>&1; fi
done
rm -f $out/prof_*/*.trace.json
cd $out && tar czf /tmp/run4.tgz . && rm -rf ./* && mv /tmp/run4.tgz .
