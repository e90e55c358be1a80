"""Paged decode attention: one new query token per sequence against its whole cached context.

Decode reads the whole KV cache of the batch for a few FLOPs per byte, so the design is about bytes and
occupancy (tuned for an H200: bf16, head_dim 128, block size 16, GQA 4):
- one program serves one KV head and ALL the query heads that share it, so each K/V tile is read once
  per KV head, not once per query head; the group's queries are the rows of one tl.dot, padded to 16
  rows (the smallest MMA shape). NOTE: even multi-head attention (group 1, 15 of 16 rows wasted) goes
  through tl.dot: on an H200, Llama-2-7B shapes read the cache at 4.3 TB/s that way against 3.4 TB/s
  for a multiply-and-reduce in registers (64 x 2048 tokens; 3.5 against 2.0 for 1 x 32768).
- the context is split across programs (flash-decoding), so that a small batch, of long or short
  sequences, still fills the GPU's multiprocessors; each split leaves a partial (max, sum, unnormalised
  output), and the last split of a (sequence, KV head) to finish combines them: a per-pair counter,
  incremented atomically by each split that holds keys, tells it that it is last (and it resets the
  counter to zero for the next launch); it reads the partials a chunk at a time, not one by one. No
  second kernel: at batch 1 its launch cost as much as the attention (a 1.9 us combine after 4.7 us,
  Llama-2-7B shape). With a single split the program writes the output directly.
- programs start in sequence order, each sequence's KV heads and splits together: a batch listed longest
  context first (the scheduler lists decode steps so) starts its longest programs first and ends on its
  shortest, instead of on a long one started late. Measured on an H200 (bench/decode_attention.py
  --ragged 478: the offline workload's 478 sequences of 33 to 1,054 tokens, Llama-3-8B, one split): 138.3
  us a layer with the sequence as the fastest grid axis (as before 2026-12-01), 128.5 with this grid,
  122.2 with this grid and the longest first (3.3 -> 3.7 TB/s); offline, Llama-2-7B +1.9% and Llama-3-8B
  +2.3% (bench/results/h200-2026-12-01p/run5_grid_order).
- with `NewKV` the kernel takes q, k, v straight from the projection: it applies the rotary embedding
  itself, stores the new K/V in the cache and folds the new key in from registers (the split holding its
  position does, after its cached tiles), so the step has no rotary kernel and one kernel boundary less
  a layer; and, for a single sequence, each program reads its first tile of cached keys before it waits
  for the projection ahead (dependent launch: nothing the step writes is in it). Measured on an H200
  (Llama-2-7B decode step, 600-token contexts): one sequence 3.93 -> 3.81 ms; but batches ran slower
  (16 sequences 5.27 -> 5.68 ms, 256: 25.2 -> 27.2). The likely cause, found later: the fused variants
  take 136-140 registers a thread against 128 (Triton 3.6, sm_90), so 3 programs of 4 warps share a
  multiprocessor instead of 4; capped at 128 (`maxnreg`), fused batches ran as fast as the rotary kernel
  and this one, not faster (Llama-3-8B, h200-2026-12-02g run 2). So the attention backend fuses
  single-sequence steps only. Without `NewKV` the new key is the cache's, read with its tile.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from .attention_tile import LOG2E, attend_kv_tile, dot_precision, fold_kv_tile, load_kv_tile
from .rotary import rotate_rounded

# One sequence: a split reads about 1.5 tiles of keys or more (_tile_config: 64 at head_dim 128), and the
# context is cut into at most 8 pieces, or one per 256 tokens beyond 2,048: past that, the splits'
# prologues and the combine cost more than their parallelism gives. A batch: a split reads at least one
# tile (BATCH_TOKENS_PER_SPLIT).
MIN_TOKENS_PER_SPLIT = 96
TOKENS_PER_SPLIT_BEYOND_8 = 256
BATCH_TOKENS_PER_SPLIT = 64
MAX_SPLITS = 64


@functools.lru_cache(maxsize=None)
def _num_multiprocessors(device: torch.device) -> int:
    if device.type != "cuda":
        return 132  # NOTE: an H200's count; on the CPU (Triton's interpreter) it only sizes the test grids
    return torch.cuda.get_device_properties(device).multi_processor_count


def choose_num_splits(max_seq_len: int, num_seqs: int, num_heads: int, num_kv_heads: int,
                      device: torch.device) -> int:
    """Splits per sequence.

    One sequence: a power of two, enough for about two waves of programs (four when each KV head serves
    one query head: its programs are shorter, and more of them hide the memory latency), within the
    length limits above, and at least two from 256 tokens on. A batch, by its (sequence, KV head) pairs:
    fewer pairs than multiprocessors, enough splits for about four waves of programs (as many as its
    64-token pieces allow); then 4 splits, 2 from 3 pairs a multiprocessor, 1 from 7.

    NOTE: measured on an H200 (bf16). Alone (bench/decode_attention.py, Llama-2-7B and Llama-3-8B
    shapes, 1 to 16 sequences of equal length, 128 to 4096 tokens, every split count; results
    h200-2026-12-01m/run1) the power-of-two rule came within 0.8% of each case's best for one sequence
    and made single-stream Llama-2-7B 0.9% faster (278.2 -> 280.7 tok/s, ABBA order in one call). Batches
    are measured where they matter, on the offline workload's batches (`--ragged`: 8 to 320 sequences of
    very different lengths, longest first as the scheduler lists them; h200-2026-12-02f/run2): the best
    count falls with the pairs a multiprocessor, whatever the model. Llama-3-8B (8 KV heads): 1 split from
    128 sequences (7.8 pairs a multiprocessor; 255 sequences: 87.9 us against 100.5 with the 2 splits of
    the rule before), 2 at 63-95 (41.2 against 45.8 us with 4 at 63), 2 and 4 equal at 48 (2.9), 4 at 32
    (1.9); Llama-2-7B (32 KV heads): 1 split at 32 and 63 sequences (82.3 against 96.2 us with 4 at 32), 4
    at 8. At 5.8 pairs a multiprocessor 2 splits led 1 by 6%, at 7.8 1 led 2 by 3%: hence 7.
    """
    programs = num_seqs * num_kv_heads
    sms = _num_multiprocessors(device)
    if num_seqs > 1:
        if programs >= 7 * sms:
            return 1
        wanted = 2 if programs >= 3 * sms else 4 if programs >= sms else triton.cdiv(4 * sms, programs)
        return max(1, min(wanted, triton.cdiv(max_seq_len, BATCH_TOKENS_PER_SPLIT), MAX_SPLITS))
    if programs >= 2 * sms:
        return 1
    waves = 4 if num_heads == num_kv_heads else 2
    wanted = min(waves * sms / programs, max_seq_len / MIN_TOKENS_PER_SPLIT,
                 max(8, max_seq_len / TOKENS_PER_SPLIT_BEYOND_8), MAX_SPLITS)
    if max_seq_len >= 256:
        wanted = max(wanted, 2)
    return 1 << (int(max(1.0, wanted)).bit_length() - 1)  # the power of two at or below


def _tile_config(head_dim: int) -> tuple[int, int, int]:
    """(BLOCK_N keys per tile, num_warps, num_stages) of the split kernel.

    NOTE: measured on an H200 at head_dim 128: 64 keys, 4 warps, 2 stages led or tied 128 keys, 32 keys,
    3 stages and 8 warps on every batch shape tried.
    """
    return (64 if head_dim <= 128 else 32), 4, 2


@triton.jit
def _load_pairs(x_ptr, offsets, partner_offsets, mask):
    """x and roll(x, HEAD_DIM / 2) along the head dimension, float32: rotary.rotate_rounded's operands."""
    x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    return x, tl.load(x_ptr + partner_offsets, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _fold_key(acc, m_i, l_i, q, k, v, qk_scale):
    """fold_kv_tile for a single key k [HEAD_DIM] and value v [HEAD_DIM]: no tensor-core tile for one."""
    s = tl.sum(q.to(tl.float32) * k.to(tl.float32)[None, :], axis=1) * qk_scale  # [GROUP_PAD]
    m_new = tl.maximum(m_i, s)
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new)
    l_i = l_i * alpha + p
    acc = acc * alpha[:, None] + p[:, None] * v.to(tl.float32)[None, :]
    return acc, m_new, l_i


@triton.jit(do_not_specialize=["num_splits", "stride_bt"])  # NOTE: per-step values; see paged_prefill.py
def _decode_split_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr,
    out_ptr, part_out_ptr, part_max_ptr, part_sum_ptr, counter_ptr,
    k_new_ptr, v_new_ptr, slot_mapping_ptr, cos_ptr, sin_ptr,
    qk_scale, num_splits, num_heads, num_kv_heads,
    stride_qs, stride_qh, stride_kns, stride_knh, stride_vns, stride_vnh, stride_cos,
    stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
    stride_bt, stride_os, stride_oh,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr, SINGLE_SPLIT: tl.constexpr, ROTARY: tl.constexpr, DOT_PRECISION: tl.constexpr,
    USE_PDL: tl.constexpr, EARLY_TILE: tl.constexpr, COMBINE_ROWS: tl.constexpr, COMBINE_SPLITS: tl.constexpr,
):
    # NOTE: the grid is (split, KV head, sequence), the split fastest: the GPU starts programs in about
    # that order, so each sequence's programs start together, the first sequences' first (module docstring)
    split = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    new_pos = seq_len - 1  # NOTE: the new token is the context's last (decode: one new token)
    # NOTE: each sequence is cut into num_splits pieces of whole tiles; the last pieces may be empty
    split_len = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    num_filled = tl.cdiv(seq_len, split_len)  # the splits that hold keys: 1..num_splits
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)
    if ROTARY:  # the new key comes from the projection, apart from the cached ones (which end before it)
        kv_end = tl.minimum(end, new_pos)
    else:  # NOTE: the kernel ahead stored the new key: it is read from the cache like the others
        kv_end = end
    table_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bt
    dims = tl.arange(0, HEAD_DIM)
    if ROTARY:
        # the tables' rows at the new position, rounded to the activations' dtype as the torch path does
        dtype = q_ptr.dtype.element_ty
        table_row = new_pos.to(tl.int64) * stride_cos + dims
        cos = tl.load(cos_ptr + table_row).to(dtype).to(tl.float32)
        sin = tl.load(sin_ptr + table_row).to(dtype).to(tl.float32)
        sin_signed = tl.where(dims < HEAD_DIM // 2, -sin, sin)  # rotate_half's sign
        partner = (dims + HEAD_DIM // 2) % HEAD_DIM
        slot = tl.load(slot_mapping_ptr + seq)  # int64
    if EARLY_TILE:
        # The first tile of cached keys, read before the wait: no kernel of this step writes them (the new
        # token's K/V come apart, below), so these loads overlap the kernel ahead.
        tl.static_assert(ROTARY, "without ROTARY the kernel ahead writes the new key into a tile")
        k_first, v_first = load_kv_tile(start, kv_end, k_cache_ptr, v_cache_ptr, table_ptr, kv_head, stride_kb,
                                        stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, BLOCK_SIZE, BLOCK_N,
                                        HEAD_DIM, True)
    if USE_PDL:
        # NOTE: launched before the kernel ahead ends (the q/k/v projection with ROTARY, else the rotary
        # kernel, which stores the new token's K/V). Until gdc_wait it read only the step's inputs (lengths,
        # tables, slots), the rotary tables and older cache entries; q and the new K/V only after it.
        gdc_wait()
        gdc_launch_dependents()

    rows = tl.arange(0, GROUP_PAD)
    row_valid = rows < GROUP
    heads = kv_head * GROUP + rows  # [GROUP_PAD]
    # partials: [num_seqs, num_heads, num_splits(, HEAD_DIM)], contiguous
    parts = (seq * num_heads + heads) * num_splits  # [GROUP_PAD], split 0 of each head
    if split < num_filled:
        q_rows = seq * stride_qs + heads[:, None] * stride_qh  # [GROUP_PAD, 1]
        if ROTARY:  # q, k, v are the projection's: rotate q and k here; store k and v in the cache
            q_x, q_partner = _load_pairs(q_ptr, q_rows + dims[None, :], q_rows + partner[None, :], row_valid[:, None])
            # NOTE: the new key and value are asked for now, so their loads overlap the tiles (folded last)
            k_row = seq * stride_kns + kv_head * stride_knh
            k_x, k_partner = _load_pairs(k_new_ptr, k_row + dims, k_row + partner, dims < HEAD_DIM)
            v_new = tl.load(v_new_ptr + seq * stride_vns + kv_head * stride_vnh + dims)
            q = rotate_rounded(q_x, q_partner, cos[None, :], sin_signed[None, :], dtype)  # [GROUP_PAD, HEAD_DIM]
        else:
            q = tl.load(q_ptr + q_rows + dims[None, :], mask=row_valid[:, None], other=0.0)
        q_pos = tl.zeros([GROUP_PAD], tl.int32) + kv_end - 1  # every row sees every cached key of the split

        acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
        m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([GROUP_PAD], tl.float32)
        rest = start
        if EARLY_TILE:
            if kv_end > start:  # NOTE: only the last split may hold no cached key (when the new one opens it)
                acc, m_i, l_i = fold_kv_tile(acc, m_i, l_i, q, q_pos, k_first, v_first, start, qk_scale, BLOCK_N,
                                             True, DOT_PRECISION)
            rest = start + BLOCK_N
        full_end = rest + tl.maximum(kv_end - rest, 0) // BLOCK_N * BLOCK_N  # whole tiles need no mask
        for tile in range(rest, full_end, BLOCK_N):
            acc, m_i, l_i = attend_kv_tile(
                acc, m_i, l_i, q, q_pos, tile, kv_end, k_cache_ptr, v_cache_ptr, table_ptr, kv_head,
                stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, qk_scale,
                BLOCK_SIZE, BLOCK_N, HEAD_DIM, False, DOT_PRECISION,
            )
        if full_end < kv_end:  # the ragged last tile
            acc, m_i, l_i = attend_kv_tile(
                acc, m_i, l_i, q, q_pos, full_end, kv_end, k_cache_ptr, v_cache_ptr, table_ptr, kv_head,
                stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, qk_scale,
                BLOCK_SIZE, BLOCK_N, HEAD_DIM, True, DOT_PRECISION,
            )
        if ROTARY:
            if split == num_filled - 1:  # the split holding the new position
                k_new = rotate_rounded(k_x, k_partner, cos, sin_signed, dtype)
                if slot >= 0:  # NOTE: a negative slot is a padding row (a CUDA graph's): its K/V land nowhere
                    block = slot // BLOCK_SIZE
                    offset = slot % BLOCK_SIZE
                    tl.store(k_cache_ptr + block * stride_kb + offset * stride_kt + kv_head * stride_kh + dims,
                             k_new.to(k_cache_ptr.dtype.element_ty))
                    tl.store(v_cache_ptr + block * stride_vb + offset * stride_vt + kv_head * stride_vh + dims,
                             v_new.to(v_cache_ptr.dtype.element_ty))
                acc, m_i, l_i = _fold_key(acc, m_i, l_i, q, k_new, v_new, qk_scale)
        if SINGLE_SPLIT:
            out = acc / l_i[:, None]
            tl.store(out_ptr + seq * stride_os + heads[:, None] * stride_oh + dims[None, :],
                     out.to(out_ptr.dtype.element_ty), mask=row_valid[:, None])
        else:
            part = parts + split
            tl.store(part_out_ptr + part[:, None] * HEAD_DIM + dims[None, :], acc, mask=row_valid[:, None])
            tl.store(part_max_ptr + part, m_i, mask=row_valid)
            tl.store(part_sum_ptr + part, l_i, mask=row_valid)

    if not SINGLE_SPLIT and split < num_filled:
        # NOTE: the barrier orders every thread's partial stores before the count (one thread counts);
        # the atomic is acquire-release at GPU scope, so the last split, which reads every count, sees
        # every partial. Only the filled splits count (every program of the pair derives the same
        # num_filled): an empty one, common in a CUDA graph sized for a longer context, just ends.
        tl.debug_barrier()
        counter = counter_ptr + seq * num_kv_heads + kv_head
        if tl.atomic_add(counter, 1) == num_filled - 1:
            _combine_splits(part_out_ptr, part_max_ptr, part_sum_ptr, out_ptr, num_filled, num_splits, seq, kv_head,
                            num_heads, stride_os, stride_oh, GROUP, COMBINE_ROWS, COMBINE_SPLITS, HEAD_DIM)
            tl.store(counter, 0)  # ready for the next launch (the next layer)


@triton.jit
def _combine_splits(part_out_ptr, part_max_ptr, part_sum_ptr, out_ptr, num_filled, num_splits, seq, kv_head,
                    num_heads, stride_os, stride_oh, GROUP: tl.constexpr, ROWS: tl.constexpr,
                    SPLITS: tl.constexpr, HEAD_DIM: tl.constexpr):
    """out = sum_s exp2(m_s - M) * acc_s / sum_s exp2(m_s - M) * l_s over the filled splits, M their max,
    for the GROUP query heads of this KV head (ROWS: GROUP padded to a power of two).

    Why this shape: the partials are read SPLITS at a time, each array with one load, so their round trips
    to L2 overlap; a loop with one split per iteration waited for each in turn (2 x splits L2 latencies
    on the critical path of every layer's attention at batch 1). Chunks fold in like flash attention's
    tiles (running max, rescaled sums).
    NOTE: the partials are read through L2 (`.cg`): other programs wrote them, this SM's L1 may be stale.
    """
    rows = tl.arange(0, ROWS)
    row_valid = rows < GROUP
    heads = kv_head * GROUP + rows  # [ROWS]
    parts = (seq * num_heads + heads) * num_splits  # [ROWS]: split 0 of each head
    splits = tl.arange(0, SPLITS)
    dims = tl.arange(0, HEAD_DIM)
    m_run = tl.full([ROWS], float("-inf"), tl.float32)
    total = tl.zeros([ROWS], tl.float32)
    out = tl.zeros([ROWS, HEAD_DIM], tl.float32)
    for first in range(0, num_filled, SPLITS):
        index = parts[:, None] + (first + splits)[None, :]  # [ROWS, SPLITS]
        valid = row_valid[:, None] & (first + splits < num_filled)[None, :]
        m = tl.load(part_max_ptr + index, mask=valid, other=float("-inf"), cache_modifier=".cg")
        m = tl.where(row_valid[:, None], m, 0.0)  # NOTE: padding rows stay finite (no inf - inf)
        l = tl.load(part_sum_ptr + index, mask=valid, other=0.0, cache_modifier=".cg")
        acc = tl.load(part_out_ptr + index[:, :, None] * HEAD_DIM + dims[None, None, :], mask=valid[:, :, None],
                      other=0.0, cache_modifier=".cg")  # [ROWS, SPLITS, HEAD_DIM]
        m_new = tl.maximum(m_run, tl.max(m, axis=1))  # NOTE: every chunk holds a filled split: finite
        alpha = tl.exp2(m_run - m_new)
        weight = tl.exp2(m - m_new[:, None])  # [ROWS, SPLITS]; 0 for the splits masked out
        total = total * alpha + tl.sum(weight * l, axis=1)
        out = out * alpha[:, None] + tl.sum(acc * weight[:, :, None], axis=1)
        m_run = m_new
    out = out / tl.where(row_valid, total, 1.0)[:, None]
    tl.store(out_ptr + seq * stride_os + heads[:, None] * stride_oh + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_valid[:, None])


@dataclass(frozen=True)
class NewKV:
    """A decode step's new keys and values as the q/k/v projection made them, before the rotary
    embedding: given these, the attention kernel rotates q and k itself (each token at position
    seq_len - 1), stores k and v in their cache slots and attends with them, so no rotary kernel (and no
    kernel boundary) comes between the projection and the attention."""

    k: torch.Tensor  # [num_seqs, num_kv_heads, head_dim], may be a strided view (a split of qkv)
    v: torch.Tensor  # [num_seqs, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor  # [num_seqs] int64; < 0 (padding) stores nothing
    cos: torch.Tensor  # [max_pos, head_dim] float32, the model's tables (cat(freqs, freqs))
    sin: torch.Tensor


def paged_decode_attention(
    q: torch.Tensor,  # [num_seqs, num_heads, head_dim], one query token per sequence
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32, context length including the new token (>= 1)
    scale: float,
    num_splits: int | None = None,
    split_counters: torch.Tensor | None = None,
    pdl: bool = False,
    new_kv: NewKV | None = None,
    tile: tuple[int, int, int] | None = None,
) -> torch.Tensor:
    """Attention of each sequence's newest token over its whole paged context: [num_seqs, heads, head_dim].

    Without `new_kv` the new token's K/V are already in the cache and q is rotated; with it, q is the
    projection's (not yet rotated) and the kernel rotates and stores (NewKV says how).
    num_splits=None derives the split count from the block tables' width (an upper bound on the longest
    context that needs no device sync); callers that know the lengths on the host pass
    `choose_num_splits(max(seq_lens), ...)`. `split_counters`: at least num_seqs x num_kv_heads int32
    zeros, left zero after the call (a caller's persistent buffer saves a memset per call; None allocates).
    `pdl`: launch as a programmatic dependent of the kernel before (kernels/gemv.py says why). With
    `new_kv` and a single sequence each program also reads its first K/V tile before that wait (only the
    one-row projection ahead lets its dependents start early, gemv.py). `tile`: (keys per tile, warps,
    stages) instead of the tuned `_tile_config` (bench/decode_attention.py --tile-sweep compares them).
    """
    num_seqs, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    assert num_heads % num_kv_heads == 0, "query heads must be a multiple of KV heads"
    assert head_dim >= 16 and head_dim & (head_dim - 1) == 0, "head_dim must be a power of two >= 16"
    assert q.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    assert k_cache.stride() == v_cache.stride()
    out = torch.empty(num_seqs, num_heads, head_dim, dtype=q.dtype, device=q.device)
    if num_seqs == 0:
        return out
    if num_splits is None:
        num_splits = choose_num_splits(block_tables.shape[1] * block_size, num_seqs, num_heads, num_kv_heads,
                                       q.device)
    group = num_heads // num_kv_heads
    group_pad = max(16, triton.next_power_of_2(group))  # NOTE: tl.dot needs >= 16 rows
    block_n, num_warps, num_stages = tile or _tile_config(head_dim)
    # the combine reads COMBINE_SPLITS partials of COMBINE_ROWS heads at once: 4,096 float32 values, 32
    # registers a thread at 4 warps (NOTE: fixed per shape, not per split count: no variant per step)
    combine_rows = triton.next_power_of_2(group)
    combine_splits = max(1, min(MAX_SPLITS, 4096 // (combine_rows * head_dim)))
    single = num_splits == 1
    if single:  # NOTE: unused by the kernel, but it needs pointers
        part_out = part_max = part_sum = counters = out
    else:
        part_out = torch.empty(num_seqs, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
        part_max = torch.empty(num_seqs, num_heads, num_splits, dtype=torch.float32, device=q.device)
        part_sum = torch.empty_like(part_max)
        counters = split_counters
        if counters is None:
            counters = torch.zeros(num_seqs * num_kv_heads, dtype=torch.int32, device=q.device)
        assert counters.dtype == torch.int32 and counters.numel() >= num_seqs * num_kv_heads
    if new_kv is None:  # NOTE: unused by the kernel, but it needs pointers and strides
        k_new = v_new = q
        slots, cos, sin = seq_lens, part_max, part_max
    else:
        k_new, v_new, slots, cos, sin = new_kv.k, new_kv.v, new_kv.slot_mapping, new_kv.cos, new_kv.sin
        assert k_new.stride(-1) == 1 and v_new.stride(-1) == 1 and cos.stride() == sin.stride()
        assert cos.stride(-1) == 1 and cos.shape[-1] == head_dim
    _decode_split_kernel[(num_splits, num_kv_heads, num_seqs)](
        q, k_cache, v_cache, block_tables, seq_lens,
        out, part_out, part_max, part_sum, counters,
        k_new, v_new, slots, cos, sin,
        scale * LOG2E, num_splits, num_heads, num_kv_heads,
        q.stride(0), q.stride(1), k_new.stride(0), k_new.stride(1), v_new.stride(0), v_new.stride(1),
        cos.stride(0),
        *k_cache.stride()[:3], *v_cache.stride()[:3],
        block_tables.stride(0), out.stride(0), out.stride(1),
        GROUP=group, GROUP_PAD=group_pad, HEAD_DIM=head_dim, BLOCK_SIZE=block_size, BLOCK_N=block_n,
        SINGLE_SPLIT=single, ROTARY=new_kv is not None, DOT_PRECISION=dot_precision(q.dtype), USE_PDL=pdl,
        EARLY_TILE=new_kv is not None and num_seqs == 1, COMBINE_ROWS=combine_rows, COMBINE_SPLITS=combine_splits,
        launch_pdl=pdl, num_warps=num_warps, num_stages=num_stages,
        # NOTE: the fused rotary's products are rounded as torch rounds them (rotary.py); the cache path keeps
        # the fused multiply-adds (a 256-sequence Llama-2-7B decode step ran 0.7-1.3% slower without them)
        enable_fp_fusion=new_kv is None,
    )
    return out


def paged_decode_attention_ref(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    seq_lens: torch.Tensor, scale: float, new_kv: NewKV | None = None,
) -> torch.Tensor:
    """The same function in plain torch (float32 math): decode is prefill with one query per sequence;
    with `new_kv`, the model's own rotary embedding and cache write come first (they fill the caches)."""
    from .paged_prefill import paged_prefill_attention_ref
    from .rotary import rotary_and_store_kv_ref

    num_seqs = q.shape[0]
    if new_kv is not None:
        positions = seq_lens.long() - 1
        q = rotary_and_store_kv_ref(q, new_kv.k, new_kv.v, k_cache, v_cache, new_kv.slot_mapping, positions,
                                    new_kv.cos, new_kv.sin)
    query_start_loc = torch.arange(num_seqs + 1, dtype=torch.int32, device=q.device)
    return paged_prefill_attention_ref(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, 1, scale)
