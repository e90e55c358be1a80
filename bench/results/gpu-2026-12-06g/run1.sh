#!/usr/bin/env bash
# The embedding lookup folded into the first q/k/v (the tree) against main (ab/main), one call:
# Llama-2-7B single stream in ABBA order, one profiled run of each (trace_steps --by-position), then the GPU tests
set -u
out=$1; mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total,clocks.max.memory --format=csv > "$out/card.txt"
AB=main MODELS=llama2-7b bash bench/h200_session.sh single_ab "$out/ab" > "$out/ab.log" 2>&1
export PYTHONPATH=/tmp/site:$PWD
for v in head main; do P=$([ $v = head ] || echo "$PWD/ab/$v:")$PYTHONPATH
  PYTHONPATH=$P timeout 120 python3 bench/single_stream.py --models llama2-7b --peers none --runs 1 \
    --profile-dir "$out/prof_$v" --out "$out/prof_$v.json" > "$out/prof_$v.log" 2>&1
  python3 bench/trace_steps.py "$out/prof_$v/profile_llama2-7b.trace.json" > "$out/steps_$v.txt" 2>&1
  python3 bench/trace_steps.py --by-position "$out/prof_$v/profile_llama2-7b.trace.json" > "$out/positions_$v.txt" 2>&1
  gzip -q "$out/prof_$v/profile_llama2-7b.trace.json"; done
timeout ${TESTS_LIMIT:-240} python3 -m pytest -q -p no:cacheprovider tests/gpu/test_kernels_gpu.py tests/gpu/test_engine_gpu.py \
  -k "projections or pending or engine or bfloat16 or float32" > "$out/gpu_tests.log" 2>&1
echo "gpu_tests rc=$?" >> "$out/ab/session.log"
