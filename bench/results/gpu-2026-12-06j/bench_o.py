"""o alone (Llama-2-7B: 4,096 x 4,096, bf16, one row, the residual added): main's plain input against the
variant's split partials (8 splits, FILLED of them holding keys), autotuned and at fixed tiles. do_bench, us."""
import sys
import torch
import triton
from bento_pagedllm.kernels import gemv
from bento_pagedllm.kernels.paged_decode import SplitPartials

torch.manual_seed(0)
dev = "cuda"
w = torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16) * 0.02
x = torch.randn(1, 4096, device=dev, dtype=torch.bfloat16)
addend = torch.randn(1, 4096, device=dev, dtype=torch.bfloat16)
for filled in (3, 6):
    seq_len = 64 * filled  # split_len 64 (8 splits): `filled` splits hold keys
    parts = SplitPartials(torch.randn(1, 32, 8, 128, device=dev, dtype=torch.bfloat16),
                          torch.randn(1, 32, 8, device=dev), torch.tensor([seq_len], dtype=torch.int32, device=dev), 8, 64)
    ref = gemv.gemv_ref(parts.combine(), w, addend)
    for config in (None, {"BLOCK_N": 8, "BLOCK_K": 512, "num_warps": 4}, {"BLOCK_N": 16, "BLOCK_K": 512, "num_warps": 8},
                   {"BLOCK_N": 4, "BLOCK_K": 1024, "num_warps": 4}):
        cfg = config  # NOTE: num_warps travels as a launch option
        def plain():
            return gemv.gemv(x, w, addend=addend, config=cfg)
        def split():
            return gemv.gemv_split_partials(parts, w, addend=addend, config=cfg)
        out = split()
        err = (out.float() - ref.float()).abs().max().item()
        t_plain = triton.testing.do_bench(plain, warmup=50, rep=300)
        t_split = triton.testing.do_bench(split, warmup=50, rep=300)
        print(f"filled {filled} config {config}: plain {t_plain * 1e3:.2f} us, split partials {t_split * 1e3:.2f} us, max err {err:.3g}", flush=True)
print(gemv.tuned_configs())
