#!/usr/bin/env bash
# Forty-seventh session: split decode batches read their first K/V tile before the dependent-launch wait.
# Any sm_90 card; carry [".whl", "ab"]: ab/main8 = main's package, ab/eta = + the early tile for split batches
# (cache path; the new key folded apart; registers capped at 128), ab/etb = eta + the rotary kernel letting the
# attention launch before its own wait (README: how to build them). Usage: run1.sh OUT [MODE]
#   full (default, ~8 min): Llama-3-8B offline (vLLM's batch settings) main8, etb, etb, main8; then the decode
#     attention alone on the offline tail's batches (no dependent launch: the early tile's cost without its
#     overlap); then the GPU tests with etb's package
#   offline (~4 min): the offline ABBA alone
#   pair (~2 min): one offline run each, main8 then etb (the per-size step times,
#     gpu_timeline.decode_graph_ms_by_seqs, show a ~1% move in the 2-95-sequence steps even from one pair)
#   short (~4.5 min): pair, then the attention alone and the GPU tests (room for run6 in the same call)
#   parts (~2 min): the attention alone and the GPU tests, no offline run
set -uo pipefail
out=$1; mode=${2:-full}
case $mode in  # offline: abba, pair or none; parts: whether the attention alone and the GPU tests run
  full) offline=abba parts=1 ;; offline) offline=abba parts= ;; pair) offline=pair parts= ;;
  short) offline=pair parts=1 ;; parts) offline=none parts=1 ;; *) echo "unknown mode $mode" >&2; exit 2 ;;
esac
mkdir -p "$out"; w=/tmp/w1; rm -rf $w; mkdir -p $w
pack() { tar czf "$out/run1_$mode.tgz" -C $w .; }
nvidia-smi --query-gpu=name,memory.total,clocks.max.memory --format=csv > $w/card.txt 2>&1
(while sleep 15; do pack; done) & packer=$!
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 NO_WHEELS=1
step() { local name=$1 limit=$2; shift 2; local t=$(date +%s)
  timeout $limit "$@" > $w/$name.log 2>&1; echo "$name rc=$? $(( $(date +%s) - t ))s" >> $w/session.log; }
if [ $offline = pair ]; then
  for v in main8 etb; do
    PYTHONPATH=$PWD/ab/$v:$PYTHONPATH step offline_$v 75 python3 bench/serve.py --mode offline --shape llama3-8b \
      --requests bench/data/requests.jsonl --dtype bfloat16 --max-num-seqs 1024 --max-num-batched-tokens 16384 \
      --max-graph-batch 512 --fused-gemv-rows 32 --out $w/serve_offline_llama3-8b_$v.json; done
elif [ $offline = abba ]; then
  SHAPES=llama3-8b VARIANTS="main8:32 etb:32" step offline 250 bash bench/h200_session.sh offline_variants $w/offline
fi
if [ -n "$parts" ]; then
  for v in main8 etb; do
    PYTHONPATH=$PWD/ab/$v:$PYTHONPATH step attention_$v 35 python3 bench/decode_attention.py --shape llama3-8b \
      --seqs "" --orders longest_first --splits 2 --ragged 8,16,32,63,95 --out $w/attention_$v.json; done
  vt=/tmp/vt; rm -rf $vt; mkdir -p $vt; cp -r tests pyproject.toml $vt/; cp -r ab/etb/bento_pagedllm $vt/
  PYTHONPATH=/tmp/site:$vt step tests 100 bash -c "cd $vt && python3 -m pytest -q -p no:cacheprovider \
    tests/gpu/test_kernels_gpu.py tests/gpu/test_engine_gpu.py -k 'decode or triton_backend or rotary or float32_greedy or bfloat16_agrees'"
fi
kill $packer; pack
