"""For Nsight Compute (ncu): each one-row projection of a Llama-2-7B layer, in the configuration the
engine's autotuner chose on H200s (the single-stream JSONs' tuned_configs), once each, without dependent
launch, and gate/up's matrix read as a plain norm projection; then a plain read-only stream
(bench/read_ceiling.py's kernel) and a device-to-device copy, as references for what the memory system
gives. Run from the project root with bench/ on the path."""
import torch

from bento_pagedllm.kernels import gemv
from read_ceiling import _read_kernel

dtype, eps = torch.bfloat16, 1e-5
torch.manual_seed(0)


def weights(n, k):
    return torch.randn(n, k, device="cuda", dtype=dtype) * k**-0.5


x = torch.randn(1, 4096, device="cuda", dtype=dtype)
g = torch.ones(4096, device="cuda", dtype=dtype)
qkv, o, gate_up, down = weights(12288, 4096), weights(4096, 4096), weights(22016, 4096), weights(4096, 11008)
act = torch.randn(1, 11008, device="cuda", dtype=dtype)
calls = [
    ("qkv", lambda: gemv.add_rms_norm_gemv(x, None, g, eps, qkv, config={"BLOCK_N": 32, "BLOCK_K": 256, "num_warps": 8})),
    ("o", lambda: gemv.gemv(x, o, x, config={"BLOCK_N": 8, "BLOCK_K": 512, "num_warps": 4})),
    ("gate_up", lambda: gemv.add_rms_norm_gemv(x, None, g, eps, gate_up, swiglu=True, interleave=128,
                                               config={"BLOCK_N": 4, "BLOCK_K": 1024, "num_warps": 4})),
    # the same matrix read as a plain norm projection (q/k/v's and the LM head's tile): one row stream a program
    ("gate_up_as_norm", lambda: gemv.add_rms_norm_gemv(x, None, g, eps, gate_up,
                                                       config={"BLOCK_N": 32, "BLOCK_K": 256, "num_warps": 8})),
    ("down", lambda: gemv.gemv(act, down, x, config={"BLOCK_N": 4, "BLOCK_K": 1024, "num_warps": 4})),
]
big = torch.rand(1 << 30, device="cuda", dtype=dtype)  # 2 GiB
out = torch.empty(big.numel() // (128 << 10), device="cuda", dtype=torch.float32)
dst = torch.empty_like(big)
read = lambda: _read_kernel[(out.numel(),)](big, out, out.numel(), CHUNK=128 << 10, BLOCK=2048, UNROLL=2,  # noqa: E731
                                            num_warps=8)
for name, call in calls + [("read", read)]:  # compiled before the profiled range
    call()
torch.cuda.synchronize()
torch.cuda.nvtx.range_push("profiled")  # NOTE: ncu --nvtx-include "profiled/" profiles what follows only
for name, call in calls + [("read", read), ("copy", lambda: dst.copy_(big))]:
    call()
torch.cuda.nvtx.range_pop()
torch.cuda.synchronize()
print("done")
