#!/usr/bin/env bash
# Fifty-first session, one call (~4-5 minutes warm; any sm_90 card; carry [".whl", "ab"]). Usage: run5.sh OUT [micro]
# ab/main8 = main's package; ab/xbuf = it with gemv_x_double_buffer.diff: the one-row plain projections (o, down)
# load the next x tile together with the next W tile, so the W load no longer waits for x's L2 round trip
# (README: the SASS). In order (the packer keeps what finished):
#   1. the 7B's down alone in every one-row tile (bench/gemv.py --sweep: tile by tile, no autotuner), each package
#   2. Llama-2-7B single stream, main8, xbuf, xbuf, main8 (2 runs each; compare their tuned_configs too: the
#      autotuner's choices differ between processes, run4's gemvw pair picked other q/k/v and o tiles)
#   3. o and down alone (bench/gemv.py, dependent launch off and on, the autotuner's tile), main8 then xbuf
# MODE `micro` (~2 minutes): 1 only.
set -uo pipefail
mode=${2:-full}
. bench/results/gpu-2026-12-07/call.sh run5 "$1"
for v in main8 xbuf; do
  PYTHONPATH=$PWD/ab/$v:$PYTHONPATH step sweep_down_$v 75 python3 bench/gemv.py --sweep --rows 1 \
    --shapes "llama2-7b down" --out $w/sweep_down_$v.json; done
pack
[ "$mode" = micro ] && { finish; exit 0; }
n=0; for v in main8 xbuf xbuf main8; do n=$((n + 1))
  PYTHONPATH=$PWD/ab/$v:$PYTHONPATH step single_stream_${n}_$v 90 python3 bench/single_stream.py \
    --models llama2-7b --peers none --runs 2 --out $w/single_stream_${n}_$v.json; done
pack
for v in main8 xbuf; do
  PYTHONPATH=$PWD/ab/$v:$PYTHONPATH step gemv_$v 60 python3 bench/gemv.py --rows 1 \
    --shapes "llama2-7b o,llama2-7b down,llama3-8b down" --out $w/gemv_$v.json; done
finish
