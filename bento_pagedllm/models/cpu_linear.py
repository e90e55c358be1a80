"""Linear layers for the CPU path: the fastest kernel for each batch shape, chosen per call.

NOTE (measured on this project's 2-core AMD EPYC machine, torch 2.13 CPU, SmolLM2-135M shapes, one
token, 30 distinct weights per shape so none stays in cache):
- One token (decode at batch 1) is a matrix-vector product bound by memory bandwidth, and MKL's speed
  depends on the weight's memory layout. A wide matrix (more outputs than inputs) streams fastest
  column-major ([in, out] contiguous): q/k/v 125 vs 165 us, gate/up 345 vs 515 us, LM head 4.6 vs 9.0 ms.
  A tall one (more inputs than outputs) streams fastest row-major: down 185 vs 245 us. Square (o_proj)
  is a tie (~100 us).
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


def gemv_layout(weight: torch.Tensor) -> torch.Tensor:
    """`weight` ([out, in] values) in the memory layout MKL's matrix-vector product streams fastest."""
    out_features, in_features = weight.shape
    if out_features > in_features:
        return weight.t().contiguous().t()  # [in, out] in memory
    return weight.contiguous()


class CpuLinear(nn.Module):
    def __init__(self, weight: torch.Tensor, packed: bool = True) -> None:
        super().__init__()
        self.register_buffer("gemv_weight", gemv_layout(weight.detach()), persistent=False)
        self.packed = None
        if packed and _MKLDNN:
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), 8)

    @property
    def weight(self) -> torch.Tensor:
        return self.gemv_weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 1 or self.packed is None:
            return F.linear(x, self.gemv_weight)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, None, "none", [], "")
