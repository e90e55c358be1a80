"""The OpenAI-compatible API as a Starlette app: `GET /models`, `POST /completions`, `POST /chat/completions`,
`POST /responses` (responses_api.py: a chat request answered as a `response`).

The generation endpoints go the same way: parse the body (protocol.py), tokenize, turn the request into one
`SamplingParams` per prompt (context window checked), then hand the `Job` to responses.py, which runs one
engine request per prompt (the engine forks the `n` choices itself) and answers in one JSON body or as
Server-Sent Events. What differs between completions and chat (the prompt, how a choice and a streamed delta
look) is a `Format` (formats.py); a Responses request becomes a chat request (`_chat_job` serves both) and
responses_api.py shapes its answer.

An API request's engine requests are admitted together, synchronously, before the first byte of the answer:
whatever refuses them (invalid, overloaded, shutting down) still gets its status code; responses.py closes
every engine stream it opened, which aborts the requests of a client that went away. Every /v1 path, unknown
ones included, sits behind the API key when one is set (auth.py).
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import replace
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
from ..sampling_params import SamplingParams
from ..structured_output import StructuredOutputs
from ..tokenizer import chat_template_call_arguments
from . import errors
from .auth import APIKeyMiddleware
from .errors import OpenAIError
from .formats import ChatFormat, CompletionFormat, Prompt, token_texts
from .protocol import FIELD_NAMES, ChatCompletionRequest, CompletionRequest, ResponsesRequest
from .responses import Job, respond
from .responses_api import ResponseBuilder, chat_request, respond_response
from .schema import openapi_document
from .tools import ToolCallFormat, ToolPlan, plan_tools, template_message

try:
    from jinja2 import TemplateError
except ImportError:  # pragma: no cover - transformers needs jinja2 for chat templates anyway
    TemplateError = ValueError  # type: ignore[misc,assignment]

logger = logging.getLogger(__name__)

LONG_INPUT_CHARS = 2048  # tokenize longer inputs in a worker thread, off the event loop
MANY_MESSAGES = 64  # render longer conversations in a worker thread too
T = TypeVar("T")
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
            return model.model_validate_json(b"".join(chunks))
        except ValidationError as error:
            raise errors.from_validation_error(error, FIELD_NAMES) from None

    def _defaults(self, engine: AsyncLLMEngine) -> Mapping[str, float | int]:
        """What a request's omitted sampling fields default to (build_openai_app's `model_sampling_defaults`)."""
        return engine.prompts.sampling_defaults if self.model_sampling_defaults else {}

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
        texts = _completion_prompts(body.prompt)
        limit = engine.limits.max_waiting_requests
        if limit is not None and len(texts) > limit:  # NOTE: never admissible: a 503 would invite retries
            raise OpenAIError(f"The prompt holds {len(texts)} prompts; this server takes at most {limit} in one "
                              "request.", param="prompt")
        prompts = [await _tokenize(engine, p) for p in texts]
        defaults = self._defaults(engine)
        base = _base_params(body, engine, defaults, logprobs=body.logprobs)
        job = _job("cmpl-", body, prompts, _fit_context(engine, base, prompts, body.max_tokens, "prompt", defaults))
        fmt = CompletionFormat(token_texts(engine.tokenizer), body.logprobs, bool(body.echo))
        return await respond(request, engine, job, fmt, body, self._reporter(request), self.stream_interval)

    # ---- POST /chat/completions ----------------------------------------------------------------
    async def chat_completions(self, request: Request) -> Response:
        body = await self._parse(request, ChatCompletionRequest)
        engine = self._engine_for(body.model)
        job, tools = await _chat_job(body, engine, self._defaults(engine), "chatcmpl-", "messages")
        texts = token_texts(engine.tokenizer)
        logprobs = job.params[0].logprobs is not None
        fmt = ChatFormat(texts, logprobs) if tools is None else ToolCallFormat(texts, tools)
        return await respond(request, engine, job, fmt, body, self._reporter(request), self.stream_interval)

    # ---- POST /responses -----------------------------------------------------------------------
    async def responses(self, request: Request) -> Response:
        body = await self._parse(request, ResponsesRequest)
        engine = self._engine_for(body.model)
        job, tools = await _chat_job(chat_request(body), engine, self._defaults(engine), "resp_", "input")
        builder = ResponseBuilder(job, body, tools, token_texts(engine.tokenizer))
        return await respond_response(request, engine, job, builder, bool(body.stream), self._reporter(request),
                                      self.stream_interval)


async def _chat_job(body: ChatCompletionRequest, engine: AsyncLLMEngine, defaults: Mapping[str, float | int],
                    id_prefix: str, noun: str) -> tuple[Job, ToolPlan | None]:
    """A chat request's job (its prompt rendered by the chat template, its sampling parameters, the tools'
    constraint) and its tool plan: for /chat/completions and /responses alike (`noun`: what errors call the
    conversation)."""
    if body.top_logprobs is not None and not body.logprobs:
        raise OpenAIError("logprobs must be true when top_logprobs is set.", param="top_logprobs")
    messages = [template_message(message) for message in body.messages]
    tools = plan_tools(body)
    if tools is not None and body.logprobs:
        raise OpenAIError("logprobs are not supported with tools (tool_choice \"none\" allows them).",
                          param="logprobs")
    render = functools.partial(engine.prompts.chat_prompt_ids, messages,
                               tools.template_tools() if tools is not None else None, **_template_options(body))
    try:
        if len(messages) > MANY_MESSAGES or sum(len(m["content"]) for m in messages) > LONG_INPUT_CHARS:
            ids = await asyncio.to_thread(render)
        else:
            ids = render()
    except TemplateError as error:
        raise OpenAIError(f"The chat template rejected the {noun}: {error}", param=noun) from None
    prompts = [Prompt(ids, None)]
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    base = _base_params(body, engine, defaults, logprobs=logprobs)
    if tools is not None and (schema := tools.constraint_schema()) is not None:
        if base.structured_outputs is not None:
            raise OpenAIError("A tool_choice that forces a call cannot be combined with response_format or "
                              "structured_outputs.", param="tool_choice")
        base = replace(base, structured_outputs=_constraint("tools", json=schema))
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    return _job(id_prefix, body, prompts, _fit_context(engine, base, prompts, max_tokens, noun, defaults)), tools


def _template_options(body: ChatCompletionRequest) -> dict[str, Any]:
    """vLLM's chat template options, checked: `continue_final_message` continues an assistant message, so it
    cannot also open a new turn."""
    add, cont = body.add_generation_prompt is not False, bool(body.continue_final_message)
    if cont and add:
        raise OpenAIError("continue_final_message needs add_generation_prompt false.", param="continue_final_message")
    if cont and body.messages[-1].role != "assistant":
        raise OpenAIError("continue_final_message needs the last message to be the assistant's.",
                          param="continue_final_message")
    kwargs = body.chat_template_kwargs or {}
    if taken := sorted(chat_template_call_arguments() & set(kwargs)):
        raise OpenAIError(f"chat_template_kwargs may not set {taken[0]!r}.", param="chat_template_kwargs")
    return {"add_generation_prompt": add, "continue_final_message": cont, "template_kwargs": kwargs}


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


async def _tokenize(engine: AsyncLLMEngine, prompt: str | list[int]) -> Prompt:
    if not isinstance(prompt, str):
        return Prompt(list(prompt), None)
    if len(prompt) > LONG_INPUT_CHARS:
        return Prompt(await asyncio.to_thread(engine.prompts.tokenize, prompt), prompt)
    return Prompt(engine.prompts.tokenize(prompt), prompt)


def _base_params(
    body: CompletionRequest | ChatCompletionRequest, engine: AsyncLLMEngine, defaults: Mapping[str, float | int], *,
    logprobs: int | None
) -> SamplingParams:
    """The request's SamplingParams, `max_tokens` left to `_fit_context`; `defaults` for the fields it leaves
    out (the model's recommendations), then OpenAI's."""
    if body.stream_options is not None and not body.stream:
        raise OpenAIError("stream_options is only allowed when stream is true.", param="stream_options")
    vocab = engine.prompts.model_config.vocab_size
    stop_token_ids = body.stop_token_ids or []
    if any(t >= vocab for t in stop_token_ids):
        raise OpenAIError(f"stop_token_ids must be in [0, {vocab}).", param="stop_token_ids")
    logit_bias = _logit_bias(body.logit_bias, vocab)
    structured_outputs = _structured_outputs(body)
    try:
        return SamplingParams(
            n=body.n or 1,
            temperature=_default(body.temperature, defaults.get("temperature", 1.0)),
            top_p=_default(body.top_p, defaults.get("top_p", 1.0)),
            top_k=_default(body.top_k, defaults.get("top_k", -1)),
            min_p=_default(body.min_p, defaults.get("min_p", 0.0)),
            repetition_penalty=_default(body.repetition_penalty, defaults.get("repetition_penalty", 1.0)),
            presence_penalty=_default(body.presence_penalty, 0.0),
            frequency_penalty=_default(body.frequency_penalty, 0.0),
            seed=body.seed,
            max_tokens=None,
            min_tokens=body.min_tokens or 0,
            stop=body.stop,
            stop_token_ids=stop_token_ids,
            ignore_eos=bool(body.ignore_eos),
            logprobs=logprobs,
            logit_bias=logit_bias,
            structured_outputs=structured_outputs,
        )
    except ValueError as error:
        raise OpenAIError(str(error)) from None


def _structured_outputs(body: CompletionRequest | ChatCompletionRequest) -> StructuredOutputs | None:
    """OpenAI's `response_format` or vLLM's `structured_outputs` (not both) as the engine's constraint;
    a schema, expression or grammar that does not parse is a 400 with the parser's message."""
    fmt, extension = body.response_format, body.structured_outputs
    if fmt is not None and fmt.type != "text":
        if extension is not None:
            raise OpenAIError("Give response_format or structured_outputs, not both.", param="structured_outputs")
        if fmt.type == "json_object":
            return _constraint("response_format", json_object=True)
        if fmt.json_schema is None or fmt.json_schema.schema_ is None:
            raise OpenAIError("response_format of type json_schema needs json_schema.schema.",
                              param="response_format")
        return _constraint("response_format", json=json.dumps(fmt.json_schema.schema_))
    if extension is None:
        return None
    schema = extension.json_
    return _constraint(
        "structured_outputs", json=schema if schema is None or isinstance(schema, str) else json.dumps(schema),
        json_object=bool(extension.json_object), regex=extension.regex,
        choice=None if extension.choice is None else tuple(extension.choice), grammar=extension.grammar,
    )


def _constraint(param: str, **fields: Any) -> StructuredOutputs:
    try:
        return StructuredOutputs(**fields)
    except ValueError as error:
        raise OpenAIError(f"Invalid {param}: {error}", param=param) from None


def _logit_bias(bias: dict[str, float] | None, vocab: int) -> dict[int, float] | None:
    """OpenAI's logit_bias (token ids as strings; the biases already bounded by the protocol) as token
    id -> bias."""
    if not bias:
        return None
    parsed = {}
    for key, value in bias.items():
        token = int(key) if key.strip().isdecimal() else -1
        if not 0 <= token < vocab:
            raise OpenAIError(f"logit_bias keys must be token ids in [0, {vocab}); got {key!r}.", param="logit_bias")
        parsed[token] = value
    return parsed


def _default(value: T | None, default: T) -> T:
    return default if value is None else value


def _fit_context(
    engine: AsyncLLMEngine, base: SamplingParams, prompts: list[Prompt], max_tokens: int | None, noun: str,
    defaults: Mapping[str, float | int],
) -> list[SamplingParams]:
    """One SamplingParams per prompt, with its max_tokens (by default the rest of the context window, at most
    the model's recommended `max_tokens` when it has one)."""
    limit = engine.prompts.configs.scheduler.max_model_len
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
            budget = min(limit - used, int(defaults.get("max_tokens", limit)))
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
            engine.prompts.validate_prompt(prompt.token_ids, params_i)
        except RequestError as error:
            raise OpenAIError(str(error), param=noun) from None
        params.append(params_i)
    return params


def _job(id_prefix: str, body: CompletionRequest | ChatCompletionRequest, prompts: list[Prompt],
         params: list[SamplingParams]) -> Job:
    return Job(f"{id_prefix}{uuid.uuid4().hex}", int(time.time()), body.model, body.n or 1, prompts, params)
