#!/usr/bin/env bash
# Forty-sixth session: the figures of record (issues 4 and 5), only where the card is an H200; on any other
# card it records the card and stops. Carry [".whl", ".whl-bento"].
set -uo pipefail
out=$1; mkdir -p "$out"; w=/tmp/w4; rm -rf $w; mkdir -p $w
pack() { tar czf "$out/run4.tgz" -C $w .; }
nvidia-smi --query-gpu=name,memory.total,clocks.max.memory --format=csv > $w/card.txt 2>&1
if grep -q H200 $w/card.txt; then
  (while sleep 20; do pack; done) & packer=$!
  timeout ${RECORD_LIMIT:-520} bash bench/h200_session.sh record $w/record > $w/record.log 2>&1
  echo "record rc=$?" >> $w/session.log
  # the H200's read-only ceiling, never measured (the H100's: 1.045x its copy bandwidth, thirty-ninth session)
  PYTHONPATH=/tmp/site:$PWD timeout 30 python3 bench/read_ceiling.py --out $w/read_ceiling.json > $w/read_ceiling.log 2>&1
  echo "read_ceiling rc=$?" >> $w/session.log; kill $packer
fi
pack
