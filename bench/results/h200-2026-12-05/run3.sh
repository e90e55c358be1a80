#!/usr/bin/env bash
# one GPU call: the cluster kernel's tests; single stream (Llama-2-7B) for the tree (cluster kernel),
# cfloor (the cluster launch, nothing after the wait), nocl (the kernel's folds without a cluster: each split
# writes its own output) and main (Triton), in ABBA order, the first four runs profiled
set -uo pipefail
out=$1; mkdir -p $out
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_kernels_gpu.py -k "cluster" > $out/gpu_tests_kernels.log 2>&1; echo "kernel tests rc=$?" | tee -a $out/session.log
n=0; for v in head cfloor nocl spread main spread nocl cfloor head; do n=$((n+1)); P=$([ $v = head ] || echo "$PWD/ab/$v:")$PYTHONPATH; t=$(date +%s)
  prof=$([ $n -le 5 ] && echo "--profile-dir $out/prof_${n}_$v")
  PYTHONPATH=$P timeout 150 python3 bench/single_stream.py --models llama2-7b --peers none --runs 3 $prof --out $out/single_stream_${n}_$v.json > $out/single_stream_${n}_$v.log 2>&1
  echo "single $n $v rc=$? $(( $(date +%s) - t ))s" | tee -a $out/session.log
  if [ -n "$prof" ]; then python3 bench/trace_steps.py $out/prof_${n}_$v/profile_llama2-7b.trace.json > $out/trace_${n}_$v.txt 2>&1
    python3 bench/results/h200-2026-12-05/starts.py $out/prof_${n}_$v/profile_llama2-7b.trace.json >> $out/trace_${n}_$v.txt 2>&1; fi
done
rm -f $out/prof_*/*.trace.json
cd $out && tar czf /tmp/run3.tgz . && rm -rf ./* && mv /tmp/run3.tgz .
