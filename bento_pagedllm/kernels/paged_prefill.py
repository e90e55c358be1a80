"""Paged prefill attention: a ragged batch of query chunks, each at the end of its cached context.

Sequence i's `q_len_i` new tokens are the LAST positions of its `seq_len_i` context (chunked prefill:
they attend to the cached prefix and causally to themselves; their own K/V are already in the cache).
Decodes are the case q_len = 1, so one launch serves any mixed step.

Design (H200: bf16, head_dim 128, block size 16, GQA 4), flash-attention style:
- a program owns one KV head and a tile of BLOCK_M query rows = BLOCK_Q tokens x the GROUP query heads
  sharing that KV head, so every K/V tile read serves the whole group (a decode in a mixed batch fills
  GROUP rows of a 16-row tile instead of 1 row of a 64-row one);
- the grid is flat over the batch's query tiles (no max_query_len x num_seqs rectangle of idle programs):
  sequence i owns tiles [qsl[i] // BLOCK_Q + i, qsl[i+1] // BLOCK_Q + i + 1), found by binary search;
- keys every row of the tile sees are walked without masks; only the diagonal tiles are masked.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .attention_tile import LOG2E, attend_kv_tile, dot_precision


@triton.jit
def _find_seq(query_start_loc_ptr, tile, num_seqs, BLOCK_Q: tl.constexpr):
    """The sequence owning flat q tile `tile` (the last i whose first tile qsl[i] // BLOCK_Q + i <= tile)."""
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_tile = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first_tile <= tile:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


# NOTE: Triton compiles a variant per value class (1, a multiple of 16, other) of each integer argument;
# the sequence count and the block-table width change every step, and a variant compiled mid-run costs a
# step a second or more on a fresh machine (bench/results/h200-2026-12-01i/run4_offline), so they are
# passed as plain integers.
@triton.jit(do_not_specialize=["num_seqs", "stride_bt"])
def _prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, query_start_loc_ptr, seq_lens_ptr, out_ptr,
    qk_scale, num_seqs,
    stride_qt, stride_qh,
    stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
    stride_bt, stride_ot, stride_oh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    kv_head = tl.program_id(0)
    tile = tl.program_id(1)
    seq = _find_seq(query_start_loc_ptr, tile, num_seqs, BLOCK_Q)
    q_begin = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_begin
    local_tile = tile - (q_begin // BLOCK_Q + seq)
    if local_tile * BLOCK_Q >= q_len:  # a spare tile of the flat grid
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    prefix = seq_len - q_len  # cached tokens before this step's queries

    # rows: token-major, head-minor; rows past BLOCK_Q * GROUP (when GROUP does not divide BLOCK_M) or
    # past the sequence's queries are padding, computed on zeros and never stored
    rows = tl.arange(0, BLOCK_M)
    dims = tl.arange(0, HEAD_DIM)
    tokens = local_tile * BLOCK_Q + rows // GROUP  # [BLOCK_M] index among the sequence's queries
    heads = kv_head * GROUP + rows % GROUP  # [BLOCK_M]
    row_valid = (rows < BLOCK_Q * GROUP) & (tokens < q_len)
    q_rows = (q_begin + tokens).to(tl.int64) * stride_qt + heads * stride_qh
    # [BLOCK_M, HEAD_DIM]
    q = tl.load(q_ptr + q_rows[:, None] + dims[None, :], mask=row_valid[:, None], other=0.0)
    q_pos = prefix + tokens  # [BLOCK_M] each row's own position: it sees keys 0..q_pos

    first_pos = prefix + local_tile * BLOCK_Q  # the tile's first query position
    kv_end = tl.minimum(seq_len, first_pos + BLOCK_Q)  # one past the last key any row sees
    full_end = (first_pos + 1) // BLOCK_N * BLOCK_N  # keys below this are seen by every row

    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    table_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for start in range(0, full_end, BLOCK_N):
        acc, m_i, l_i = attend_kv_tile(
            acc, m_i, l_i, q, q_pos, start, kv_end, k_cache_ptr, v_cache_ptr, table_ptr, kv_head,
            stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, qk_scale,
            BLOCK_SIZE, BLOCK_N, HEAD_DIM, False, DOT_PRECISION,
        )
    for start in range(full_end, kv_end, BLOCK_N):  # the diagonal: causal and length masks
        acc, m_i, l_i = attend_kv_tile(
            acc, m_i, l_i, q, q_pos, start, kv_end, k_cache_ptr, v_cache_ptr, table_ptr, kv_head,
            stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, qk_scale,
            BLOCK_SIZE, BLOCK_N, HEAD_DIM, True, DOT_PRECISION,
        )

    out = acc / l_i[:, None]
    out_rows = (q_begin + tokens).to(tl.int64) * stride_ot + heads * stride_oh
    out_ptrs = out_ptr + out_rows[:, None] + dims[None, :]
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_valid[:, None])


def _tile_config(max_query_len: int, group: int) -> tuple[int, int, int, int]:
    """(BLOCK_M rows, BLOCK_N keys, num_warps, num_stages): rows for the longest query, at most 64.

    NOTE: measured on an H200 (bf16, head_dim 128, block size 16): 64 x 64 tiles with 4 warps beat
    128-row tiles everywhere: 322 against 283 TFLOP/s on a 4096-token Llama-3-8B prompt (torch's flash
    SDPA on contiguous K/V: 527), and 1.6-1.9x on mixed steps, where every decode pads a whole tile.
    """
    rows = max_query_len * group
    return max(16, min(64, triton.next_power_of_2(rows))), 64, 4, 2


def paged_prefill_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim], sequences' queries back to back
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32, context length including this step's queries
    max_query_len: int,  # host-side, sizes the tiles (no device sync)
    scale: float,
) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its paged context: [num_tokens, heads, head_dim]."""
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    num_seqs = seq_lens.shape[0]
    assert num_heads % num_kv_heads == 0, "query heads must be a multiple of KV heads"
    assert head_dim >= 16 and head_dim & (head_dim - 1) == 0, "head_dim must be a power of two >= 16"
    assert q.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    out = torch.empty(num_tokens, num_heads, head_dim, dtype=q.dtype, device=q.device)
    if num_tokens == 0:
        return out
    group = num_heads // num_kv_heads
    block_m, block_n, num_warps, num_stages = _tile_config(max_query_len, group)
    block_m = max(block_m, triton.next_power_of_2(group))  # NOTE: a tile holds at least one token's group
    block_q = block_m // group
    num_tiles = num_tokens // block_q + num_seqs  # NOTE: >= sum of cdiv(q_len_i, block_q), see _find_seq
    _prefill_kernel[(num_kv_heads, num_tiles)](
        q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, out,
        scale * LOG2E, num_seqs,
        q.stride(0), q.stride(1),
        *k_cache.stride()[:3], *v_cache.stride()[:3],
        block_tables.stride(0), out.stride(0), out.stride(1),
        GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        BLOCK_M=block_m, BLOCK_Q=block_q, BLOCK_N=block_n, DOT_PRECISION=dot_precision(q.dtype),
        num_warps=num_warps, num_stages=num_stages,
    )
    return out


def paged_prefill_attention_ref(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    query_start_loc: torch.Tensor, seq_lens: torch.Tensor, max_query_len: int, scale: float,
) -> torch.Tensor:
    """The same function in plain torch, one sequence at a time, in float32 (a reference, not a path)."""
    del max_query_len  # only sizes the kernel's tiles
    num_heads = q.shape[1]
    block_size = k_cache.shape[1]
    group = num_heads // k_cache.shape[2]
    out = torch.empty_like(q)
    starts, lens = query_start_loc.tolist(), seq_lens.tolist()
    for i, seq_len in enumerate(lens):
        begin, end = starts[i], starts[i + 1]
        blocks = block_tables[i, : -(-seq_len // block_size)].long()
        # [seq_len, num_heads, head_dim]: the context gathered through the block table, heads repeated
        k = k_cache[blocks].flatten(0, 1)[:seq_len].float().repeat_interleave(group, dim=1)
        v = v_cache[blocks].flatten(0, 1)[:seq_len].float().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[begin:end].float(), k) * scale  # [heads, q_len, seq_len]
        q_pos = torch.arange(seq_len - (end - begin), seq_len, device=q.device)
        visible = torch.arange(seq_len, device=q.device)[None, :] <= q_pos[:, None]  # [q_len, seq_len]
        probs = scores.masked_fill(~visible, float("-inf")).softmax(dim=-1)
        out[begin:end] = torch.einsum("hqk,khd->qhd", probs, v).to(q.dtype)
    return out
