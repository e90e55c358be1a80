"""The step both paged attention kernels repeat: fold one tile of cached keys/values into a softmax.

A program of either kernel holds a block of query rows (decode: the query heads that share one KV head;
prefill: a few tokens times those heads) and walks its context one tile of `BLOCK_N` token positions at
a time. Each token's cache block is looked up in the sequence's block table, so a tile may span several
cache blocks: any block size works, and the tile size is tuned apart from it.

NOTE: scores are kept in base-2 units (`qk_scale` = softmax scale * log2(e)) so the exponentials are
`exp2`, one instruction on the GPU; the running max `m` and sum `l` are in the same units.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634


def dot_precision(dtype: torch.dtype) -> str:
    """tl.dot's input precision: exact products for float32 caches (tf32 would cost ~1e-3), else unused."""
    return "ieee" if dtype == torch.float32 else "tf32"


@triton.jit
def load_kv_tile(
    start, kv_end,  # the tile covers keys [start, start + BLOCK_N); keys >= kv_end do not exist
    k_cache_ptr, v_cache_ptr, table_ptr, kv_head,
    stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
    MASKED: tl.constexpr,  # False: every key of the tile exists (no masks at all)
):
    """K transposed [HEAD_DIM, BLOCK_N] and V [BLOCK_N, HEAD_DIM] of one tile, read through the block table
    (zeros for keys that do not exist: a masked load asks memory for nothing)."""
    keys = start + tl.arange(0, BLOCK_N)  # [BLOCK_N] token positions
    dims = tl.arange(0, HEAD_DIM)
    if MASKED:
        key_valid = keys < kv_end
        blocks = tl.load(table_ptr + keys // BLOCK_SIZE, mask=key_valid, other=0).to(tl.int64)
    else:
        blocks = tl.load(table_ptr + keys // BLOCK_SIZE).to(tl.int64)
    offsets = keys % BLOCK_SIZE
    k_rows = blocks * stride_kb + offsets * stride_kt + kv_head * stride_kh  # [BLOCK_N]
    v_rows = blocks * stride_vb + offsets * stride_vt + kv_head * stride_vh
    # NOTE: K is loaded transposed, [HEAD_DIM, BLOCK_N], so the scores are a plain q @ k.
    if MASKED:
        k = tl.load(k_cache_ptr + k_rows[None, :] + dims[:, None], mask=key_valid[None, :], other=0.0)
        v = tl.load(v_cache_ptr + v_rows[:, None] + dims[None, :], mask=key_valid[:, None], other=0.0)
    else:
        k = tl.load(k_cache_ptr + k_rows[None, :] + dims[:, None])
        v = tl.load(v_cache_ptr + v_rows[:, None] + dims[None, :])  # [BLOCK_N, HEAD_DIM]
    return k, v


@triton.jit
def fold_kv_tile(
    acc, m_i, l_i,  # running output [M, HEAD_DIM] fp32, max [M] and sum [M] fp32
    q,  # [M, HEAD_DIM], the program's query rows (M >= 16: tl.dot's smallest shape)
    q_pos,  # [M] int32, the last key position each row may see (its own position)
    k, v,  # the tile from load_kv_tile
    start,  # the tile's first key position
    qk_scale,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,  # False: every row sees every key of the tile
    DOT_PRECISION: tl.constexpr,
):
    keys = start + tl.arange(0, BLOCK_N)
    s = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale  # [M, BLOCK_N] fp32
    if MASKED:
        # NOTE: keys past the tile's end are also past every valid row's position, so the causal test
        # covers them.
        s = tl.where(keys[None, :] <= q_pos[:, None], s, float("-inf"))

    # NOTE: every row sees at least one key of each tile a program folds in (a prefill row sees key 0; a
    # decode split folds only tiles holding its keys), so m_new is finite from the first tile on: no
    # -inf - -inf.
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)  # [M], rescales what was accumulated under the old max
    p = tl.exp2(s - m_new[:, None])  # [M, BLOCK_N]
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc, m_new, l_i


@triton.jit
def attend_kv_tile(
    acc, m_i, l_i, q, q_pos, start, kv_end,
    k_cache_ptr, v_cache_ptr, table_ptr, kv_head,
    stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
    qk_scale,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
    MASKED: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """load_kv_tile, then fold_kv_tile: one tile of keys [start, start + BLOCK_N) below kv_end."""
    k, v = load_kv_tile(start, kv_end, k_cache_ptr, v_cache_ptr, table_ptr, kv_head, stride_kb, stride_kt,
                        stride_kh, stride_vb, stride_vt, stride_vh, BLOCK_SIZE, BLOCK_N, HEAD_DIM, MASKED)
    return fold_kv_tile(acc, m_i, l_i, q, q_pos, k, v, start, qk_scale, BLOCK_N, MASKED, DOT_PRECISION)
