"""The OpenAI-compatible API as a Starlette app: `GET /models`, `POST /completions`, `POST /chat/completions`.

Both generation endpoints go the same way: parse the body (protocol.py), tokenize, turn the request into one
`SamplingParams` per prompt (context window checked), run one engine request per prompt (the engine forks the
`n` choices itself), then answer in one JSON body or as Server-Sent Events. What differs between the two
endpoints (the prompt, how a choice and a streamed delta look) is a `_Format`.

Closing an engine stream aborts its request, so every path here closes the streams it opened: a client that
goes away mid-stream (the SSE generator is closed) or before a non-streamed answer (its task is cancelled)
frees its KV blocks at the engine's next step.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from dataclasses import dataclass, replace
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from ..async_engine import AsyncLLMEngine
from ..engine import RequestError
from ..outputs import RequestOutput
from ..sampling_params import SamplingParams
from . import errors
from .errors import OpenAIError
from .formats import _ChatFormat, _CompletionFormat, _finish_reason, _Format, _Prompt, _token_texts
from .protocol import FIELD_NAMES, ChatCompletionRequest, CompletionRequest

try:
    from jinja2 import TemplateError
except ImportError:  # pragma: no cover - transformers needs jinja2 for chat templates anyway
    TemplateError = ValueError  # type: ignore[misc,assignment]

logger = logging.getLogger(__name__)

LONG_INPUT_CHARS = 2048  # tokenize longer inputs in a worker thread, off the event loop
T = TypeVar("T")
Body = TypeVar("Body", bound=BaseModel)


def build_openai_app(
    get_engine: Callable[[], AsyncLLMEngine],
    *,
    model_name: str,
    api_key: str | None = None,
    max_body_bytes: int = 4 << 20,
) -> Starlette:
    """The OpenAI API for one model. `get_engine()` is called per request (the engine may start later)."""
    server = _Server(get_engine, model_name, api_key, max_body_bytes)
    routes = [
        Route("/models", server.guard(server.list_models), methods=["GET"]),
        Route("/models/{model:path}", server.guard(server.retrieve_model), methods=["GET"]),
        Route("/completions", server.guard(server.completions), methods=["POST"]),
        Route("/chat/completions", server.guard(server.chat_completions), methods=["POST"]),
    ]
    return Starlette(routes=routes, exception_handlers={HTTPException: _http_exception})


async def _http_exception(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    if exc.status_code == 404:
        message = f"Invalid URL ({request.method} {request.url.path})"
    else:
        message = exc.detail
    return OpenAIError(message, status=exc.status_code).response(headers=exc.headers)  # e.g. 405's Allow


# ---- one request, parsed ---------------------------------------------------------------------------


@dataclass
class _Job:
    """An API request ready for the engine: its prompts, each with its sampling parameters."""

    id: str
    created: int
    model: str
    n: int
    prompts: list[_Prompt]
    params: list[SamplingParams]

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p.token_ids) for p in self.prompts)


class _Server:
    def __init__(
        self, get_engine: Callable[[], AsyncLLMEngine], model_name: str, api_key: str | None, max_body_bytes: int
    ) -> None:
        self.get_engine = get_engine
        self.model_name = model_name
        self._api_key = api_key.encode() if api_key else None
        self.max_body_bytes = max_body_bytes
        self.created = int(time.time())

    # ---- what every route does ----------------------------------------------------------------
    def guard(self, handler: Callable[[Request], Awaitable[Response]]) -> Callable[[Request], Awaitable[Response]]:
        """Authenticate, then map every failure to OpenAI's error object."""

        async def endpoint(request: Request) -> Response:
            try:
                self._authenticate(request)
                return await handler(request)
            except OpenAIError as error:
                return error.response()
            except RequestError as error:
                return OpenAIError(str(error)).response()
            except ClientDisconnect:
                return Response(status_code=499)  # nobody reads it
            except Exception:
                logger.exception("%s %s failed", request.method, request.url.path)
                return errors.server_error().response()

        return endpoint

    def _authenticate(self, request: Request) -> None:
        if self._api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise OpenAIError(
                "You didn't provide an API key: pass it as 'Authorization: Bearer <key>'.",
                status=401, code="invalid_api_key",
            )
        if not hmac.compare_digest(token.strip().encode(), self._api_key):
            raise OpenAIError("Incorrect API key provided.", status=401, code="invalid_api_key")

    async def _parse(self, request: Request, model: type[Body]) -> Body:
        length = request.headers.get("content-length", "")
        if length.isdigit() and int(length) > self.max_body_bytes:
            raise _too_large(self.max_body_bytes)
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > self.max_body_bytes:
                raise _too_large(self.max_body_bytes)
            chunks.append(chunk)
        try:
            return model.model_validate_json(b"".join(chunks))
        except ValidationError as error:
            raise errors.from_validation_error(error, FIELD_NAMES) from None

    def _engine_for(self, model: str) -> AsyncLLMEngine:
        if model != self.model_name:
            raise errors.model_not_found(model)
        engine = self.get_engine()
        if engine is None:
            raise OpenAIError("The engine is not ready yet.", status=503, type="server_error")
        return engine

    # ---- GET /models ---------------------------------------------------------------------------
    def _model_card(self) -> dict[str, Any]:
        return {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "bento-pagedllm"}

    async def list_models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [self._model_card()]})

    async def retrieve_model(self, request: Request) -> Response:
        model = request.path_params["model"]
        if model != self.model_name:
            raise errors.model_not_found(model)
        return JSONResponse(self._model_card())

    # ---- POST /completions ---------------------------------------------------------------------
    async def completions(self, request: Request) -> Response:
        body = await self._parse(request, CompletionRequest)
        engine = self._engine_for(body.model)
        n = body.n or 1
        if body.suffix is not None:
            raise OpenAIError("suffix is not supported.", param="suffix")
        if body.best_of is not None and body.best_of != n:
            raise OpenAIError("best_of is supported only when equal to n.", param="best_of")
        if body.echo and body.logprobs is not None:
            raise OpenAIError("echo with logprobs is not supported (no prompt logprobs).", param="echo")
        prompts = [await _tokenize(engine, p) for p in _completion_prompts(body.prompt)]
        base = _base_params(body, engine, logprobs=body.logprobs)
        job = _job("cmpl", body, prompts, _fit_context(engine, base, prompts, body.max_tokens, "prompt"))
        fmt = _CompletionFormat(_token_texts(engine.tokenizer), body.logprobs, bool(body.echo))
        return await _respond(request, engine, job, fmt, body)

    # ---- POST /chat/completions ----------------------------------------------------------------
    async def chat_completions(self, request: Request) -> Response:
        body = await self._parse(request, ChatCompletionRequest)
        engine = self._engine_for(body.model)
        if body.top_logprobs is not None and not body.logprobs:
            raise OpenAIError("logprobs must be true when top_logprobs is set.", param="top_logprobs")
        messages = _chat_messages(body)
        try:
            if sum(len(m["content"]) for m in messages) > LONG_INPUT_CHARS:
                ids = await asyncio.to_thread(engine.engine.chat_prompt_ids, messages)
            else:
                ids = engine.engine.chat_prompt_ids(messages)
        except TemplateError as error:
            raise OpenAIError(f"The chat template rejected the messages: {error}", param="messages") from None
        prompts = [_Prompt(ids, None)]
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        base = _base_params(body, engine, logprobs=logprobs)
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        job = _job("chatcmpl", body, prompts, _fit_context(engine, base, prompts, max_tokens, "messages"))
        fmt = _ChatFormat(_token_texts(engine.tokenizer), logprobs is not None)
        return await _respond(request, engine, job, fmt, body)


def _too_large(limit: int) -> OpenAIError:
    return OpenAIError(f"The request body is larger than {limit} bytes.", status=413, code="request_too_large")


# ---- from request to SamplingParams: shared by both endpoints ----------------------------------------


def _completion_prompts(prompt: str | list) -> list[str | list[int]]:
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise OpenAIError("prompt must not be an empty list.", param="prompt")
    if isinstance(prompt[0], int):
        return [prompt]
    return list(prompt)


async def _tokenize(engine: AsyncLLMEngine, prompt: str | list[int]) -> _Prompt:
    if not isinstance(prompt, str):
        return _Prompt(list(prompt), None)
    if len(prompt) > LONG_INPUT_CHARS:
        return _Prompt(await asyncio.to_thread(engine.engine.tokenize, prompt), prompt)
    return _Prompt(engine.engine.tokenize(prompt), prompt)


def _chat_messages(body: ChatCompletionRequest) -> list[dict[str, str]]:
    messages = []
    for message in body.messages:
        content = message.content
        if isinstance(content, list):
            content = "\n".join(part.text for part in content)
        item = {"role": "system" if message.role == "developer" else message.role, "content": content or ""}
        if message.name is not None:
            item["name"] = message.name
        messages.append(item)
    return messages


def _base_params(
    body: CompletionRequest | ChatCompletionRequest, engine: AsyncLLMEngine, *, logprobs: int | None
) -> SamplingParams:
    """The request's SamplingParams, `max_tokens` left to `_fit_context`."""
    if body.logit_bias:
        raise OpenAIError("logit_bias is not supported.", param="logit_bias")
    if body.stream_options is not None and not body.stream:
        raise OpenAIError("stream_options is only allowed when stream is true.", param="stream_options")
    vocab = engine.engine.model_config.vocab_size
    stop_token_ids = body.stop_token_ids or []
    if any(t >= vocab for t in stop_token_ids):
        raise OpenAIError(f"stop_token_ids must be in [0, {vocab}).", param="stop_token_ids")
    try:
        return SamplingParams(
            n=body.n or 1,
            temperature=_default(body.temperature, 1.0),
            top_p=_default(body.top_p, 1.0),
            top_k=_default(body.top_k, -1),
            min_p=_default(body.min_p, 0.0),
            repetition_penalty=_default(body.repetition_penalty, 1.0),
            presence_penalty=_default(body.presence_penalty, 0.0),
            frequency_penalty=_default(body.frequency_penalty, 0.0),
            seed=body.seed,
            max_tokens=None,
            min_tokens=body.min_tokens or 0,
            stop=body.stop,
            stop_token_ids=stop_token_ids,
            ignore_eos=bool(body.ignore_eos),
            logprobs=logprobs,
        )
    except ValueError as error:
        raise OpenAIError(str(error)) from None


def _default(value: T | None, default: T) -> T:
    return default if value is None else value


def _fit_context(
    engine: AsyncLLMEngine, base: SamplingParams, prompts: list[_Prompt], max_tokens: int | None, noun: str
) -> list[SamplingParams]:
    """One SamplingParams per prompt, with its max_tokens (by default the rest of the context window)."""
    limit = engine.engine.configs.scheduler.max_model_len
    params = []
    for prompt in prompts:
        used = len(prompt.token_ids)
        if max_tokens is None:
            if used >= limit:
                raise OpenAIError(
                    f"This model's maximum context length is {limit} tokens. However, your {noun} resulted in "
                    f"{used} tokens, which leaves no room for the completion. Please reduce the length of the "
                    f"{noun} by {used - limit + 1} tokens.",
                    param=noun, code="context_length_exceeded",
                )
            budget = limit - used
        elif used + max_tokens > limit:
            raise OpenAIError(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{used + max_tokens} tokens ({used} in the {noun}, {max_tokens} in the completion). Please "
                f"reduce the length of the {noun} or completion by {used + max_tokens - limit} tokens.",
                param=noun, code="context_length_exceeded",
            )
        else:
            budget = max_tokens
        if base.min_tokens > budget:
            raise OpenAIError(f"min_tokens must be at most max_tokens ({budget}).", param="min_tokens")
        params_i = replace(base, max_tokens=budget)
        try:
            engine.engine.validate_prompt(prompt.token_ids, params_i)
        except RequestError as error:
            raise OpenAIError(str(error), param=noun) from None
        params.append(params_i)
    return params


def _job(prefix: str, body: CompletionRequest | ChatCompletionRequest, prompts: list[_Prompt],
         params: list[SamplingParams]) -> _Job:
    return _Job(f"{prefix}-{uuid.uuid4().hex}", int(time.time()), body.model, body.n or 1, prompts, params)


# ---- running the engine requests --------------------------------------------------------------------


async def _engine_outputs(engine: AsyncLLMEngine, job: _Job) -> AsyncIterator[tuple[int, RequestOutput]]:
    """The outputs of the job's engine requests (one per prompt, run concurrently) as (prompt index, output).

    Closing this generator closes every engine stream, which aborts the requests not yet finished.
    """
    queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def pump(i: int) -> None:
        try:
            stream = engine.generate(job.prompts[i].token_ids, job.params[i], request_id=f"{job.id}-{i}")
            async with aclosing(stream):
                async for out in stream:
                    queue.put_nowait((i, out))
            queue.put_nowait((i, None))
        except Exception as error:  # noqa: BLE001 - handed to the consumer
            queue.put_nowait((i, error))

    tasks = [asyncio.create_task(pump(i)) for i in range(len(job.prompts))]
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
            task.cancel()  # NOTE: synchronous; each pump's `aclosing` then aborts its engine request
        await asyncio.gather(*tasks, return_exceptions=True)


async def _final_outputs(engine: AsyncLLMEngine, job: _Job) -> list[RequestOutput]:
    final: dict[int, RequestOutput] = {}
    async with aclosing(_engine_outputs(engine, job)) as outputs:
        async for i, out in outputs:
            if out.finished:
                final[i] = out
    return [final[i] for i in range(len(job.prompts))]


async def _until_disconnect(request: Request, work: Awaitable[T]) -> T:
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


async def _respond(
    request: Request, engine: AsyncLLMEngine, job: _Job, fmt: "_Format", body: Any
) -> Response:
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return _SSEResponse(_sse_events(engine, job, fmt, include_usage))
    outputs = await _until_disconnect(request, _final_outputs(engine, job))
    choices, completion_tokens = [], 0
    for p_index, (prompt, out) in enumerate(zip(job.prompts, outputs)):
        for choice in sorted(out.outputs, key=lambda c: c.index):
            choices.append(fmt.choice(p_index * job.n + choice.index, prompt, choice))
            completion_tokens += len(choice.token_ids)
    return JSONResponse({
        "id": job.id,
        "object": fmt.object,
        "created": job.created,
        "model": job.model,
        "system_fingerprint": None,
        "choices": choices,
        "usage": _usage(job.prompt_tokens, completion_tokens),
    })


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


# ---- Server-Sent Events ------------------------------------------------------------------------------


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


async def _sse_events(engine: AsyncLLMEngine, job: _Job, fmt: "_Format", include_usage: bool) -> AsyncIterator[str]:
    """The stream as OpenAI sends it: per choice an opening chunk (chat: the role), its deltas as generated, a
    chunk with its finish_reason; then the usage chunk if asked for, then [DONE]. A failure ends the stream
    with an error event."""

    def chunk(choice: dict[str, Any] | None, usage: dict[str, int] | None = None) -> str:
        payload = {
            "id": job.id,
            "object": fmt.chunk_object,
            "created": job.created,
            "model": job.model,
            "system_fingerprint": None,
            "choices": [choice] if choice is not None else [],
        }
        if include_usage:
            payload["usage"] = usage
        return _sse(payload)

    try:
        opening = [fmt.opening(p * job.n + c, prompt) for p, prompt in enumerate(job.prompts) for c in range(job.n)]
        if any(opening):
            yield "".join(chunk(choice) for choice in opening if choice is not None)
        finished: set[int] = set()
        completion_tokens = 0
        async with aclosing(_engine_outputs(engine, job)) as outputs:
            async for p_index, out in outputs:
                events = []
                for choice in out.outputs:
                    index = p_index * job.n + choice.index
                    if index in finished:
                        continue
                    delta = fmt.delta(index, choice)
                    if delta is not None:
                        events.append(chunk(delta))
                    if choice.finished:
                        finished.add(index)
                        completion_tokens += len(choice.token_ids)
                        events.append(chunk(fmt.finish(index, _finish_reason(choice))))
                if events:
                    yield "".join(events)
        if include_usage:
            yield chunk(None, _usage(job.prompt_tokens, completion_tokens))
        yield "data: [DONE]\n\n"
    except Exception as error:  # noqa: BLE001 - the status line is sent: report it in the stream
        if isinstance(error, OpenAIError):
            reported = error
        elif isinstance(error, RequestError):
            reported = OpenAIError(str(error))
        else:
            logger.exception("stream %s failed", job.id)
            reported = errors.server_error()
        yield _sse(reported.to_dict())


class _SSEResponse(StreamingResponse):
    """A StreamingResponse that always closes its generator (Starlette may just stop iterating it when the
    client disconnects): closing it is what aborts the engine requests."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[str]) -> None:
        super().__init__(events, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()  # type: ignore[attr-defined]


