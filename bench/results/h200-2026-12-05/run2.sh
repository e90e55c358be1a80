#!/usr/bin/env bash
# one GPU call: the cluster decode kernel's GPU tests, then single stream (Llama-2-7B, Llama-3-8B) from the tree
# (the cluster kernel) and from ab/main (the Triton kernel alone) in ABBA order, the tree's first run
# profiled; then the engine's GPU tests (greedy parity through the decode graphs)
set -uo pipefail
out=$1; mkdir -p $out
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_kernels_gpu.py -k "cluster or paged_decode" > $out/gpu_tests_kernels.log 2>&1; echo "kernel tests rc=$?" | tee -a $out/session.log
n=0; for v in head main main head; do n=$((n+1)); P=$([ $v = head ] || echo "$PWD/ab/$v:")$PYTHONPATH; t=$(date +%s)
  prof=$([ $n -eq 1 ] && echo "--profile-dir $out/prof_${n}_$v")
  PYTHONPATH=$P timeout 150 python3 bench/single_stream.py --models llama2-7b llama3-8b --peers none --runs 3 $prof --out $out/single_stream_${n}_$v.json > $out/single_stream_${n}_$v.log 2>&1
  echo "single $n $v rc=$? $(( $(date +%s) - t ))s" | tee -a $out/session.log
  [ -n "$prof" ] && python3 bench/trace_steps.py $out/prof_${n}_$v/profile_llama2-7b.trace.json > $out/trace_${n}_$v.txt 2>&1
done
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_engine_gpu.py > $out/gpu_tests_engine.log 2>&1; echo "engine tests rc=$?" | tee -a $out/session.log
rm -f $out/prof_*/*.trace.json
cd $out && tar czf /tmp/run2.tgz . && rm -rf ./* && mv /tmp/run2.tgz .
