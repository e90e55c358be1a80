#!/usr/bin/env bash
# Forty-sixth session, the last of its device time; any sm_90 card; carry [".whl", "ab"]: ab/mainf = main's package,
# ab/pollf = + variant_wait_done.diff (PAGEDLLM_WAIT_DONE=1 switches it on), both with q/k/v forced to the
# one-wave tile (as run1-3). The question: the o projection, instead of waiting for the single-sequence
# attention kernel's completion (griddepcontrol.wait), polls a count that each KV head's combining split raises
# (release) once its output is stored: is the count seen sooner than the kernel boundary resolves?
# Llama-2-7B single stream, ABBA, 2 runs each, then the engine's bfloat16 single-stream test with the variant.
set -uo pipefail
out=$1; mkdir -p "$out"; w=/tmp/w6; rm -rf $w; mkdir -p $w
pack() { tar czf "$out/run6.tgz" -C $w .; }
step() { local name=$1 limit=$2; shift 2; local t=$(date +%s)
  timeout $limit "$@" > $w/$name.log 2>&1; echo "$name rc=$? $(( $(date +%s) - t ))s" >> $w/session.log; pack; }
nvidia-smi --query-gpu=name,memory.total,clocks.max.memory --format=csv > $w/card.txt 2>&1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONUNBUFFERED=1
n=0; for v in mainf pollf pollf mainf; do n=$((n + 1))
  flag=$([ $v = pollf ] && echo PAGEDLLM_WAIT_DONE=1)
  step single_stream_${n}_$v 70 env $flag PYTHONPATH=$PWD/ab/$v:/tmp/site:$PWD python3 bench/single_stream.py \
    --models llama2-7b --peers none --runs 2 --out $w/single_stream_${n}_$v.json
done
vt=/tmp/vt; rm -rf $vt; mkdir -p $vt; cp -r tests pyproject.toml $vt/; cp -r ab/pollf/bento_pagedllm $vt/
step tests_poll 120 env PAGEDLLM_WAIT_DONE=1 PYTHONPATH=/tmp/site:$vt bash -c "cd $vt && python3 -m pytest -q \
  -p no:cacheprovider tests/gpu/test_engine_gpu.py -k 'single_stream_through'"
pack
