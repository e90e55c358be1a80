#!/usr/bin/env bash
# run1.sh cut to its offline part for the device time left (~360 s): Llama-3-8B offline, main8, etb, etb, main8.
# Carry [".whl", "ab"] (ab/main8, ab/etb as in run1.sh).
set -uo pipefail
out=$1; mkdir -p "$out"; w=/tmp/w1; rm -rf $w; mkdir -p $w
pack() { tar czf "$out/run1b.tgz" -C $w .; }
nvidia-smi --query-gpu=name,memory.total,clocks.max.memory --format=csv > $w/card.txt 2>&1
(while sleep 15; do pack; done) & packer=$!
SHAPES=llama3-8b VARIANTS="main8:32 etb:32" timeout 225 bash bench/h200_session.sh offline_variants $w/offline \
  > $w/offline.log 2>&1; echo "offline rc=$?" >> $w/session.log
kill $packer; pack
