"""RMSNorm, alone and fused with the residual add that precedes it in every decoder layer.

Numerics are transformers' LlamaRMSNorm, operation for operation: the mean of squares in float32, the
normalised row rounded back to the input dtype, THEN multiplied by the weight (rounded once more). The
fused variant also rounds `x + residual` to the input dtype first, as the eager model does, so both
kernels match the torch model up to the order of the float32 sum and the rsqrt's last bits, which can
move a rounding boundary: an ulp of the input dtype, rarely.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr, sum_ptr,
    stride_x, stride_r, stride_o, stride_s, hidden, eps,
    BLOCK: tl.constexpr, ADD_RESIDUAL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if ADD_RESIDUAL:
        residual = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(x_ptr.dtype.element_ty)  # rounded, like torch
        tl.store(sum_ptr + row * stride_s + cols, x, mask=mask)
    x32 = x.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(x32 * x32, axis=0) / hidden + eps)
    normed = (x32 * inv_rms).to(x_ptr.dtype.element_ty).to(tl.float32)  # NOTE: rounded before the weight
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (weight * normed).to(out_ptr.dtype.element_ty), mask=mask)


def _launch(x, residual, weight, eps):
    hidden = x.shape[-1]
    assert x.stride(-1) == 1 and weight.is_contiguous()
    rows = x.reshape(-1, hidden)  # [num_rows, hidden]
    # NOTE: the output dtype is torch's promotion of weight and input, as in `weight * x.to(dtype)`
    out = torch.empty(rows.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    if residual is None:
        res_rows, total = rows, out  # unused by the kernel
    else:
        res_rows = residual.reshape(-1, hidden)
        total = torch.empty_like(rows)
    block = triton.next_power_of_2(hidden)
    if rows.shape[0]:
        _rms_norm_kernel[(rows.shape[0],)](
            rows, res_rows, weight, out, total,
            rows.stride(0), res_rows.stride(0), out.stride(0), total.stride(0), hidden, eps,
            BLOCK=block, ADD_RESIDUAL=residual is not None, num_warps=min(16, max(1, block // 256)),
            enable_fp_fusion=False,  # NOTE: keep each rounding torch does (see rotary.py)
        )
    return out.view(x.shape), total.view(x.shape)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [..., hidden] -> normalised x * weight, same shape."""
    return _launch(x, None, weight, eps)[0]


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual) in one pass over the row: the sum is the next residual."""
    assert x.shape == residual.shape and x.dtype == residual.dtype and residual.stride(-1) == 1
    return _launch(x, residual, weight, eps)


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The model's own torch function (transformers' LlamaRMSNorm), so parity means parity with the model."""
    from bento_pagedllm.models.ops import rms_norm as model_rms_norm  # NOTE: lazy, the model may import us

    return model_rms_norm(x, weight, eps)


def fused_add_rms_norm_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    total = x + residual
    return rms_norm_ref(total, weight, eps), total
