"""Decode steps replayed from CUDA graphs: one graph per batch size of a ladder, padded up to the next.

A decode step of a small model is hundreds of kernel launches whose host-side cost (Triton's launcher
especially) dwarfs the GPU time; replaying a captured graph costs one launch. Every graph reads its
inputs from the same static buffers, which the runner fills before each replay.

NOTE: invariants that make a padded replay safe:
- padding rows have slot -1 (the cache write skips them), context length 1 and position 0, and their
  outputs are dropped; they read valid (if stale) cache memory and never write it;
- graphs were captured with the block-table width of `max_model_len`; each batch size has a graph for
  contexts up to SHORT_CONTEXT (one split: decode attention needs no combine step, which is most of a
  small model's attention time) and one for contexts up to `max_model_len` (split count chosen for that
  length), and a step replays the first whose bound covers its longest context;
- the KV cache is allocated before capture and never reallocated (graphs hold its addresses).
"""

from __future__ import annotations

import logging
import time

import torch

from .attention import AttentionMetadata

logger = logging.getLogger(__name__)

SHORT_CONTEXT = 1024  # tokens: one program reads that much of a KV head in a few microseconds


def batch_size_ladder(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then steps of 8 to 64, then of 16 to 256, then of 32: padding stays under ~15%."""
    sizes = [1, 2, 4]
    size = 8
    while size <= max_batch:
        sizes.append(size)
        size += 8 if size < 64 else 16 if size < 256 else 32
    return [s for s in sizes if s <= max_batch] or [1]


class DecodeGraphs:
    def __init__(self, model, kv_caches, *, max_batch: int, max_model_len: int, block_size: int,
                 device: torch.device) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.max_model_len = max_model_len
        self.sizes = batch_size_ladder(max_batch)
        top = self.sizes[-1]
        max_blocks = -(-max_model_len // block_size)

        def buffer(*shape, fill=0, dtype=torch.int32):
            return torch.full(shape, fill, dtype=dtype, device=device)

        # device buffers the graphs read; pinned host twins so each step's inputs go up asynchronously
        self.input_ids = buffer(top, dtype=torch.int64)
        self.positions = buffer(top, dtype=torch.int64)
        self.slot_mapping = buffer(top, fill=-1, dtype=torch.int64)
        self.seq_lens = buffer(top, fill=1)
        self.block_tables = buffer(top, max_blocks)
        self.host = {name: torch.zeros_like(getattr(self, name), device="cpu").pin_memory()
                     for name in ("input_ids", "positions", "slot_mapping", "seq_lens", "block_tables")}
        self.query_start_loc = torch.arange(top + 1, dtype=torch.int32, device=device)
        self.rows = torch.arange(top, dtype=torch.int64, device=device)
        # NOTE: the host twins are rewritten only after the device has read them for the previous step
        self.inputs_copied = torch.cuda.Event()
        self.context_bounds = sorted({min(SHORT_CONTEXT, max_model_len), max_model_len})
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.capture_seconds = 0.0

    def _metadata(self, batch: int, context_bound: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:batch],
            query_start_loc=self.query_start_loc[: batch + 1],
            seq_lens=self.seq_lens[:batch],
            block_tables=self.block_tables[:batch],
            query_lens_host=(1,) * batch,
            seq_lens_host=(context_bound,) * batch,
            decode_indices=self.rows[:batch],
            decode_token_indices=self.rows[:batch],
            decode_indices_host=tuple(range(batch)),
            decode_num_splits=1 if context_bound < self.max_model_len else None,
        )

    @torch.inference_mode()
    def capture(self) -> None:
        start = time.perf_counter()
        pool = None
        # largest first: the smaller graphs reuse its memory pool
        for batch in reversed(self.sizes):
            for bound in reversed(self.context_bounds):
                meta = self._metadata(batch, bound)
                args = (self.input_ids[:batch], self.positions[:batch], self.kv_caches, meta)
                for _ in range(2):  # warm-up: compiles the kernels, settles the allocator
                    self.model(*args)
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    out = self.model(*args)
                pool = graph.pool()
                self.graphs[batch, bound] = (graph, out)
        torch.cuda.synchronize()
        self.capture_seconds = time.perf_counter() - start
        logger.info("captured %d decode graphs (batch 1..%d, contexts up to %s) in %.1f s", len(self.graphs),
                    self.sizes[-1], self.context_bounds, self.capture_seconds)

    def fits(self, num_seqs: int) -> bool:
        return num_seqs <= self.sizes[-1]

    def run(self, input_ids: list[int], positions: list[int], slot_mapping: list[int], seq_lens: list[int],
            block_tables: list[list[int]], pending=None) -> torch.Tensor:
        """One decode step of n sequences: [n, hidden] (before the final norm) from the padded graph.
        `pending` (PendingInputs) fills the input ids still on the device."""
        n = len(input_ids)
        self.inputs_copied.synchronize()
        batch = next(size for size in self.sizes if size >= n)
        width = len(block_tables[0])
        pad = batch - n
        # NOTE: padding rows write nowhere (slot -1) and attend to one token at position 0
        values = {
            "input_ids": input_ids + [0] * pad,
            "positions": positions + [0] * pad,
            "slot_mapping": slot_mapping + [-1] * pad,
            "seq_lens": seq_lens + [1] * pad,
        }
        for name, row in values.items():
            self.host[name][:batch].copy_(torch.tensor(row, dtype=self.host[name].dtype))
            getattr(self, name)[:batch].copy_(self.host[name][:batch], non_blocking=True)
        self.host["block_tables"][:n, :width].copy_(torch.tensor(block_tables, dtype=torch.int32))
        self.block_tables[:n, :width].copy_(self.host["block_tables"][:n, :width], non_blocking=True)
        self.inputs_copied.record()
        if pending is not None:
            pending.apply(self.input_ids)
        bound = next(b for b in self.context_bounds if b >= max(seq_lens))
        graph, out = self.graphs[batch, bound]
        graph.replay()
        return out[:n]
