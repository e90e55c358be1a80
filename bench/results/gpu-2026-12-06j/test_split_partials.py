"""VARIANT (gpu-2026-12-06j): a single sequence's decode splits left uncombined, combined by the o projection."""
from __future__ import annotations

import pytest
import torch
from kernel_cases import decode_case, make_batch, randn, rotary_tables, assert_attention_close  # NOTE: conftest sets TRITON_INTERPRET

from bento_pagedllm.kernels.gemv import gemv_ref, gemv_split_partials
from bento_pagedllm.kernels.paged_decode import NewKV, paged_decode_attention, paged_decode_attention_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("seq_len,num_splits,dtype,group", [
    (300, 8, torch.float32, 4), (70, 8, torch.float16, 1), (129, 4, torch.float32, 1), (5, 2, torch.float16, 4),
    (1000, 8, torch.float16, 4),
])
def test_split_partials_combined_in_the_projection(seq_len, num_splits, dtype, group):
    case = decode_case((seq_len,), dtype=dtype, group=group, num_splits=num_splits)
    b = make_batch(case, DEVICE)
    kv_size = case.num_kv_heads * case.head_dim
    qkv = randn((1, b.q[0].numel() + 2 * kv_size), dtype, DEVICE, seed=7)
    q = qkv[:, : -2 * kv_size].view(b.q.shape)
    k, v = (qkv[:, -2 * kv_size + i * kv_size:][:, :kv_size].view(1, case.num_kv_heads, -1) for i in range(2))
    cos, sin = rotary_tables(seq_len, case.head_dim, DEVICE)
    new_kv = NewKV(k, v, b.meta.slot_mapping.clone(), cos, sin)
    args = (b.meta.block_tables, b.meta.seq_lens, case.head_dim**-0.5)
    expected = (b.k_cache.clone(), b.v_cache.clone())
    partials = paged_decode_attention(q, b.k_cache, b.v_cache, *args, num_splits=num_splits, new_kv=new_kv,
                                      partials_only=True)
    ref = paged_decode_attention_ref(q, *expected, *args, new_kv=new_kv)  # [1, heads, head_dim]
    combined = partials.combine()
    assert_attention_close(combined.view_as(ref), ref)
    hidden = 48
    weight = randn((hidden, case.num_heads * case.head_dim), dtype, DEVICE, seed=3, scale=0.1)
    addend = randn((1, hidden), dtype, DEVICE, seed=4)
    expect = gemv_ref(combined, weight, addend)
    tol = dict(atol=2e-5, rtol=2e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    for config in (None, {"BLOCK_N": 16, "BLOCK_K": 32}, {"BLOCK_N": 8, "BLOCK_K": 256}):  # tiles in, over heads
        out = gemv_split_partials(partials, weight, addend=addend, config=config)
        torch.testing.assert_close(out, expect, **tol)
