#!/usr/bin/env bash
# NOT RUN yet (no H200 was lent in the thirty-sixth session): the polled combine on an H200, the issue's
# machine, where the attention's programs start ~24 us before q/k/v ends and wait together (on the H100s of
# runs 1-2 they started only ~2 us before it), so the combiner may find its peers' partials ready at its
# first read. `ab/main` = main's package; `ab/poll` = main's package, tests, bench and pyproject.toml with
# `variant_polled_combine.diff` applied; `ab/relaxed` = ab/poll's package with `probe_relaxed_loads.diff`
# (README.md here says how to build them). Order poll, relaxed, main, main, relaxed, poll, the first three
# profiled; the variant's GPU tests first.
set -uo pipefail
out=$1; mkdir -p $out; w=/tmp/w; mkdir -p $w
pack() { tar czf $out/run3.tgz -C $w --exclude='*.trace.json' .; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONUNBUFFERED=1
nvidia-smi > $w/nvidia-smi.txt 2>&1
t=$(date +%s)
(cd ab/poll && PYTHONPATH=/tmp/site:$PWD timeout 150 python3 -m pytest -q -p no:cacheprovider \
  tests/gpu/test_kernels_gpu.py -k "polled or decode or backend" tests/gpu/test_engine_gpu.py) > $w/gpu_tests_poll.log 2>&1
echo "the variant's GPU tests rc=$? $(( $(date +%s) - t ))s" | tee -a $w/session.log; pack
n=0; for v in poll relaxed main main relaxed poll; do n=$((n+1)); t=$(date +%s)
  prof=$([ $n -le 3 ] && echo "--profile-dir $w/prof_${n}_$v")
  PYTHONPATH=$PWD/ab/$v:/tmp/site:$PWD timeout 100 python3 bench/single_stream.py --models llama2-7b --peers none \
    --runs 3 $prof --out $w/single_stream_${n}_$v.json > $w/single_stream_${n}_$v.log 2>&1
  echo "single $n $v rc=$? $(( $(date +%s) - t ))s" | tee -a $w/session.log
  [ -n "$prof" ] && python3 bench/trace_steps.py $w/prof_${n}_$v/profile_llama2-7b.trace.json > $w/trace_${n}_$v.txt 2>&1
  [ -n "$prof" ] && python3 bench/results/h200-2026-12-05/starts.py $w/prof_${n}_$v/profile_llama2-7b.trace.json > $w/starts_${n}_$v.txt 2>&1
  pack
done
