"""AsyncLLMEngine: the engine stepped by a background thread, each request an async stream of outputs.

The engine thread owns the LLMEngine: it alone touches the scheduler, the cache and the model, so no
locks guard engine state. Callers talk to it through a thread-safe command queue (add, abort, drain) and
get their outputs through per-request asyncio queues filled with `loop.call_soon_threadsafe`, one batch per
step. The event loop never waits on a model step: torch releases the GIL while it computes.

What keeps it up under load and misbehaviour:
- admission is synchronous and bounded: `submit` refuses a request (`EngineOverloadedError`) while
  `max_waiting_requests` requests still wait for their first output, so the queue never grows unbounded;
- a request past its wall-clock limit (`request_timeout_s`) is aborted by the engine thread and its stream
  ends with `RequestTimeoutError`;
- a request that fails inside the engine ends its stream with `RequestFailedError`, alone; a whole step
  that fails fails the requests the engine held, and the loop goes on serving new ones;
- `drain(grace_s)` (graceful shutdown) refuses new requests, lets the running ones finish within the
  grace period, then ends the rest with `EngineShuttingDownError`.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass

from .config import EngineArgs
from .engine import LLMEngine, PromptType, RequestError
from .outputs import RequestOutput
from .sampling_params import SamplingParams

logger = logging.getLogger(__name__)

LONG_PROMPT_CHARS = 2048  # tokenize longer prompts in a worker thread, off the event loop


class EngineOverloadedError(RuntimeError):
    """Too many requests wait for their first output: the client should retry later."""


class EngineShuttingDownError(RuntimeError):
    """The engine is draining or stopped: it takes no new requests and ends those left at the deadline."""


class RequestTimeoutError(RuntimeError):
    """The request ran past the engine's wall-clock limit and was aborted."""


class RequestFailedError(RuntimeError):
    """The engine failed while serving this request (the message says why, for logs, not for clients)."""


@dataclass(frozen=True)
class RequestLimits:
    """How much the async engine takes on. None means no limit (the library default; the service sets both)."""

    max_waiting_requests: int | None = None  # requests admitted that have not had their first output yet
    request_timeout_s: float | None = None  # wall-clock limit per request, from admission to its last output

    def __post_init__(self) -> None:
        if self.max_waiting_requests is not None and self.max_waiting_requests < 1:
            raise ValueError("max_waiting_requests must be at least 1")
        if self.request_timeout_s is not None and not self.request_timeout_s > 0:
            raise ValueError("request_timeout_s must be positive")


class EngineObserver:
    """What the engine thread reports (metrics.EngineMetrics implements it); every method is a no-op here.

    NOTE: all but `observe_rejection` run on the engine thread, which alone may read the engine's state.
    """

    def observe_step(self, engine: LLMEngine, outputs: list[RequestOutput]) -> None:
        """After every step; finished outputs with an `error` are failures."""

    def observe_abort(self, engine: LLMEngine) -> None:
        """A request was aborted (client gone, shutdown)."""

    def observe_timeout(self, engine: LLMEngine) -> None:
        """A request was aborted for running past its time limit."""

    def observe_failure(self, engine: LLMEngine) -> None:
        """A request failed because its whole step failed."""

    def observe_rejection(self) -> None:
        """A request was refused at admission (overload). Runs on the caller's event loop."""


@dataclass
class _Add:
    request_id: str
    prompt: PromptType
    prompt_token_ids: list[int]
    params: SamplingParams
    stream: "RequestStream"


@dataclass
class _Abort:
    request_id: str


@dataclass
class _Drain:
    deadline: float  # time.monotonic() after which the requests left are ended


class RequestStream:
    """One request's outputs, as the event loop sees them: an async iterator of `RequestOutput`s, the last
    with `finished`; a failure, a timeout or a shutdown is raised from it instead.

    NOTE: closing it (`aclose`) before its last output aborts the request, which frees its KV blocks. Unlike
    an async generator's `finally`, that holds even when it was never iterated.
    """

    def __init__(self, owner: "AsyncLLMEngine", request_id: str, deadline: float | None) -> None:
        self.request_id = request_id
        self.deadline = deadline
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._owner = owner
        self._closed = False

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self._closed:
            raise StopAsyncIteration
        item = await self.queue.get()
        self._owner._started(self.request_id)
        if isinstance(item, BaseException):
            self._release(abort=False)  # the engine already dropped the request
            raise item
        if item.error is not None:
            self._release(abort=False)
            raise RequestFailedError(item.error)
        if item.finished:
            self._release(abort=False)
        return item

    async def aclose(self) -> None:
        self.close()

    def close(self) -> None:
        self._release(abort=True)

    def _release(self, abort: bool) -> None:
        if not self._closed:
            self._closed = True
            self._owner._release(self.request_id, abort)


class AsyncLLMEngine:
    def __init__(
        self,
        args: EngineArgs | None = None,
        *,
        engine: LLMEngine | None = None,
        observer: EngineObserver | None = None,
        limits: RequestLimits = RequestLimits(),
    ) -> None:
        """`observer` (optional, e.g. `metrics.EngineMetrics`) hears about steps, aborts, timeouts, failures
        and rejections; `limits` bound the queue and each request's time."""
        self.engine = engine if engine is not None else LLMEngine(args)  # type: ignore[arg-type]
        self.observer = observer or EngineObserver()
        self.limits = limits
        self._owns_engine = engine is None  # NOTE: an engine given to us is its giver's to shut down
        self.tokenizer = self.engine.tokenizer
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._ids = itertools.count(1)
        # NOTE: touched by the engine thread only
        self._streams: dict[str, RequestStream] = {}
        self._deadlines: list[tuple[float, str]] = []  # a heap of (deadline, request id)
        self._drain_deadline: float | None = None
        # NOTE: touched on the callers' event loops only
        self._active_ids: set[str] = set()  # streams open
        self._waiting_ids: set[str] = set()  # streams without their first output yet
        self._draining = False  # NOTE: a plain flag: drain() may run in a signal handler
        self.dead_error: BaseException | None = None

    # ---- lifecycle -----------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="pagedllm-engine", daemon=True)
            self._thread.start()

    def drain(self, grace_s: float) -> None:
        """Begin a graceful shutdown: refuse new requests now, end those still running after `grace_s`.

        NOTE: safe to call from a signal handler: it sets a flag and puts on a SimpleQueue (reentrant).
        """
        self._draining = True
        self._commands.put(_Drain(time.monotonic() + grace_s))

    def shutdown(self) -> None:
        """Stop the engine thread; unfinished requests are aborted and their streams end with an error.
        An engine built here is shut down too (its tensor-parallel workers stop)."""
        self._draining = True
        if self._thread is not None:
            self._stopping.set()
            self._commands.put(None)
            self._thread.join()
            self._thread = None
        if self._owns_engine:
            self.engine.shutdown()

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def is_draining(self) -> bool:
        return self._draining

    @property
    def num_waiting(self) -> int:
        """Requests admitted that have not had their first output yet (what `max_waiting_requests` bounds)."""
        return len(self._waiting_ids)

    @property
    def num_open_streams(self) -> int:
        return len(self._active_ids)

    # ---- requests ------------------------------------------------------------------------------
    def submit(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        prompt: PromptType | None = None,
    ) -> RequestStream:
        """Admit a request and return its stream; everything that can refuse it raises here, synchronously
        (so an HTTP route can still answer with a status code): `RequestError` (invalid),
        `EngineOverloadedError`, `EngineShuttingDownError`. Must be called on a running event loop."""
        if self._draining:
            raise EngineShuttingDownError("the engine is shutting down")
        if self.dead_error is not None:
            raise RuntimeError("the engine loop has failed")
        self.start()
        self.engine.validate_prompt(prompt_token_ids, params)
        limit = self.limits.max_waiting_requests
        if limit is not None and len(self._waiting_ids) >= limit:
            self.observer.observe_rejection()
            raise EngineOverloadedError(f"{limit} requests are already waiting")
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self._active_ids:
            raise RequestError(f"request id {request_id!r} is already in use")
        timeout = self.limits.request_timeout_s
        stream = RequestStream(self, request_id, None if timeout is None else time.monotonic() + timeout)
        self._active_ids.add(request_id)
        self._waiting_ids.add(request_id)
        self._commands.put(_Add(request_id, prompt if prompt is not None else prompt_token_ids,
                                prompt_token_ids, params, stream))
        return stream

    async def generate(
        self,
        prompt: PromptType,
        params: SamplingParams | None = None,
        request_id: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs, one per step in which it advanced; the last has `finished`.

        Cancelling the consumer (a client that went away) aborts the request, which frees its blocks.
        What `submit` refuses raises before anything is queued; `RequestFailedError`, `RequestTimeoutError`
        and `EngineShuttingDownError` end a stream that had begun.
        """
        params = params or SamplingParams()
        if isinstance(prompt, str) and len(prompt) > LONG_PROMPT_CHARS:
            ids = await asyncio.to_thread(self.engine.tokenize, prompt)  # keep the event loop free
        else:
            ids = self.engine.tokenize(prompt)
        async with aclosing(self.submit(ids, params, request_id, prompt=prompt)) as stream:
            async for out in stream:
                yield out

    def abort(self, request_id: str) -> None:
        self._commands.put(_Abort(request_id))

    def _started(self, request_id: str) -> None:
        self._waiting_ids.discard(request_id)

    def _release(self, request_id: str, abort: bool) -> None:
        self._waiting_ids.discard(request_id)
        self._active_ids.discard(request_id)
        if abort:
            self.abort(request_id)

    # ---- the engine thread ---------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stopping.is_set():
                self._drain_commands(block=not self.engine.has_unfinished_requests())
                if self._stopping.is_set():
                    break
                self._end_overdue(time.monotonic())
                if self.engine.has_unfinished_requests():
                    self._step()
        except BaseException as error:  # noqa: BLE001 - the loop died: tell every waiting stream
            logger.exception("engine loop failed")
            self.dead_error = error
            self._fail_all(RuntimeError(f"engine loop failed: {error!r}"))
            return
        self._fail_all(EngineShuttingDownError("the engine shut down"))

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as error:  # noqa: BLE001 - the step's requests fail; the loop serves the next ones
            logger.exception("engine step failed: failing the %d requests it held", len(self.engine.requests))
            self._end_all(RequestFailedError(f"the engine step failed: {error!r}"), self.observer.observe_failure)
            for request_id in list(self.engine.requests):  # NOTE: none should be left without a stream
                self.engine.abort_request(request_id)
            return
        # NOTE: counted before delivered: a client that sees its request end finds it on /metrics already
        self.observer.observe_step(self.engine, outputs)
        self._deliver(outputs)

    def _drain_commands(self, block: bool) -> None:
        while True:
            try:
                command = self._commands.get(block=block)
            except queue.Empty:
                return
            block = False
            if command is None:
                return
            if isinstance(command, _Add):
                self._add(command)
            elif isinstance(command, _Abort):
                self._streams.pop(command.request_id, None)
                if self.engine.abort_request(command.request_id):
                    self.observer.observe_abort(self.engine)
            elif isinstance(command, _Drain):
                self._drain_deadline = command.deadline

    def _add(self, command: _Add) -> None:
        try:
            self.engine.add_request(
                command.request_id, command.prompt, command.params, prompt_token_ids=command.prompt_token_ids
            )
        except Exception as error:  # noqa: BLE001 - e.g. a duplicate id: that request fails alone
            command.stream.loop.call_soon_threadsafe(command.stream.queue.put_nowait, error)
            return
        self._streams[command.request_id] = command.stream
        if command.stream.deadline is not None:
            heapq.heappush(self._deadlines, (command.stream.deadline, command.request_id))

    def _end_overdue(self, now: float) -> None:
        """End the requests past their wall-clock limit, and every request once the drain deadline passed."""
        while self._deadlines and self._deadlines[0][0] <= now:
            _, request_id = heapq.heappop(self._deadlines)
            if request_id in self._streams:
                timeout = self.limits.request_timeout_s
                self._end(request_id, RequestTimeoutError(f"the request ran past the {timeout:g} s time limit"),
                          self.observer.observe_timeout)
        if self._drain_deadline is not None and now >= self._drain_deadline and self._streams:
            logger.warning("shutdown grace period over: ending %d requests", len(self._streams))
            self._end_all(EngineShuttingDownError("the server is shutting down"), self.observer.observe_abort)

    def _end(self, request_id: str, error: BaseException, observe: Callable[[LLMEngine], None]) -> None:
        """Abort one request (its blocks are free after this) and end its stream with `error`."""
        stream = self._streams.pop(request_id)
        if self.engine.abort_request(request_id):
            observe(self.engine)
        _put_threadsafe(stream, error)

    def _end_all(self, error: BaseException, observe: Callable[[LLMEngine], None]) -> None:
        for request_id in list(self._streams):
            self._end(request_id, error, observe)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            if out.finished:
                del self._streams[out.request_id]
            by_loop.setdefault(stream.loop, []).append((stream, out))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:
                pass  # that event loop is closed: nobody reads those streams

    def _fail_all(self, error: BaseException) -> None:
        for request_id, stream in list(self._streams.items()):
            self.engine.abort_request(request_id)
            _put_threadsafe(stream, error)
        self._streams.clear()


def _put_threadsafe(stream: RequestStream, item: RequestOutput | BaseException) -> None:
    try:
        stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)
    except RuntimeError:
        pass  # that event loop is closed: nobody reads this stream


def _put_all(items) -> None:
    for stream, out in items:
        stream.queue.put_nowait(out)
