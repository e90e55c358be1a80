"""The model runner: turns a StepPlan into tensors, runs the model over the paged cache, samples.

It owns the KV cache and the device; it makes no scheduling decisions. One call of `execute` is one
engine step, whatever mix of prefill chunks, decodes and recomputes the plan holds.

Under tensor parallelism every rank has a runner over its shard of the model and of the KV cache (its
KV heads of every block). Rank 0 turns the plan into host inputs (`prepare`) and sends them to the other
ranks (distributed/workers.py); every rank runs `launch` on the same inputs, and only rank 0 samples.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, field

import torch

from .attention import AttentionMetadata
from .config import EngineConfigs
from .cuda_graphs import batch_size_ladder
from .distributed.parallel_state import ParallelConfig
from .models.llama import LlamaForCausalLM
from .sampler import HostSamples, SamplerOutput, SamplingBatch, sample, score_tokens
from .scheduler import StepPlan
from .sequence import PENDING_TOKEN, TokenLogprob
from .transfer import pack_to_device, to_device

logger = logging.getLogger(__name__)


def kv_block_bytes(configs: EngineConfigs) -> int:
    """Bytes one KV block takes across all layers (keys and values) on one rank (its KV heads)."""
    m = configs.model
    element = torch.empty((), dtype=configs.device.dtype).element_size()
    kv_heads = m.num_key_value_heads // configs.tensor_parallel_size
    return 2 * m.num_hidden_layers * configs.cache.block_size * kv_heads * m.head_dim * element


def activation_reserve_bytes(configs: EngineConfigs) -> int:
    """Memory a step's activations may take at most: the widest intermediates of a full token budget, and
    float32 logits with their sampling temporaries for every running sequence, plus 1 GiB of slack.
    (Per rank: the head and MLP intermediates are split; rank 0 gathers the full logits.)"""
    m, s, tp = configs.model, configs.scheduler, configs.tensor_parallel_size
    element = torch.empty((), dtype=configs.device.dtype).element_size()
    per_token = (6 * m.hidden_size + (4 * m.intermediate_size + 2 * (m.q_size + 2 * m.kv_size)) // tp) * element
    logits = s.max_num_seqs * m.vocab_size * 4 * 6
    return s.max_num_batched_tokens * per_token + logits + (1 << 30)


def num_kv_blocks(configs: EngineConfigs) -> int:
    """How many blocks fit the memory budget: a byte budget on the CPU, a share of the GPU's memory on CUDA
    (after the weights, which are loaded first, and the activation reserve)."""
    if configs.cache.num_blocks is not None:
        return configs.cache.num_blocks
    device = configs.device.device
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        used = total - free
        budget = int(total * configs.cache.gpu_memory_utilization) - used - activation_reserve_bytes(configs)
    else:
        budget = configs.cache.cpu_kv_cache_bytes
    blocks = budget // kv_block_bytes(configs)
    if blocks <= 0:
        raise RuntimeError(f"no memory left for the KV cache (budget {budget} bytes)")
    return int(blocks)


def logit_row_buckets(max_rows: int) -> tuple[int, ...]:
    """The row counts the LM head runs on (CUDA): the decode graphs' batch ladder (so a graph's padded
    output needs no further padding) up to `max_rows`, and `max_rows` itself, the most logit rows a step
    can have (one per sequence)."""
    return tuple(sorted(set(batch_size_ladder(max_rows)) | {max_rows}))


class ModelRunner:
    def __init__(self, configs: EngineConfigs, model: LlamaForCausalLM,
                 parallel: ParallelConfig | None = None) -> None:
        self.configs = configs
        self.model = model
        self.parallel = parallel = parallel or ParallelConfig()
        self.device = configs.device.device
        self.block_size = configs.cache.block_size
        # NOTE: rank 0's block manager hands out block ids for every rank: all ranks hold the same count
        self.num_blocks = parallel.all_reduce_min(num_kv_blocks(configs))
        m = configs.model
        kv_heads = parallel.shard(m.num_key_value_heads, "num_key_value_heads")
        # [layers, k/v, num_blocks, block_size, kv_heads / tp, head_dim]
        self.kv_cache = torch.zeros(
            m.num_hidden_layers, 2, self.num_blocks, self.block_size, kv_heads, m.head_dim,
            dtype=configs.device.dtype, device=self.device,
        )
        self.kv_caches = [(self.kv_cache[i, 0], self.kv_cache[i, 1]) for i in range(m.num_hidden_layers)]
        logger.info("KV cache: %d blocks of %d tokens (%.1f MiB)", self.num_blocks, self.block_size,
                    self.kv_cache.numel() * self.kv_cache.element_size() / 2**20)
        self.eos_token_ids: tuple[int, ...] = tuple(configs.model.eos_token_id)  # the engine may add more
        self._last_sampled_rows: dict[int, int] = {}  # seq_id -> its row in the latest launch's samples
        # NOTE: every step's sampled ids land here (rows <= max_num_seqs: a request's n choices hold n
        # seats), so the decode graphs, which hold its address, read their pending inputs from it
        self.sampled_tokens = torch.zeros(configs.scheduler.max_num_seqs, dtype=torch.int64, device=self.device)
        # NOTE: the sampled ids go to the host on a stream of their own (SamplerOutput.copy_to_host says why);
        # the next sampling, which overwrites `sampled_tokens`, waits for the last copy's end
        self.copy_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._samples_copied: torch.cuda.Event | None = None
        # NOTE: pending inputs always come from the latest launch's samples (the engine reads a step's tokens
        # before it plans the step after next); the graphs fill them inside, an eager step before the model
        from .kernels import tokens

        self._fill_pending_ids = tokens.fill_pending_ids if self.device.type == "cuda" else tokens.fill_pending_ids_ref
        if self.device.type == "cuda":
            tokens.compile_fill_pending_ids(configs.scheduler.max_num_batched_tokens, self.sampled_tokens)
        # set to [] to record every step's (start, end) CUDA events, path ("decode_graph", "mixed_graph" or
        # "eager"), sequences and tokens (bench/timeline.py reads them)
        self.timeline: list | None = None
        # NOTE: the LM head runs outside the graphs, on each step's logit rows padded to a bucket (`logits`):
        # its kernels compile, tune and load now for every row count it may see, not inside the first steps
        # to meet them
        self.logit_row_buckets = (logit_row_buckets(configs.scheduler.max_num_seqs)
                                  if self.device.type == "cuda" else ())
        for rows in sorted(set(model.ops.row_counts_to_tune()) | set(self.logit_row_buckets)):
            model.compute_logits(torch.zeros(rows, m.hidden_size, dtype=configs.device.dtype, device=self.device))
        self.graphs = None
        # NOTE: this runner's graphs are captured on a stream of their own (cuda_graphs._capture says why)
        capture_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        if configs.cuda_graph_max_batch:
            from .cuda_graphs import DecodeGraphs

            # NOTE: at tp > 1 every rank captures the same ladder in the same order, and the graphs hold
            # the NCCL all-reduces (capturable since NCCL 2.9.6, pytorch#103503; checked on 2 H200s by
            # tests/gpu/test_tensor_parallel_gpu.py). NCCL keeps their resources until the graphs are
            # destroyed: see `release_graphs`.
            self.graphs = DecodeGraphs(
                model, self.kv_caches, max_batch=configs.cuda_graph_max_batch,
                max_model_len=configs.scheduler.max_model_len, block_size=self.block_size, device=self.device,
                sampled=self.sampled_tokens, capture_stream=capture_stream,
            )
            self.graphs.capture()
            if self.graphs.timed_sizes:  # some batch sizes replay faster padded to a bigger graph (cuBLAS's
                # kernel choice by row count); NOTE: every rank takes rank 0's times
                replay_ms = torch.tensor(self.graphs.time_replays(), dtype=torch.float64,
                                         device=self.parallel.collective_device)
                self.graphs.use_faster_graphs(self.parallel.broadcast_from_driver(replay_ms).tolist())
        self.mixed_graphs = None
        if configs.cuda_graph_max_mixed_tokens >= 32:
            from .cuda_graphs import MixedGraphs

            # NOTE: captured after the decode graphs, into their memory pool
            self.mixed_graphs = MixedGraphs(
                model, self.kv_caches, max_tokens=configs.cuda_graph_max_mixed_tokens,
                max_seqs=configs.cuda_graph_max_mixed_seqs, max_model_len=configs.scheduler.max_model_len,
                block_size=self.block_size, pool=self.graphs.pool if self.graphs is not None else None,
                device=self.device, sampled=self.sampled_tokens, capture_stream=capture_stream,
            )
            self.mixed_graphs.capture()
        if self.device.type == "cuda":
            self.warm_up_eager_step(configs.scheduler.max_num_batched_tokens)

    @torch.inference_mode()
    def warm_up_eager_step(self, num_tokens: int) -> None:
        """One eager step of `num_tokens` prompt tokens that writes no cache slot, and its LM head rows.

        Why: the graphs' captures run the decode and small mixed steps' kernels at start-up, but a longer
        prompt's (prefill attention at its widest tile, the SwiGLU GEMM from 4,096 tokens, cuBLAS at
        prefill sizes) compiled, tuned or loaded inside the first long request a server met.
        NOTE: sequences of at most max_model_len tokens (the rotary tables' length), every table row block
        0 (read only: slot -1 stores nothing), so the cache is left as it was.
        """
        max_len = self.configs.scheduler.max_model_len
        lens = [min(max_len, num_tokens - start) for start in range(0, num_tokens, max_len)]
        host = HostInputs(  # NOTE: through the eager step's own input path (`_device_inputs`)
            input_ids=[0] * num_tokens, positions=[p for n in lens for p in range(n)], slots=[-1] * num_tokens,
            query_lens=lens, seq_lens=list(lens), logits_indices=[end - 1 for end in itertools.accumulate(lens)],
            tables=[(0,) * -(-n // self.block_size) for n in lens],
        )
        input_ids, positions, meta, logits_indices, _ = self._device_inputs(host, [])
        hidden = self.model(input_ids, positions, self.kv_caches, meta)  # [num_tokens, hidden]
        self.logits(hidden[logits_indices], len(lens))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def release_graphs(self) -> None:
        """Drop the captured graphs (the runner replays no graph afterwards).

        NOTE: NCCL holds resources for the collectives captured in a graph until the graph is destroyed,
        so a tensor-parallel rank releases its graphs before it leaves the group.
        """
        self.graphs = self.mixed_graphs = None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def execute(self, plan: StepPlan) -> list[TokenLogprob]:
        """Run one step and wait for it: the sampled token of each of the plan's sampling rows, in order."""
        return self.collect(self.launch(plan))

    def prepare(self, plan: StepPlan) -> "HostInputs":
        """The step's inputs as host lists: all a rank needs to run it (rank 0 prepares, workers receive).

        Why here and only once: a worker that rebuilt them from the plan (a Python loop over the
        sequences, after unpickling thousands of objects) spent ~4 ms of host time a step doing it, and
        rank 0's all-reduces in 450-sequence steps took ~100 us against 36 us alone: waiting for the late
        worker, as BENCHMARKS.md infers (issue 7's profile).
        """
        host = self._host_inputs(plan)
        if host.pending_positions:
            rows = self._last_sampled_rows
            host.pending_rows = [rows[seq_id] for seq_id in host.pending_seq_ids]
        host.block_copies = plan.block_copies
        host.num_sampling_rows = len(plan.sampling_rows)
        if plan.prompt_score_rows:
            starts = dict(zip((s.seq_id for s in plan.seqs), itertools.accumulate(
                (len(s.token_ids) for s in plan.seqs), initial=0)))
            for rows in plan.prompt_score_rows:
                first = starts[rows.seq_id] + rows.offset
                host.score_indices += range(first, first + len(rows.targets))
        return host

    @torch.inference_mode()
    def launch(self, plan: StepPlan | None, host: "HostInputs | None" = None) -> "LaunchedStep":
        """Queue one step on the device (model, sampling, the copy of the sampled ids to the host) and
        return without waiting for it, so the host can plan the next step meanwhile. `host`: the plan's
        `prepare`d inputs (made here if not given); a worker rank passes no plan (it does not sample).

        NOTE: a plan's PENDING_TOKEN inputs are the tokens sampled by the previous launch: they are copied
        on the device, never through the host.
        """
        host = host if host is not None else self.prepare(plan)
        started = self._record_event()
        num_seqs = len(host.query_lens)
        for src, dst in host.block_copies:
            self.kv_cache[:, :, dst].copy_(self.kv_cache[:, :, src])
        path = "eager"
        pending_src = host.pending_sources()
        if self.graphs is not None and host.all_decode and self.graphs.fits(num_seqs):
            # NOTE: every decode computes logits, in plan order: the graph's rows are the logit rows
            path = "decode_graph"
            hidden = every_token = self.graphs.run(host.input_ids, host.positions, host.slots, host.seq_lens,
                                                   host.tables, pending_src)
        elif self.mixed_graphs is not None and self.mixed_graphs.fits(len(host.input_ids), num_seqs):
            path = "mixed_graph"
            every_token = self.mixed_graphs.run(host.input_ids, host.positions, host.slots, host.query_lens,
                                                host.seq_lens, host.tables, pending_src)
            hidden = every_token[to_device(torch.tensor(host.logits_indices, dtype=torch.int64), self.device)]
        else:
            input_ids, positions, meta, logits_indices, pending_src = self._device_inputs(host, pending_src)
            if host.pending_positions:
                self._fill_pending_ids(input_ids, pending_src, self.sampled_tokens)
            every_token = self.model(input_ids, positions, self.kv_caches, meta)  # [num_tokens, hidden]
            hidden = every_token[logits_indices]
        shape = (path, num_seqs, len(host.input_ids))
        prompt_scores = self._score_prompt_tokens(every_token, host.score_indices, plan) if host.score_indices \
            else None
        if not host.num_sampling_rows:
            return self._launched(plan, None, started, shape, prompt_scores)
        # [num_logit_rows, vocab] on rank 0, None elsewhere (the decode graph's hidden holds padding rows too)
        logits = self.logits(hidden, num_seqs if path == "decode_graph" else hidden.shape[0])
        sampled, rows = None, ()
        assert host.num_sampling_rows <= len(self.sampled_tokens), "more sampling rows than sequence seats"
        token_ids = self.sampled_tokens[: host.num_sampling_rows]  # [rows] int64
        if self.parallel.is_driver:
            rows = plan.sampling_rows
            if len(rows) != logits.shape[0]:  # forked choices share their prompt's logits row
                logits = logits[to_device(torch.tensor([r.logits_index for r in rows]), self.device)]
            batch = SamplingBatch.from_rows(rows, self.configs.model.vocab_size, self.device, self.eos_token_ids)
            if self._samples_copied is not None:
                torch.cuda.current_stream(self.device).wait_event(self._samples_copied)
            sampled = sample(logits, batch, out=token_ids)
        if self.configs.async_scheduling:
            # NOTE: the next plan's PENDING inputs are these tokens, which only rank 0 sampled: every
            # rank gets them now, device to device (a no-op at tp 1)
            self.parallel.broadcast_from_driver(token_ids)
        # NOTE: the row of each sequence is read by rank 0's next `prepare` (workers get it from there)
        self._last_sampled_rows = {row.seq_id: i for i, row in enumerate(rows)}
        samples = sampled.copy_to_host(self.copy_stream) if sampled is not None else None
        if samples is not None and samples.copied is not None:
            self._samples_copied = samples.copied
        return self._launched(plan, samples, started, shape, prompt_scores)

    # rows of prompt tokens scored a time: float32 logits and their log-softmax, [rows, vocab] each
    SCORE_ROWS = 256

    def _score_prompt_tokens(self, every_token: torch.Tensor, indices: list[int],
                             plan: StepPlan | None) -> HostSamples | None:
        """The log-probabilities of the prompt tokens the plan scores (`StepPlan.prompt_score_rows`), from the
        hidden states of the tokens before them (`indices` into the step's tokens); copied to the host on
        rank 0 (None on the other ranks, which take part in the LM head's collectives).

        NOTE: the LM head runs on at most as many rows a time as a step has logit rows (its row buckets on
        CUDA, SCORE_ROWS on the CPU): the memory reserved for a step's logits bounds the scoring's."""
        rows = every_token[to_device(torch.tensor(indices, dtype=torch.int64), self.device)]  # [n, hidden]
        step = max(self.logit_row_buckets, default=self.SCORE_ROWS)
        if self.parallel.is_driver:
            targets = to_device(torch.tensor([t for r in plan.prompt_score_rows for t in r.targets],
                                             dtype=torch.int64), self.device)
            num_top = max(r.num_top for r in plan.prompt_score_rows)
        parts = []
        for start in range(0, len(indices), step):
            logits = self.logits(rows[start : start + step], min(step, len(indices) - start))
            if logits is not None:
                parts.append(score_tokens(logits, targets[start : start + step], num_top))
        return SamplerOutput.concat(parts).copy_to_host(self.copy_stream) if parts else None

    def collect_prompt_scores(self, step: "LaunchedStep") -> list[tuple[int, int, TokenLogprob]]:
        """A launched step's prompt-token scores as (sequence id, prompt position of the token, its score),
        waiting for their copy; none on the other ranks."""
        if step.prompt_scores is None:
            return []
        rows = step.plan.prompt_score_rows
        tops = [r.num_top for r in rows for _ in r.targets]
        scores = iter(step.prompt_scores.read_tops(tops))
        return [(r.seq_id, r.first_position + 1 + i, next(scores)) for r in rows for i in range(len(r.targets))]

    def logits(self, hidden: torch.Tensor, num_rows: int) -> torch.Tensor | None:
        """The logits of hidden's first `num_rows` rows: [num_rows, vocab] on rank 0, None elsewhere.

        NOTE: on CUDA the LM head multiplies only the row counts of `logit_row_buckets` (all run at
        start-up), the step's rows padded up to one with zeros or with a graph's padding rows: cuBLAS picks
        its kernel by row count, and CUDA loads a kernel it has not run yet at its first launch, waiting
        for the device first. Llama-3-8B's offline run (2026-12-01) lost 15-30 ms of host time at each new count,
        10-17 ms of it with the GPU idle, a dozen times a run.
        """
        buckets = self.logit_row_buckets
        rows = hidden.shape[0]
        if buckets:
            bucket = next((b for b in buckets if b >= num_rows), rows)
            if bucket < rows:  # a decode graph bigger than the step's bucket (DecodeGraphs.graph_size)
                hidden = hidden[:bucket]
            elif bucket > rows:
                hidden = torch.cat([hidden, hidden.new_zeros(bucket - rows, hidden.shape[1])])
        logits = self.model.compute_logits(hidden)
        return logits if logits is None or logits.shape[0] == num_rows else logits[:num_rows]

    def _launched(self, plan: StepPlan | None, samples: HostSamples | None, started, shape,
                  prompt_scores: HostSamples | None = None) -> "LaunchedStep":
        step = LaunchedStep(plan, samples, started, self._record_event(), prompt_scores)
        if started is not None:
            self.timeline.append((started, step.ended, *shape))
        return step

    def collect(self, step: "LaunchedStep") -> list[TokenLogprob]:
        """Wait for a launched step; its sampled tokens (the step's one device-to-host synchronisation)."""
        if step.samples is None:
            return []
        return step.samples.read(step.plan.sampling_rows)

    def _record_event(self) -> "torch.cuda.Event | None":
        """Step boundaries on the device's timeline, recorded only while `timeline` is switched on."""
        if self.timeline is None or self.device.type != "cuda":
            return None
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _host_inputs(self, plan: StepPlan) -> "HostInputs":
        """The step's inputs as host lists: token ids, positions, cache slots, lengths, block tables."""
        host = HostInputs()
        bs = self.block_size
        for seq in plan.seqs:
            n = len(seq.token_ids)
            if seq.token_ids[-1] == PENDING_TOKEN:
                host.pending_positions.append(len(host.input_ids) + n - 1)
                host.pending_seq_ids.append(seq.seq_id)
            host.input_ids += seq.token_ids
            table = seq.block_table
            if n == 1:  # a decode (most rows of most steps): no range, no list of one
                p = seq.start_pos
                host.positions.append(p)
                host.slots.append(table[p // bs] * bs + p % bs)
            else:
                span = range(seq.start_pos, seq.start_pos + n)
                host.positions += span
                host.slots += [table[p // bs] * bs + p % bs for p in span]
            host.query_lens.append(n)
            host.seq_lens.append(seq.start_pos + n)
            if seq.compute_logits:
                host.logits_indices.append(len(host.input_ids) - 1)
        host.tables = [s.block_table for s in plan.seqs]  # NOTE: the plan's tuples, unpadded
        host.all_decode = all(n == 1 for n in host.query_lens)
        return host

    def _device_inputs(self, host: "HostInputs", pending_src: list[int]):
        decode = [i for i, n in enumerate(host.query_lens) if n == 1]
        starts = [0]
        for n in host.query_lens:
            starts.append(starts[-1] + n)
        longs = pack_to_device(dict(
            input_ids=host.input_ids, positions=host.positions, slots=host.slots, logits=host.logits_indices,
            decode=decode, decode_tokens=[starts[i] for i in decode],
            pending_src=pending_src if host.pending_positions else [],
        ), torch.int64, self.device)
        width = max(len(table) for table in host.tables)
        tables = []  # [num_seqs * width], each row padded with zeros
        for table in host.tables:
            tables += table
            tables += (0,) * (width - len(table))
        ints = pack_to_device(dict(starts=starts, seq_lens=host.seq_lens, tables=tables), torch.int32, self.device)
        meta = AttentionMetadata(
            slot_mapping=longs["slots"],
            query_start_loc=ints["starts"],
            seq_lens=ints["seq_lens"],
            block_tables=ints["tables"].view(len(host.tables), -1),
            query_lens_host=tuple(host.query_lens),
            seq_lens_host=tuple(host.seq_lens),
            decode_indices=longs["decode"],
            decode_token_indices=longs["decode_tokens"],
            decode_indices_host=tuple(decode),
        )
        return longs["input_ids"], longs["positions"], meta, longs["logits"], longs["pending_src"]


@dataclass(frozen=True)
class LaunchedStep:
    """A step queued on the device; `samples` become readable when its copy to the host completes."""

    plan: StepPlan | None  # None on a worker rank
    samples: HostSamples | None
    started: "torch.cuda.Event | None" = None  # device timeline, when the runner records it
    ended: "torch.cuda.Event | None" = None
    prompt_scores: HostSamples | None = None  # the plan's `prompt_score_rows`, in order (rank 0)

    @property
    def needs_token_history(self) -> bool:
        """Some row's next step reads its token history on the host (penalties, a grammar's mask): the
        engine must read this step's tokens before it plans the next one."""
        return any(row.params.reads_history for row in self.plan.sampling_rows)


@dataclass
class HostInputs:
    """A step's inputs on the host, as `ModelRunner.prepare` makes them from a plan: what every rank
    needs to run the step (rank 0 pickles them to the workers: plain lists and ints, cheap to send)."""

    input_ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    query_lens: list[int] = field(default_factory=list)
    seq_lens: list[int] = field(default_factory=list)
    logits_indices: list[int] = field(default_factory=list)
    # NOTE: each sequence's blocks, rows of different lengths: a reader pads them if it needs a matrix
    tables: list[tuple[int, ...]] = field(default_factory=list)
    all_decode: bool = False
    pending_positions: list[int] = field(default_factory=list)  # inputs to take from the previous step
    pending_seq_ids: list[int] = field(default_factory=list)
    pending_rows: list[int] = field(default_factory=list)  # their rows in the previous step's samples
    block_copies: tuple[tuple[int, int], ...] = ()
    num_sampling_rows: int = 0
    score_indices: list[int] = field(default_factory=list)  # the tokens whose logits score prompt tokens

    def pending_sources(self) -> list[int]:
        """Per input id, the row of the previous step's samples it is, or -1 (the id is given): the form
        every path fills its pending inputs from (`kernels/tokens.py::fill_pending_ids`)."""
        sources = [-1] * len(self.input_ids)
        for position, row in zip(self.pending_positions, self.pending_rows):
            sources[position] = row
        return sources
