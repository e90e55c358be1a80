"""LLMEngine (one synchronous step at a time) and LLM, the offline batch interface.

A step is: the scheduler plans, the model runner computes and samples, then the output processing here
appends the tokens, detokenises, checks the stop conditions and builds the outputs. A failure while one
request's token is processed fails that request alone (finish reason "error"); the others go on.
"""

from __future__ import annotations

import gc
import itertools
import logging
import random
import time
from collections.abc import Callable, Mapping
from collections.abc import Sequence as SequenceABC

import torch

from .beam_search import BeamSearch, BeamSearchParams
from .block_manager import BlockManager
from .config import EngineArgs, EngineConfigs
from .distributed.parallel_state import ParallelConfig
from .distributed.workers import TensorParallelWorkers
from .loader import ModelSource, iter_weights
from .model_runner import LaunchedStep, ModelRunner
from .models.llama import LlamaForCausalLM
from .outputs import CompletionOutput, RequestMetrics, RequestOutput
from .sampler import mix_seed
from .sampling_params import SamplingParams
from .scheduler import Scheduler
from .sequence import Request, Sequence, TokenLogprob
from .prompts import PromptProcessor, PromptType, RequestError, plain_prompt
from .structured_output import GrammarMatchers, advance, token_bitmask
from .tokenizer import IncrementalDetokenizer

logger = logging.getLogger(__name__)

__all__ = ["LLM", "LLMEngine", "PromptType", "RequestError", "build_model"]


TokenHook = Callable[[Sequence, TokenLogprob], None]


def build_model(configs: EngineConfigs, source: ModelSource | None,
                parallel: ParallelConfig | None = None) -> LlamaForCausalLM:
    """Create the model (this rank's shard under tensor parallelism) on its device in its dtype, then fill
    it with checkpoint or random weights."""
    device, dtype = configs.device.device, configs.device.dtype
    start = time.perf_counter()
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(configs.model, max_positions=configs.scheduler.max_model_len, device=device,
                                     parallel=parallel, fused_gemv_rows=configs.fused_gemv_rows,
                                     dependent_launch=configs.dependent_launch,
                                     measured_tiles=configs.measured_tiles)
    finally:
        torch.set_default_dtype(previous)
    # NOTE: rotary tables stay float32 whatever the model dtype, as in transformers.
    model.rotary.float()
    if configs.load_format == "dummy" or source is None:
        model.init_dummy_weights(configs.device.seed)
    else:
        model.load_weights(iter_weights(source))
    model.ops.prepare_weights(model.layers)  # NOTE: after loading: the layout the device's kernels read
    if device.type == "cpu":
        model.prepare_for_cpu(native_ops=configs.native_cpu_ops)
    model.eval()
    logger.info("model ready in %.1f s", time.perf_counter() - start)
    return model


# NOTE: a step makes thousands of short-lived Python objects (plans, outputs, token lists). With the
# collector's defaults, its frequent young passes and its full passes over the startup heap (modules,
# tokenizer) kept the device idle 7% of an offline run, between steps (Llama-3-8B shape, 500 requests,
# 46 req/s); with the collector off, 2% and 49 req/s (bench/results/h200-2026-12-01i/run7_gc_off).
GC_YOUNG_THRESHOLD = 20_000
# NOTE: and the passes come between steps, at GC_STEP_YOUNG young objects. At GC_YOUNG_THRESHOLD the
# collector's own young passes, every ~150 steps of an offline run, took 3-8 ms over ~20,000 objects
# wherever an allocation triggered them, and the device sat idle 3-6 ms behind five of the seven
# (bench/results/h200-2026-12-02g/run3, Llama-3-8B offline). The cyclic garbage those passes freed was the
# benchmark's own: ~120 tuples in a reference cycle a step from its reading of torch.cuda.memory_reserved(), whose
# memory_stats() flattens through a recursive closure (`bench/serve.py --gc-debug`, h200-2026-12-02h run
# 1); the engine's own steps leave no cycles, but still thousands of young objects a step at 500 sequences.
GC_STEP_YOUNG = 2_000


def freeze_startup_heap() -> int:
    """Collect, then freeze every object alive now, so the collector's full passes never traverse them again;
    what a process wants once its start-up is done (vLLM's API server and engine core do the same). Returns
    how many objects are frozen.

    Why: a full pass over a serving process's startup heap (torch, transformers, bentoml: ~224,000 objects)
    took ~100 ms on the development CPU; under streaming load the oldest generation comes due every few
    hundred requests, and each pass stops the event loop that writes every stream's tokens. Frozen in the
    serving worker, the p99 time to first token through HTTP at 40 req/s fell from 96-111 to 69-72 ms
    (Llama-2-7B shape, one H100; BENCHMARKS.md).
    NOTE: `gc.unfreeze()` undoes it (shutdown), so what was frozen becomes collectable again."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def quiet_garbage_collector() -> None:
    """Freeze the startup heap (never traversed again) and collect young objects less often, for the
    whole process: what an engine that owns its process wants (EngineArgs.quiet_gc; the engine process)."""
    freeze_startup_heap()
    young, *older = gc.get_threshold()
    gc.set_threshold(max(young, GC_YOUNG_THRESHOLD), *older)


def collect_garbage_between_steps() -> None:
    """With `quiet_garbage_collector`: a collector pass once GC_STEP_YOUNG young objects are tracked, called
    where a pass costs the device nothing (a step just launched, the one before it maybe still running:
    the host has about a step's time), of the oldest generation due.

    NOTE: these passes keep the young count under the collector's own threshold, so it would never pass
    by itself, nor over the older generations: they are chosen here on the collector's schedule at that
    threshold, by volume. A young pass comes every GC_STEP_YOUNG objects instead of every
    GC_YOUNG_THRESHOLD, so the middle generation is due after that many times more young passes; the
    oldest, as in the collector, after its threshold of middle ones (the collector may also skip it while
    the heap grew by less than a quarter since its last full pass; that test is not public)."""
    counts = gc.get_count()
    if counts[0] < GC_STEP_YOUNG:  # NOTE: every step comes here: nothing more until a pass is due
        return
    thresholds = gc.get_threshold()
    young_passes_per_middle = thresholds[1] * max(1, thresholds[0] // GC_STEP_YOUNG)
    gc.collect(2 if counts[2] >= thresholds[2] else 1 if counts[1] >= young_passes_per_middle else 0)


class LLMEngine:
    def __init__(self, args: EngineArgs) -> None:
        self.args = args
        self.prompts = PromptProcessor(args)
        source = self.prompts.source
        self.configs = self.prompts.configs
        self.model_config = self.configs.model
        self.tokenizer = self.prompts.tokenizer
        # ranks 1.. of a tensor-parallel group: they build their shards while this process builds rank 0's
        self.workers = TensorParallelWorkers(self.configs, source) if self.configs.tensor_parallel_size > 1 else None
        try:
            parallel = self.workers.parallel if self.workers is not None else ParallelConfig()
            self.model = build_model(self.configs, source, parallel)
            self.runner = ModelRunner(self.configs, self.model, parallel)
        except BaseException:
            self.shutdown()
            raise
        block_size = self.configs.cache.block_size
        capacity = self.runner.num_blocks * block_size
        if capacity < self.configs.scheduler.max_model_len:
            self.shutdown()
            raise ValueError(
                f"the KV cache holds {capacity} tokens, fewer than max_model_len "
                f"{self.configs.scheduler.max_model_len}: raise the memory budget or lower max_model_len"
            )
        self.block_manager = BlockManager(self.runner.num_blocks, block_size,
                                          enable_prefix_caching=self.configs.cache.enable_prefix_caching)
        self.scheduler = Scheduler(self.configs.scheduler, self.block_manager, self._child_seed)
        self.requests: dict[str, Request] = {}
        self._detokenizers: dict[int, IncrementalDetokenizer] = {}
        self._emitted: dict[int, int] = {}
        self._failures: dict[str, str] = {}  # request id -> why it failed, until its output is made
        self._rng = random.Random(args.seed)
        self._request_counter = itertools.count()
        self.last_plan = None
        self._in_flight: LaunchedStep | None = None  # launched, tokens not yet read (async scheduling)
        self.eos_token_ids = self.prompts.eos_token_ids
        self.runner.eos_token_ids = tuple(sorted(self.eos_token_ids))
        self.grammars = GrammarMatchers(self.tokenizer, self.model_config.vocab_size, self.runner.eos_token_ids)
        # A test hook (see faults.py) called with each sampled token before it is appended; what it raises
        # fails that token's request alone.
        self.token_hook: TokenHook | None = None
        if self.configs.quiet_gc:
            quiet_garbage_collector()

    # ---- requests ------------------------------------------------------------------------------
    def tokenize(self, prompt: PromptType) -> list[int]:
        return self.prompts.tokenize(prompt)

    def chat_prompt_ids(self, messages: list[dict]) -> list[int]:
        return self.prompts.chat_prompt_ids(messages)

    def add_request(
        self,
        request_id: str | None,
        prompt: PromptType,
        params: SamplingParams | None = None,
        prompt_token_ids: list[int] | None = None,
        cache_salt: str | None = None,
        priority: int = 0,
    ) -> Request:
        """Admit a request (`RequestError` where it cannot be served). `cache_salt` (vLLM's): its prompt's
        blocks are found in, and go into, the prefix cache only for requests with the same salt: tenants that
        do not share a salt cannot learn from its timing which prompts the others sent. `priority` (vLLM's):
        under the priority scheduling policy, lower values run first and are preempted last; else 0."""
        params = params or SamplingParams()
        request_id = request_id or f"req-{next(self._request_counter)}"
        if request_id in self.requests:
            raise RequestError(f"request id {request_id!r} is already in use")
        prompt = plain_prompt(prompt)
        ids = prompt_token_ids if prompt_token_ids is not None else self.tokenize(prompt)
        self.validate_prompt(ids, params, priority)
        seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        allowed = params.allowed_token_ids
        request = Request(request_id, prompt if isinstance(prompt, str) else None, ids, params, mix_seed(seed, 0),
                          bad_words=self.prompts.bad_words_token_ids(params), cache_salt=cache_salt,
                          priority=priority,
                          allowed_mask=None if allowed is None else token_bitmask(allowed, self.model_config.vocab_size))
        if params.structured_outputs is not None:
            try:
                request.seqs[0].grammar = self.grammars.matcher(params.structured_outputs)
            except ValueError as error:
                raise RequestError(str(error)) from None
        self.requests[request_id] = request
        self.scheduler.add_request(request)
        return request

    def validate_prompt(self, ids: list[int], params: SamplingParams, priority: int = 0) -> None:
        self.prompts.validate_prompt(ids, params, priority)

    def _child_seed(self, request: Request, index: int) -> int:
        seed = request.params.seed if request.params.seed is not None else request.rng_seed
        return mix_seed(seed, index)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """End a request now: its blocks are free when this returns. Its last output (each choice ending with
        reason "abort", as vLLM's), or None when the engine does not hold it (finished already)."""
        request = self.requests.get(request_id)
        if request is None:
            return None
        self.scheduler.finish_request(request, "abort")
        return self._output_or_failure(request)  # NOTE: forgets the finished request

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers, if any (also done when the engine is garbage-collected), and
        unfreeze what `quiet_gc` froze.

        NOTE: the engine cannot step afterwards.
        """
        if self.configs.quiet_gc:
            gc.unfreeze()  # NOTE: the startup heap may hold cycles (the engine's own): collectable again
        if self.workers is not None:
            self.runner.release_graphs()
            self.workers.shutdown()

    # ---- one step ------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Plan and launch a step, and read the tokens of the step before it.

        With async scheduling the step launched here is read by the next call, while the one after it
        runs: the device computes step N+1 while the host reads, detokenises and stops step N's
        sequences. A sequence that stops at step N has also been given a row in step N+1; that token is
        dropped. Without it (the CPU default) a step is read as soon as it is launched.
        """
        outputs: list[RequestOutput] = []
        in_flight, self._in_flight = self._in_flight, None
        if in_flight is not None and in_flight.needs_token_history:
            outputs += self._read_step(in_flight)
            in_flight = None
        plan = self.scheduler.schedule()
        self.last_plan = plan  # read by metrics and tests
        launched = None
        if not plan.is_empty:
            try:
                inputs = self.runner.prepare(plan)
                if self.workers is not None:
                    self.workers.send_step(inputs)  # the other ranks run the same step alongside
                launched = self.runner.launch(plan, inputs)
            except BaseException:
                if self.workers is not None:
                    # NOTE: the ranks may now disagree on which collective comes next: the group cannot go
                    # on, so its workers stop and every later step fails at once instead of hanging
                    self.shutdown()
                raise
            self.scheduler.update_computed(plan)
            if self.configs.quiet_gc:
                collect_garbage_between_steps()
        if in_flight is not None:
            outputs += self._read_step(in_flight)
        if launched is not None:
            if self.configs.async_scheduling and self.requests:
                self._in_flight = launched
            else:
                outputs += self._read_step(launched)
        return outputs

    def _read_step(self, step: LaunchedStep) -> list[RequestOutput]:
        """Append a launched step's tokens to their sequences (waiting for the device if need be)."""
        sampled = self.runner.collect(step)
        # NOTE: before the tokens: the step that samples a request's first token also scores its last prompt
        # tokens, so every output with a token comes after all its prompt's scores
        for seq_id, position, score in self.runner.collect_prompt_scores(step):
            seq = self.scheduler.seqs_by_id.get(seq_id)
            if seq is not None:
                seq.request.prompt_logprobs[position] = score
        touched: dict[str, Request] = {}
        now = time.monotonic()
        for row, token in zip(step.plan.sampling_rows, sampled):
            seq = self.scheduler.seqs_by_id.get(row.seq_id)
            if seq is None:
                # it ended (stop, abort, or a failure earlier in this loop) after this step was launched:
                # the token is dropped
                continue
            touched[seq.request.request_id] = seq.request
            if seq.request.times.first_token is None:
                seq.request.times.first_token = now
            try:
                self._accept_token(seq, token)
            except Exception as error:  # noqa: BLE001 - one request's failure must not end the step for all
                self._fail_request(seq.request, error)
        return [self._output_or_failure(request) for request in touched.values()]

    def _accept_token(self, seq: Sequence, token: TokenLogprob) -> None:
        if self.token_hook is not None:
            self.token_hook(seq, token)
        self._append_token(seq, token)

    def _fail_request(self, request: Request, error: BaseException) -> None:
        """Finish every choice of the request with reason "error" (its blocks are freed); it reports once.

        NOTE: tokens are sampled only once a request has forked its n choices, so finishing the choices it
        has finishes the request.
        """
        logger.error("request %s failed: %r", request.request_id, error)
        self._failures[request.request_id] = f"{type(error).__name__}: {error}"
        self.scheduler.finish_request(request, "error")

    def _output_or_failure(self, request: Request) -> RequestOutput:
        """The request's output; if building it fails, the request fails and reports without text."""
        if request.request_id not in self._failures:
            try:
                return self._make_output(request)
            except Exception as error:  # noqa: BLE001 - e.g. the detokenizer: this request alone fails
                self._fail_request(request, error)
        return self._failed_output(request, self._failures.pop(request.request_id))

    def _failed_output(self, request: Request, message: str) -> RequestOutput:
        self.requests.pop(request.request_id, None)
        self._forget(request)
        times = request.times
        times.finished = time.monotonic()
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            outputs=[CompletionOutput(index=seq.index, text="", token_ids=seq.output_token_ids,
                                      cumulative_logprob=None, logprobs=None, finish_reason="error")
                     for seq in request.seqs],
            finished=True,
            metrics=RequestMetrics(times.arrival, times.first_scheduled, times.first_token, times.finished,
                                   sum(s.num_preemptions for s in request.seqs), times.cached_prompt_tokens),
            error=message,
        )

    def _append_token(self, seq: Sequence, token: TokenLogprob) -> None:
        if seq.request.params.max_tokens == 0:  # only the prompt was wanted (its scores): the token is dropped
            self.scheduler.finish_sequence(seq, "length")
            return
        seq.append_token(token)
        if seq.num_computed_tokens >= seq.num_known_tokens:  # a launched step already used this token
            self.block_manager.cache_full_blocks(seq)
        params = seq.request.params
        reason, stop_reason = None, None
        if token.token_id in self.eos_token_ids and not params.ignore_eos:
            reason = "stop"
        elif token.token_id in params.stop_token_ids:
            reason, stop_reason = "stop", token.token_id
        # NOTE: the grammar is complete when it takes no more tokens (only end-of-sequence would come):
        # the sequence stops after this token's text
        complete = reason is None and seq.grammar is not None and advance(seq.grammar, token.token_id)
        detok = self._detokenizer(seq)
        if detok is not None and reason is None:
            matched = detok.add_tokens([token.token_id])
            if matched is not None:
                reason, stop_reason = "stop", matched
        if complete and reason is None:
            reason = "stop"
        if reason is None and (
            (params.max_tokens is not None and seq.num_known_output_tokens >= params.max_tokens)
            or seq.num_known_tokens >= self.configs.scheduler.max_model_len
        ):
            reason = "length"
        if reason is not None:
            self.scheduler.finish_sequence(seq, reason, stop_reason)

    def _detokenizer(self, seq: Sequence) -> IncrementalDetokenizer | None:
        if self.tokenizer is None:
            return None
        detok = self._detokenizers.get(seq.seq_id)
        if detok is None:
            params = seq.request.params
            detok = IncrementalDetokenizer(
                self.tokenizer,
                skip_special_tokens=params.skip_special_tokens,
                stop=params.stop_strings,
                include_stop_str_in_output=params.include_stop_str_in_output,
            )
            self._detokenizers[seq.seq_id] = detok
        return detok

    def _make_output(self, request: Request) -> RequestOutput:
        finished = request.is_finished
        choices = []
        num_preemptions = 0
        for seq in request.seqs:
            num_preemptions += seq.num_preemptions
            detok = self._detokenizers.get(seq.seq_id)
            emitted = self._emitted.get(seq.seq_id, 0)
            outputs = seq.output_token_ids
            want_logprobs = request.params.logprobs is not None
            # NOTE: the delta first: at the finish it flushes held-back text into output_text.
            delta_text = detok.get_delta(seq.is_finished) if detok else ""
            choices.append(
                CompletionOutput(
                    index=seq.index,
                    text=detok.output_text if detok else "",
                    token_ids=outputs,
                    cumulative_logprob=seq.cumulative_logprob,
                    logprobs=list(seq.logprobs) if want_logprobs else None,
                    finish_reason=seq.finish_reason,
                    stop_reason=seq.stop_reason,
                    delta_text=delta_text,
                    delta_token_ids=outputs[emitted:],
                    delta_logprobs=seq.logprobs[emitted:] if want_logprobs else None,
                )
            )
            self._emitted[seq.seq_id] = len(outputs)
        times = request.times
        if finished:
            times.finished = time.monotonic()
            self.requests.pop(request.request_id, None)
            self._forget(request)
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            outputs=choices,
            finished=finished,
            metrics=RequestMetrics(
                times.arrival, times.first_scheduled, times.first_token, times.finished, num_preemptions,
                times.cached_prompt_tokens,
            ),
            prompt_logprobs=request.prompt_logprobs,
        )

    def _forget(self, request: Request) -> None:
        for seq in request.seqs:
            self._detokenizers.pop(seq.seq_id, None)
            self._emitted.pop(seq.seq_id, None)


def _prompt_list(prompts: PromptType | SequenceABC[PromptType]) -> list[PromptType]:
    """One prompt (a text, token ids or a prompt dict) or a list of them, as a list."""
    if isinstance(prompts, (str, Mapping)) or (prompts and isinstance(prompts[0], int)):
        return [prompts]  # type: ignore[list-item]
    return list(prompts)


class LLM:
    """Offline generation: give all prompts, get all outputs (in the same order)."""

    def __init__(self, model: str, **kwargs) -> None:
        self.engine = LLMEngine(EngineArgs(model=model, **kwargs))
        self.tokenizer = self.engine.tokenizer

    def generate(
        self,
        prompts: PromptType | SequenceABC[PromptType],
        params: SamplingParams | SequenceABC[SamplingParams] | None = None,
        priority: SequenceABC[int] | None = None,
    ) -> list[RequestOutput]:
        """`priority`: one per prompt (vLLM's; needs the priority scheduling policy)."""
        prompts = _prompt_list(prompts)
        if params is None:
            params = self.default_sampling_params()
        params_list = list(params) if isinstance(params, SequenceABC) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(f"one SamplingParams per prompt: {len(params_list)} for {len(prompts)} prompts")
        priorities = list(priority) if priority is not None else [0] * len(prompts)
        if len(priorities) != len(prompts):
            raise ValueError(f"one priority per prompt: {len(priorities)} for {len(prompts)} prompts")
        return self._run(self._add_all([(p, sp, rank) for p, sp, rank in zip(prompts, params_list, priorities)]))

    def _add_all(self, requests: list[tuple[PromptType, SamplingParams, int]]) -> list[str]:
        """Admit every request or none: one the engine refuses aborts those admitted before it (vLLM's)."""
        ids: list[str] = []
        try:
            for prompt, params, priority in requests:
                ids.append(self.engine.add_request(None, prompt, params, priority=priority).request_id)
        except Exception:
            for request_id in ids:
                self.engine.abort_request(request_id)
            raise
        return ids

    def beam_search(self, prompts: PromptType | SequenceABC[PromptType],
                    params: BeamSearchParams) -> list[RequestOutput]:
        """vLLM's `LLM.beam_search`: each prompt's `params.width` most likely continuations (beam_search.py
        says how), as one finished RequestOutput a prompt whose choices are the beams, best first."""
        prompts = _prompt_list(prompts)
        limit = self.engine.configs.scheduler.max_model_len
        searches = []
        for prompt in prompts:
            ids = self.engine.tokenize(prompt)
            if len(ids) + params.max_tokens > limit:
                raise RequestError(f"a prompt of {len(ids)} tokens and {params.max_tokens} more exceed the "
                                   f"maximum context length {limit}")
            searches.append(BeamSearch(ids, params, self.engine.eos_token_ids))
        step_params = params.step_params()
        while live := [search for search in searches if not search.done]:
            groups = [[self.engine.add_request(None, context, step_params).request_id
                       for context in search.contexts()] for search in live]
            request_ids = [request_id for group in groups for request_id in group]
            outs = dict(zip(request_ids, self._run(request_ids)))
            for search, group in zip(live, groups):
                search.advance([outs[i].outputs[0].logprobs[0].top for i in group])
        return [search.output(f"beam-{index}", prompt if isinstance(prompt, str) else None, self.tokenizer)
                for index, (search, prompt) in enumerate(zip(searches, prompts))]

    def default_sampling_params(self) -> SamplingParams:
        """What `generate` and `chat` use when given no params: SamplingParams' defaults, with the sampling
        the model's authors recommend in its generation_config.json (as vLLM's LLM does)."""
        return SamplingParams(**self.engine.prompts.sampling_defaults)

    def chat(self, conversations, params: SamplingParams | None = None) -> list[RequestOutput]:
        """One conversation (a list of {"role", "content"} dicts) or a list of them."""
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        prompts = [self.engine.chat_prompt_ids(c) for c in conversations]
        return self.generate(prompts, params)

    def _run(self, request_ids: list[str]) -> list[RequestOutput]:
        final: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.finished:
                    final[out.request_id] = out
        return [final[i] for i in request_ids]
