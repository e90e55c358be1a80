#!/usr/bin/env bash
# One call, any sm_90 GPU (carry [".whl", "ab"]; ab/main = HEAD's package, ab/late = HEAD + variant_late_trigger.diff):
# does gate/up (5.2 waves of one-row programs) lose time to down's early-launched programs taking its later
# waves' slots? The variant lets only gate/up's last PAGEDLLM_LATE_WAVES x multiprocessors programs trigger the
# dependent launch (late4: one full wave at 4 programs a multiprocessor; late1: the last 132). Measured:
# bench/gemv.py gate/up and down at one row (each in a graph of dependent launches), then Llama-2-7B single
# stream in the order main, late4, late1, late1, late4, main (the first three profiled), and the step's edges.
set -uo pipefail
out=$1; mkdir -p $out; w=/tmp/w; mkdir -p $w
pack() { tar czf $out/run1.tgz -C $w --exclude='*.trace.json' .; }
step() { local name=$1 limit=$2; shift 2; local t=$(date +%s)
  timeout $limit "$@" > $w/$name.log 2>&1; echo "$name rc=$? $(( $(date +%s) - t ))s" | tee -a $w/session.log; pack; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONUNBUFFERED=1
nvidia-smi > $w/nvidia-smi.txt 2>&1
for v in main late4 late1; do
  tree=$([ $v = main ] && echo main || echo late); waves=${v#late}; [ $v = main ] && waves=0
  PAGEDLLM_LATE_WAVES=$waves PYTHONPATH=$PWD/ab/$tree:/tmp/site:$PWD:$PWD/bench step gemv_$v 120 python3 bench/gemv.py \
    --rows 1 --shapes "llama2-7b gate_up,llama2-7b down" --out $w/gemv_$v.json
done
n=0; for v in main late4 late1 late1 late4 main; do n=$((n+1))
  tree=$([ $v = main ] && echo main || echo late); waves=${v#late}; [ $v = main ] && waves=0
  prof=$([ $n -le 3 ] && echo "--profile-dir $w/prof_${n}_$v")
  PAGEDLLM_LATE_WAVES=$waves PYTHONPATH=$PWD/ab/$tree:/tmp/site:$PWD step single_stream_${n}_$v 100 python3 bench/single_stream.py \
    --models llama2-7b --peers none --runs 3 $prof --out $w/single_stream_${n}_$v.json
  if [ -n "$prof" ]; then
    python3 bench/trace_steps.py $w/prof_${n}_$v/profile_llama2-7b.trace.json > $w/trace_${n}_$v.txt 2>&1
    python3 bench/trace_steps.py --by-position $w/prof_${n}_$v/profile_llama2-7b.trace.json > $w/positions_${n}_$v.txt 2>&1
  fi
done
pack
