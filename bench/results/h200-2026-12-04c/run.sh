#!/usr/bin/env bash
# one GPU call: the L2 micro-benchmark, then Llama-2-7B single stream main / l2 / l2 / main, then 8B offline main / l2
set -uo pipefail
out=$1; mkdir -p $out
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi > $out/nvidia-smi.txt 2>&1
PYTHONPATH=$PWD/ab/l2:$PYTHONPATH timeout 120 python3 bench/l2_persist.py --out $out/l2_persist.json > $out/l2_persist.log 2>&1; echo "micro rc=$?" | tee -a $out/session.log
n=0; for v in head l2 l2 head; do n=$((n+1)); P=$([ $v = head ] || echo "$PWD/ab/$v:")$PYTHONPATH; t=$(date +%s)
  PYTHONPATH=$P timeout 100 python3 bench/single_stream.py --models llama2-7b --peers none --runs 3 --out $out/single_stream_${n}_$v.json > $out/single_stream_${n}_$v.log 2>&1
  echo "single $n $v rc=$? $(( $(date +%s) - t ))s" | tee -a $out/session.log; done
S8="--max-num-seqs 1024 --max-num-batched-tokens 16384 --max-graph-batch 512"
n=0; for v in l2 head; do n=$((n+1)); P=$([ $v = head ] || echo "$PWD/ab/$v:")$PYTHONPATH; t=$(date +%s)
  PYTHONPATH=$P timeout 80 python3 bench/serve.py --mode offline --shape llama3-8b --requests bench/data/requests.jsonl --dtype bfloat16 $S8 --out $out/offline8b_${n}_$v.json > $out/offline8b_${n}_$v.log 2>&1
  echo "offline $n $v rc=$? $(( $(date +%s) - t ))s" | tee -a $out/session.log; done
