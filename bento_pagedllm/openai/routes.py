"""The OpenAI-compatible API as a Starlette app: `GET /models`, `POST /completions`, `POST /chat/completions`,
`POST /responses` (responses_api.py: a chat request answered as a `response`), and vLLM's `POST /tokenize` and
`POST /detokenize` (tokenization.py; vLLM serves them at its root, service.py too).

The generation endpoints go the same way: parse the body (protocol.py), turn it into a `Job` (jobs.py: the
prompts tokenized or rendered, one `SamplingParams` per prompt, the context window checked), then hand it to
responses.py, which runs one engine request per prompt (the engine forks the `n` choices itself) and answers
in one JSON body or as Server-Sent Events. What differs between completions and chat (the prompt, how a
choice and a streamed delta look) is a `Format` (formats.py); a Responses request becomes a chat request
(`jobs.chat_job` serves both) and responses_api.py shapes its answer.

An API request's engine requests are admitted together, synchronously, before the first byte of the answer:
whatever refuses them (invalid, overloaded, shutting down) still gets its status code; responses.py closes
every engine stream it opened, which aborts the requests of a client that went away. Every /v1 path, unknown
ones included, sits behind the API key when one is set (auth.py).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ..async_engine import (
    AsyncLLMEngine,
    EngineOverloadedError,
    EngineShuttingDownError,
    RequestFailedError,
    RequestTimeoutError,
)
from ..engine import RequestError
from . import errors
from .auth import APIKeyMiddleware
from .errors import OpenAIError
from .formats import ChatFormat, CompletionFormat, token_texts
from .jobs import chat_job, completion_job
from .protocol import (
    FIELD_NAMES,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ResponsesRequest,
    TokenizeRequest,
)
from .responses import respond
from .responses_api import ResponseBuilder, chat_request, respond_response
from .schema import openapi_document
from .tokenization import detokenize, tokenize
from .tools import ToolCallFormat

logger = logging.getLogger(__name__)

Body = TypeVar("Body", bound=BaseModel)


def build_openai_app(
    get_engine: Callable[[], AsyncLLMEngine],
    *,
    model_name: str,
    api_key: str | None = None,
    max_body_bytes: int = 4 << 20,
    retry_after_s: int = 1,
    stream_interval: int = 1,
    model_sampling_defaults: bool = True,
) -> Starlette:
    """The OpenAI API for one model. `get_engine()` is called per request (the engine may start later).

    `max_body_bytes` bounds a request body (413 past it); `retry_after_s` is the Retry-After sent with 503s;
    a stream is written once `stream_interval` new tokens wait (1: every step), and when it ends.
    `model_sampling_defaults`: a request that leaves out temperature, top_p, top_k, min_p,
    repetition_penalty or max_tokens gets the model's recommendation (its generation_config.json), as vLLM's
    `--generation-config auto` does; else OpenAI's defaults (temperature 1, no filters, the rest of the window).
    `GET /openapi.json` describes the API (the request bodies' schemas come from protocol.py)."""
    if stream_interval < 1:
        raise ValueError("stream_interval must be at least 1")
    server = _Server(get_engine, model_name, max_body_bytes, retry_after_s, stream_interval, model_sampling_defaults)
    document = openapi_document(model_name, secured=api_key is not None)
    routes = [
        Route("/models", server.guard(server.list_models), methods=["GET"]),
        Route("/models/{model:path}", server.guard(server.retrieve_model), methods=["GET"]),
        Route("/completions", server.guard(server.completions), methods=["POST"]),
        Route("/chat/completions", server.guard(server.chat_completions), methods=["POST"]),
        Route("/responses", server.guard(server.responses), methods=["POST"]),
        Route("/tokenize", server.guard(server.tokenize), methods=["POST"]),
        Route("/detokenize", server.guard(server.detokenize), methods=["POST"]),
        Route("/openapi.json", lambda request: JSONResponse(document), methods=["GET"]),
    ]
    middleware = [Middleware(APIKeyMiddleware, api_key=api_key)] if api_key else []
    return Starlette(routes=routes, middleware=middleware, exception_handlers={HTTPException: _http_exception})


async def _http_exception(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    if exc.status_code == 404:
        message = f"Invalid URL ({request.method} {request.url.path})"
    else:
        message = exc.detail
    return OpenAIError(message, status=exc.status_code).response(headers=exc.headers)  # e.g. 405's Allow


# ---- one request, parsed ---------------------------------------------------------------------------


class _Server:
    def __init__(
        self, get_engine: Callable[[], AsyncLLMEngine], model_name: str, max_body_bytes: int, retry_after_s: int,
        stream_interval: int, model_sampling_defaults: bool,
    ) -> None:
        self.get_engine = get_engine
        self.stream_interval = stream_interval
        self.model_sampling_defaults = model_sampling_defaults
        self.model_name = model_name
        self.max_body_bytes = max_body_bytes
        self.retry_after_s = retry_after_s
        self.created = int(time.time())

    # ---- what every route does ----------------------------------------------------------------
    def guard(self, handler: Callable[[Request], Awaitable[Response]]) -> Callable[[Request], Awaitable[Response]]:
        """Map every failure to OpenAI's error object."""

        async def endpoint(request: Request) -> Response:
            try:
                return await handler(request)
            except ClientDisconnect:
                return Response(status_code=499)  # nobody reads it
            except Exception as error:  # noqa: BLE001 - mapped to a status and OpenAI's error object
                return self._reporter(request)(error).response()

        return endpoint

    def _reporter(self, request: Request) -> Callable[[Exception], OpenAIError]:
        return lambda error: self.as_openai_error(error, f"{request.method} {request.url.path}")

    def as_openai_error(self, error: Exception, what: str) -> OpenAIError:
        """The client's view of a failure; internals (an engine failure's cause) go to the log only."""
        if isinstance(error, OpenAIError):
            return error
        if isinstance(error, RequestError):
            return OpenAIError(str(error))
        if isinstance(error, EngineOverloadedError):
            return errors.overloaded(self.retry_after_s)
        if isinstance(error, EngineShuttingDownError):
            return errors.shutting_down(self.retry_after_s)
        if isinstance(error, RequestTimeoutError):
            logger.warning("%s: %s", what, error)
            return errors.timed_out(error)
        if isinstance(error, RequestFailedError):
            logger.warning("%s: %s", what, error)  # NOTE: the engine logged the failure itself
        else:
            logger.error("%s failed", what, exc_info=error)
        return errors.server_error()

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
            body = model.model_validate_json(_as_utf8(b"".join(chunks)))
        except ValidationError as error:
            raise errors.from_validation_error(error, FIELD_NAMES) from None
        if getattr(body, "model", "") is None:  # left out or null: the served model (vLLM's)
            body.model = self.model_name
        if (client_id := request.headers.get("x-request-id")) and hasattr(body, "request_id"):
            body.request_id = client_id  # vLLM's: the header names the answer, before the body's field
        return body

    def _defaults(self, engine: AsyncLLMEngine) -> Mapping[str, float | int]:
        """What a request's omitted sampling fields default to (build_openai_app's `model_sampling_defaults`)."""
        return engine.prompts.sampling_defaults if self.model_sampling_defaults else {}

    def _engine_for(self, model: str | None) -> AsyncLLMEngine:
        """The engine of the served model; `model` None (vLLM's tokenizer endpoints may leave it out): that one."""
        if model is not None and model != self.model_name:
            raise errors.model_not_found(model)
        engine = self.get_engine()
        if engine is None:
            raise OpenAIError("The engine is not ready yet.", status=503, type="server_error")
        return engine

    # ---- GET /models ---------------------------------------------------------------------------
    def _model_card(self) -> dict[str, Any]:
        """OpenAI's model object, with vLLM's `max_model_len` (clients size their prompts by it) once the engine
        is up."""
        card = {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "bento-pagedllm"}
        engine = self.get_engine()
        if engine is not None:
            card["max_model_len"] = engine.prompts.configs.scheduler.max_model_len
        return card

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
        job = await completion_job(body, engine, self._defaults(engine))
        texts = token_texts(engine.tokenizer, bool(body.return_tokens_as_token_ids))
        fmt = CompletionFormat(texts, body.logprobs, bool(body.echo), body.prompt_logprobs)
        return _echo_request_id(request, await respond(request, engine, job, fmt, body, self._reporter(request),
                                                       self.stream_interval))

    # ---- POST /chat/completions ----------------------------------------------------------------
    async def chat_completions(self, request: Request) -> Response:
        body = await self._parse(request, ChatCompletionRequest)
        engine = self._engine_for(body.model)
        job, tools = await chat_job(body, engine, self._defaults(engine), "chatcmpl-", "messages")
        texts = token_texts(engine.tokenizer, bool(body.return_tokens_as_token_ids))
        logprobs = job.params[0].logprobs is not None
        fmt = ChatFormat(texts, logprobs, body.prompt_logprobs) if tools is None else ToolCallFormat(
            texts, tools, body.prompt_logprobs)
        return _echo_request_id(request, await respond(request, engine, job, fmt, body, self._reporter(request),
                                                       self.stream_interval))

    # ---- POST /responses -----------------------------------------------------------------------
    async def responses(self, request: Request) -> Response:
        body = await self._parse(request, ResponsesRequest)
        engine = self._engine_for(body.model)
        job, tools = await chat_job(chat_request(body), engine, self._defaults(engine), "resp_", "input")
        builder = ResponseBuilder(job, body, tools, token_texts(engine.tokenizer))
        return await respond_response(request, engine, job, builder, bool(body.stream), self._reporter(request),
                                      self.stream_interval)


    # ---- POST /tokenize, POST /detokenize (vLLM's) ---------------------------------------------------
    async def tokenize(self, request: Request) -> Response:
        body = await self._parse(request, TokenizeRequest)
        engine = self._engine_for(body.model)
        return JSONResponse(await tokenize(body, engine, self.model_name))

    async def detokenize(self, request: Request) -> Response:
        body = await self._parse(request, DetokenizeRequest)
        engine = self._engine_for(body.model)
        return JSONResponse(detokenize(body, engine))


def _echo_request_id(request: Request, response: Response) -> Response:
    """The client's X-Request-Id back on the answer (what proxies and vLLM's request-id headers do), so logs on
    both sides meet."""
    if client_id := request.headers.get("x-request-id"):
        response.headers["X-Request-Id"] = client_id
    return response


def _as_utf8(body: bytes) -> bytes:
    """The body as UTF-8 JSON: what Python's `json.loads` (vLLM's parser) reads from bytes, pydantic's reads too
    (a UTF-8 byte-order mark, UTF-16 or UTF-32, told apart by their first bytes as RFC 8259 says)."""
    encoding = json.detect_encoding(body)
    if encoding == "utf-8":
        return body
    try:
        return body.decode(encoding).encode("utf-8")
    except UnicodeDecodeError:
        return body  # NOTE: the parser says what is wrong with it


def _too_large(limit: int) -> OpenAIError:
    return OpenAIError(f"The request body is larger than {limit} bytes.", status=413, code="request_too_large")
