"""Registers and spills of the decode attention kernel as Triton compiles it on this GPU (a diagnostic).

Why: ptxas on another machine (another Triton) may allocate very differently. On the project's CPU machine
(Triton 3.9, sm_90a) this kernel showed 255 registers with spills; on the H200 (Triton 3.6) 110-128 and
none (bench/results/h200-2026-12-01n/run1_combine/regs_head.txt). Run it where the kernel runs:

    python bench/decode_registers.py
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bento_pagedllm.kernels import paged_decode  # noqa: E402


def main() -> None:
    for group, kv_heads in ((1, 32), (4, 8)):  # Llama-2-7B's and Llama-3-8B's head layouts
        q = torch.randn(2, group * kv_heads, 128, dtype=torch.bfloat16, device="cuda")
        k_cache = torch.randn(64, 16, kv_heads, 128, dtype=torch.bfloat16, device="cuda")
        tables = torch.arange(64, dtype=torch.int32, device="cuda").view(2, 32)
        lens = torch.tensor([300, 500], dtype=torch.int32, device="cuda")
        for splits in (4, 1):
            paged_decode.paged_decode_attention(q, k_cache, torch.randn_like(k_cache), tables, lens, 0.08,
                                                num_splits=splits)
    for cache in paged_decode._decode_split_kernel.device_caches.values():
        kernels = cache[0] if isinstance(cache, tuple) else cache
        for key, kernel in kernels.items():
            if getattr(kernel, "n_regs", None) is None:  # NOTE: set when the binary is loaded (its first launch)
                kernel._init_handles()
            print(f"registers {kernel.n_regs}, spills {kernel.n_spills}, warps {kernel.metadata.num_warps}: "
                  f"{str(key)[-120:]}")


if __name__ == "__main__":
    main()
