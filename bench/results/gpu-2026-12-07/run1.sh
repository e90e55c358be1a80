#!/usr/bin/env bash
# Forty-seventh session: split decode batches read their first K/V tile before the dependent-launch wait.
# Any sm_90 card; carry [".whl", "ab"]: ab/main8 = main's package, ab/eta = + the early tile for split batches
# (cache path; the new key folded apart; registers capped at 128), ab/etb = eta + the rotary kernel letting the
# attention launch before its own wait. Llama-3-8B offline (vLLM's batch settings) in the order main8, etb,
# etb, main8 (eta not run: it fits no call with the rest); then the decode attention alone on the offline tail's
# batches (no dependent launch: the early tile's cost without its overlap); then the GPU tests with etb's package.
set -uo pipefail
out=$1; mkdir -p "$out"; w=/tmp/w1; rm -rf $w; mkdir -p $w
pack() { tar czf "$out/run1.tgz" -C $w .; }
nvidia-smi --query-gpu=name,memory.total,clocks.max.memory --format=csv > $w/card.txt 2>&1
(while sleep 20; do pack; done) & packer=$!
SHAPES=llama3-8b VARIANTS="main8:32 etb:32" timeout 250 bash bench/h200_session.sh offline_variants $w/offline \
  > $w/offline.log 2>&1; echo "offline rc=$?" >> $w/session.log
export PYTHONUNBUFFERED=1
for v in main8 etb; do
  PYTHONPATH=$PWD/ab/$v:/tmp/site:$PWD timeout 35 python3 bench/decode_attention.py --shape llama3-8b --seqs "" \
    --orders longest_first --splits 2 --ragged 8,16,32,63,95 --out $w/attention_$v.json > $w/attention_$v.log 2>&1
  echo "attention_$v rc=$?" >> $w/session.log; done
vt=/tmp/vt; rm -rf $vt; mkdir -p $vt; cp -r tests pyproject.toml $vt/; cp -r ab/etb/bento_pagedllm $vt/
PYTHONPATH=/tmp/site:$vt timeout 100 bash -c "cd $vt && python3 -m pytest -q -p no:cacheprovider \
  tests/gpu/test_kernels_gpu.py tests/gpu/test_engine_gpu.py -k 'decode or triton_backend or rotary or float32_greedy or bfloat16_agrees'" \
  > $w/tests.log 2>&1; echo "tests rc=$?" >> $w/session.log
kill $packer; pack
