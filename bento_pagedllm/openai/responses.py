"""Answering one API request: run its engine requests (one per prompt, admitted together) and answer in one
JSON body or as Server-Sent Events (routes.py parses and admits the request; formats.py says how a choice
and a streamed delta look).

NOTE: closing an engine stream aborts its request, so every path here closes the streams it opened: a client
that goes away mid-stream (the SSE response is closed) or before a non-streamed answer (its task is
cancelled) frees its KV blocks at the engine's next step.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any, TypeVar

from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from ..async_engine import AsyncLLMEngine, RequestStream
from ..beam_search import BeamSearchParams, beam_search_output
from ..outputs import CompletionOutput, RequestOutput
from ..sampling_params import SamplingParams
from .errors import OpenAIError
from .formats import Format, Prompt, finish_reason

T = TypeVar("T")


@dataclass
class Job:
    """An API request ready for the engine: its prompts, each with its sampling parameters."""

    id: str
    created: int
    model: str
    n: int
    prompts: list[Prompt]
    params: list[SamplingParams]
    cache_salt: str | None = None  # vLLM's: the prefix cache shared only with requests of the same salt
    priority: int = 0  # vLLM's: lower runs first (the priority scheduling policy)
    beams: list[BeamSearchParams] | None = None  # vLLM's use_beam_search: per prompt, instead of sampling
    # NOTE: set where the id came from the client (X-Request-Id, vLLM's `request_id`), which may send it twice:
    # keeps the engine's request ids apart
    nonce: str = ""

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p.token_ids) for p in self.prompts)

    def engine_request_id(self, prompt_index: int) -> str:
        return f"{self.id}{self.nonce}-{prompt_index}"


class WritePacer:
    """When a stream writes what it has queued: the first tokens at once (time to first token), then once
    `interval` new tokens wait or an answer finished, and only when no more outputs are queued, so a loop that
    fell behind the engine catches up in fewer writes (vLLM's output collector does the same).

    NOTE: each write is a trip through the ASGI stack (BentoML's middlewares, its tracing, uvicorn), hence the
    interval."""

    def __init__(self, streams: "JobStreams", interval: int) -> None:
        self.streams, self.interval = streams, interval
        self.waiting_tokens, self.finishing, self.first = 0, False, True  # since the last write

    def add(self, tokens: int, finished: bool) -> None:
        self.waiting_tokens += tokens
        self.finishing = self.finishing or finished

    def due(self) -> bool:
        """A write is due now; the caller writes, or has nothing to write, and calls `wrote()` after writing."""
        pending = self.waiting_tokens >= self.interval or self.finishing or self.first
        return pending and not self.streams.has_pending()

    def wrote(self) -> None:
        self.waiting_tokens, self.finishing, self.first = 0, False, False


class JobStreams:
    """The engine streams of one API request, one per prompt: admitted all together or none.

    NOTE: `close()` aborts every engine request not yet finished; each path that admits a job closes it, even
    when the answer never starts (a client gone before the first byte).
    """

    def __init__(self, engine: AsyncLLMEngine, job: Job) -> None:
        self.streams: list[RequestStream] = []
        self._merged: asyncio.Queue | None = None  # the outputs of several streams, while outputs() runs
        try:
            for i, (prompt, params) in enumerate(zip(job.prompts, job.params)):
                self.streams.append(engine.submit(prompt.token_ids, params, request_id=job.engine_request_id(i),
                                                  cache_salt=job.cache_salt, priority=job.priority))
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        for stream in self.streams:
            stream.close()

    def has_pending(self) -> bool:
        """Outputs queued already: a consumer that fell behind the engine can fold them into one write."""
        return any(not stream.queue.empty() for stream in self.streams) or (
            self._merged is not None and not self._merged.empty())

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """The outputs of all streams as they come (run concurrently), as (prompt index, output)."""
        if len(self.streams) == 1:  # NOTE: the common case: no pump task and queue, one hop less per step
            try:
                async for out in self.streams[0]:
                    yield 0, out
            finally:
                self.close()
            return
        queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()
        self._merged = queue

        async def pump(i: int, stream: RequestStream) -> None:
            try:
                async for out in stream:
                    queue.put_nowait((i, out))
                queue.put_nowait((i, None))
            except Exception as error:  # noqa: BLE001 - handed to the consumer
                queue.put_nowait((i, error))

        tasks = [asyncio.create_task(pump(i, stream)) for i, stream in enumerate(self.streams)]
        try:
            running = len(tasks)
            while running:
                i, item = await queue.get()
                if item is None:
                    running -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield i, item
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            self.close()

    async def final_outputs(self) -> list[RequestOutput]:
        final: dict[int, RequestOutput] = {}
        async with aclosing(self.outputs()) as outputs:
            async for i, out in outputs:
                if out.finished:
                    final[i] = out
        return [final[i] for i in range(len(self.streams))]


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it if the client disconnects first (then raise ClientDisconnect)."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    try:
        done, _ = await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()  # our caller was cancelled, or the client left: abort the engine requests
    if task in done:
        return task.result()
    await asyncio.wait((task,))
    if not task.cancelled():
        task.exception()  # retrieved: nobody is waiting for it
    raise ClientDisconnect()


async def respond(
    request: Request, engine: AsyncLLMEngine, job: Job, fmt: Format, body: Any,
    report: Callable[[Exception], OpenAIError], stream_interval: int,
) -> Response:
    """Admit the job (refusals raise here, before any byte is sent), then answer in one body or as SSE."""
    token_ids = bool(getattr(body, "return_token_ids", False))
    if token_ids and body.stream:
        raise OpenAIError("return_token_ids is supported in non-streamed answers.", param="return_token_ids")
    if job.beams is not None:  # NOTE: never streamed (jobs._beam_search)
        outputs = await until_disconnect(request, _beam_search_outputs(engine, job))
    else:
        streams = JobStreams(engine, job)
        if body.stream:
            options = body.stream_options
            include_usage = bool(options and options.include_usage)
            continuous = include_usage and bool(options.continuous_usage_stats)
            events = _sse_events(streams, job, fmt, include_usage, report, stream_interval, continuous)
            return SSEResponse(events, on_close=streams.close)
        try:
            outputs = await until_disconnect(request, streams.final_outputs())
        finally:
            streams.close()
    choices, completion_tokens = [], 0
    cached_tokens = sum(prompt_tokens_cached(out) for out in outputs)
    for p_index, (prompt, out) in enumerate(zip(job.prompts, outputs)):
        for choice in sorted(out.outputs, key=lambda c: c.index):
            fmt.take_prompt_scores(p_index * job.n + choice.index, out.prompt_logprobs)
            answer = _with_stop_reason(fmt.choice(p_index * job.n + choice.index, prompt, choice), choice)
            choices.append({**answer, **fmt.choice_token_ids(prompt, choice)} if token_ids else answer)
            completion_tokens += len(choice.token_ids)
    return JSONResponse({
        "id": job.id,
        "object": fmt.object,
        "created": job.created,
        "model": job.model,
        "system_fingerprint": None,
        "choices": choices,
        "usage": _usage(job.prompt_tokens, completion_tokens, cached_tokens),
        **fmt.response_fields(outputs),
        **(fmt.response_token_ids(job.prompts) if token_ids else {}),
    })


def _with_stop_reason(answer: dict[str, Any], choice: CompletionOutput) -> dict[str, Any]:
    """vLLM's `stop_reason` beside the finish reason: the stop string or stop token id that ended the choice
    (None: end of sequence, or a length)."""
    return {**answer, "stop_reason": choice.stop_reason}


async def _beam_search_outputs(engine: AsyncLLMEngine, job: Job) -> list[RequestOutput]:
    """Each prompt's beam search, concurrently (their steps' requests batch together in the engine)."""
    return list(await asyncio.gather(*(
        beam_search_output(engine, prompt.token_ids, beams, job.engine_request_id(i), prompt=prompt.text,
                           cache_salt=job.cache_salt, priority=job.priority)
        for i, (prompt, beams) in enumerate(zip(job.prompts, job.beams)))))


def prompt_tokens_cached(out: RequestOutput) -> int:
    """The request's prompt tokens found in the prefix cache (set once it was scheduled)."""
    return out.metrics.num_cached_tokens if out.metrics is not None else 0


def _usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


# ---- Server-Sent Events ------------------------------------------------------------------------------


def encode_json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {encode_json(payload)}\n\n"


async def _sse_events(streams: JobStreams, job: Job, fmt: Format, include_usage: bool,
                      report: Callable[[Exception], OpenAIError], stream_interval: int,
                      continuous_usage: bool = False) -> AsyncIterator[str]:
    """The stream as OpenAI sends it: per choice an opening chunk (chat: the role), its deltas as generated, a
    chunk with its finish_reason; then the usage chunk if asked for, then [DONE]. A failure (the engine's, a
    timeout, a shutdown) ends the stream with an error event instead of [DONE]. After the first tokens,
    chunks are written once `stream_interval` new tokens wait or a choice finished, and no more outputs are
    queued (each step's chunk stays its own event). `continuous_usage` (vLLM's `continuous_usage_stats`):
    every choice's chunk also carries the usage of that choice so far (its prompt's tokens, its tokens)."""

    # NOTE: every chunk shares its envelope, so it is serialised once and each chunk encodes only its choice
    # (the bytes are those of json.dumps of the whole payload, keys in OpenAI's order)
    envelope = _sse({"id": job.id, "object": fmt.chunk_object, "created": job.created, "model": job.model,
                     "system_fingerprint": None, "choices": []})
    head = envelope[: envelope.rindex("[]") + 1]  # 'data: {..."choices":['
    tail = "],\"usage\":null}\n\n" if include_usage else "]}\n\n"

    def chunk(choice: dict[str, Any] | None, usage: dict[str, Any] | None = None) -> str:
        body = "" if choice is None else encode_json(choice)
        if usage is not None:
            return head + body + '],"usage":' + encode_json(usage) + "}\n\n"
        return head + body + tail

    cached_tokens: dict[int, int] = {}  # per prompt

    def choice_chunk(choice: dict[str, Any], p_index: int, tokens: int) -> str:
        """A choice's chunk; with continuous usage, what its prompt and it have used so far."""
        if not continuous_usage:
            return chunk(choice)
        prompt_tokens = len(job.prompts[p_index].token_ids)
        return chunk(choice, _usage(prompt_tokens, tokens, cached_tokens.get(p_index, 0)))

    events: list[str] = []  # chunks not yet written
    try:
        opening = [(p, fmt.opening(p * job.n + c, prompt)) for p, prompt in enumerate(job.prompts)
                   for c in range(job.n)]
        if any(choice for _, choice in opening):
            yield "".join(choice_chunk(choice, p, 0) for p, choice in opening if choice is not None)
        finished: set[int] = set()
        completion_tokens = 0
        pacer = WritePacer(streams, stream_interval)
        async with aclosing(streams.outputs()) as outputs:
            async for p_index, out in outputs:
                cached_tokens[p_index] = prompt_tokens_cached(out)
                for choice in out.outputs:
                    index = p_index * job.n + choice.index
                    if index in finished:
                        continue
                    fmt.take_prompt_scores(index, out.prompt_logprobs)
                    delta = fmt.delta(index, choice)
                    if delta is not None:
                        events.append(choice_chunk(delta, p_index, len(choice.token_ids)))
                    pacer.add(len(choice.delta_token_ids), choice.finished)
                    if choice.finished:
                        finished.add(index)
                        completion_tokens += len(choice.token_ids)
                        *held, last = fmt.finish(index, finish_reason(choice))
                        events += (choice_chunk(c, p_index, len(choice.token_ids))
                                   for c in (*held, _with_stop_reason(last, choice)))
                if events and pacer.due():
                    yield "".join(events)
                    events = []
                    pacer.wrote()
        if events:
            yield "".join(events)
        if include_usage:
            yield chunk(None, _usage(job.prompt_tokens, completion_tokens, sum(cached_tokens.values())))
        yield "data: [DONE]\n\n"
    except Exception as error:  # noqa: BLE001 - the status line is sent: report it in the stream
        yield "".join(events) + _sse(report(error).to_dict())


class SSEResponse(StreamingResponse):
    """A StreamingResponse that always closes its generator and its engine streams (Starlette may just stop
    iterating when the client disconnects, or never start when the client is gone already): closing them is
    what aborts the engine requests."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(events, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()  # type: ignore[attr-defined]
            self._on_close()
