#!/usr/bin/env bash
# Forty-ninth session: the big batches' single-split decode attention capped at 128 registers (130 uncapped:
# 3 programs of 4 warps a multiprocessor instead of 4; ptxas spills 32 bytes with the cap). Any sm_90 card;
# carry [".whl", "ab"]: ab/main8 = main's package, ab/cap1 = it with `maxnreg=128` for single-split cache-path
# launches (README: how to build them). ~5 minutes warm. Usage: run3.sh OUT
#   registers of both packages; the attention alone on the offline workload's big batches (Llama-3-8B, one
#   split, longest first) in the order main8, cap1, cap1, main8; then Llama-3-8B offline main8, cap1, cap1, main8
#   (MODE `short`, ~1.5 minutes: without the offline runs)
set -uo pipefail
out=$1; mode=${2:-full}; mkdir -p "$out"; w=/tmp/w3; rm -rf $w; mkdir -p $w
pack() { tar czf "$out/run3.tgz" -C $w .; }
nvidia-smi --query-gpu=name,memory.total,clocks.max.memory --format=csv > $w/card.txt 2>&1
(while sleep 15; do pack; done) & packer=$!
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 NO_WHEELS=1
step() { local name=$1 limit=$2; shift 2; local t=$(date +%s)
  timeout $limit "$@" > $w/$name.log 2>&1; echo "$name rc=$? $(( $(date +%s) - t ))s" >> $w/session.log; }
# NOTE: decode_registers.py puts the tree first on sys.path; this copy leaves PYTHONPATH's order (ab/ first)
sed '/sys.path.insert/d' bench/decode_registers.py > /tmp/regs.py
for v in main8 cap1; do
  PYTHONPATH=$PWD/ab/$v:$PYTHONPATH step registers_$v 40 python3 /tmp/regs.py; done
n=0; for v in main8 cap1 cap1 main8; do n=$((n+1))
  PYTHONPATH=$PWD/ab/$v:$PYTHONPATH step attention_${n}_$v 40 python3 bench/decode_attention.py --shape llama3-8b \
    --seqs "" --orders longest_first --splits 1 --ragged 159,192,256,320,400,478 --out $w/attention_${n}_$v.json; done
pack
[ "$mode" = short ] || SHAPES=llama3-8b VARIANTS="main8:32 cap1:32" step offline 250 bash bench/h200_session.sh offline_variants $w/offline
kill $packer; pack
