#!/usr/bin/env bash
# one GPU call: the polled combine, partials as a normalised output and a log-sum-exp row (the working tree,
# `head`: volatile loads), the same with relaxed GPU-scope loads (`ab/relaxed`, inline PTX) and main's counter
# (`ab/main`): the polled kernel's GPU test, Llama-2-7B single stream ABBA (the first three profiled), the
# decode kernels' and the engine's GPU tests on head, then Llama-3-8B single stream head / main.
# Results go to /tmp/w, packed into OUT/run2.tgz after every stage (what a time limit leaves still comes back).
set -uo pipefail
out=$1; mkdir -p $out; w=/tmp/w; mkdir -p $w
pack() { tar czf $out/run2.tgz -C $w --exclude='*.trace.json' .; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi > $w/nvidia-smi.txt 2>&1
t=$(date +%s)
timeout 100 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_kernels_gpu.py -k polled > $w/gpu_tests_polled.log 2>&1
echo "polled kernel test rc=$? $(( $(date +%s) - t ))s" | tee -a $w/session.log; pack
n=0; for v in head relaxed main main relaxed head; do n=$((n+1)); P=$([ $v = head ] || echo "$PWD/ab/$v:")$PYTHONPATH; t=$(date +%s)
  prof=$([ $n -le 3 ] && echo "--profile-dir $w/prof_${n}_$v")
  PYTHONPATH=$P timeout 100 python3 bench/single_stream.py --models llama2-7b --peers none --runs 3 $prof --out $w/single_stream_${n}_$v.json > $w/single_stream_${n}_$v.log 2>&1
  echo "single $n $v rc=$? $(( $(date +%s) - t ))s" | tee -a $w/session.log
  [ -n "$prof" ] && python3 bench/trace_steps.py $w/prof_${n}_$v/profile_llama2-7b.trace.json > $w/trace_${n}_$v.txt 2>&1
  [ -n "$prof" ] && python3 bench/results/h200-2026-12-05/starts.py $w/prof_${n}_$v/profile_llama2-7b.trace.json > $w/starts_${n}_$v.txt 2>&1
  pack
done
t=$(date +%s)
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_kernels_gpu.py -k "decode or backend" tests/gpu/test_engine_gpu.py > $w/gpu_tests.log 2>&1
echo "decode kernel + engine tests rc=$? $(( $(date +%s) - t ))s" | tee -a $w/session.log; pack
for v in head main; do n=$((n+1)); P=$([ $v = head ] || echo "$PWD/ab/$v:")$PYTHONPATH; t=$(date +%s)
  PYTHONPATH=$P timeout 100 python3 bench/single_stream.py --models llama3-8b --peers none --runs 3 --out $w/single_stream_${n}_$v.json > $w/single_stream_${n}_$v.log 2>&1
  echo "single 8b $n $v rc=$? $(( $(date +%s) - t ))s" | tee -a $w/session.log; pack
done
