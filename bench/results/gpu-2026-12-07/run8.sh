#!/usr/bin/env bash
# Fifty-second session, one short call (~2.5 minutes warm; carry [".whl"]). Usage: run8.sh OUT
# On a GPU with a packaged tile table (kernels/tiles/): the landed table itself against the autotuner, Llama-2-7B
# single stream, fresh processes: table, autotuned (--no-measured-tiles), autotuned, table.
# On a GPU without one (an H200): run7's search for the 7B instead (run7.sh OUT 7b), the table to be.
set -uo pipefail
. bench/results/gpu-2026-12-07/call.sh run8 "$1"
if ! python3 -c "import sys, torch; from bento_pagedllm.kernels import gemv; sys.exit(not gemv.measured_tiles(torch.cuda.get_device_name()))"; then
  finish; exec bash bench/results/gpu-2026-12-07/run7.sh "$1" 7b
fi
n=0; for v in table autotuned autotuned table; do n=$((n + 1))
  step single_stream_${n}_$v 90 python3 bench/single_stream.py --models llama2-7b --peers none --runs 2 \
    $([ $v = autotuned ] && echo --no-measured-tiles) --out $w/single_stream_${n}_$v.json
done
finish
