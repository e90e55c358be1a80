"""Writing a step's new keys and values into their paged cache slots.

One program per token copies all of its KV heads (keys and values), so the launch is one program per
new token whatever the head count. A slot is `block * block_size + offset`; a negative slot marks a
padding token (e.g. a batch padded for a CUDA graph) whose K/V are dropped.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcb, stride_kct, stride_kch, stride_vcb, stride_vct, stride_vch,
    NUM_KV_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token)  # int64
    if slot >= 0:  # NOTE: a negative slot is a padding token: nothing to write
        heads = tl.arange(0, HEADS_PAD)[:, None]
        dims = tl.arange(0, HEAD_DIM)[None, :]
        mask = heads < NUM_KV_HEADS  # [HEADS_PAD, 1]
        block = slot // BLOCK_SIZE
        offset = slot % BLOCK_SIZE
        row = token.to(tl.int64)
        k = tl.load(k_ptr + row * stride_kt + heads * stride_kh + dims, mask=mask)  # [HEADS_PAD, HEAD_DIM]
        v = tl.load(v_ptr + row * stride_vt + heads * stride_vh + dims, mask=mask)
        dst_k = k_cache_ptr + block * stride_kcb + offset * stride_kct + heads * stride_kch + dims
        dst_v = v_cache_ptr + block * stride_vcb + offset * stride_vct + heads * stride_vch + dims
        tl.store(dst_k, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(dst_v, v.to(v_cache_ptr.dtype.element_ty), mask=mask)

def write_kv_cache(
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim], may be a strided view (a split of qkv)
    v: torch.Tensor,
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens] int64; < 0 skips the token
) -> None:
    """Store each new token's keys and values in its cache slot, in place."""
    num_tokens, num_kv_heads, head_dim = k.shape
    assert head_dim & (head_dim - 1) == 0, "head_dim must be a power of two"
    assert k.stride(-1) == 1 and v.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    if num_tokens == 0:
        return
    _write_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        *k_cache.stride()[:3], *v_cache.stride()[:3],
        NUM_KV_HEADS=num_kv_heads, HEADS_PAD=triton.next_power_of_2(num_kv_heads), HEAD_DIM=head_dim,
        BLOCK_SIZE=k_cache.shape[1], num_warps=4 if num_kv_heads * head_dim >= 2048 else 1,
    )


def write_kv_cache_ref(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """The same function in plain torch (attention.py's version, plus skipping negative slots)."""
    num_kv_heads, head_dim = k.shape[1:]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, k[keep].to(k_cache.dtype))
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, v[keep].to(v_cache.dtype))
