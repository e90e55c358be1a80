"""AsyncLLMEngine: the engine stepped by a background thread, each request an async stream of outputs.

The engine thread owns the LLMEngine: it alone touches the scheduler, the cache and the model, so no
locks guard engine state. Callers talk to it through a thread-safe command queue (add, abort) and get
their outputs through per-request asyncio queues filled with `loop.call_soon_threadsafe`, one batch per
step. The event loop never waits on a model step: torch releases the GIL while it computes.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass

from .config import EngineArgs
from .engine import LLMEngine, PromptType, RequestError
from .outputs import RequestOutput
from .sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass
class _Add:
    request_id: str
    prompt: PromptType
    prompt_token_ids: list[int]
    params: SamplingParams
    stream: "_Stream"


@dataclass
class _Abort:
    request_id: str


class _Stream:
    """One request's outputs, as the event loop sees them."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.finished = False


class AsyncLLMEngine:
    def __init__(self, args: EngineArgs | None = None, *, engine: LLMEngine | None = None, observer=None) -> None:
        """`observer` (optional, e.g. `metrics.EngineMetrics`) is called on the engine thread:
        `observe_step(engine, outputs)` after every step, `observe_abort(engine)` after every abort."""
        self.engine = engine if engine is not None else LLMEngine(args)  # type: ignore[arg-type]
        self.observer = observer
        self.tokenizer = self.engine.tokenizer
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}  # NOTE: touched only by the engine thread
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._ids = 0
        self._active_ids: set[str] = set()  # NOTE: touched on the callers' event loop only
        self.dead_error: BaseException | None = None

    # ---- lifecycle -----------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="pagedllm-engine", daemon=True)
            self._thread.start()

    def shutdown(self) -> None:
        """Stop the engine thread; unfinished requests are aborted and their streams end with an error."""
        if self._thread is None:
            return
        self._stopping.set()
        self._commands.put(None)
        self._thread.join()
        self._thread = None

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # ---- requests ------------------------------------------------------------------------------
    async def generate(
        self,
        prompt: PromptType,
        params: SamplingParams | None = None,
        request_id: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs, one per step in which it advanced; the last has `finished`.

        Cancelling the consumer (a client that went away) aborts the request, which frees its blocks.
        Invalid requests raise `RequestError` here, before anything is queued.
        """
        self.start()
        params = params or SamplingParams()
        if request_id is None:
            self._ids += 1
            request_id = f"req-{self._ids}"
        if isinstance(prompt, str) and len(prompt) > 2048:
            ids = await asyncio.to_thread(self.engine.tokenize, prompt)  # keep the event loop free
        else:
            ids = self.engine.tokenize(prompt)
        self.engine.validate_prompt(ids, params)
        if request_id in self._active_ids:
            raise RequestError(f"request id {request_id!r} is already in use")
        self._active_ids.add(request_id)
        stream = _Stream(asyncio.get_running_loop())
        self._commands.put(_Add(request_id, prompt, ids, params, stream))
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    stream.finished = True
                    return
        finally:
            self._active_ids.discard(request_id)
            if not stream.finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self._commands.put(_Abort(request_id))

    # ---- the engine thread ---------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stopping.is_set():
                self._drain_commands(block=not self.engine.has_unfinished_requests())
                if self._stopping.is_set():
                    break
                if self.engine.has_unfinished_requests():
                    outputs = self.engine.step()
                    self._deliver(outputs)
                    if self.observer is not None:
                        self.observer.observe_step(self.engine, outputs)
        except BaseException as error:  # noqa: BLE001 - the loop died: tell every waiting stream
            logger.exception("engine loop failed")
            self.dead_error = error
            self._fail_all(RuntimeError(f"engine loop failed: {error!r}"))
            return
        self._fail_all(RuntimeError("engine shut down"))

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
                if self.engine.abort_request(command.request_id) and self.observer is not None:
                    self.observer.observe_abort(self.engine)

    def _add(self, command: _Add) -> None:
        try:
            self.engine.add_request(
                command.request_id, command.prompt, command.params, prompt_token_ids=command.prompt_token_ids
            )
        except Exception as error:  # noqa: BLE001 - e.g. a duplicate id: that request fails alone
            command.stream.loop.call_soon_threadsafe(command.stream.queue.put_nowait, error)
            return
        self._streams[command.request_id] = command.stream

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
            loop.call_soon_threadsafe(_put_all, items)

    def _fail_all(self, error: BaseException) -> None:
        for request_id, stream in list(self._streams.items()):
            self.engine.abort_request(request_id)
            try:
                stream.loop.call_soon_threadsafe(stream.queue.put_nowait, error)
            except RuntimeError:
                pass  # that event loop is closed
        self._streams.clear()


def _put_all(items) -> None:
    for stream, out in items:
        stream.queue.put_nowait(out)
