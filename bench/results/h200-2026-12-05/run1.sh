#!/usr/bin/env bash
# one GPU call: what the single-sequence decode attention costs a Llama-2-7B step, bounded from below:
# main, `floor` (the kernel does nothing after its dependent-launch wait) and `nocombine` (each split writes
# the output, no counter, no combine), single stream ABBA, each run profiled; plus which NVRTC / CUDA headers
# the machine has (for a CUDA cluster kernel)
set -uo pipefail
out=$1; mkdir -p $out
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi > $out/nvidia-smi.txt 2>&1
{ python3 -c "import torch,triton;print(torch.__version__, torch.version.cuda, triton.__version__)"
  find / -xdev \( -name 'libnvrtc*' -o -name 'cuda_bf16.h' -o -name 'nvcc' -o -name 'cuda_runtime.h' \) 2>/dev/null | head -20
  python3 -c "import triton.experimental.gluon.language.nvidia.hopper as h; print(dir(h))"
  python3 -c "import triton.experimental.gluon.language as gl; print([n for n in dir(gl) if 'ayout' in n or 'cta' in n.lower() or 'cluster' in n.lower()])"
  pip list 2>/dev/null | grep -i -E "cuda|nvidia|cupy" ; } > $out/probe_env.txt 2>&1
n=0; for v in head floor nocombine nocombine floor head; do n=$((n+1)); P=$([ $v = head ] || echo "$PWD/ab/$v:")$PYTHONPATH; t=$(date +%s)
  prof=$([ $n -le 3 ] && echo "--profile-dir $out/prof_${n}_$v")
  PYTHONPATH=$P timeout 150 python3 bench/single_stream.py --models llama2-7b --peers none --runs 3 $prof --out $out/single_stream_${n}_$v.json > $out/single_stream_${n}_$v.log 2>&1
  echo "single $n $v rc=$? $(( $(date +%s) - t ))s" | tee -a $out/session.log
  [ -n "$prof" ] && python3 bench/trace_steps.py $out/prof_${n}_$v/profile_llama2-7b.trace.json > $out/trace_${n}_$v.txt 2>&1
  [ -n "$prof" ] && python3 bench/trace_steps.py --by-position $out/prof_${n}_$v/profile_llama2-7b.trace.json > $out/trace_pos_${n}_$v.txt 2>&1
done
rm -f $out/prof_*/*.trace.json
cd $out && tar czf /tmp/run1.tgz . && rm -rf ./* && mv /tmp/run1.tgz .
