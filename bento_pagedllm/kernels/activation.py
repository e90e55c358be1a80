"""SwiGLU's activation: silu(gate) * up over the fused gate/up projection's output.

Numerics follow the eager model (`silu(gate) * up` in the input dtype): silu is computed in float32 and
rounded, then the product is rounded, so the kernel matches torch up to where Triton's float32 exp and
torch's differ by an ulp.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def silu_and_mul_tile(gate, up, dtype: tl.constexpr):
    """silu(gate) * up for float32 tiles, rounded to `dtype` where torch rounds: silu, then the product.
    (Also the epilogue of the gate/up projection of a few tokens, kernels/gemv.py.)"""
    act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    return (act * up).to(dtype)


@triton.jit
def gate_up_index(index, inter, INTERLEAVE: tl.constexpr):
    """Where gate `index` (a column of the product, a row of W) and its up partner lie: the gate ones, then
    the up ones (`inter` of each); with INTERLEAVE, blocks of that many gate ones each followed by the same
    up ones (kernels/swiglu_gemm.py's layout)."""
    if INTERLEAVE:
        gate = index // INTERLEAVE * 2 * INTERLEAVE + index % INTERLEAVE
        up = gate + INTERLEAVE
    else:
        gate = index
        up = index + inter
    return gate, up


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, inter, BLOCK: tl.constexpr, INTERLEAVE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate_cols, up_cols = gate_up_index(cols, inter, INTERLEAVE)
    gate = tl.load(x_ptr + row * stride_x + gate_cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + up_cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, silu_and_mul_tile(gate, up, out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor, interleave: int = 0) -> torch.Tensor:
    """x: [num_tokens, 2 * intermediate] (gate then up; with `interleave`, blocks of that many gate columns
    each followed by the same up columns: kernels/swiglu_gemm.py's layout) -> [num_tokens, intermediate]."""
    num_tokens, width = x.shape
    assert width % 2 == 0 and x.stride(-1) == 1
    inter = width // 2
    out = torch.empty(num_tokens, inter, dtype=x.dtype, device=x.device)
    block = min(1024, triton.next_power_of_2(inter))
    if num_tokens:
        _silu_and_mul_kernel[(num_tokens, triton.cdiv(inter, block))](
            x, out, x.stride(0), out.stride(0), inter, BLOCK=block, INTERLEAVE=interleave, num_warps=4,
            enable_fp_fusion=False,  # NOTE: keep each rounding torch does (see rotary.py)
        )
    return out


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """The model's own torch function (TorchOps)."""
    from bento_pagedllm.models.ops import TorchOps  # NOTE: lazy, the model may import us

    return TorchOps().silu_and_mul(x)
