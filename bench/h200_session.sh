#!/usr/bin/env bash
# The GPU figures of BENCHMARKS.md, as run on the lent H200 from the source tree (no bentoml there:
# wheels travel in .whl/ and .whl-bento/, made by `make gpu-wheels`). Usage: bash bench/h200_session.sh PART OUTDIR
# (PART tp2 / tp4: tensor parallelism, on the 2- and 4-GPU kinds; online_interval: issue 5's online/offline
# ratio at PAGEDLLM_STREAM_INTERVAL 1 and 4 in one call; engine_process: the same with the engine in its own
# process and on the worker's thread)
set -uo pipefail
part=$1; out=$2; mkdir -p "$out"; out=$(cd "$out" && pwd)  # absolute: some parts run from bench/
PY=${PY:-python3}
if [ -z "${NO_WHEELS:-}" ]; then  # on the GPU machine: the missing packages travel as wheels
  wheels=".whl/*.whl"; case $part in online*|record|ttft_paths) wheels="$wheels .whl-bento/*.whl";; esac
  [ -n "${PYSPY:-}" ] && wheels="$wheels .whl-debug/*.whl"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $wheels
  export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH
fi
R=bench/data/requests.jsonl
BIG="--max-num-seqs 512 --max-num-batched-tokens 8192 --max-graph-batch 512"
S8="--max-num-seqs 1024 --max-num-batched-tokens 16384 --max-graph-batch 512"  # vLLM's batch settings (Llama-3-8B's figures of record)
run() { local name=$1 limit=$2; shift 2; local t=$(date +%s)
  timeout "$limit" "$@" > "$out/$name.log" 2>&1; echo "$name rc=$? $(( $(date +%s) - t ))s" | tee -a "$out/session.log"; }
# each_variant FN: FN N EXPORT ROWS PYTHONPATH for each EXPORT:ROWS of VARIANTS, in order and then reversed
each_variant() { local n=0 v e rows; for v in $VARIANTS $(echo $VARIANTS | tr ' ' '\n' | tac | tr '\n' ' '); do
  n=$((n + 1)); e=${v%%:*}; rows=${v##*:}; "$1" $n $e $rows "$([ $e = head ] || echo "$PWD/ab/$e:")$PYTHONPATH"; done; }
offline_variant() { local shape settings; for shape in ${SHAPES:-llama3-8b}; do
  settings=$([ $shape = llama3-8b ] && echo "$S8" || echo "$BIG")
  PYTHONPATH=$4 run serve_offline_${shape}_$1_$2_rows$3 90 $PY bench/serve.py --mode offline --shape $shape --requests $R --dtype bfloat16 $settings --fused-gemv-rows $3 --out "$out/serve_offline_${shape}_$1_$2_rows$3.json"; done; }
startup_variant() { PYTHONPATH=$4 TRITON_CACHE_DIR=$(mktemp -d) run startup_$1_$2_rows$3 120 $PY bench/single_stream.py --models llama2-7b --peers none --runs 1 --fused-gemv-rows $3 --out "$out/startup_$1_$2_rows$3.json"; }
# online_abba A B: the `online` part run four times in ABBA order, one server each, through the caller's
# `online_variant V DIR` (which sets V's environment); each server's event loop and runs go to session.log
online_abba() { local n=0 v; for v in $1 $2 $2 $1; do n=$((n + 1))
  NO_WHEELS=1 RATES="${RATES:-requests_rate40 requests_rate20}" online_variant $v "$out/${n}_$v" > "$out/${n}_$v.log" 2>&1
  grep -h "event loop" "$out/${n}_$v/server.log" >> "$out/session.log"; cat "$out/${n}_$v/session.log" >> "$out/session.log"; done; }
case $part in
  throughput)
    run serve_offline_llama2-7b 110 $PY bench/serve.py --mode offline --shape llama2-7b --requests $R --dtype bfloat16 $BIG --out "$out/serve_offline_llama2-7b.json"
    run serve_offline_llama3-8b 110 $PY bench/serve.py --mode offline --shape llama3-8b --requests $R --dtype bfloat16 $BIG --out "$out/serve_offline_llama3-8b.json"
    run single_stream_peers 200 $PY bench/single_stream.py --models smollm2-135m llama2-7b --peers eager,compile --runs 2 --out "$out/single_stream_peers.json"
    run transformers_cb_llama2-7b 170 $PY bench/serve.py --mode transformers --shape llama2-7b --requests $R --out "$out/transformers_cb_llama2-7b.json"
    ;;
  peers)
    run single_stream_peers 230 $PY bench/single_stream.py --models smollm2-135m llama2-7b --peers eager,compile --runs 2 --out "$out/single_stream_peers.json"
    for pc in on off; do flag=$([ $pc = off ] && echo --no-prefix-caching)
      run prefix_${pc} 60 $PY bench/serve.py --mode async --shape llama2-7b --requests bench/data/requests_rate20.jsonl --limit 200 --shared-prefix-tokens 1000 --dtype bfloat16 $flag --out "$out/prefix_${pc}_llama2-7b.json"; done
    run transformers_cb_llama2-7b 260 $PY bench/serve.py --mode transformers --shape llama2-7b --requests $R --out "$out/transformers_cb_llama2-7b.json"
    ;;
  final)
    for pc in on off; do flag=$([ $pc = off ] && echo --no-prefix-caching)
      run prefix_${pc} 50 $PY bench/serve.py --mode async --shape llama2-7b --requests bench/data/requests_rate20.jsonl --limit 200 --shared-prefix-tokens 1000 --dtype bfloat16 $flag --out "$out/prefix_${pc}_llama2-7b.json"; done
    run serve_offline_llama2-7b 60 $PY bench/serve.py --mode offline --shape llama2-7b --requests $R --dtype bfloat16 $BIG --out "$out/serve_offline_llama2-7b.json"
    run serve_offline_llama3-8b 60 $PY bench/serve.py --mode offline --shape llama3-8b --requests $R --dtype bfloat16 $BIG --out "$out/serve_offline_llama3-8b.json"
    run single_stream_7b 200 $PY bench/single_stream.py --models llama2-7b --peers compile --runs 2 --out "$out/single_stream_llama2-7b.json"
    ;;
  gemv)
    # issue 4: the fused one-token GEMVs (kernels/gemv.py): the GPU tests first; the kernels against cuBLAS;
    # then single stream with them (the default) and without (--fused-gemv-rows 0), same machine
    run gpu_tests 240 $PY -m pytest -q -x -p no:cacheprovider tests/gpu
    run gemv 90 $PY bench/gemv.py --out "$out/gemv.json"
    run single_stream 150 $PY bench/single_stream.py --models smollm2-135m llama2-7b llama3-8b --peers none --runs 3 --profile-dir "$out/prof" --out "$out/single_stream.json"
    run single_stream_cublas 120 $PY bench/single_stream.py --models smollm2-135m llama2-7b llama3-8b --peers none --runs 3 --fused-gemv-rows 0 --out "$out/single_stream_cublas.json"
    ;;
  rows)
    # issue 5: the fused projections for decode batches of a few sequences (kernels/gemv.py, tensor-core
    # tiles) against cuBLAS, 1 to 64 rows; then the GPU tests
    run gemv_rows 150 $PY bench/gemv.py --rows 1,2,4,8,16,32,64 --shapes llama2-7b,llama3-8b --out "$out/gemv_rows.json"
    run gpu_tests 380 $PY -m pytest -q -x -p no:cacheprovider tests/gpu
    ;;
  rows_probe)
    # issue 5: the tensor-core tiles against cuBLAS at 1 to 32 rows; where a small decode step's time goes
    run gemv_rows 100 $PY bench/gemv.py --rows 1,4,16,32 --shapes llama2-7b --out "$out/gemv_rows.json"
    run step_llama2-7b 120 $PY bench/mixed_step.py --shape llama2-7b --batches 8,16,32 --prompts 0 --context 1000 --fused-gemv-rows 0 --profile-dir "$out/prof" --out "$out/step_llama2-7b.json"
    run step_llama3-8b 120 $PY bench/mixed_step.py --shape llama3-8b --batches 8,32,256 --prompts 0 --context 1000 --fused-gemv-rows 0 --profile-dir "$out/prof" --out "$out/step_llama3-8b.json"
    run gpu_engine_tests 150 $PY -m pytest -q -x -p no:cacheprovider tests/gpu/test_engine_gpu.py
    ;;
  rows_offline_probe)
    # issue 5: the tensor-core tiles (activation separate) against cuBLAS, 1 to 64 rows; offline with them
    # for steps of up to 32 tokens and without (0), 7B and 8B
    run gemv_rows 150 $PY bench/gemv.py --rows 1,8,16,24,32,48,64 --shapes llama2-7b,llama3-8b --out "$out/gemv_rows.json"
    for rows in 32 0; do
      run serve_offline_llama2-7b_rows$rows 80 $PY bench/serve.py --mode offline --shape llama2-7b --requests $R --dtype bfloat16 $BIG --fused-gemv-rows $rows --out "$out/serve_offline_llama2-7b_rows$rows.json"
      run serve_offline_llama3-8b_rows$rows 80 $PY bench/serve.py --mode offline --shape llama3-8b --requests $R --dtype bfloat16 $S8 --fused-gemv-rows $rows --out "$out/serve_offline_llama3-8b_rows$rows.json"; done
    ;;
  rows16)
    # issue 5: offline with the tensor-core tiles for decode steps of up to 16 sequences (the default; the
    # LM head tuned at start-up) against cuBLAS (0); GPU kernel tests; single stream (issue 4)
    for run_ in 16a 0 16b; do rows=${run_%[ab]}
      run serve_offline_llama2-7b_rows$run_ 80 $PY bench/serve.py --mode offline --shape llama2-7b --requests $R --dtype bfloat16 $BIG --fused-gemv-rows $rows --out "$out/serve_offline_llama2-7b_rows$run_.json"; done
    for rows in 16 0; do
      run serve_offline_llama3-8b_rows$rows 80 $PY bench/serve.py --mode offline --shape llama3-8b --requests $R --dtype bfloat16 $S8 --fused-gemv-rows $rows --out "$out/serve_offline_llama3-8b_rows$rows.json"; done
    run single_stream 150 $PY bench/single_stream.py --models smollm2-135m llama2-7b llama3-8b --peers none --runs 3 --out "$out/single_stream.json"
    run gpu_kernel_tests 150 $PY -m pytest -q -x -p no:cacheprovider tests/gpu/test_kernels_gpu.py -k "few_tokens or decode"
    ;;
  pdl)
    # issue 4: the SwiGLU epilogue and programmatic dependent launch (kernels/gemv.py): the kernels with and
    # without it; single stream with and without; the engine's GPU tests; 7B offline on a fresh machine
    run gemv_pdl 120 $PY bench/gemv.py --rows 1,16 --shapes llama2-7b,llama3-8b --out "$out/gemv_pdl.json"
    run single_stream 150 $PY bench/single_stream.py --models smollm2-135m llama2-7b llama3-8b --peers none --runs 3 --out "$out/single_stream.json"
    run single_stream_nopdl 100 $PY bench/single_stream.py --models smollm2-135m llama2-7b --peers none --runs 3 --no-dependent-launch --out "$out/single_stream_nopdl.json"
    run gpu_engine_tests 100 $PY -m pytest -q -x -p no:cacheprovider tests/gpu/test_engine_gpu.py
    run serve_offline_llama2-7b 70 $PY bench/serve.py --mode offline --shape llama2-7b --requests $R --dtype bfloat16 $BIG --out "$out/serve_offline_llama2-7b.json"
    ;;
  pdl2)
    # issue 4: + decode attention and rotary reading their inputs before the wait, tiles without PDL:
    # GPU kernel tests, the kernels, single stream with and without PDL (profiles), engine tests, 8B offline
    run gpu_kernel_tests 170 $PY -m pytest -q -x -p no:cacheprovider tests/gpu/test_kernels_gpu.py -k "few_tokens or decode or rotary"
    run gemv_pdl 80 $PY bench/gemv.py --rows 1,16 --shapes smollm2,llama2-7b --out "$out/gemv_pdl.json"
    run single_stream 100 $PY bench/single_stream.py --models smollm2-135m llama2-7b llama3-8b --peers none --runs 3 --profile-dir "$out/prof" --out "$out/single_stream.json"
    run single_stream_nopdl 80 $PY bench/single_stream.py --models smollm2-135m llama2-7b llama3-8b --peers none --runs 3 --no-dependent-launch --out "$out/single_stream_nopdl.json"
    run gpu_engine_tests 70 $PY -m pytest -q -x -p no:cacheprovider tests/gpu/test_engine_gpu.py
    run serve_offline_llama3-8b 50 $PY bench/serve.py --mode offline --shape llama3-8b --requests $R --dtype bfloat16 $S8 --out "$out/serve_offline_llama3-8b.json"
    ;;
  prefix_t0)
    # issue 5: a shared 1,000-token system prompt on the 500-request workload all at t=0, caching on and off
    for pc in on off; do flag=$([ $pc = off ] && echo --no-prefix-caching)
      run prefix_t0_${pc} 100 $PY bench/serve.py --mode async --engine-process --shape llama2-7b --requests $R --shared-prefix-tokens 1000 --dtype bfloat16 $BIG $flag --out "$out/prefix_t0_${pc}_llama2-7b.json"; done
    ;;
  closing)
    # the closing figures of 2026-12-01's second session, on a fresh machine: 7B single stream first (its
    # start-up is the cold one: every kernel compiles), 7B offline, online through HTTP at t=0, 20 and 40
    # req/s (issue 5), 7B single stream beside transformers' eager and compiled paths (issue 4)
    run single_stream_7b_cold 80 $PY bench/single_stream.py --models llama2-7b --peers none --runs 3 --out "$out/single_stream_7b_cold.json"
    run serve_offline_llama2-7b 60 $PY bench/serve.py --mode offline --shape llama2-7b --requests $R --dtype bfloat16 $BIG --out "$out/serve_offline_llama2-7b.json"
    NO_WHEELS=1 RATES="requests requests_rate20 requests_rate40" bash "$0" online "$out/online" > "$out/online.log" 2>&1
    run single_stream_peers 200 $PY bench/single_stream.py --models llama2-7b --peers eager,compile --runs 2 --out "$out/single_stream_peers.json"
    ;;
  online_ratio)
    # issue 5 after the engine process's sender thread (2026-12-01, ninth session): offline, then online
    # through HTTP (engine process) at t=0, 20 and 40 req/s, one machine, one call
    run serve_offline_llama2-7b 80 $PY bench/serve.py --mode offline --shape llama2-7b --requests $R --dtype bfloat16 $BIG --out "$out/serve_offline_llama2-7b.json"
    NO_WHEELS=1 RATES="requests requests_rate20 requests_rate40" bash "$0" online "$out/online" > "$out/online.log" 2>&1
    ;;
  fused_rotary)
    # issues 4 and 5: decode attention rotating q and k and storing the new K/V itself (no rotary kernel in
    # a decode step), its first K/V tile read before it waits: the GPU kernel tests; single stream from HEAD,
    # from the commit before (PREV: an export of it, put first on PYTHONPATH) and HEAD again, one machine;
    # the engine's GPU tests; 7B and 8B offline
    run gpu_kernel_tests 170 $PY -m pytest -q -x -p no:cacheprovider tests/gpu/test_kernels_gpu.py -k "decode or backend or rotary"
    for ab in head prev head2; do
      [ $ab = prev ] && { [ -n "${PREV:-}" ] || continue; }
      PYTHONPATH=$([ $ab = prev ] && echo "$PREV:")$PYTHONPATH run single_stream_$ab 90 $PY bench/single_stream.py --models llama2-7b llama3-8b --peers none --runs 3 --out "$out/single_stream_$ab.json"; done
    run gpu_engine_tests 100 $PY -m pytest -q -x -p no:cacheprovider tests/gpu/test_engine_gpu.py
    run serve_offline_llama2-7b 70 $PY bench/serve.py --mode offline --shape llama2-7b --requests $R --dtype bfloat16 $BIG --out "$out/serve_offline_llama2-7b.json"
    run serve_offline_llama3-8b 70 $PY bench/serve.py --mode offline --shape llama3-8b --requests $R --dtype bfloat16 $S8 --out "$out/serve_offline_llama3-8b.json"
    ;;
  decode_ab)
    # decode-step variants side by side on one machine: Llama-2-7B decode graphs of 1 to 256 sequences of
    # 600 tokens (device time of a replay) from HEAD and from each export named in AB (ab/NAME, put first on
    # PYTHONPATH; e.g. `git archive REV bento_pagedllm | tar x -C ab/prev`; git-ignored, so the device call
    # carries it: carry [".whl", "ab"]); single stream from HEAD and ab/prev; 7B offline from HEAD (TESTS=1: the GPU kernel and
    # engine tests first)
    if [ -n "${TESTS:-}" ]; then
      run gpu_kernel_tests 170 $PY -m pytest -q -x -p no:cacheprovider tests/gpu/test_kernels_gpu.py -k "decode or backend or rotary"
      run gpu_engine_tests 100 $PY -m pytest -q -x -p no:cacheprovider tests/gpu/test_engine_gpu.py
    fi
    for v in head ${AB:-}; do
      PYTHONPATH=$([ $v = head ] || echo "$PWD/ab/$v:")$PYTHONPATH run step_$v 100 $PY bench/mixed_step.py --shape llama2-7b --batches 1,16,64,256 --prompts 0 --context 600 --out "$out/step_$v.json"; done
    for v in head prev; do
      PYTHONPATH=$([ $v = head ] || echo "$PWD/ab/$v:")$PYTHONPATH run single_stream_$v 100 $PY bench/single_stream.py --models ${MODELS:-llama2-7b llama3-8b} --peers none --runs 3 --out "$out/single_stream_$v.json"; done
    run serve_offline_llama2-7b 70 $PY bench/serve.py --mode offline --shape llama2-7b --requests $R --dtype bfloat16 $BIG --out "$out/serve_offline_llama2-7b.json"
    [ -n "${OFFLINE8B:-}" ] && run serve_offline_llama3-8b 70 $PY bench/serve.py --mode offline --shape llama3-8b --requests $R --dtype bfloat16 $S8 --out "$out/serve_offline_llama3-8b.json"
    ;;
  gemv_ab)
    # projection variants side by side on one machine: the kernels alone (ROWS rows, default 1; SHAPES,
    # default Llama-2-7B's) from HEAD and from each export named in AB (ab/NAME, first on PYTHONPATH);
    # single stream (MODELS, default 7B and 8B) from each, in ABBA order; 7B offline from HEAD (OFFLINE=0:
    # not); TESTS=1: the GPU projection tests first
    [ -n "${TESTS:-}" ] && run gpu_gemv_tests 300 $PY -m pytest -q -p no:cacheprovider tests/gpu/test_kernels_gpu.py -k "projection"
    for v in head ${AB:-}; do
      PYTHONPATH=$([ $v = head ] || echo "$PWD/ab/$v:")$PYTHONPATH run gemv_$v 300 $PY bench/gemv.py --rows ${ROWS:-1} --shapes ${SHAPES:-llama2-7b} --out "$out/gemv_$v.json"; done
    order="head ${AB:-} $(echo ${AB:-} | tr ' ' '\n' | tac | tr '\n' ' ') head"
    n=0; for v in $order; do n=$((n + 1))
      PYTHONPATH=$([ $v = head ] || echo "$PWD/ab/$v:")$PYTHONPATH run single_stream_${n}_$v 150 $PY bench/single_stream.py --models ${MODELS:-llama2-7b llama3-8b} --peers none --runs 3 --out "$out/single_stream_${n}_$v.json"; done
    [ "${OFFLINE:-1}" = 1 ] && run serve_offline_llama2-7b 70 $PY bench/serve.py --mode offline --shape llama2-7b --requests $R --dtype bfloat16 $BIG --out "$out/serve_offline_llama2-7b.json"
    [ -n "${OFFLINE8B:-}" ] && run serve_offline_llama3-8b 70 $PY bench/serve.py --mode offline --shape llama3-8b --requests $R --dtype bfloat16 $S8 --out "$out/serve_offline_llama3-8b.json"
    ;;
  decode_splits)
    # (TESTS=1: the GPU tests first)
    [ -n "${TESTS:-}" ] && run gpu_tests 300 $PY -m pytest -q -p no:cacheprovider tests/gpu
    # issue 4: decode attention alone, one to a few sequences, at every split count, fused rotary and not
    # (bench/decode_attention.py): the split count a single short sequence wants, and its cost a layer
    for shape in llama2-7b llama3-8b; do
      [ "${SEQS:-1,4}" != none ] && run decode_attention_$shape 150 $PY bench/decode_attention.py --shape $shape --seqs ${SEQS:-1,4} --contexts 128,384,1024,4096 --out "$out/decode_attention_$shape.json"; done
    # issue 5 (RAGGED=6,16,32,...): the offline workload's tail batches, whose contexts differ, at every split
    # count up to 32
    [ -n "${RAGGED:-}" ] && for shape in llama2-7b llama3-8b; do
      run decode_ragged_$shape 150 $PY bench/decode_attention.py --shape $shape --seqs "" --ragged $RAGGED --out "$out/decode_ragged_$shape.json"; done
    ;;
  rows16_final)
    # issue 5: 7B offline on a fresh machine (which Triton kernels compile inside the clock), then warm;
    # 8B warm; the GPU tests of the projections and the engine
    for run_ in 1 2; do
      run serve_offline_llama2-7b_$run_ 80 $PY bench/serve.py --mode offline --shape llama2-7b --requests $R --dtype bfloat16 $BIG --out "$out/serve_offline_llama2-7b_$run_.json"; done
    run serve_offline_llama3-8b 80 $PY bench/serve.py --mode offline --shape llama3-8b --requests $R --dtype bfloat16 $S8 --out "$out/serve_offline_llama3-8b.json"
    run gpu_kernel_tests 170 $PY -m pytest -q -x -p no:cacheprovider tests/gpu/test_kernels_gpu.py -k few_tokens
    run gpu_engine_tests 100 $PY -m pytest -q -x -p no:cacheprovider tests/gpu/test_engine_gpu.py
    ;;
  rows_offline)
    # issue 5: offline throughput with small decode batches through the fused projections (32 rows, the
    # default), through cuBLAS (0), and fused again (the first run on a fresh machine compiles in its clock)
    for run_ in 32a 0 32b; do rows=${run_%[ab]}
      run serve_offline_llama2-7b_rows$run_ 80 $PY bench/serve.py --mode offline --shape llama2-7b --requests $R --dtype bfloat16 $BIG --fused-gemv-rows $rows --out "$out/serve_offline_llama2-7b_rows$run_.json"
      run serve_offline_llama3-8b_rows$run_ 80 $PY bench/serve.py --mode offline --shape llama3-8b --requests $R --dtype bfloat16 $S8 --fused-gemv-rows $rows --out "$out/serve_offline_llama3-8b_rows$run_.json"; done
    ;;
  single_stream)
    run single_stream 150 $PY bench/single_stream.py --models smollm2-135m llama2-7b llama3-8b --peers none --runs 3 --profile-dir "$out/prof" --out "$out/single_stream.json"
    ;;
  tp2)
    # issue 7 on nvidia-h200-x2: Llama-3-8B shape, the 500-request workload on 2 GPUs, then on 1 (target 1.7x),
    # with vLLM's batch settings (1024 seqs, 16384 tokens a step); then each run again under the profiler (rank
    # 0's kernels: where a step's time goes), the single-GPU tests on GPU 1 beside the profiled 1-GPU run (a
    # profiled run's throughput is not a figure), and the 2-GPU tests last
    for tp in 2 1; do
      run serve_offline_llama3-8b_tp$tp 150 $PY bench/serve.py --mode offline --shape llama3-8b --requests $R --dtype bfloat16 $S8 --tensor-parallel-size $tp ${TP_FLAGS:-} --out "$out/serve_offline_llama3-8b_tp$tp.json"; done
    [ -n "${TESTS:-}" ] && { CUDA_VISIBLE_DEVICES=1 run gpu_tests 300 $PY -m pytest -q -p no:cacheprovider tests/gpu & tests=$!; }
    CUDA_VISIBLE_DEVICES=0 run profile_tp1 150 $PY bench/serve.py --mode offline --shape llama3-8b --requests $R --dtype bfloat16 $S8 --profile "$out/profile_tp1.txt" --out "$out/profiled_tp1.json"
    [ -n "${tests:-}" ] && wait $tests
    run profile_tp2 150 $PY bench/serve.py --mode offline --shape llama3-8b --requests $R --dtype bfloat16 $S8 --tensor-parallel-size 2 ${TP_FLAGS:-} --profile "$out/profile_tp2.txt" --out "$out/profiled_tp2.json"
    [ -n "${TESTS:-}" ] && run tp_gpu_tests 200 $PY -m pytest -q -p no:cacheprovider tests/gpu/test_tensor_parallel_gpu.py
    ;;
  tp2_profile)
    # issue 7: where a tensor-parallel step's time goes, by step shape: tp2 timed, then profiled in windows of
    # prefill, big, middling and small decode steps, on 2 GPUs (NCCL; then the peer-memory all-reduce) and on 1
    W="--profile-window 2:4 --profile-window 40:10 --profile-window 600:10 --profile-window 950:10"
    run serve_offline_llama3-8b_tp2 150 $PY bench/serve.py --mode offline --shape llama3-8b --requests $R --dtype bfloat16 $S8 --tensor-parallel-size 2 --out "$out/serve_offline_llama3-8b_tp2.json"
    for v in tp2:2 tp2peer:2:--peer-all-reduce tp1:1; do IFS=: read name tp flag <<< "$v"
      run profile_$name 150 $PY bench/serve.py --mode offline --shape llama3-8b --requests $R --dtype bfloat16 $S8 --tensor-parallel-size $tp $flag --profile "$out/profile_$name.txt" $W --out "$out/profiled_$name.json"; done
    ;;
  tp2_comm)
    # issue 7: all-reduce time by message size (bench/allreduce.py: NCCL as set up, and with other NCCL
    # settings; torch's peer-memory one-shot and two-shot), then the 500-request workload on 1 GPU and on 2
    # with each variant named in VARIANTS (NAME=ENV... or ab:EXPORT with --peer-all-reduce)
    NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,GRAPH,TUNING run allreduce_default 90 $PY bench/allreduce.py --out "$out/allreduce_default.json"
    for env in NCCL_MIN_NCHANNELS=16 NCCL_PROTO=LL128 NCCL_PROTO=Simple; do
      env $env $PY bench/allreduce.py --out "$out/allreduce_${env//=/_}.json" > "$out/allreduce_${env//=/_}.log" 2>&1; done
    run serve_offline_llama3-8b_tp1 150 $PY bench/serve.py --mode offline --shape llama3-8b --requests $R --dtype bfloat16 $S8 --out "$out/serve_offline_llama3-8b_tp1.json"
    for v in ${VARIANTS:-}; do name=${v%%=*}; setting=${v#*=}
      if [ "${setting%%:*}" = ab ]; then
        PYTHONPATH="$PWD/ab/${setting#ab:}:$PYTHONPATH" run serve_offline_llama3-8b_tp2_$name 150 $PY bench/serve.py --mode offline --shape llama3-8b --requests $R --dtype bfloat16 $S8 --tensor-parallel-size 2 --peer-all-reduce --out "$out/serve_offline_llama3-8b_tp2_$name.json"
      else
        timeout 150 env $setting $PY bench/serve.py --mode offline --shape llama3-8b --requests $R --dtype bfloat16 $S8 --tensor-parallel-size 2 --out "$out/serve_offline_llama3-8b_tp2_$name.json" > "$out/serve_offline_llama3-8b_tp2_$name.log" 2>&1
        echo "tp2_$name rc=$?" >> "$out/session.log"
      fi; done
    ;;
  tp2_ab)
    # issue 7: the 500-request workload on 2 GPUs (NCCL, then the peer-memory all-reduce), on 1, then again
    # on 2 with NCCL (machine drift), the big decode steps profiled, and the 2-GPU tests
    for v in tp2:2 tp2peer:2:--peer-all-reduce tp1:1 tp2again:2; do IFS=: read name tp flag <<< "$v"
      run serve_offline_llama3-8b_$name 150 $PY bench/serve.py --mode offline --shape llama3-8b --requests $R --dtype bfloat16 $S8 --tensor-parallel-size $tp $flag --out "$out/serve_offline_llama3-8b_$name.json"; done
    [ -n "${PROFILE:-}" ] && run profile_tp2 150 $PY bench/serve.py --mode offline --shape llama3-8b --requests $R --dtype bfloat16 $S8 --tensor-parallel-size 2 --profile "$out/profile_tp2.txt" --profile-window 40:10 --profile-window 300:10 --out "$out/profiled_tp2.json"
    [ -n "${TESTS:-}" ] && run tp_gpu_tests 200 $PY -m pytest -q -p no:cacheprovider tests/gpu/test_tensor_parallel_gpu.py
    ;;
  splits_ab)
    # issues 4 and 5: the decode split rule, from HEAD and from each export named in AB (ab/NAME first on
    # PYTHONPATH), alternating: Llama-3-8B offline with vLLM's batch settings, Llama-2-7B offline as in
    # `offline` (SINGLE=1: Llama-2-7B single stream first)
    for v in head ${AB:-}; do
      P=$([ $v = head ] || echo "$PWD/ab/$v:")$PYTHONPATH
      [ -n "${SINGLE:-}" ] && PYTHONPATH=$P run single_stream_$v 100 $PY bench/single_stream.py --models llama2-7b --peers none --runs 3 --out "$out/single_stream_$v.json"
      PYTHONPATH=$P run serve_offline_llama3-8b_$v 90 $PY bench/serve.py --mode offline --shape llama3-8b --requests $R --dtype bfloat16 $S8 --out "$out/serve_offline_llama3-8b_$v.json"
      PYTHONPATH=$P run serve_offline_llama2-7b_$v 90 $PY bench/serve.py --mode offline --shape llama2-7b --requests $R --dtype bfloat16 $BIG --out "$out/serve_offline_llama2-7b_$v.json"; done
    ;;
  final_ab)
    # issues 4 and 5 in one short call: the GPU decode kernel tests (TESTS=1); Llama-2-7B single stream and
    # Llama-3-8B offline (vLLM's batch settings; OFFLINE7B=1: Llama-2-7B offline too) from HEAD and from each export in AB (ab/NAME first on
    # PYTHONPATH), in ABBA order (HEAD, the exports, the exports reversed, HEAD): one call's runs drift by a
    # few per cent (2026-12-01, run 6 of bench/results/h200-2026-12-01m), which that order cancels
    [ -n "${TESTS:-}" ] && run gpu_tests 150 $PY -m pytest -q -p no:cacheprovider tests/gpu/test_kernels_gpu.py tests/gpu/test_engine_gpu.py -k "decode or float32_greedy"
    order="head ${AB:-} $(echo ${AB:-} | tr ' ' '\n' | tac | tr '\n' ' ') head"
    n=0; for v in $order; do n=$((n + 1)); P=$([ $v = head ] || echo "$PWD/ab/$v:")$PYTHONPATH
      PYTHONPATH=$P run single_stream_${n}_$v 100 $PY bench/single_stream.py --models llama2-7b --peers none --runs 3 --out "$out/single_stream_${n}_$v.json"
      PYTHONPATH=$P run serve_offline_llama3-8b_${n}_$v 90 $PY bench/serve.py --mode offline --shape llama3-8b --requests $R --dtype bfloat16 $S8 --out "$out/serve_offline_llama3-8b_${n}_$v.json"
      [ -n "${OFFLINE7B:-}" ] && PYTHONPATH=$P run serve_offline_llama2-7b_${n}_$v 90 $PY bench/serve.py --mode offline --shape llama2-7b --requests $R --dtype bfloat16 $BIG --out "$out/serve_offline_llama2-7b_${n}_$v.json"; done
    ;;
  startup_ab)
    # issue 4's start-up, cold: startup_variants for HEAD and each export in AB, at the default 16 rows
    VARIANTS="head:16 $(for v in ${AB:-}; do echo -n "$v:16 "; done)" each_variant startup_variant
    ;;
  rows32_ab)
    # issue 5: Llama-3-8B offline with the fused tiles up to 32 rows against 16 (the default), ABBA in one call
    VARIANTS="head:32 head:16" each_variant offline_variant
    ;;
  offline_variants)
    # issue 5: offline runs of SHAPES (default llama3-8b; each with its batch settings of the figures of
    # record) for each of VARIANTS (EXPORT:ROWS; EXPORT head = the tree, else ab/EXPORT; ROWS the
    # --fused-gemv-rows), in the given order and then reversed, in one call; TESTS=1: the GPU projection and
    # engine tests first
    [ -n "${TESTS:-}" ] && run gpu_tests 200 $PY -m pytest -q -p no:cacheprovider tests/gpu/test_kernels_gpu.py tests/gpu/test_engine_gpu.py -k "${TESTK:-projections or bfloat16 or float32_greedy}"
    each_variant offline_variant
    ;;
  profile_offline)
    # issue 5: where the device time of decode steps of a given size goes: a profiled offline run of SHAPE
    # (default llama3-8b, vLLM's batch settings) with a kernel table and a trace per window of WINDOWS
    # (START:COUNT; the defaults are the 8B workload's steps of ~50, ~22, ~13 and ~7 sequences)
    run profile_offline 150 $PY bench/serve.py --mode offline --shape ${SHAPE:-llama3-8b} --requests $R --dtype bfloat16 $S8 --profile "$out/profile.txt" $(for w in ${WINDOWS:-380:10 540:20 640:20 850:20}; do echo --profile-window $w; done) --out "$out/profiled.json"
    ;;
  startup_variants)
    # issue 4's start-up, cold: Llama-2-7B single stream for each of VARIANTS (EXPORT:ROWS, as
    # offline_variants), in the given order and then reversed, each with an empty Triton cache
    each_variant startup_variant
    ;;
  gemv_sweep)
    # issues 4 and 5: the projections' kernels in configurations beyond the autotuner's (bench/gemv.py --sweep):
    # one row for ROW1_SHAPES (default Llama-2-7B: single stream; ~140 s a model), 16 rows for the Llama-3-8B
    # gate/up (the 8B's tail steps) unless NO_ROWS16 is set
    (cd bench && run gemv_sweep_rows1 400 $PY gemv.py --sweep --rows 1 --shapes "${ROW1_SHAPES:-llama2-7b}" --out "$out/gemv_sweep_rows1.json")
    [ -n "${NO_ROWS16:-}" ] || (cd bench && run gemv_sweep_rows16 150 $PY gemv.py --sweep --rows 16 --shapes "llama3-8b gate_up" --out "$out/gemv_sweep_rows16.json")
    ;;
  tile_sweep)
    # issue 5: the tensor-core tiles at ROWS rows (default 32) in every configuration of bench/gemv.py's
    # sweep, for SHAPES_SWEEP (default the Llama-3-8B projections; its o has Llama-2-7B's shape)
    (cd bench && run gemv_sweep_rows${ROWS:-32} 300 $PY gemv.py --sweep --rows ${ROWS:-32} --shapes "${SHAPES_SWEEP:-llama3-8b qkv,llama3-8b down,llama3-8b gate_up,llama2-7b o}" --out "$out/gemv_sweep_rows${ROWS:-32}.json")
    ;;
  tuning_spread)
    # issue 5: how much the autotuner's per-process choices cost: the tensor-core tiles at ROWS rows (default 16)
    # in every sweep configuration (the autotuner's own included) for the Llama-3-8B projections, then N_RUNS
    # (default 4) Llama-3-8B offline runs of the tree, each recording its choices (tuned_configs)
    (cd bench && run gemv_sweep_rows${ROWS:-16} 300 $PY gemv.py --sweep --rows ${ROWS:-16} --shapes "${SHAPES_SWEEP:-llama3-8b qkv,llama3-8b down,llama3-8b gate_up,llama2-7b o,llama3-8b lm_head}" --out "$out/gemv_sweep_rows${ROWS:-16}.json")
    for n in $(seq ${N_RUNS:-4}); do offline_variant $n head 32 "$PYTHONPATH"; done
    ;;
  offline_runs)
    # issue 5: N_RUNS (default 3) Llama-3-8B offline runs of the tree, the first with an empty Triton cache (a
    # fresh machine's first run: whether anything compiles inside the clock, `triton_compiles_in_run`)
    TRITON_CACHE_DIR=$(mktemp -d) offline_variant 1 cold 32 "$PYTHONPATH"
    for n in $(seq 2 ${N_RUNS:-3}); do offline_variant $n head 32 "$PYTHONPATH"; done
    ;;
  attention_tiles)
    # issue 5: decode attention alone on the offline workload's big batches (RAGGED), in every tile of
    # bench/decode_attention.py's sweep_tiles() at the split count the backend picks
    for shape in ${ATT_SHAPES:-llama3-8b llama2-7b}; do
      run attention_tiles_$shape 300 $PY bench/decode_attention.py --shape $shape --seqs "" --tile-sweep --ragged ${RAGGED:-478,400,320,256,192,128,64} --out "$out/attention_tiles_$shape.json"; done
    ;;
  attention_splits)
    # issue 5: decode attention alone on the offline workload's batches (RAGGED), longest context first, at
    # every split count up to 32, for the tree and each export of AB (ab/NAME)
    for v in head ${AB:-}; do for shape in ${ATT_SHAPES:-llama3-8b llama2-7b}; do
      PYTHONPATH=$([ $v = head ] || echo "$PWD/ab/$v:")$PYTHONPATH run attention_splits_${shape}_$v 300 $PY bench/decode_attention.py --shape $shape --seqs "" --orders longest_first --ragged ${RAGGED:-320,256,192,128,64,32,16,8} --out "$out/attention_splits_${shape}_$v.json"; done; done
    ;;
  decode_steps_ab)
    # issues 4 and 5: decode graph steps alone (bench/mixed_step.py: device time of a replay, CONTEXT tokens a
    # sequence, default 600) for STEP_SHAPES (default Llama-3-8B) at STEP_BATCHES, from HEAD and from each
    # export of AB (ab/NAME first on PYTHONPATH), in the order given and then reversed (ONCE=1: head, AB, head)
    order="head ${AB:-} $([ -n "${ONCE:-}" ] || echo ${AB:-} | tr ' ' '\n' | tac | tr '\n' ' ') head"
    n=0; for v in $order; do n=$((n + 1)); for shape in ${STEP_SHAPES:-llama3-8b}; do
      PYTHONPATH=$([ $v = head ] || echo "$PWD/ab/$v:")$PYTHONPATH run step_${shape}_${n}_$v 150 $PY bench/mixed_step.py --shape $shape --batches ${STEP_BATCHES:-1,4,8,16,32,48,64,128,256,512} --prompts 0 --context ${CONTEXT:-600} --max-batch 512 --runs 20 --out "$out/step_${shape}_${n}_$v.json"; done; done
    ;;
  offline_env_ab)
    # issue 5: Llama-3-8B offline runs of the tree plain and with ENV (default CUDA_MODULE_LOADING=EAGER: every
    # kernel loaded at start-up, so none waits for the device at its first launch), order plain, env, env,
    # plain; compare `host.longest` (the last prefill-heavy step's `forward`) and the GPU timeline
    n=0; for v in plain env env plain; do n=$((n + 1))
      PY="$([ $v = env ] && echo "env ${ENV:-CUDA_MODULE_LOADING=EAGER} ")$PY" offline_variant $n $v 32 "$PYTHONPATH"; done
    ;;
  prefill_attention)
    # issue 5: prefill attention alone on the offline workload's first steps, against one long prompt and
    # torch's flash SDPA (bench/prefill_attention.py)
    run prefill_attention 150 $PY bench/prefill_attention.py --shapes llama3-8b,llama2-7b --out "$out/prefill_attention.json"
    ;;
  persistent_mlp)
    # issue 4: a persistent decode-layer kernel (grid barriers, tile counters) against the chain of dependent
    # launches on a Llama-2-7B layer's o, gate/up and down (bench/persistent_mlp.py; run from bench/)
    (cd bench && run persistent_mlp 300 $PY persistent_mlp.py --layers 8 --variants ${VARIANTS:-dataflow,barriers} --out "$out/persistent_mlp.json")
    ;;
  gemm_tunable)
    # issue 5: what PyTorch's TunableOp (cuBLAS/cuBLASLt algorithms timed per shape) finds over cuBLAS's own
    # choice at the decode graphs' row counts and prefill's (bench/gemm.py --tunable)
    run gemm_tunable_llama3-8b 300 $PY bench/gemm.py --tunable --shapes llama3-8b --rows ${ROWS:-256,384,448,480,512,16384} --out "$out/gemm_tunable_llama3-8b.json"
    run gemm_tunable_llama2-7b 200 $PY bench/gemm.py --tunable --shapes llama2-7b --rows ${ROWS:-256,384,512,16384} --out "$out/gemm_tunable_llama2-7b.json"
    ;;
  gemm)
    # issue 5: the GEMMs of big decode steps and prefill, cuBLAS (as the model calls it), cuBLASLt and a
    # persistent Triton GEMM, TFLOP/s per row count of the decode ladder (bench/gemm.py)
    run gemm_llama3-8b 240 $PY bench/gemm.py --shapes llama3-8b --rows ${ROWS:-128,256,320,384,448,512,16384} --out "$out/gemm_llama3-8b.json"
    run gemm_llama2-7b 200 $PY bench/gemm.py --shapes llama2-7b --rows ${ROWS:-128,256,320,384,448,512,16384} --out "$out/gemm_llama2-7b.json"
    ;;
  single_ab)
    # issue 4 in one call: the GPU engine and small-kernel tests (TESTS=1), then single stream (MODELS, default
    # the three shapes) from HEAD and from each export in AB (ab/NAME first on PYTHONPATH), in ABBA order
    [ -n "${TESTS:-}" ] && run gpu_tests 320 $PY -m pytest -q -p no:cacheprovider tests/gpu/test_engine_gpu.py tests/gpu/test_kernels_gpu.py -k "engine or bfloat16 or float32 or argmax or pending or projections or counting or waiting or waits"
    order="head ${AB:-} $(echo ${AB:-} | tr ' ' '\n' | tac | tr '\n' ' ') head"
    n=0; for v in $order; do n=$((n + 1)); P=$([ $v = head ] || echo "$PWD/ab/$v:")$PYTHONPATH
      PYTHONPATH=$P run single_stream_${n}_$v 120 $PY bench/single_stream.py --models ${MODELS:-llama2-7b smollm2-135m llama3-8b} --peers none --runs 3 --out "$out/single_stream_${n}_$v.json"; done
    ;;
  record)
    # issues 4 and 5's figures of record in one call, most wanted first: single stream (Llama-2-7B, Llama-3-8B),
    # Llama-3-8B offline twice (vLLM's batch settings), Llama-2-7B offline once, then through HTTP (a real
    # `bentoml serve`) at t=0, 20 and 40 req/s
    run single_stream 150 $PY bench/single_stream.py --models llama2-7b llama3-8b --peers none --runs 3 --out "$out/single_stream.json"
    for n in 1 2; do
      run serve_offline_llama3-8b_$n 80 $PY bench/serve.py --mode offline --shape llama3-8b --requests $R --dtype bfloat16 $S8 --out "$out/serve_offline_llama3-8b_$n.json"; done
    run serve_offline_llama2-7b 80 $PY bench/serve.py --mode offline --shape llama2-7b --requests $R --dtype bfloat16 $BIG --out "$out/serve_offline_llama2-7b.json"
    NO_WHEELS=1 RATES="${RATES:-requests requests_rate20 requests_rate40}" bash "$0" online "$out/online" > "$out/online.log" 2>&1
    ;;
  ttft_paths)
    # issue 5: where time to first token goes under load, by path, same machine, Poisson arrivals (RATES, default
    # 40 then 20 req/s): the AsyncLLMEngine in-process with the engine on a thread, then in its own process
    # (pipe and threads, no HTTP), then a real `bentoml serve` (engine process, HTTP); each client also
    # reports its own event loop's lag
    for rate in ${RATES:-40 20}; do
      for path in thread process; do flag=$([ $path = process ] && echo --engine-process)
        run async_${path}_rate$rate 120 $PY bench/serve.py --mode async $flag --shape llama2-7b --requests bench/data/requests_rate$rate.jsonl --dtype bfloat16 $BIG --out "$out/async_${path}_rate$rate.json"; done; done
    NO_WHEELS=1 RATES="$(for rate in ${RATES:-40 20}; do echo -n "requests_rate$rate "; done)" bash "$0" online "$out/online" > "$out/online.log" 2>&1
    ;;
  session_figures)
    # issues 4 and 5, one call: single stream (three shapes), Llama-2-7B offline twice and Llama-3-8B offline
    # (vLLM's batch settings) twice, then the continuous-batching peer on the same 500 requests, stopped at
    # DEADLINE seconds (default 120) with the requests it finished by then
    run single_stream 120 $PY bench/single_stream.py --models smollm2-135m llama2-7b llama3-8b --peers none --runs 3 --out "$out/single_stream.json"
    for n in 1 2; do
      run serve_offline_llama2-7b_$n 80 $PY bench/serve.py --mode offline --shape llama2-7b --requests $R --dtype bfloat16 $BIG --out "$out/serve_offline_llama2-7b_$n.json"
      run serve_offline_llama3-8b_$n 80 $PY bench/serve.py --mode offline --shape llama3-8b --requests $R --dtype bfloat16 $S8 --out "$out/serve_offline_llama3-8b_$n.json"; done
    run transformers_cb_llama2-7b $(( ${DEADLINE:-120} + 60 )) $PY bench/serve.py --mode transformers --shape llama2-7b --requests $R --deadline ${DEADLINE:-120} --out "$out/transformers_cb_llama2-7b.json"
    ;;
  vllm_ours|vllm_stash|vllm|vllm_async_ours|vllm_async)
    # issues 4 and 5 beside vLLM 0.26.0, over several calls to one warm machine. vLLM's trimmed package
    # (`bash bench/vllm_pack.sh` makes it here) travels in three git-ignored parts, .vllm1 and .vllm2
    # (~33 MiB each) and .vllm3 (the last part, its checksum and vLLM's wheels), one a call (the tree takes
    # ~25 of the 64 MiB a call allows); a carried folder is gone at the next call, so each call first moves
    # its part to /tmp/parts, which lasts while the machine stays warm (30 s between calls). Order: vllm_ours
    # (carry .vllm1), vllm_stash (.vllm2), vllm (.vllm3); or vllm_async_ours, vllm_stash, vllm_async.
    mkdir -p /tmp/parts
    for d in .vllm1 .vllm2 .vllm3; do [ -d $d ] && cp -r $d/. /tmp/parts/; done
    unpack_vllm() {  # NOTE: once per machine
      [ -d /tmp/vllm/vllm ] && return 0
      cat /tmp/parts/vllm.tar.xz.part* > /tmp/vllm.tar.xz || return 1
      echo "$(cat /tmp/parts/sha256)  /tmp/vllm.tar.xz" | sha256sum -c - | tee -a "$out/session.log" || return 1
      mkdir -p /tmp/vllm && tar -xJf /tmp/vllm.tar.xz -C /tmp/vllm && rm /tmp/vllm.tar.xz || return 1
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/vsite /tmp/parts/deps/*.whl
    }
    ls -la /tmp/parts > "$out/parts.log"
    case $part in
      vllm_ours)  # the engine offline: Llama-2-7B with the settings of record, Llama-3-8B with vLLM's batch settings
        run serve_offline_llama2-7b 100 $PY bench/serve.py --mode offline --shape llama2-7b --requests $R --dtype bfloat16 $BIG --out "$out/serve_offline_llama2-7b.json"
        run serve_offline_llama3-8b 100 $PY bench/serve.py --mode offline --shape llama3-8b --requests $R --dtype bfloat16 $S8 --out "$out/serve_offline_llama3-8b.json" ;;
      vllm)  # single stream of the engine and of vLLM, both shapes, in one run; vLLM's process also runs $R offline
        unpack_vllm || exit 1
        VLLM_PYTHONPATH=/tmp/vllm:/tmp/vsite run single_stream_vllm 540 $PY bench/single_stream.py --models llama2-7b llama3-8b --peers vllm --vllm-requests $R --runs 3 --out "$out/single_stream_vllm.json" ;;
      vllm_async_ours)  # the engine's AsyncLLMEngine in-process (no HTTP), Llama-2-7B, at 10, 20 and 40 req/s (RATES)
        for rate in ${RATES:-10 20 40}; do
          run async_ours_rate$rate 120 $PY bench/serve.py --mode async --shape llama2-7b --requests bench/data/requests_rate$rate.jsonl --dtype bfloat16 $BIG --out "$out/async_ours_rate$rate.json"; done ;;
      vllm_async)  # vLLM's AsyncLLM in-process, same workloads, one engine
        unpack_vllm || exit 1
        PYTHONPATH=/tmp/vllm:/tmp/vsite:$PYTHONPATH run async_vllm 500 $PY bench/vllm_peer.py --shape llama2-7b --async-requests $(for rate in ${RATES:-10 20 40}; do echo bench/data/requests_rate$rate.jsonl; done) --out "$out/async_vllm.json" ;;
    esac
    ;;
  tp4)
    # issue 7 on nvidia-h200-x4: Llama-2-70B shape (random bf16) single stream against the 4-GPU roofline (target 70%)
    run single_stream_llama2-70b_tp4 400 $PY bench/single_stream.py --models llama2-70b --peers none --runs 2 --tensor-parallel-size 4 --out "$out/single_stream_llama2-70b_tp4.json"
    ;;
  online_interval)
    # issue 5 in one call: offline, then the online t=0 workload at stream interval 1 and 4 (one server each)
    run serve_offline_llama2-7b 80 $PY bench/serve.py --mode offline --shape llama2-7b --requests $R --dtype bfloat16 $BIG --out "$out/serve_offline_llama2-7b.json"
    for interval in 1 4; do
      PAGEDLLM_STREAM_INTERVAL=$interval NO_WHEELS=1 RATES=requests bash "$0" online "$out/interval$interval" > "$out/interval$interval.log" 2>&1
      cp "$out/interval$interval/online_requests_llama2-7b.json" "$out/online_interval${interval}_llama2-7b.json"; done
    ;;
  engine_process)
    # issue 5 in one call, stream interval 1: offline; online through HTTP with the engine in its own process
    # (t=0, 20 and 40 req/s); then with the engine on the HTTP worker's thread (t=0), one server each
    run serve_offline_llama2-7b 80 $PY bench/serve.py --mode offline --shape llama2-7b --requests $R --dtype bfloat16 $BIG --out "$out/serve_offline_llama2-7b.json"
    for mode in process thread; do rates=$([ $mode = process ] && echo "requests requests_rate20 requests_rate40" || echo requests)
      PAGEDLLM_ENGINE_PROCESS=$([ $mode = process ] && echo true || echo false) NO_WHEELS=1 RATES="$rates" \
        bash "$0" online "$out/$mode" > "$out/$mode.log" 2>&1
      for f in "$out/$mode"/online_*.json; do cp "$f" "$out/${mode}_$(basename "$f")"; done; done
    ;;
  online_vs_offline)
    # issue 5's ratio in one call: offline, then online through HTTP (engine process, t=0), both warmed up
    run serve_offline_llama2-7b 80 $PY bench/serve.py --mode offline --shape llama2-7b --requests $R --dtype bfloat16 $BIG --out "$out/serve_offline_llama2-7b.json"
    NO_WHEELS=1 RATES=requests bash "$0" online "$out/process" > "$out/process.log" 2>&1
    cp "$out/process/online_requests_llama2-7b.json" "$out/process_online_requests_llama2-7b.json"
    ;;
  prefix)
    # issue 5: a shared 1,000-token system prompt, 200 requests at 20 req/s, the engine in its own process
    for pc in on off; do flag=$([ $pc = off ] && echo --no-prefix-caching)
      run prefix_${pc} 80 $PY bench/serve.py --mode async --engine-process --shape llama2-7b --requests bench/data/requests_rate20.jsonl --limit 200 --shared-prefix-tokens 1000 --dtype bfloat16 $BIG $flag --out "$out/prefix_${pc}_llama2-7b.json"; done
    ;;
  offline)
    # issue 5 offline in one call, with the step breakdown (bench/timeline.py): Llama-2-7B twice (the first
    # run on a fresh machine compiles kernels in its clock), then Llama-3-8B twice with vLLM's 1024 seqs / 16384 tokens
    for run_ in 1 2; do run serve_offline_llama2-7b_$run_ 90 $PY bench/serve.py --mode offline --shape llama2-7b --requests $R --dtype bfloat16 $BIG --out "$out/serve_offline_llama2-7b_$run_.json"; done
    for run_ in 1 2; do
      run serve_offline_llama3-8b_1024_$run_ 90 $PY bench/serve.py --mode offline --shape llama3-8b --requests $R --dtype bfloat16 $S8 --out "$out/serve_offline_llama3-8b_1024_$run_.json"; done
    ;;
  offline_settings)
    # issue 5: Llama-3-8B offline with the settings above and with vLLM's defaults (1024 seqs, 16384 tokens a step)
    run serve_offline_llama3-8b 80 $PY bench/serve.py --mode offline --shape llama3-8b --requests $R --dtype bfloat16 $BIG --out "$out/serve_offline_llama3-8b.json"
    run serve_offline_llama3-8b_1024 90 $PY bench/serve.py --mode offline --shape llama3-8b --requests $R --dtype bfloat16 $S8 --out "$out/serve_offline_llama3-8b_1024.json"
    ;;
  vllm_settings)
    # issue 5: where a mixed step's time goes; then Llama-2-7B offline and online (engine process) with vLLM's
    # defaults (1024 seqs, 16384 tokens a step; decode graphs up to 512)
    run mixed_step 120 $PY bench/mixed_step.py --shape llama2-7b --out "$out/mixed_step_llama2-7b.json"
    run serve_offline_llama2-7b_1024 90 $PY bench/serve.py --mode offline --shape llama2-7b --requests $R --dtype bfloat16 $S8 --out "$out/serve_offline_llama2-7b_1024.json"
    SEQS=1024 TOKENS=16384 GRAPH=512 NO_WHEELS=1 RATES="requests requests_rate20 requests_rate40" bash "$0" online "$out/online1024" > "$out/online1024.log" 2>&1
    for f in "$out"/online1024/online_*.json; do cp "$f" "$out/1024_$(basename "$f")"; done
    ;;
  online_trace_ab)
    # issue 5's latencies through HTTP with /v1 out of BentoML's tracing (the default) against traced
    # (PAGEDLLM_TRACE_REQUESTS=true: an OpenTelemetry span around every streamed chunk), ABBA (RATES)
    online_variant() { PAGEDLLM_TRACE_REQUESTS=$([ $1 = traced ] && echo true || echo false) bash "$0" online "$2"; }
    online_abba untraced traced
    ;;
  online_httptools_ab)
    # issue 5's latencies through HTTP with httptools (pyproject asks for it; uvicorn takes it when installed)
    # against h11 (the same wheels less httptools), ABBA (RATES). NOTE: the GPU image has uvloop already
    # (0.23.0), so both sides run on uvloop's event loop
    rm -rf /tmp/site_no && cp -r /tmp/site /tmp/site_no && rm -rf /tmp/site_no/httptools*
    online_variant() { PYTHONPATH=$([ $1 = h11 ] && echo /tmp/site_no || echo /tmp/site):$PWD bash "$0" online "$2"; }
    online_abba httptools h11
    ;;
  online_gc_ab)
    # issue 5's latencies through HTTP, the service as on main against SERVICE_AB's service.py (a folder
    # holding another version of it), ABBA (RATES)
    online_variant() { SERVICE_DIR=$([ $1 = ab ] && echo "$SERVICE_AB" || echo .) bash "$0" online "$2"; }
    online_abba main ab
    ;;
  online)
    # a real `bentoml serve service:svc` with random weights of a shape (imported as a config-only model),
    # then streaming OpenAI requests at t=0 and at Poisson rates; SHAPE and LIMIT override for a smoke test;
    # SERVICE_DIR: where service.py is taken from (the package always from this tree)
    shape=${SHAPE:-llama2-7b}; limit=${LIMIT:+--limit $LIMIT}
    export BENTOML_HOME=$(mktemp -d) PROMETHEUS_MULTIPROC_DIR=$(mktemp -d)
    dir=$($PY -c "import sys; sys.path.insert(0, 'bench'); from serve import shape_dir; print(shape_dir('$shape'))")
    $PY -m bento_pagedllm.loader.store "$dir" --name "$shape" > "$out/import.log" 2>&1
    PAGEDLLM_MODEL=$shape PAGEDLLM_LOAD_FORMAT=dummy PAGEDLLM_MAX_NUM_SEQS=${SEQS:-512} \
      PAGEDLLM_MAX_NUM_BATCHED_TOKENS=${TOKENS:-8192} PAGEDLLM_MAX_GRAPH_BATCH=${GRAPH:-${SEQS:-512}} \
      $PY -m bentoml serve service:svc --port 3000 --working-dir "${SERVICE_DIR:-.}" > "$out/server.log" 2>&1 &
    server=$!
    for _ in $(seq 240); do curl -sf localhost:3000/readyz > /dev/null && break; sleep 1; done
    for rates in ${RATES:-requests requests_rate10 requests_rate20 requests_rate40}; do
      # PYSPY=1: sample the server's processes (engine thread and event loop apart) during the first 20 s
      [ -n "${PYSPY:-}" ] && { py-spy record --subprocesses --threads --nonblocking -r 50 -d 20 --format raw \
        -o "$out/pyspy_${rates}.txt" --pid $server > "$out/pyspy_${rates}.log" 2>&1 & spies="${spies:-} $!"; }
      run online_${rates}_$shape 150 $PY bench/serve.py --mode online --model "$shape" --requests bench/data/$rates.jsonl $limit --out "$out/online_${rates}_$shape.json"
      ps -eo pid,ppid,pcpu,cputime,rss,args --sort=-cputime | grep -E "python|bentoml" | grep -v grep | head -8 > "$out/ps_${rates}.log"
    done
    # NOSTREAM=1: the t=0 workload again without streaming (one write per request, not per token)
    [ -n "${NOSTREAM:-}" ] && run online_requests_nostream_$shape 150 $PY bench/serve.py --mode online --no-stream \
      --model "$shape" --requests $R $limit --out "$out/online_requests_nostream_$shape.json"
    [ -n "${spies:-}" ] && wait $spies  # NOTE: not a bare wait: the server is a background job too
    kill $server; wait $server
    ;;
esac
for f in "$out"/*.json; do echo "== $f"; grep -E '"(completed|duration_s|request_throughput|output_throughput|idle_fraction|decode_tok_s|roofline_tok_s|engine_vs_[a-z_]+|median)"' "$f"; done
