"""Linear layers for the CPU path: the fastest kernel for each batch shape, chosen per call.

NOTE (measured on this project's 2-core AMD EPYC machine, torch 2.13 CPU, SmolLM2-135M shapes):
- One token (decode at batch 1) is a matrix-vector product bound by memory bandwidth. MKL streams a
  column-major weight ([in, out] contiguous) at up to 1.7x the speed of a row-major one (q/k/v 16.7 vs
  10.3 GB/s, gate/up 19.2 vs 11.5, LM head 21.9 vs 13.0).
- Several tokens: MKL's sgemm is slow on this CPU for small M (gate/up at M=8: 1,044 us), while oneDNN
  with a weight prepacked for its blocked layout takes 351 us.
So each layer keeps both forms. That doubles the weight memory on the CPU (the default model: 0.5 to 1.1
GB), the price of being fast at both batch 1 and batch 8; GPUs never use this module.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

_MKLDNN = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


class CpuLinear(nn.Module):
    def __init__(self, weight: torch.Tensor, packed: bool = True) -> None:
        super().__init__()
        # [out, in] values, [in, out] memory: the layout MKL's matrix-vector product streams fastest
        self.register_buffer("weight_colmajor", weight.detach().t().contiguous().t(), persistent=False)
        self.packed = None
        if packed and _MKLDNN:
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), 8)

    @property
    def weight(self) -> torch.Tensor:
        return self.weight_colmajor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 1 or self.packed is None:
            return F.linear(x, self.weight_colmajor)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, None, "none", [], "")
