#!/usr/bin/env bash
# One call, any sm_90 GPU (carry [".whl", "ab"]; ab/main = HEAD's package, ab/var = HEAD + variant_coresidency.diff,
# whose switches are environment variables): can the single-sequence attention's programs sit beside q/k/v's
# while q/k/v runs, so their early K/V tile is read before q/k/v ends? Variants (Llama-2-7B single stream, ABBA,
# the first four profiled):
#   main   HEAD
#   grid   the decode grid with the KV head fastest (a graph's empty splits start last)
#   force  q/k/v and the LM head forced to the 32 x 256 x 8 one-row tile (the control for cores)
#   cores  force + that tile capped at 64 registers + the single-sequence attention capped at 128 + grid:
#          3 x 8 warps x 64 + 4 warps x 128 registers = 65,536, one attention program fits beside 3 of q/k/v's
set -uo pipefail
out=$1; mkdir -p $out; w=/tmp/w; mkdir -p $w; here=bench/results/gpu-2026-12-06
pack() { tar czf $out/run2.tgz -C $w --exclude='*.trace.json' .; }
step() { local name=$1 limit=$2; shift 2; local t=$(date +%s)
  timeout $limit "$@" > $w/$name.log 2>&1; echo "$name rc=$? $(( $(date +%s) - t ))s" | tee -a $w/session.log; pack; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONUNBUFFERED=1
nvidia-smi > $w/nvidia-smi.txt 2>&1
settings() { case $1 in
  main) echo "" ;;
  grid) echo "PAGEDLLM_HEAD_FASTEST=1" ;;
  force) echo "PAGEDLLM_QKV_TILE=1" ;;
  cores) echo "PAGEDLLM_QKV_TILE=1 PAGEDLLM_QKV_MAXNREG=64 PAGEDLLM_ATT_MAXNREG=128 PAGEDLLM_HEAD_FASTEST=1" ;;
esac; }
n=0; for v in ${ORDER:-main cores grid force force grid cores main}; do n=$((n+1))
  tree=$([ $v = main ] && echo main || echo var)
  prof=$([ $n -le 4 ] && echo "--profile-dir $w/prof_${n}_$v")
  step single_stream_${n}_$v 100 env $(settings $v) PYTHONPATH=$PWD/ab/$tree:/tmp/site:$PWD python3 bench/single_stream.py \
    --models llama2-7b --peers none --runs 3 $prof --out $w/single_stream_${n}_$v.json
  if [ -n "$prof" ]; then
    python3 bench/trace_steps.py $w/prof_${n}_$v/profile_llama2-7b.trace.json > $w/trace_${n}_$v.txt 2>&1
    python3 bench/results/h200-2026-12-05/starts.py $w/prof_${n}_$v/profile_llama2-7b.trace.json > $w/starts_${n}_$v.txt 2>&1
  fi
done
pack
