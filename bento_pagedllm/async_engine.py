"""AsyncLLMEngine: the engine driven by a loop of its own, each request an async stream of outputs.

The loop (engine_loop.py) alone touches the LLMEngine. It runs on a background thread of this process,
or, with `engine_process=True`, in a child process with a GIL of its own (engine_process.py: the serving
process then keeps only the HTTP work, which under load matters more than the pipe between them). Callers
talk to it through a command queue (add, abort, drain); each pass of the loop comes back as one batch,
which this class routes to the per-request asyncio queues with `loop.call_soon_threadsafe`. The event loop
never waits on a model step.

What keeps it up under load and misbehaviour:
- admission is synchronous and bounded: `submit` refuses a request (`EngineOverloadedError`) while
  `max_waiting_requests` requests still wait for their first output, so the queue never grows unbounded;
- a request past its wall-clock limit (`request_timeout_s`) is aborted by the loop and its stream
  ends with `RequestTimeoutError`;
- a request that fails inside the engine ends its stream with `RequestFailedError`, alone; a whole step
  that fails fails the requests the engine held, and the loop goes on serving new ones;
- `drain(grace_s)` (graceful shutdown) refuses new requests, lets the running ones finish within the
  grace period, then ends the rest with `EngineShuttingDownError`;
- a loop (or engine process) that dies fails every open stream, and `dead_error` says why.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass

from .config import EngineArgs
from .engine import LLMEngine, PromptType, RequestError, TokenHook
from .engine_loop import (
    NO_COMMAND,
    AbortRequest,
    AddRequest,
    Command,
    Delivery,
    DrainRequests,
    EngineLoop,
    EngineOverloadedError,
    EngineReport,
    EngineShuttingDownError,
    RequestFailedError,
    RequestTimeoutError,
)
from .engine_process import EngineProcess, OutputAssembler
from .outputs import RequestOutput
from .prompts import PromptProcessor, plain_prompt
from .sampling_params import SamplingParams

logger = logging.getLogger(__name__)

__all__ = ["AsyncLLMEngine", "EngineObserver", "EngineOverloadedError", "EngineShuttingDownError",
           "RequestFailedError", "RequestLimits", "RequestStream", "RequestTimeoutError"]

LONG_PROMPT_CHARS = 2048  # tokenize longer prompts in a worker thread, off the event loop


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
    """What the engine loop reports (metrics.EngineMetrics implements it); every method is a no-op here.

    NOTE: `observe` runs on the thread that routes the loop's batches (the engine thread, or the reader of
    the engine process), before the batch's outputs reach their streams.
    """

    def observe(self, report: EngineReport) -> None:
        """After every pass of the loop: the engine's counts, the tokens generated, the requests ended."""

    def observe_rejection(self) -> None:
        """A request was refused at admission (overload). Runs on the caller's event loop."""


class RequestStream:
    """One request's outputs, as the event loop sees them: an async iterator of `RequestOutput`s, the last
    with `finished`; a failure, a timeout or a shutdown is raised from it instead.

    NOTE: closing it (`aclose`) before its last output aborts the request, which frees its KV blocks. Unlike
    an async generator's `finally`, that holds even when it was never iterated.
    """

    def __init__(self, owner: "AsyncLLMEngine", request_id: str, assembler: OutputAssembler | None) -> None:
        self.request_id = request_id
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.assembler = assembler  # rebuilds outputs from the engine process's deltas; None in-process
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


class _EngineThread:
    """Runs the loop on a thread of this process (the CPU default)."""

    def __init__(self, engine: LLMEngine, request_timeout_s: float | None,
                 on_batch: Callable[[EngineReport, list[Delivery]], None],
                 on_exit: Callable[[BaseException | None], None]) -> None:
        self._loop = EngineLoop(engine, on_batch, request_timeout_s)
        self._on_exit = on_exit
        self._commands: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="pagedllm-engine", daemon=True)
            self._thread.start()

    def send(self, command: Command) -> None:
        self._commands.put(command)  # NOTE: reentrant (a SimpleQueue): safe in a signal handler

    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stop(self) -> None:
        if self._thread is not None:
            self._commands.put(None)
            self._thread.join()

    def _receive(self, block: bool) -> object:
        try:
            return self._commands.get(block=block)
        except queue.Empty:
            return NO_COMMAND

    def _run(self) -> None:
        try:
            self._loop.run(self._receive)
        except BaseException as error:  # noqa: BLE001 - the loop died: every open stream fails
            logger.exception("engine loop failed")
            self._on_exit(RuntimeError(f"engine loop failed: {error!r}"))
            return
        self._on_exit(None)


class AsyncLLMEngine:
    def __init__(
        self,
        args: EngineArgs | None = None,
        *,
        engine: LLMEngine | None = None,
        observer: EngineObserver | None = None,
        limits: RequestLimits = RequestLimits(),
        engine_process: bool = False,
        token_hook: TokenHook | None = None,
    ) -> None:
        """`observer` (optional, e.g. `metrics.EngineMetrics`) hears what the loop did and the rejections;
        `limits` bound the queue and each request's time; `engine_process` runs the engine in a child process
        built from `args` (then `self.engine` is None); `token_hook` is the engine's test hook (faults.py)."""
        self.observer = observer or EngineObserver()
        self.limits = limits
        self._owns_engine = engine is None  # NOTE: an engine given to us is its giver's to shut down
        self._core: _EngineThread | EngineProcess
        if engine_process:
            if engine is not None or args is None:
                raise ValueError("engine_process=True builds its engine from args, in the child process")
            self.engine: LLMEngine | None = None
            self.prompts = PromptProcessor(args)
            self._core = EngineProcess(args, token_hook, limits.request_timeout_s, self._route, self._on_exit)
        else:
            self.engine = engine if engine is not None else LLMEngine(args)  # type: ignore[arg-type]
            if token_hook is not None:
                self.engine.token_hook = token_hook
            self.prompts = self.engine.prompts
            self._core = _EngineThread(self.engine, limits.request_timeout_s, self._route, self._on_exit)
        self.tokenizer = self.prompts.tokenizer
        self._ids = itertools.count(1)
        # NOTE: the streams by request id: added on the callers' event loops before their request is sent,
        # removed there on close or by the routing thread at their last output (single dict operations)
        self._streams: dict[str, RequestStream] = {}
        # NOTE: touched on the callers' event loops only
        self._active_ids: set[str] = set()  # streams open
        self._waiting_ids: set[str] = set()  # streams without their first output yet
        self._draining = False  # NOTE: a plain flag: drain() may run in a signal handler
        self.dead_error: BaseException | None = None
        # NOTE: set by `_on_exit` before it fails the open streams, so a caller whose stream ended with the
        # engine's death already sees it stopped (the core's thread is still alive while it runs `_on_exit`)
        self._core_exited = False

    # ---- lifecycle -----------------------------------------------------------------------------
    def start(self) -> None:
        self._core.start()

    def drain(self, grace_s: float) -> None:
        """Begin a graceful shutdown: refuse new requests now, end those still running after `grace_s`.

        NOTE: safe to call from a signal handler: it sets a flag and puts on a SimpleQueue (reentrant).
        """
        self._draining = True
        self._core.send(DrainRequests(time.monotonic() + grace_s))

    def shutdown(self) -> None:
        """Stop the loop; unfinished requests are aborted and their streams end with an error. An engine
        built here is shut down too (its tensor-parallel workers stop; an engine process exits)."""
        self._draining = True
        self._core.stop()
        self._fail_streams(EngineShuttingDownError("the engine shut down"))
        if self._owns_engine and self.engine is not None:
            self.engine.shutdown()

    @property
    def is_running(self) -> bool:
        return not self._core_exited and self._core.is_alive()

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
        cache_salt: str | None = None,
        priority: int = 0,
    ) -> RequestStream:
        """Admit a request and return its stream; everything that can refuse it raises here, synchronously
        (so an HTTP route can still answer with a status code): `RequestError` (invalid),
        `EngineOverloadedError`, `EngineShuttingDownError`. Must be called on a running event loop.
        `cache_salt`, `priority`: as `LLMEngine.add_request`'s."""
        if self._draining:
            raise EngineShuttingDownError("the engine is shutting down")
        if self.dead_error is not None:
            raise RuntimeError("the engine loop has failed")
        self.start()
        self.prompts.validate_prompt(prompt_token_ids, params, priority)
        limit = self.limits.max_waiting_requests
        if limit is not None and len(self._waiting_ids) >= limit:
            self.observer.observe_rejection()
            raise EngineOverloadedError(f"{limit} requests are already waiting")
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self._active_ids:
            raise RequestError(f"request id {request_id!r} is already in use")
        timeout = self.limits.request_timeout_s
        prompt = prompt if prompt is not None else prompt_token_ids
        assembler = None
        if self.engine is None:
            assembler = OutputAssembler(request_id, prompt if isinstance(prompt, str) else None, prompt_token_ids)
        stream = RequestStream(self, request_id, assembler)
        self._active_ids.add(request_id)
        self._waiting_ids.add(request_id)
        self._streams[request_id] = stream
        self._core.send(AddRequest(request_id, prompt, prompt_token_ids, params,
                                   None if timeout is None else time.monotonic() + timeout, cache_salt, priority))
        return stream

    async def generate(
        self,
        prompt: PromptType,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
    ) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs, one per step in which it advanced; the last has `finished`.

        Cancelling the consumer (a client that went away) aborts the request, which frees its blocks.
        What `submit` refuses raises before anything is queued; `RequestFailedError`, `RequestTimeoutError`
        and `EngineShuttingDownError` end a stream that had begun.
        """
        params = params or SamplingParams()
        prompt = plain_prompt(prompt)
        if isinstance(prompt, str) and len(prompt) > LONG_PROMPT_CHARS:
            ids = await asyncio.to_thread(self.prompts.tokenize, prompt)  # keep the event loop free
        else:
            ids = self.prompts.tokenize(prompt)
        async with aclosing(self.submit(ids, params, request_id, prompt=prompt, priority=priority)) as stream:
            async for out in stream:
                yield out

    def abort(self, request_id: str) -> None:
        """End a request from outside its stream (vLLM's `abort`): the stream's last output has its choices end
        with "abort". An id the engine no longer holds is ignored."""
        self._core.send(AbortRequest(request_id))

    def _started(self, request_id: str) -> None:
        self._waiting_ids.discard(request_id)

    def _release(self, request_id: str, abort: bool) -> None:
        self._waiting_ids.discard(request_id)
        self._active_ids.discard(request_id)
        if abort:
            self._streams.pop(request_id, None)
            self.abort(request_id)

    # ---- what the loop sends back (on the engine thread, or the engine process's reader) ---------
    def _route(self, report: EngineReport, deliveries: list[Delivery]) -> None:
        # NOTE: counted before delivered: a client that sees its request end finds it on /metrics already
        self.observer.observe(report)
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for request_id, item in deliveries:
            stream = self._streams.get(request_id)
            if stream is None:
                continue  # closed by its consumer: the request is (being) aborted
            if stream.assembler is not None and not isinstance(item, BaseException):
                item = stream.assembler.add(item)
            if isinstance(item, BaseException) or item.finished:
                self._streams.pop(request_id, None)
            by_loop.setdefault(stream.loop, []).append((stream, item))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:
                pass  # that event loop is closed: nobody reads those streams

    def _on_exit(self, error: BaseException | None) -> None:
        """The loop ended: stopped (error None) or dead. Every stream still open ends."""
        self._core_exited = True
        if error is not None:
            self.dead_error = error
        self._fail_streams(error if error is not None else EngineShuttingDownError("the engine shut down"))

    def _fail_streams(self, error: BaseException) -> None:
        for request_id in list(self._streams):
            stream = self._streams.pop(request_id, None)
            if stream is not None:
                _put_threadsafe(stream, error)


def _put_threadsafe(stream: RequestStream, item: RequestOutput | BaseException) -> None:
    try:
        stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)
    except RuntimeError:
        pass  # that event loop is closed: nobody reads this stream


def _put_all(items) -> None:
    for stream, out in items:
        stream.queue.put_nowait(out)
