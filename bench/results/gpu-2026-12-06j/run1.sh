#!/usr/bin/env bash
# Forty-sixth session, one call on any sm_90 card; carry [".whl", ".whl-bento", "ab"] (ab/ built per README.md).
# Part 1 (any card): does a thread-block-cluster launch of 2 or 4 start early under dependent launch? The
# forty-fifth session's probe could not tell on an H100, because that card's autotuner gave q/k/v a multi-wave
# tile and so even main's attention did not start early there. Here every tree forces q/k/v and the LM head to
# the one-wave 32 x 256 x 8 tile (the H200's usual choice; on an H100 it made main's attention start 33 us
# early, fortieth session): ctrlf = 9a84f74 + force (the control), cf4f / cf2f = the do-nothing cluster
# decode kernel in clusters of 4 / 2 + force. Llama-2-7B single stream, one profiled run each.
# Part 2 (an H200 only): the figures of record, `bench/h200_session.sh record`.
set -uo pipefail
out=$1; mkdir -p "$out"; w=/tmp/w1; rm -rf $w; mkdir -p $w
pack() { tar czf "$out/run1.tgz" -C $w --exclude='prof_*' .; }
nvidia-smi --query-gpu=name,memory.total,clocks.max.memory --format=csv > $w/card.txt 2>&1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONUNBUFFERED=1
n=0; for v in ${ORDER:-ctrlf cf4f cf2f ctrlf}; do n=$((n + 1)); t=$(date +%s)
  PYTHONPATH=$PWD/ab/$v:/tmp/site:$PWD timeout 120 python3 ab/single_stream.py --models llama2-7b --peers none \
    --runs 1 --profile-dir $w/prof_${n}_$v --out $w/single_stream_${n}_$v.json > $w/single_stream_${n}_$v.log 2>&1
  echo "single_stream_${n}_$v rc=$? $(( $(date +%s) - t ))s" >> $w/session.log
  python3 bench/results/h200-2026-12-05/starts.py $w/prof_${n}_$v/profile_llama2-7b.trace.json > $w/starts_${n}_$v.txt 2>&1
  rm -rf $w/prof_${n}_$v; pack
done
if grep -q H200 $w/card.txt; then
  (while sleep 20; do pack; done) & packer=$!
  timeout ${RECORD_LIMIT:-380} bash bench/h200_session.sh record $w/record > $w/record.log 2>&1
  echo "record rc=$?" >> $w/session.log; kill $packer
fi
pack
