"""Linear layers for the CPU path: the fastest kernel for each batch shape, chosen per call.

NOTE (measured on this project's 2-core AMD EPYC machine, torch 2.13 CPU, SmolLM2-135M shapes, one
token, 30 distinct weights per shape so none stays in cache, us per call):

| one token | q/k/v | o | gate/up | down | LM head |
|---|---|---|---|---|---|
| row-major weight ([out, in], `nn.Linear`) | 175-200 | 105 | 560-610 | 190-220 | 8,200-10,300 |
| column-major weight ([in, out] contiguous) | 127-149 | 100 | 325-360 | 245-300 | 4,500-5,500 |
| two column blocks, one `bmm` ([2, in, out/2]) | 98-117 | 75-82 | 240-285 | 170-205 | 3,200-3,650 |

A matrix-vector product is bound by memory bandwidth, and MKL's one-token product runs on one core
(one thread streams it as fast as two). Split into one column block per thread, a batched product
streams each block on its own core: ~25% less time a step. Several tokens are another matter: MKL's
sgemm is slow on this CPU for small M (gate/up at M=8: 1,044 us), while oneDNN with a weight prepacked
for its blocked layout takes 351 us. So each layer keeps both forms. That doubles the weight memory on
the CPU (the default model: 0.5 to 1.1 GB), the price of being fast at both batch 1 and batch 8; GPUs
never use this module.
"""

from __future__ import annotations

import torch
from torch import nn

_MKLDNN = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def column_blocks(weight: torch.Tensor, parts: int) -> torch.Tensor:
    """weight [out, in] -> [parts, in, out / parts]: block b holds W^T's columns b*out/parts onwards."""
    out_features, in_features = weight.shape
    return weight.t().reshape(in_features, parts, out_features // parts).permute(1, 0, 2).contiguous()


class CpuLinear(nn.Module):
    def __init__(self, weight: torch.Tensor, packed: bool = True, parts: int | None = None) -> None:
        super().__init__()
        weight = weight.detach()
        self.out_features, self.in_features = weight.shape
        # NOTE: one block per intra-op thread; measured with 2 threads (this project's machine) only
        parts = parts or torch.get_num_threads()
        if self.out_features % parts:
            parts = 1  # NOTE: one block: a plain column-major matrix-vector product
        self.parts = parts
        # [parts, in, out / parts]
        self.register_buffer("gemv_blocks", column_blocks(weight, parts), persistent=False)
        self.packed = None
        # NOTE: float32 only: oneDNN's bf16 reorder needs AVX512-BF16 or AVX-NE-CONVERT, and refuses otherwise
        if packed and _MKLDNN and weight.dtype == torch.float32:
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), 8)

    @property
    def weight(self) -> torch.Tensor:
        """The [out, in] matrix (a copy: for inspection, not for the hot path)."""
        return self.gemv_blocks.permute(1, 0, 2).reshape(self.in_features, self.out_features).t()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [num_tokens, in] -> [num_tokens, out]
        num_tokens = x.shape[0]
        if num_tokens == 1:
            # [parts, 1, in] @ [parts, in, out / parts] -> [parts, 1, out / parts], the blocks in order
            return torch.bmm(x.expand(self.parts, 1, self.in_features), self.gemv_blocks).view(1, self.out_features)
        if self.packed is None:  # [parts, num_tokens, out / parts] -> [num_tokens, out]
            return torch.matmul(x, self.gemv_blocks).permute(1, 0, 2).reshape(num_tokens, self.out_features)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, None, "none", [], "")
