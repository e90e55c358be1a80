"""Steps replayed from CUDA graphs: decode steps, one graph per batch size of a ladder, padded up to the
next (or further, where a bigger graph replays much faster: `faster_graph_sizes`); and small mixed steps
(prefill chunks with decodes), one graph per token count of a ladder.

A step of the model is hundreds of kernel launches whose host-side cost (Triton's launcher especially)
exceeds the GPU time of all but big steps: on an H200 the Llama-2-7B forward takes the host 11 to 17 ms to
launch, eagerly, against 4 to 11 ms of device work for up to ~500 tokens (bench/mixed_step.py); replaying a
captured graph costs one launch. Every graph reads its inputs from static buffers, which the runner
fills before each replay.

NOTE: invariants that make a padded replay safe:
- padding rows have slot -1 (the cache write skips them), context length 1 and position 0, and their
  outputs are dropped; they read valid (if stale) cache memory and never write it;
- graphs were captured with the block-table width of `max_model_len`; each batch size has a graph for
  contexts up to SHORT_CONTEXT and one for contexts up to `max_model_len`, the decode attention's split
  count chosen for that bound (fewer splits for short contexts: less for the last split to combine), and
  a step replays the first whose bound covers its longest context;
- the KV cache is allocated before capture and never reallocated (graphs hold its addresses).
Mixed graphs (MixedGraphs) pad the same way, and their attention is the varlen prefill kernel's:
- the step's sequences come first; a padding sequence owns the padding tokens (slot -1, its context is its
  own queries, read through a table row of valid block ids), and the rest of the captured sequence slots
  hold no queries and no context (each owns one spare tile of the kernel's flat grid, which exits);
- the kernel's grid and tiles were fixed at capture for the graph's token count and sequence capacity.
"""

from __future__ import annotations

import functools
import logging
import math
import time

import torch

from .attention import AttentionMetadata
from .transfer import ALIGNMENT_BYTES

logger = logging.getLogger(__name__)

SHORT_CONTEXT = 1024  # tokens: one program reads that much of a KV head in a few microseconds


def batch_size_ladder(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then steps of 8 to 64, then of 16 to 256, then of 32: a batch is padded by at most 7, 15
    or 31 rows."""
    sizes = [1, 2, 4]
    size = 8
    while size <= max_batch:
        sizes.append(size)
        size += 8 if size < 64 else 16 if size < 256 else 32
    return [s for s in sizes if s <= max_batch] or [1]


# a bigger decode graph serves a batch only when it replayed at least this much faster than the batch's own
# at start-up. NOTE: not a few per cent: short replays on an idle GPU favour padding more than sustained
# load does. Llama-3-8B's 416 graph replayed 6% slower than its 480 graph at start-up, yet its offline
# steps of 385-416 sequences ran ~1 ms (6%) faster on their own graph than on the 480 one; its 448 graph
# replayed 35% slower than the 480 one, and its steps of 417-448 sequences ran ~2 ms (10-15%) faster on
# the 480 graph (H200, 2026-12-01).
FASTER_GRAPH_MARGIN = 0.15
# smaller batches are bound by reading the weights, whatever GEMM kernel runs: their graphs are not timed
MIN_TIMED_BATCH = 128


def faster_graph_sizes(sizes: list[int], replay_ms: list[float], margin: float = FASTER_GRAPH_MARGIN) -> dict[int, int]:
    """For each size with a replay time, the size of the graph its batches replay: the fastest of itself and
    the bigger sizes, if that is faster than its own by more than `margin`, else itself.

    Why: cuBLAS picks a GEMM kernel per row count, and some counts get a slow one. On an H200 (2026-12-01,
    bench/gemm.py) Llama-3-8B's gate/up projection ran at 380 TFLOP/s on 448 rows against 655 on 512, so
    a batch of 448 sequences finished sooner padded to 480; no rule of thumb predicts which counts, so
    the replays at start-up are timed (`DecodeGraphs.time_replays`)."""
    assert len(sizes) == len(replay_ms) and sizes == sorted(sizes)
    chosen = {}
    for i, size in enumerate(sizes):
        fastest = min(range(i, len(sizes)), key=lambda j: (replay_ms[j], j))
        chosen[size] = sizes[fastest] if replay_ms[fastest] < replay_ms[i] * (1 - margin) else size
    return chosen


def mixed_token_ladder(max_tokens: int) -> list[int]:
    """Token counts of the mixed graphs: 32, 64, ... up to `max_tokens` (padding under 32 tokens, which costs
    little: below a few hundred rows a 7B step is bound by its weights, not by its tokens)."""
    return list(range(32, max_tokens + 1, 32))


def _model_step(model, inputs: "_StaticInputs", sampled: torch.Tensor, num_tokens: int, kv_caches,
                metadata: AttentionMetadata) -> torch.Tensor:
    """What a graph replays: the pending input ids filled in from `sampled` (the runner's buffer of the
    step before's token ids), then the model over the first `num_tokens` tokens of the static inputs."""
    from .kernels.tokens import fill_pending_ids

    fill_pending_ids(inputs.input_ids[:num_tokens], inputs.pending_src[:num_tokens], sampled)
    return model(inputs.input_ids[:num_tokens], inputs.positions[:num_tokens], kv_caches, metadata)


def _capture(step, pool, stream: torch.cuda.Stream) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """`step()`: the work the graph replays, returning its output; captured on `stream`, the runner's own.

    Why not torch's default capture stream, one per process: cuBLAS's workspaces are cached per (handle,
    stream), so graphs captured on one stream share one, and destroying a graph releases its stream's
    (pytorch/pytorch#193402): an engine's graphs, freed while another engine of the process captures or
    replays, can pull the workspace from under it. The likely cause of the GPU test that builds six
    engines failing twice in ~10 suite runs (CUBLAS_STATUS_EXECUTION_FAILED while capturing; intermittent,
    so not proven). A runner's graphs (decode and mixed, one memory pool) live and die together."""
    for _ in range(2):  # warm-up: compiles the kernels, settles the allocator
        step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, stream=stream):
        out = step()
    return graph, out


class _StaticInputs:
    """Device buffers the graphs read, as sections of one byte buffer with a pinned host twin, so a step's
    inputs go up in one asynchronous copy.

    Why one copy: each copy is an operation on the step's stream, and a step had five (plus one for the
    pending ids). Measured on an H200 (BENCHMARKS.md, fourteenth session): offline +0.2-0.4%, single
    stream unchanged within 0.3% (the copy engine's hand-overs, ~7 us each under the profiler, remain).
    Why on its own stream (CUDA): on the step's stream the copy sat between the step before's last kernel
    and the graph's first, a hand-over each way; on `stream` it starts once the last graph that read the
    buffer ended (`released`), while that step's LM head and sampling run, and the next replay only waits
    for its end (`copied`), long past by then.
    NOTE: the host twin mirrors the device buffer (each upload copies a prefix of the whole twin, so
    sections are written in full, or as rows of the last one, `block_tables`); it is rewritten only after
    the device has read it for the step before (`copied`); the device buffer only after the graphs that
    read it were replayed (`released`, which `replayed` records after each replay).
    """

    def __init__(self, device: torch.device, **shapes: tuple[tuple[int, ...], int, torch.dtype]) -> None:
        layout, size = {}, 0
        for name, (shape, fill, dtype) in shapes.items():
            size = -(-size // ALIGNMENT_BYTES) * ALIGNMENT_BYTES
            layout[name] = (size, shape, dtype)
            size += math.prod(shape) * dtype.itemsize
        assert list(layout)[-1] == "block_tables", "uploads copy whole rows of the last section"
        self.device_bytes = torch.zeros(size, dtype=torch.uint8, device=device)
        self.host_bytes = torch.zeros(size, dtype=torch.uint8).pin_memory()
        self.host = {}  # name -> numpy view of the pinned twin
        for name, (offset, shape, dtype) in layout.items():
            end = offset + math.prod(shape) * dtype.itemsize
            setattr(self, name, self.device_bytes[offset:end].view(dtype).view(shape))
            self.host[name] = self.host_bytes[offset:end].view(dtype).view(shape).numpy()
            self.host[name][...] = shapes[name][1]
        self.tables_offset, self.table_row_bytes = layout["block_tables"][0], self.block_tables[0].nbytes
        self.device_bytes.copy_(self.host_bytes)
        self.copied = torch.cuda.Event()
        self.copied.record()
        self.released = torch.cuda.Event()
        self.released.record()
        self.stream = torch.cuda.Stream(device)

    def upload(self, block_tables: list[tuple[int, ...]], **values: list[int]) -> None:
        """section[:len(values)] = values for each named section, block_tables[i, :len(row i)] = row i of
        the tables, then one copy of the twin's prefix through the last table row.

        NOTE: a row's entries past its blocks keep what earlier steps wrote: the kernels read only the
        blocks a sequence's length covers. Rows are written unpadded: padding them to the widest (~4x
        the real blocks in the offline workload's big steps, whose contexts are ragged) and converting the
        padded lists took 0.77-0.90 ms of host time for 414-498 sequences, row by row 0.23-0.25 ms (on
        the 2-core development CPU).
        """
        self.copied.synchronize()
        for name, section in values.items():
            self.host[name][: len(section)] = section
        n = len(block_tables)
        tables = self.host["block_tables"]
        for row, blocks in enumerate(block_tables):
            tables[row, : len(blocks)] = blocks
        end = self.tables_offset + n * self.table_row_bytes
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(self.released)
            self.device_bytes[:end].copy_(self.host_bytes[:end], non_blocking=True)
            self.copied.record(self.stream)
        torch.cuda.current_stream(self.device_bytes.device).wait_event(self.copied)

    def replayed(self) -> None:
        """Mark the end of a replay that read the buffer (on the step's stream): the next upload waits for it."""
        self.released.record()


class DecodeGraphs:
    """`sampled`: the runner's buffer of the previous step's token ids ([rows] int64, written in place by
    every step's sampling): a graph takes its pending inputs from it (`fill_pending_ids`, its first kernel;
    the mixed graphs likewise)."""

    def __init__(self, model, kv_caches, *, max_batch: int, max_model_len: int, block_size: int,
                 device: torch.device, sampled: torch.Tensor, capture_stream: torch.cuda.Stream) -> None:
        self.model = model
        self.capture_stream = capture_stream
        self.sampled = sampled
        self.kv_caches = kv_caches
        self.max_model_len = max_model_len
        self.sizes = batch_size_ladder(max_batch)
        top = self.sizes[-1]
        max_blocks = -(-max_model_len // block_size)

        self.inputs = _StaticInputs(
            device, input_ids=((top,), 0, torch.int64), positions=((top,), 0, torch.int64),
            slot_mapping=((top,), -1, torch.int64), pending_src=((top,), -1, torch.int64),
            seq_lens=((top,), 1, torch.int32), block_tables=((top, max_blocks), 0, torch.int32),
        )
        self.query_start_loc = torch.arange(top + 1, dtype=torch.int32, device=device)
        self.rows = torch.arange(top, dtype=torch.int64, device=device)
        self.context_bounds = sorted({min(SHORT_CONTEXT, max_model_len), max_model_len})
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.graph_size = {size: size for size in self.sizes}  # a ladder size -> the graph its batches replay
        self.pool = None
        self.capture_seconds = 0.0

    def _metadata(self, batch: int, context_bound: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.inputs.slot_mapping[:batch],
            query_start_loc=self.query_start_loc[: batch + 1],
            seq_lens=self.inputs.seq_lens[:batch],
            block_tables=self.inputs.block_tables[:batch],
            query_lens_host=(1,) * batch,
            seq_lens_host=(context_bound,) * batch,
            decode_indices=self.rows[:batch],
            decode_token_indices=self.rows[:batch],
            decode_indices_host=tuple(range(batch)),
        )

    @torch.inference_mode()
    def capture(self, sizes: list[int] | None = None) -> None:
        """Capture every batch size's graphs; `sizes` (of the ladder): re-capture only theirs, in a pool of
        their own (bench/tile_search.py, after changing a kernel's tiles)."""
        start = time.perf_counter()
        pool = None
        # largest first: the smaller graphs reuse its memory pool
        for batch in sorted(sizes or self.sizes, reverse=True):
            for bound in reversed(self.context_bounds):
                graph, out = _capture(functools.partial(self._step, batch, bound), pool, self.capture_stream)
                pool = graph.pool()
                self.graphs[batch, bound] = (graph, out)
        torch.cuda.synchronize()
        if sizes is None:  # NOTE: start-up's capture: its pool and its time
            self.pool = pool  # NOTE: the mixed graphs are captured into it too
            self.capture_seconds = time.perf_counter() - start
            logger.info("captured %d decode graphs (batch 1..%d, contexts up to %s) in %.1f s", len(self.graphs),
                        self.sizes[-1], self.context_bounds, self.capture_seconds)

    @torch.inference_mode()
    def time_replays(self, repeats: int = 3) -> list[float]:
        """The replay times in ms of the graphs of `timed_sizes` (short contexts; the median of `repeats`
        after one warm replay), for `use_faster_graphs`. NOTE: the static inputs hold what capture left:
        padding rows' values (slot -1: nothing is written), so a replay only reads. The graphs of the other
        context bound run the same GEMMs (Llama-3-8B: the same times within 3%, 2026-12-01).
        At tp > 1 every rank replays the same graphs in the same order (their all-reduces pair up)."""
        times = []
        for size in self.timed_sizes:
            graph = self.graphs[size, self.context_bounds[0]][0]
            graph.replay()
            events = [torch.cuda.Event(enable_timing=True) for _ in range(repeats + 1)]
            events[0].record()
            for event in events[1:]:
                graph.replay()
                event.record()
            events[-1].synchronize()
            times.append(sorted(a.elapsed_time(b) for a, b in zip(events, events[1:]))[repeats // 2])
        return times

    @property
    def timed_sizes(self) -> list[int]:
        return [size for size in self.sizes if size >= MIN_TIMED_BATCH]

    def use_faster_graphs(self, replay_ms: list[float]) -> None:
        """Route the timed sizes' batches to the graphs `faster_graph_sizes` picks. NOTE: at tp > 1 all
        ranks must pass the same times (rank 0's), or their graphs' all-reduces would not pair up."""
        sizes = self.timed_sizes
        self.graph_size.update(faster_graph_sizes(sizes, replay_ms))
        logger.info("decode graph replays (ms) by batch size: %s",
                    {size: round(ms, 2) for size, ms in zip(sizes, replay_ms)})
        for i, size in enumerate(sizes):
            j = sizes.index(self.graph_size[size])
            if j != i:
                logger.info("decode batches of up to %d sequences replay the %d graph (%.2f ms against %.2f)",
                            size, sizes[j], replay_ms[j], replay_ms[i])

    def _step(self, batch: int, bound: int) -> torch.Tensor:
        return _model_step(self.model, self.inputs, self.sampled, batch, self.kv_caches, self._metadata(batch, bound))

    def fits(self, num_seqs: int) -> bool:
        return num_seqs <= self.sizes[-1]

    def run(self, input_ids: list[int], positions: list[int], slot_mapping: list[int], seq_lens: list[int],
            block_tables: list[tuple[int, ...]], pending_src: list[int]) -> torch.Tensor:
        """One decode step of n sequences: [batch, hidden] (before the final norm), the padded graph's
        output, whose first n rows are the step's (the LM head takes the first rows of the step's bucket:
        ModelRunner.logits).
        `pending_src[i]`: the row of `sampled` that is sequence i's input id, or -1 (the id is given)."""
        n = len(input_ids)
        bound = next(b for b in self.context_bounds if b >= max(seq_lens))
        batch = self.graph_size[next(size for size in self.sizes if size >= n)]
        pad = batch - n
        # NOTE: padding rows write nowhere (slot -1) and attend to one token at position 0
        self.inputs.upload(block_tables, input_ids=input_ids + [0] * pad, positions=positions + [0] * pad,
                           slot_mapping=slot_mapping + [-1] * pad, pending_src=pending_src + [-1] * pad,
                           seq_lens=seq_lens + [1] * pad)
        graph, out = self.graphs[batch, bound]
        graph.replay()
        self.inputs.replayed()
        return out


class MixedGraphs:
    """Small mixed steps (any mix of prefill chunks and decodes, up to `max_tokens` tokens and `max_seqs`
    sequences) replayed from graphs of the varlen forward, one per token count of `mixed_token_ladder`."""

    def __init__(self, model, kv_caches, *, max_tokens: int, max_seqs: int, max_model_len: int, block_size: int,
                 pool, device: torch.device, sampled: torch.Tensor, capture_stream: torch.cuda.Stream) -> None:
        self.model = model
        self.capture_stream = capture_stream
        self.sampled = sampled  # NOTE: as DecodeGraphs'
        self.kv_caches = kv_caches
        self.sizes = mixed_token_ladder(max_tokens)
        self.max_seqs = max_seqs
        self.slots = max_seqs + 1  # NOTE: one more: the padding sequence
        top = self.sizes[-1]
        # NOTE: wide enough for any real context and for the padding sequence's (at most `top` tokens)
        self.width = -(-max(max_model_len, top) // block_size)
        self.inputs = _StaticInputs(
            device, input_ids=((top,), 0, torch.int64), positions=((top,), 0, torch.int64),
            slot_mapping=((top,), -1, torch.int64), pending_src=((top,), -1, torch.int64),
            query_start_loc=((self.slots + 1,), 0, torch.int32),
            seq_lens=((self.slots,), 0, torch.int32), block_tables=((self.slots, self.width), 0, torch.int32),
        )
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = pool
        self.capture_seconds = 0.0
        self.replays = 0  # steps served (tests and benchmarks read it)

    def metadata(self, num_tokens: int) -> AttentionMetadata:
        """The graph's view of the buffers: `num_tokens` query tokens over all sequence slots; the host
        tuples size the kernel (the longest query may be all the tokens) and route it to the prefill kernel."""
        inputs = self.inputs
        empty = inputs.slot_mapping[:0]
        return AttentionMetadata(
            slot_mapping=inputs.slot_mapping[:num_tokens],
            query_start_loc=inputs.query_start_loc,
            seq_lens=inputs.seq_lens,
            block_tables=inputs.block_tables,
            query_lens_host=(num_tokens,) + (0,) * (self.slots - 1),
            seq_lens_host=(num_tokens,) + (0,) * (self.slots - 1),
            decode_indices=empty,
            decode_token_indices=empty,
            decode_indices_host=(),
        )

    @torch.inference_mode()
    def capture(self) -> None:
        start = time.perf_counter()
        # a valid state to capture with: sequence 0 owns every token, writes nowhere (slot -1)
        for tokens in reversed(self.sizes):
            self._fill([0] * tokens, [0] * tokens, [-1] * tokens, [tokens], [tokens], [[0]], [-1] * tokens)
            step = functools.partial(_model_step, self.model, self.inputs, self.sampled, tokens, self.kv_caches,
                                     self.metadata(tokens))
            graph, out = _capture(step, self.pool, self.capture_stream)
            self.pool = graph.pool()
            self.graphs[tokens] = (graph, out)
        torch.cuda.synchronize()
        self.capture_seconds = time.perf_counter() - start
        logger.info("captured %d mixed-step graphs (up to %d tokens, %d sequences) in %.1f s", len(self.graphs),
                    self.sizes[-1], self.max_seqs, self.capture_seconds)

    def fits(self, num_tokens: int, num_seqs: int) -> bool:
        return num_tokens <= self.sizes[-1] and num_seqs <= self.max_seqs

    def run(self, input_ids: list[int], positions: list[int], slot_mapping: list[int], query_lens: list[int],
            seq_lens: list[int], block_tables: list[tuple[int, ...]], pending_src: list[int]) -> torch.Tensor:
        """One mixed step: [num_tokens, hidden] (before the final norm) from the padded graph.
        `pending_src[i]`: the row of `sampled` that is input i's id, or -1 (the id is given)."""
        tokens = next(size for size in self.sizes if size >= len(input_ids))
        self._fill(input_ids, positions, slot_mapping, query_lens, seq_lens, block_tables, pending_src, pad_to=tokens)
        graph, out = self.graphs[tokens]
        graph.replay()
        self.inputs.replayed()
        self.replays += 1
        return out[: len(input_ids)]

    def _fill(self, input_ids, positions, slot_mapping, query_lens, seq_lens, block_tables, pending_src,
              pad_to=None) -> None:
        padded = pad_mixed_step(input_ids, positions, slot_mapping, query_lens, seq_lens,
                                num_tokens=pad_to or len(input_ids), num_slots=self.slots)
        pad = len(padded["input_ids"]) - len(pending_src)
        # NOTE: the padding sequence's table row keeps whatever block ids it held: valid ones, only read
        self.inputs.upload(block_tables, pending_src=pending_src + [-1] * pad, **padded)


def pad_mixed_step(input_ids: list[int], positions: list[int], slot_mapping: list[int], query_lens: list[int],
                   seq_lens: list[int], *, num_tokens: int, num_slots: int) -> dict[str, list[int]]:
    """A mixed step's inputs padded to `num_tokens` tokens and `num_slots` sequences (see the module's NOTE):
    the padding tokens belong to sequence `len(query_lens)`, whose context is its own queries; the slots
    after it hold no queries and no context."""
    n_tokens, n_seqs = len(input_ids), len(query_lens)
    pad = num_tokens - n_tokens
    spare = num_slots - n_seqs - 1
    assert pad >= 0 and spare >= 0, "the step does not fit the graph"
    starts = [0]
    for q in query_lens:
        starts.append(starts[-1] + q)
    return {
        "input_ids": input_ids + [0] * pad,
        "positions": positions + [0] * pad,
        "slot_mapping": slot_mapping + [-1] * pad,
        "query_start_loc": starts + [num_tokens] * (spare + 1),
        "seq_lens": seq_lens + [pad] + [0] * spare,
    }
