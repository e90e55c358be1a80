"""The small per-step kernels around a decode step's model: the greedy choice of each row's token, and the
input ids a step takes from the step before it (on the device, never through the host).

Why kernels: under the torch profiler a Llama-2-7B single-stream step spent ~60 us of its 3.6 ms on an
H200 outside the model (2026-12-01): torch's argmax reduced a row in one block of threads (10 us for
32,000 logits, more for 128,256), after a conversion of the logits to float32 (4 us); the pending input ids
took an index_select and an index_copy_ besides their upload. `argmax` reads the 16-bit logits as they are
(the conversion is exact and monotonic: the same token), in chunks of a row; `fill_pending_ids` runs
first in every step, inside the graphs (cuda_graphs.py). Without the profiler the gain is small
(BENCHMARKS.md, fourteenth session).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _argmax_chunk_kernel(logits_ptr, best_ptr, best_col_ptr, out_ptr, stride, vocab, num_chunks,
                         CHUNK: tl.constexpr, BLOCK: tl.constexpr, WHOLE_ROW: tl.constexpr):
    """Program (row, chunk): the chunk's best value and its first column (WHOLE_ROW: one chunk a row, whose
    column is the row's token, stored in `out`). Each lane keeps the best value it saw and its first
    column, then the best lane with the smallest column wins (torch's rule: the first maximal index).
    NOTE: NaN counts as +inf."""
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    lanes = tl.arange(0, BLOCK)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_col = tl.full([BLOCK], 2**31 - 1, tl.int32)
    for start in range(chunk * CHUNK, chunk * CHUNK + CHUNK, BLOCK):
        cols = start + lanes
        x = tl.load(logits_ptr + row * stride + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32)
        x = tl.where(x != x, float("inf"), x)
        better = (x > best) | ((best_col == 2**31 - 1) & (cols < vocab))  # NOTE: a lane's first column counts
        best = tl.where(better, x, best)
        best_col = tl.where(better, cols, best_col)
    top = tl.max(best, axis=0)
    first = tl.min(tl.where(best == top, best_col, 2**31 - 1), axis=0)
    if WHOLE_ROW:
        tl.store(out_ptr + row, first.to(tl.int64))
    else:
        tl.store(best_ptr + row * num_chunks + chunk, top)
        tl.store(best_col_ptr + row * num_chunks + chunk, first)


@triton.jit
def _argmax_combine_kernel(best_ptr, best_col_ptr, out_ptr, num_chunks, CHUNKS: tl.constexpr):
    """Program per row: the first chunk holding the row's best value has its first maximal column."""
    row = tl.program_id(0).to(tl.int64)
    chunks = tl.arange(0, CHUNKS)
    mask = chunks < num_chunks
    best = tl.load(best_ptr + row * num_chunks + chunks, mask=mask, other=float("-inf"))
    cols = tl.load(best_col_ptr + row * num_chunks + chunks, mask=mask, other=2**31 - 1)
    top = tl.max(best, axis=0)
    tl.store(out_ptr + row, tl.min(tl.where(best == top, cols, 2**31 - 1), axis=0).to(tl.int64))


# rows of at least CHUNKED_VOCAB logits go in chunks of ARGMAX_CHUNK (8 KB in 16-bit), tiles of ARGMAX_BLOCK
CHUNKED_VOCAB, ARGMAX_CHUNK, ARGMAX_BLOCK = 65536, 4096, 2048


def argmax(logits: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """logits: [rows, vocab] (any float dtype) -> [rows] int64, each row's first maximal column.

    Why chunks for big vocabularies: one program a row walks the row a tile at a time, each tile's load
    waiting for the one before: Llama-3-8B's 128,256 logits took 16-18 us a step of 1 to 50 rows on an
    H200 (2026-12-02 profile), in chunks 3-4.5 us plus a 1 us second kernel that picks each row's first
    chunk holding the best. NOTE: smaller vocabularies (32,000, 49,152: 5 us a row) keep one launch of
    one program a row: the second launch's host time slowed the host-bound SmolLM2 single stream (1,677
    and 1,765 tok/s with one launch, 1,417 and 1,440 with two; same call, 2026-12-02)."""
    rows, vocab = logits.shape
    assert logits.stride(1) == 1 and vocab < 2**31 - 1
    out = torch.empty(rows, dtype=torch.int64, device=logits.device) if out is None else out
    assert out.shape == (rows,) and out.dtype == torch.int64
    if not rows:
        return out
    if vocab < CHUNKED_VOCAB:
        block = min(8192, triton.next_power_of_2(vocab))
        _argmax_chunk_kernel[(rows, 1)](logits, out, out, out, logits.stride(0), vocab, 1,
                                        CHUNK=triton.cdiv(vocab, block) * block, BLOCK=block, WHOLE_ROW=True,
                                        num_warps=min(16, max(1, block // 512)))
        return out
    num_chunks = triton.cdiv(vocab, ARGMAX_CHUNK)
    best = torch.empty(rows, num_chunks, dtype=torch.float32, device=logits.device)
    best_col = torch.empty(rows, num_chunks, dtype=torch.int32, device=logits.device)
    _argmax_chunk_kernel[(rows, num_chunks)](logits, best, best_col, out, logits.stride(0), vocab, num_chunks,
                                             CHUNK=ARGMAX_CHUNK, BLOCK=ARGMAX_BLOCK, WHOLE_ROW=False, num_warps=4)
    _argmax_combine_kernel[(rows,)](best, best_col, out, num_chunks, CHUNKS=triton.next_power_of_2(num_chunks),
                                    num_warps=1)
    return out


def argmax_ref(logits: torch.Tensor) -> torch.Tensor:
    return logits.argmax(dim=-1)


@triton.jit(do_not_specialize=["n"])  # NOTE: per-step values (see swiglu_gemm.py)
def _fill_pending_kernel(ids_ptr, src_ptr, sampled_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = i < n
    src = tl.load(src_ptr + i, mask=mask, other=-1)
    token = tl.load(sampled_ptr + tl.maximum(src, 0), mask=mask & (src >= 0), other=0)
    tl.store(ids_ptr + i, token, mask=mask & (src >= 0))


def fill_pending_ids(input_ids: torch.Tensor, pending_src: torch.Tensor, sampled: torch.Tensor) -> None:
    """input_ids[i] = sampled[pending_src[i]] where pending_src[i] >= 0 (in place; [n] int64 each): the
    inputs sampled by the step before, which the host has not read yet. One program up to 1,024 ids (a
    decode step's), more for a prefill-sized step's."""
    n = input_ids.shape[0]
    assert pending_src.shape == (n,) and input_ids.dtype == sampled.dtype == torch.int64
    if n:
        block = fill_block(n)
        _fill_pending_kernel[(triton.cdiv(n, block),)](input_ids, pending_src, sampled, n, BLOCK=block)


FILL_MAX_BLOCK = 1024


def fill_block(n: int) -> int:
    """The ids one program of `fill_pending_ids` takes for a call of n ids (a compiled variant each)."""
    return min(FILL_MAX_BLOCK, triton.next_power_of_2(n))


def compile_fill_pending_ids(max_ids: int, sampled: torch.Tensor) -> None:
    """Run `fill_pending_ids` once at every block size a call of at most `max_ids` ids takes (filling
    nothing), so that no step compiles or loads a variant while serving. NOTE: the decode graphs capture
    the sizes of their ladder, but a prefill-sized eager step's 1,024-id block was met only in the first
    such step (bench/serve.py's `triton_compiles_in_run`, H200, 2026-12-02)."""
    n = 1
    while True:
        ids = torch.zeros(n, dtype=torch.int64, device=sampled.device)
        fill_pending_ids(ids, torch.full_like(ids, -1), sampled)
        if n >= min(max_ids, FILL_MAX_BLOCK):  # NOTE: past the largest block, every count takes it
            return
        n = min(2 * n, max_ids)


def fill_pending_ids_ref(input_ids: torch.Tensor, pending_src: torch.Tensor, sampled: torch.Tensor) -> None:
    taken = pending_src >= 0
    input_ids[taken] = sampled[pending_src[taken]]
