#!/usr/bin/env bash
# Fiftieth session, one call (~8 minutes warm; any sm_90 card; carry [".whl", "ab"]). Usage: run4.sh OUT [short]
# ab/main8 = main's package; ab/gemvw = it with kernels/gemv.py's one-row gate/up loading its gate and up rows
# as one tile (gemv_joined.diff), so that ptxas does not issue the up rows' loads only after the gate rows'
# have arrived (README: the SASS). In order (the packer keeps what finished):
#   1. bench/read_ceiling.py --matrices: a read-only kernel over each projection's bytes beside the projections
#   2. single stream, main8, gemvw, gemvw, main8 (2 runs each): Llama-2-7B and Llama-3-8B (short: the 7B only)
#   3. gate/up alone, every one-row tile (bench/gemv.py --sweep, the model's interleaved layout), each package
#   4. run3's short mode (cap1 against main8, the attention alone at 159-478 sequences)
# MODE `short` (~4-5 minutes): 1 and 2 (the 7B only); `tiny` (~3 minutes): 1 (the 7B only) and one pair;
# `micro` (~1.5 minutes): 1 only, the 7B's projections, 8 read configurations.
set -uo pipefail
mode=${2:-full}
. bench/results/gpu-2026-12-07/call.sh run4 "$1"
small=$(case $mode in tiny|micro) echo 1;; esac)
step read_matrices $([ -n "$small" ] && echo 110 || echo 150) python3 bench/read_ceiling.py --matrices --out $w/read_matrices.json \
  --models $([ -n "$small" ] && echo llama2-7b || echo llama2-7b,llama3-8b) $([ "$mode" = micro ] && echo --quick)
pack
[ "$mode" = micro ] && { finish; exit 0; }
models="llama2-7b llama3-8b"; [ "$mode" != full ] && models=llama2-7b
order="main8 gemvw gemvw main8"; [ "$mode" = tiny ] && order="main8 gemvw"
n=0; for v in $order; do n=$((n + 1))
  PYTHONPATH=$PWD/ab/$v:$PYTHONPATH step single_stream_${n}_$v $([ "$mode" = tiny ] && echo 90 || echo 150) python3 bench/single_stream.py \
    --models $models --peers none --runs 2 --out $w/single_stream_${n}_$v.json; done
pack
[ "$mode" != full ] || for v in main8 gemvw; do
  PYTHONPATH=$PWD/ab/$v:$PYTHONPATH step sweep_gate_up_$v 75 python3 bench/gemv.py --sweep --rows 1 \
    --shapes "llama2-7b gate_up,llama3-8b gate_up" --interleave 128 --out $w/sweep_gate_up_$v.json; done
pack
[ "$mode" != full ] || step run3 100 bash bench/results/gpu-2026-12-07/run3.sh $w/run3 short
finish
