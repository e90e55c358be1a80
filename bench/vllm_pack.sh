#!/usr/bin/env bash
# Packs vLLM (the peer of bench/vllm_peer.py) for the GPU machine, which cannot fetch anything: run here, in
# the repo root (pip reaches the package registry; ~3 minutes, most of it xz). Makes three git-ignored folders
# of at most ~33 MiB each, since a device call carries 64 MiB and the tracked tree takes ~25 of them:
#   .vllm1, .vllm2: the first two parts of vllm.tar.xz; .vllm3: the last part, its sha256 and vLLM's wheels.
# Then, on one warm machine, call by call (bench/h200_session.sh says what each part runs):
#   vllm_ours (carry .whl .vllm1), vllm_stash (.vllm2), vllm (.whl .vllm3)
#   or vllm_async_ours (.whl .vllm1), vllm_stash (.vllm2), vllm_async (.whl .vllm3).
# The wheel is trimmed of what an H100 or H200 in bf16 does not load (about 710 -> 313 MB unpacked, 70 MB
# as .tar.xz): the FlashAttention-2 library (vLLM takes FlashAttention 3 on Hopper), the vllm-rs binary,
# the fmha_sm100 and deep_gemm headers, and the MoE kernels (imported under contextlib.suppress).
set -euo pipefail
VERSION=${VLLM_VERSION:-0.26.0}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
wheel_args="--no-deps --only-binary=:all: --python-version 3.12 --implementation cp"
for n in 5 17 24 26 27 28 31; do wheel_args="$wheel_args --platform manylinux_2_${n}_x86_64"; done
wheel_args="$wheel_args --platform manylinux2014_x86_64 --platform manylinux1_x86_64"
python3 -m pip download -q $wheel_args -d "$work" "vllm==$VERSION"
mkdir "$work/un" && (cd "$work/un" && python3 -m zipfile -e "$work"/vllm-*.whl .)
rm -rf "$work/un/vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so" "$work/un/vllm/vllm-rs" \
  "$work/un/vllm/third_party/fmha_sm100" "$work/un/vllm/third_party/deep_gemm" \
  "$work/un/vllm/_moe_C_stable_libtorch.abi3.so"
tar -cf - -C "$work/un" . | xz -T2 -9 > "$work/vllm.tar.xz"
rm -rf .vllm1 .vllm2 .vllm3 && mkdir -p .vllm1 .vllm2 .vllm3/deps
split -b 34000000 -d "$work/vllm.tar.xz" "$work/vllm.tar.xz.part"
mv "$work/vllm.tar.xz.part00" .vllm1/ && mv "$work/vllm.tar.xz.part01" .vllm2/ && mv "$work"/vllm.tar.xz.part0[2-9] .vllm3/
sha256sum "$work/vllm.tar.xz" | cut -d' ' -f1 > .vllm3/sha256
# vLLM's dependencies missing on the GPU machine's image, at the versions of ../shared/peers/vllm-wheels.txt
sed -n 's/^\([A-Za-z0-9_.]*\)-\([^-]*\)-.*\.whl$/\1==\2/p' "${VLLM_WHEELS_LIST:-../shared/peers/vllm-wheels.txt}" > "$work/reqs.txt"
python3 -m pip download -q $wheel_args -d .vllm3/deps -r "$work/reqs.txt"
for d in .vllm1 .vllm2 .vllm3; do grep -qx "/$d/" .git/info/exclude 2>/dev/null || echo "/$d/" >> .git/info/exclude; done
du -sm .vllm1 .vllm2 .vllm3
