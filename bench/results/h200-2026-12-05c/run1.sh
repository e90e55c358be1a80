#!/usr/bin/env bash
# One H200 call (thirty-seventh session; fma added in the thirty-ninth):
# (1) the polled combine and the FMA projections against main on an H200: the polled combine's GPU test, then
#     Llama-2-7B single stream in the order poll, relaxed, main, main, relaxed, poll (the first four profiled;
#     ORDER changes it: with fma, bench/gemv.py at one row on ab/fma too);
# (2)-(4) run2.sh: what a read-only stream reaches (bench/read_ceiling.py) against the copy bandwidth; Nsight
#     Compute on each one-row projection of a 7B layer, a read-only stream and a copy (ncu_kernels.py here);
#     bench/gemv.py at one row on main, the 7B's projections in a graph with dependent launch.
# Needs ab/main, ab/poll, ab/relaxed, ab/fma and .whl: prepare.sh builds them.
set -uo pipefail
out=$1; mkdir -p $out; w=/tmp/w; mkdir -p $w; here=bench/results/h200-2026-12-05c
pack() { tar czf $out/run1.tgz -C $w --exclude='*.trace.json' --exclude='*.ncu-rep' .; }
step() { local name=$1 limit=$2; shift 2; local t=$(date +%s)
  timeout $limit "$@" > $w/$name.log 2>&1; echo "$name rc=$? $(( $(date +%s) - t ))s" | tee -a $w/session.log; pack; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONUNBUFFERED=1
nvidia-smi > $w/nvidia-smi.txt 2>&1
order=${ORDER:-poll relaxed main main relaxed poll}  # fma: no gain on an H100 (run1_h100); ORDER adds it back
if [[ " $order " == *" poll "* ]]; then
  (cd ab/poll && PYTHONPATH=/tmp/site:$PWD timeout 100 python3 -m pytest -q -p no:cacheprovider \
    tests/gpu/test_kernels_gpu.py -k polled) > $w/gpu_tests_poll.log 2>&1
  echo "polled test rc=$?" | tee -a $w/session.log
fi
n=0; for v in $order; do n=$((n+1))
  prof=$([ $n -le 4 ] && echo "--profile-dir $w/prof_${n}_$v")
  PYTHONPATH=$PWD/ab/$v:/tmp/site:$PWD step single_stream_${n}_$v 100 python3 bench/single_stream.py --models llama2-7b \
    --peers none --runs 3 $prof --out $w/single_stream_${n}_$v.json
  [ -n "$prof" ] && python3 bench/trace_steps.py $w/prof_${n}_$v/profile_llama2-7b.trace.json > $w/trace_${n}_$v.txt 2>&1
  [ -n "$prof" ] && python3 bench/results/h200-2026-12-05/starts.py $w/prof_${n}_$v/profile_llama2-7b.trace.json > $w/starts_${n}_$v.txt 2>&1
done
[[ " $order " == *" fma "* ]] && PYTHONPATH=$PWD/ab/fma:/tmp/site:$PWD:$PWD/bench step gemv_fma 150 python3 bench/gemv.py --rows 1 --shapes llama2-7b \
  --interleave 0,4,128 --out $w/gemv_fma.json
pack
bash $here/run2.sh $out  # the probes, into the same /tmp/w (run2.tgz then holds everything)
