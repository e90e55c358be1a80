"""Rotary position embeddings, rotate-half convention (Llama / transformers), on q and k in one launch.

For a head vector x = [x1, x2] (halves) at position p: out = x * cos[p] + [-x2, x1] * sin[p], with the
tables [max_pos, head_dim] as models/llama.py builds them (cat(freqs, freqs)). Numerics follow the eager
model: the float32 tables are rounded to the input dtype, and each product and the sum are rounded too,
so the kernel reproduces torch's bits in bfloat16/float16. NOTE: that needs `enable_fp_fusion=False`:
Triton turns the float32 round trips into 16-bit multiplies and adds (exact, as the products fit in
float32) but would then fuse one product into an FMA and skip its rounding (seen on an H200).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate_heads(x_ptr, out_ptr, stride_xt, stride_xh, stride_ot, stride_oh, token, c1, c2, s1, s2,
                  NUM_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr, HALF: tl.constexpr):
    """Rotate all heads of one token; c1/c2/s1/s2 [HALF] are the table halves, already rounded."""
    heads = tl.arange(0, HEADS_PAD)[:, None]
    dims = tl.arange(0, HALF)[None, :]
    mask = heads < NUM_HEADS
    src = x_ptr + token * stride_xt + heads * stride_xh + dims  # [HEADS_PAD, HALF]
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    # NOTE: round every product, as eager torch does op by op in a 16-bit dtype
    out1 = (x1 * c1[None, :]).to(dtype).to(tl.float32) - (x2 * s1[None, :]).to(dtype).to(tl.float32)
    out2 = (x2 * c2[None, :]).to(dtype).to(tl.float32) + (x1 * s2[None, :]).to(dtype).to(tl.float32)
    dst = out_ptr + token * stride_ot + heads * stride_oh + dims
    tl.store(dst, out1.to(dtype), mask=mask)
    tl.store(dst + HALF, out2.to(dtype), mask=mask)


@triton.jit
def _rotary_kernel(
    q_ptr, k_ptr, q_out_ptr, k_out_ptr, positions_ptr, cos_ptr, sin_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_qot, stride_qoh, stride_kot, stride_koh, stride_cos,
    NUM_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr, NUM_KV_HEADS: tl.constexpr, KV_HEADS_PAD: tl.constexpr,
    HALF: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + token)
    dims = tl.arange(0, HALF)
    dtype = q_out_ptr.dtype.element_ty
    table = pos * stride_cos + dims
    # the tables' halves, rounded to the activations' dtype as `cos[positions].to(dtype)` does
    c1 = tl.load(cos_ptr + table).to(dtype).to(tl.float32)
    c2 = tl.load(cos_ptr + table + HALF).to(dtype).to(tl.float32)
    s1 = tl.load(sin_ptr + table).to(dtype).to(tl.float32)
    s2 = tl.load(sin_ptr + table + HALF).to(dtype).to(tl.float32)
    _rotate_heads(q_ptr, q_out_ptr, stride_qt, stride_qh, stride_qot, stride_qoh, token, c1, c2, s1, s2,
                  NUM_HEADS, HEADS_PAD, HALF)
    _rotate_heads(k_ptr, k_out_ptr, stride_kt, stride_kh, stride_kot, stride_koh, token, c1, c2, s1, s2,
                  NUM_KV_HEADS, KV_HEADS_PAD, HALF)


def apply_rotary(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim], may be a strided view (a split of qkv)
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    positions: torch.Tensor,  # [num_tokens] int64
    cos: torch.Tensor,  # [max_pos, head_dim] float32
    sin: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotated copies of q and k (new contiguous tensors; the inputs are left untouched)."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    assert head_dim % 2 == 0 and (head_dim // 2) & (head_dim // 2 - 1) == 0, "head_dim must be a power of two"
    assert q.stride(-1) == 1 and k.stride(-1) == 1 and cos.stride() == sin.stride() and cos.stride(-1) == 1
    q_out, k_out = torch.empty_like(q, memory_format=torch.contiguous_format), torch.empty_like(
        k, memory_format=torch.contiguous_format
    )
    if num_tokens:
        _rotary_kernel[(num_tokens,)](
            q, k, q_out, k_out, positions, cos, sin,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1),
            q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1), cos.stride(0),
            NUM_HEADS=num_heads, HEADS_PAD=triton.next_power_of_2(num_heads),
            NUM_KV_HEADS=num_kv_heads, KV_HEADS_PAD=triton.next_power_of_2(num_kv_heads),
            HALF=head_dim // 2, num_warps=4,
            enable_fp_fusion=False,  # NOTE: a fused multiply-add would skip a rounding torch does
        )
    return q_out, k_out


def apply_rotary_ref(q, k, positions, cos, sin):
    """The model's own torch path: tables looked up and rounded to the dtype, then rotate-half."""
    from bento_pagedllm.models.ops import rotate_half_apply as model_apply_rotary  # NOTE: lazy, see rms_norm_ref

    cos = cos[positions].to(q.dtype)[:, None, :]  # [num_tokens, 1, head_dim]
    sin = sin[positions].to(q.dtype)[:, None, :]
    return model_apply_rotary(q, k, cos, sin)
