#!/usr/bin/env bash
# Forty-sixth session, one call on any sm_90 card; carry [".whl", "ab"]: ab/mainf = main's package (c575184),
# ab/varf = + variant_split_partials.diff (PAGEDLLM_SPLIT_PARTIALS=1 switches it on), both with q/k/v and the LM
# head forced to the one-wave 32 x 256 x 8 tile (the H200's usual choice; on an H100 it lets the attention
# start early as on an H200, and it removes the process-to-process spread of q/k/v's autotuned tile).
# The question: a single sequence's decode splits left uncombined (each stores its normalised output and its
# log-sum-exp), the o projection combining them in its prologue: does the attention's counter-and-combine
# chain (2.2 us a layer on an H200) go for less than o's extra partial reads cost?
# run2 (the first version, variant_split_partials_v1.diff) made o 7x slower; this is the second version
# (variant_split_partials.diff: the combine element-wise, split by split). First o alone (ab/bench_o.py), the variant's tests (kernel against reference; the engine's bfloat16 single stream through the
# graphs), then Llama-2-7B single stream in ABBA order, the first pair profiled.
set -uo pipefail
out=$1; mkdir -p "$out"; w=/tmp/w3; rm -rf $w; mkdir -p $w
pack() { tar czf "$out/run3.tgz" -C $w --exclude='prof_*' .; }
step() { local name=$1 limit=$2; shift 2; local t=$(date +%s)
  timeout $limit "$@" > $w/$name.log 2>&1; echo "$name rc=$? $(( $(date +%s) - t ))s" >> $w/session.log; pack; }
nvidia-smi --query-gpu=name,memory.total,clocks.max.memory --format=csv > $w/card.txt 2>&1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONUNBUFFERED=1
step bench_o 120 env PYTHONPATH=$PWD/ab/varf:/tmp/site python3 ab/bench_o.py
# the variant's tests in a tree of its own (pytest puts the rootdir's package first on the path)
vt=/tmp/vt; rm -rf $vt; mkdir -p $vt; cp -r tests pyproject.toml $vt/; cp -r ab/varf/bento_pagedllm $vt/
cp ab/test_split_partials.py $vt/tests/
step tests_var 240 env PAGEDLLM_SPLIT_PARTIALS=1 PYTHONPATH=/tmp/site:$vt bash -c "cd $vt && python3 -m pytest -q \
  -p no:cacheprovider tests/test_split_partials.py tests/gpu/test_engine_gpu.py -k 'split_partials or single_stream_through'"
n=0; for v in ${ORDER:-mainf varf varf mainf}; do n=$((n + 1))
  flag=$([ $v = varf ] && echo PAGEDLLM_SPLIT_PARTIALS=1)
  prof=$([ $n -le 2 ] && echo "--profile-dir $w/prof_${n}_$v")
  step single_stream_${n}_$v 120 env $flag PYTHONPATH=$PWD/ab/$v:/tmp/site:$PWD python3 bench/single_stream.py \
    --models llama2-7b --peers none --runs 3 $prof --out $w/single_stream_${n}_$v.json
  if [ -n "$prof" ]; then
    python3 bench/trace_steps.py $w/prof_${n}_$v/profile_llama2-7b.trace.json > $w/trace_${n}_$v.txt 2>&1
    python3 bench/results/h200-2026-12-05/starts.py $w/prof_${n}_$v/profile_llama2-7b.trace.json > $w/starts_${n}_$v.txt 2>&1
    rm -rf $w/prof_${n}_$v; pack
  fi
done
pack
