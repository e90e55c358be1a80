"""Rotary position embeddings, rotate-half convention (Llama / transformers), fused with the KV-cache
write: one launch per layer rotates q and k and stores the rotated keys and the values in their paged
cache slots (slot = block * block_size + offset, from the step's slot mapping). It serves every step but
a single sequence's decode step, whose attention kernel does the same itself (paged_decode.py, `NewKV`).

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
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def rotate_rounded(x, x_partner, cos, sin_signed, dtype: tl.constexpr):
    """x * cos + x_partner * sin_signed in `dtype`, every product and the sum rounded as eager torch rounds
    them op by op (x_partner: rotate_half's other half of the head; sin_signed: sin, negated where rotate_half
    negates). Inputs float32, the tables already rounded to `dtype`. Shared with the decode kernel
    (paged_decode.py), which rotates a single sequence's q and k itself. NOTE: a kernel using it must be
    compiled with `enable_fp_fusion=False` (the module docstring says why)."""
    return ((x * cos).to(dtype).to(tl.float32) + (x_partner * sin_signed).to(dtype).to(tl.float32)).to(dtype)


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
    dst = out_ptr + token * stride_ot + heads * stride_oh + dims
    # rotate_half(x) = [-x2, x1]: ((-x2) * s1 rounds as -(x2 * s1): one helper serves both halves)
    tl.store(dst, rotate_rounded(x1, x2, c1[None, :], -s1[None, :], dtype), mask=mask)
    tl.store(dst + HALF, rotate_rounded(x2, x1, c2[None, :], s2[None, :], dtype), mask=mask)


@triton.jit
def _rotary_store_kv_kernel(
    q_ptr, k_ptr, v_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr, positions_ptr, cos_ptr, sin_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_qot, stride_qoh,
    stride_kcb, stride_kct, stride_kch, stride_vcb, stride_vct, stride_vch, stride_cos,
    NUM_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr, NUM_KV_HEADS: tl.constexpr, KV_HEADS_PAD: tl.constexpr,
    HALF: tl.constexpr, BLOCK_SIZE: tl.constexpr, USE_PDL: tl.constexpr,
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
    slot = tl.load(slot_mapping_ptr + token)  # int64
    if USE_PDL:
        # NOTE: launched before the kernel ahead (the q/k/v projection) ends: what came before is the
        # step's inputs and the tables, which no kernel writes; q, k, v only after gdc_wait (gemv.py)
        gdc_wait()
        gdc_launch_dependents()
    _rotate_heads(q_ptr, q_out_ptr, stride_qt, stride_qh, stride_qot, stride_qoh, token, c1, c2, s1, s2,
                  NUM_HEADS, HEADS_PAD, HALF)
    if slot >= 0:  # NOTE: a negative slot is a padding token (a CUDA graph's): its K/V land nowhere
        block = slot // BLOCK_SIZE
        offset = slot % BLOCK_SIZE
        # the rotated keys go straight to their cache slot (token stride 0: the slot is the base)
        k_dst = k_cache_ptr + block * stride_kcb + offset * stride_kct
        _rotate_heads(k_ptr, k_dst, stride_kt, stride_kh, 0, stride_kch, token, c1, c2, s1, s2,
                      NUM_KV_HEADS, KV_HEADS_PAD, HALF)
        heads = tl.arange(0, KV_HEADS_PAD)[:, None]
        head_dims = tl.arange(0, 2 * HALF)[None, :]
        mask = heads < NUM_KV_HEADS
        v = tl.load(v_ptr + token * stride_vt + heads * stride_vh + head_dims, mask=mask)
        v_dst = v_cache_ptr + block * stride_vcb + offset * stride_vct + heads * stride_vch + head_dims
        tl.store(v_dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def rotary_and_store_kv(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim], may be a strided view (a split of qkv)
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens] int64; < 0 skips the token's K/V
    positions: torch.Tensor,  # [num_tokens] int64
    cos: torch.Tensor,  # [max_pos, head_dim] float32
    sin: torch.Tensor,
    pdl: bool = False,
) -> torch.Tensor:
    """Rotate q (returned as a new contiguous tensor) and k, and store the rotated keys and the values in
    their cache slots: one launch, and the rotated keys never make a round trip through memory.
    `pdl`: launch as a programmatic dependent of the kernel before (kernels/gemv.py says why)."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    assert head_dim % 2 == 0 and (head_dim // 2) & (head_dim // 2 - 1) == 0, "head_dim must be a power of two"
    assert q.stride(-1) == 1 and k.stride(-1) == 1 and v.stride(-1) == 1
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1 and cos.stride() == sin.stride() and cos.stride(-1) == 1
    q_out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if num_tokens:
        _rotary_store_kv_kernel[(num_tokens,)](
            q, k, v, q_out, k_cache, v_cache, slot_mapping, positions, cos, sin,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            q_out.stride(0), q_out.stride(1), *k_cache.stride()[:3], *v_cache.stride()[:3], cos.stride(0),
            NUM_HEADS=num_heads, HEADS_PAD=triton.next_power_of_2(num_heads),
            NUM_KV_HEADS=num_kv_heads, KV_HEADS_PAD=triton.next_power_of_2(num_kv_heads),
            HALF=head_dim // 2, BLOCK_SIZE=k_cache.shape[1], USE_PDL=pdl, launch_pdl=pdl, num_warps=4,
            enable_fp_fusion=False,  # NOTE: a fused multiply-add would skip a rounding torch does
        )
    return q_out


def rotary_and_store_kv_ref(q, k, v, k_cache, v_cache, slot_mapping, positions, cos, sin):
    """The model's own torch path (TorchOps): tables looked up and rounded to the dtype, the rotation,
    then the cache write, so parity means parity with the model."""
    from bento_pagedllm.models.ops import TorchOps  # NOTE: lazy, see rms_norm_ref

    ops = TorchOps()
    context = ops.rotary_context(positions, cos, sin, q.dtype)
    return ops.rotary_and_store_kv(q, k, v, (k_cache, v_cache), context, slot_mapping)
