#!/usr/bin/env bash
# one GPU call: a single sequence's decode splits combined by polling (the working tree, `head`) against
# main's counter (`ab/main`): the polled kernel's GPU test first (a hang would show there), then Llama-2-7B
# single stream in ABBA order (the first of each profiled), then the decode kernels' and the engine's GPU tests
set -uo pipefail
out=$1; mkdir -p $out
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi > $out/nvidia-smi.txt 2>&1
t=$(date +%s)
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_kernels_gpu.py -k polled > $out/gpu_tests_polled.log 2>&1
echo "polled kernel test rc=$? $(( $(date +%s) - t ))s" | tee -a $out/session.log
n=0; for v in head main main head head main; do n=$((n+1)); P=$([ $v = head ] || echo "$PWD/ab/$v:")$PYTHONPATH; t=$(date +%s)
  prof=$([ $n -le 2 ] && echo "--profile-dir $out/prof_${n}_$v")
  PYTHONPATH=$P timeout 120 python3 bench/single_stream.py --models llama2-7b --peers none --runs 3 $prof --out $out/single_stream_${n}_$v.json > $out/single_stream_${n}_$v.log 2>&1
  echo "single $n $v rc=$? $(( $(date +%s) - t ))s" | tee -a $out/session.log
  [ -n "$prof" ] && python3 bench/trace_steps.py $out/prof_${n}_$v/profile_llama2-7b.trace.json > $out/trace_${n}_$v.txt 2>&1
  [ -n "$prof" ] && python3 bench/results/h200-2026-12-05/starts.py $out/prof_${n}_$v/profile_llama2-7b.trace.json > $out/starts_${n}_$v.txt 2>&1
done
rm -f $out/prof_*/*.trace.json
t=$(date +%s)
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_kernels_gpu.py -k "decode or backend" tests/gpu/test_engine_gpu.py > $out/gpu_tests.log 2>&1
echo "decode kernel + engine tests rc=$? $(( $(date +%s) - t ))s" | tee -a $out/session.log
cd $out && tar czf /tmp/run1.tgz . && rm -rf ./* && mv /tmp/run1.tgz .
