"""The loop that drives an LLMEngine for the AsyncLLMEngine: it takes commands (add, abort, drain, stop),
steps the engine while it holds requests, ends the requests past their deadlines, and after each pass hands
one batch to its sink: the outputs and errors for the request streams, and a report for the metrics.

It runs on the AsyncLLMEngine's thread, or alone in a child process (engine_process.py) where nothing else
contends for its GIL. Either way it alone touches the LLMEngine, so no locks guard engine state; it knows
request ids only, never the streams (the AsyncLLMEngine routes each delivery to its stream).
"""

from __future__ import annotations

import heapq
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from .engine import LLMEngine, PromptType
from .outputs import RequestOutput
from .sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class EngineOverloadedError(RuntimeError):
    """Too many requests wait for their first output: the client should retry later."""


class EngineShuttingDownError(RuntimeError):
    """The engine is draining or stopped: it takes no new requests and ends those left at the deadline."""


class RequestTimeoutError(RuntimeError):
    """The request ran past the engine's wall-clock limit and was aborted."""


class RequestFailedError(RuntimeError):
    """The engine failed while serving this request (the message says why, for logs, not for clients)."""


# ---- commands (what the AsyncLLMEngine asks of the loop) ----------------------------------------------
@dataclass(frozen=True)
class AddRequest:
    request_id: str
    prompt: PromptType
    prompt_token_ids: list[int]
    params: SamplingParams
    deadline: float | None  # time.monotonic() past which the request is aborted (one clock for all processes)
    cache_salt: str | None = None  # LLMEngine.add_request's
    priority: int = 0  # LLMEngine.add_request's


@dataclass(frozen=True)
class AbortRequest:
    request_id: str


@dataclass(frozen=True)
class DrainRequests:
    deadline: float  # time.monotonic() after which the requests left are ended


Command = AddRequest | AbortRequest | DrainRequests | None  # None: stop the loop
NO_COMMAND = object()  # what a non-blocking receive returns when no command waits


# ---- what the loop reports -----------------------------------------------------------------------------
@dataclass(frozen=True)
class EngineStats:
    """The engine's counts after a pass, for the metrics' gauges."""

    num_running: int
    num_waiting: int
    num_unfinished: int
    kv_blocks_used: int
    kv_blocks_total: int
    prefix_query_tokens: int  # cumulative
    prefix_hit_tokens: int  # cumulative

    @classmethod
    def of(cls, engine: LLMEngine) -> "EngineStats":
        scheduler, blocks = engine.scheduler, engine.block_manager
        return cls(scheduler.num_running, scheduler.num_waiting, len(engine.requests), blocks.num_used_blocks,
                   blocks.num_blocks, blocks.prefix_query_tokens, blocks.prefix_hit_tokens)


@dataclass(frozen=True)
class FinishedRequest:
    """A request that finished normally, with what the metrics' histograms need."""

    prompt_tokens: int
    time_to_first_token: float | None
    time_per_output_token: float | None  # mean after the first token; None for a single token
    latency: float | None = None  # from arrival to the end

    @classmethod
    def of(cls, out: RequestOutput) -> "FinishedRequest":
        m = out.metrics
        ttft = tpot = None
        if m is not None and m.first_token_time is not None:
            ttft = m.first_token_time - m.arrival_time
            generated = max(len(c.token_ids) for c in out.outputs)
            if generated > 1 and m.finished_time is not None:
                tpot = (m.finished_time - m.first_token_time) / (generated - 1)
        latency = m.finished_time - m.arrival_time if m is not None and m.finished_time is not None else None
        return cls(len(out.prompt_token_ids), ttft, tpot, latency)


@dataclass
class EngineReport:
    """What one pass of the loop did.

    NOTE: every request the engine admits ends in exactly one of `finished`, `num_failed`, `num_aborted`
    or `num_timed_out` (the ends at shutdown are not counted), so the metrics lose none.
    """

    stats: EngineStats
    generated_tokens: int = 0  # tokens delivered (with async scheduling, a stopped row's extra token is not)
    num_preempted: int = 0
    finished: list[FinishedRequest] = field(default_factory=list)
    num_failed: int = 0
    num_aborted: int = 0
    num_timed_out: int = 0


Delivery = tuple[str, RequestOutput | BaseException]  # (request id, its next output or the error ending it)
Sink = Callable[[EngineReport, list[Delivery]], None]
Receive = Callable[[bool], object]  # receive(block) -> a Command, or NO_COMMAND when not blocking


class EngineLoop:
    def __init__(self, engine: LLMEngine, sink: Sink, request_timeout_s: float | None) -> None:
        self.engine = engine
        self._sink = sink
        self._timeout_s = request_timeout_s
        self._deadlines: list[tuple[float, str]] = []  # a heap of (deadline, request id)
        self._drain_deadline: float | None = None
        self._report = EngineReport(EngineStats.of(engine))
        self._deliveries: list[Delivery] = []

    def run(self, receive: Receive) -> None:
        """Serve commands and step until told to stop; the requests still held then end with
        `EngineShuttingDownError`. What kills the loop is raised (its host fails every stream)."""
        while True:
            if self._take_commands(receive, block=not self.engine.has_unfinished_requests()):
                break
            self._end_overdue(time.monotonic())
            if self.engine.has_unfinished_requests():
                self._step()
            self._flush()
        self._end_all(EngineShuttingDownError("the engine shut down"))  # NOTE: not counted: the metrics end too
        self._flush()

    def _take_commands(self, receive: Receive, block: bool) -> bool:
        """Apply the commands waiting (the first may be waited for); True when one said stop."""
        while True:
            command = receive(block)
            if command is NO_COMMAND:
                return False
            block = False
            if command is None:
                return True
            if isinstance(command, AddRequest):
                self._add(command)
            elif isinstance(command, AbortRequest):
                # NOTE: the last output ends the request's stream (a consumer that left has none to end)
                last = self.engine.abort_request(command.request_id)
                if last is not None:
                    self._report.num_aborted += 1
                    self._deliveries.append((command.request_id, last))
            elif isinstance(command, DrainRequests):
                self._drain_deadline = command.deadline

    def _add(self, command: AddRequest) -> None:
        try:
            self.engine.add_request(command.request_id, command.prompt, command.params,
                                    prompt_token_ids=command.prompt_token_ids, cache_salt=command.cache_salt,
                                    priority=command.priority)
        except Exception as error:  # noqa: BLE001 - e.g. a duplicate id: that request fails alone
            self._deliveries.append((command.request_id, error))
            return
        if command.deadline is not None:
            heapq.heappush(self._deadlines, (command.deadline, command.request_id))

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as error:  # noqa: BLE001 - the step's requests fail; the loop serves the next ones
            logger.exception("engine step failed: failing the %d requests it held", len(self.engine.requests))
            self._report.num_failed += self._end_all(RequestFailedError(f"the engine step failed: {error!r}"))
            return
        report = self._report
        plan = self.engine.last_plan
        if plan is not None:
            report.num_preempted += plan.num_preempted
        for out in outputs:
            report.generated_tokens += sum(len(choice.delta_token_ids) for choice in out.outputs)
            if out.finished:
                if out.error is not None:
                    report.num_failed += 1
                else:
                    report.finished.append(FinishedRequest.of(out))
            self._deliveries.append((out.request_id, out))

    def _end_overdue(self, now: float) -> None:
        """End the requests past their wall-clock limit, and every request once the drain deadline passed."""
        while self._deadlines and self._deadlines[0][0] <= now:
            _, request_id = heapq.heappop(self._deadlines)
            if request_id in self.engine.requests:
                error = RequestTimeoutError(f"the request ran past the {self._timeout_s:g} s time limit")
                self._report.num_timed_out += self._end(request_id, error)
        if self._drain_deadline is not None and now >= self._drain_deadline and self.engine.requests:
            logger.warning("shutdown grace period over: ending %d requests", len(self.engine.requests))
            self._report.num_aborted += self._end_all(EngineShuttingDownError("the server is shutting down"))

    def _end(self, request_id: str, error: BaseException) -> bool:
        """Abort one request (its blocks are free after this) and end its stream with `error`; True when the
        engine held it (the caller counts it)."""
        self._deliveries.append((request_id, error))
        return self.engine.abort_request(request_id) is not None

    def _end_all(self, error: BaseException) -> int:
        return sum(self._end(request_id, error) for request_id in list(self.engine.requests))

    def _flush(self) -> None:
        """Hand the pass's deliveries and report to the sink. NOTE: the report goes with its deliveries, so
        a client that sees its request end finds it counted on /metrics already."""
        report, deliveries = self._report, self._deliveries
        report.stats = EngineStats.of(self.engine)
        self._report, self._deliveries = EngineReport(report.stats), []
        self._sink(report, deliveries)
