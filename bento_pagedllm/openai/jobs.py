"""From a parsed request to the engine's `Job` (responses.py runs it): the prompts tokenized or rendered by the
chat template, one `SamplingParams` per prompt with the request's sampling fields (or the model's recommended
defaults), its structured-output or tool constraint, and the context window checked. Every refusal is an
`OpenAIError` (a 400 naming the parameter), raised before anything reaches the engine.
"""

from __future__ import annotations

import asyncio
import functools
import json
import re
import time
import uuid
from collections.abc import Mapping
from dataclasses import replace
from typing import Any, TypeVar

from ..async_engine import AsyncLLMEngine
from ..beam_search import BeamSearchParams
from ..engine import RequestError
from ..sampling_params import SamplingParams
from ..structured_output import StructuredOutputs
from ..tokenizer import chat_template_call_arguments
from .errors import OpenAIError
from .formats import Prompt
from .protocol import ChatCompletionRequest, ChatMessage, CompletionRequest
from .responses import Job
from .tools import ToolPlan, plan_tools, template_message

try:
    from jinja2 import TemplateError
except ImportError:  # pragma: no cover - transformers needs jinja2 for chat templates anyway
    TemplateError = ValueError  # type: ignore[misc,assignment]

LONG_INPUT_CHARS = 2048  # tokenize longer inputs in a worker thread, off the event loop
MANY_MESSAGES = 64  # render longer conversations in a worker thread too
T = TypeVar("T")
# what a completions request that leaves max_tokens out (or sends null) generates at most: OpenAI's legacy
# endpoint's default, and vLLM's (chat's is the rest of the context)
COMPLETIONS_DEFAULT_MAX_TOKENS = 16


async def completion_job(body: CompletionRequest, engine: AsyncLLMEngine, defaults: Mapping[str, float | int]) -> Job:
    """A completions request's job: each prompt tokenized, with its sampling parameters."""
    n = body.n or 1
    if body.suffix is not None:
        raise OpenAIError("suffix is not supported.", param="suffix")
    if body.best_of is not None and body.best_of != n:
        raise OpenAIError("best_of is supported only when equal to n.", param="best_of")
    if body.max_tokens == 0 and not body.echo:
        raise OpenAIError("max_tokens may be 0 only with echo (the prompt and its log-probabilities).",
                          param="max_tokens")
    texts = _completion_prompts(body.prompt)
    limit = engine.limits.max_waiting_requests
    if limit is not None and len(texts) > limit:  # NOTE: never admissible: a 503 would invite retries
        raise OpenAIError(f"The prompt holds {len(texts)} prompts; this server takes at most {limit} in one "
                          "request.", param="prompt")
    prompts = _truncated([await _tokenize(engine, p, body.add_special_tokens is not False) for p in texts],
                         _prompt_tokens_kept(body, engine))
    # NOTE: echo with logprobs scores the prompt too, with as many alternatives as the output's
    scored = [k for k in (body.prompt_logprobs, body.logprobs if body.echo else None) if k is not None]
    base = _base_params(body, engine, defaults, logprobs=body.logprobs, prompt_logprobs=max(scored, default=None))
    # NOTE: the default, like the model's recommended max_tokens, is cut to the context the prompt leaves
    completion_defaults = {**defaults, "max_tokens": min(COMPLETIONS_DEFAULT_MAX_TOKENS,
                                                         int(defaults.get("max_tokens", COMPLETIONS_DEFAULT_MAX_TOKENS)))}
    return _job("cmpl-", body, prompts,
                _fit_context(engine, base, prompts, body.max_tokens, "prompt", completion_defaults))


async def chat_job(body: ChatCompletionRequest, engine: AsyncLLMEngine, defaults: Mapping[str, float | int],
                    id_prefix: str, noun: str) -> tuple[Job, ToolPlan | None]:
    """A chat request's job (its prompt rendered by the chat template, its sampling parameters, the tools'
    constraint) and its tool plan: for /chat/completions and /responses alike (`noun`: what errors call the
    conversation)."""
    if body.top_logprobs is not None and not body.logprobs:
        raise OpenAIError("logprobs must be true when top_logprobs is set.", param="top_logprobs")
    tools = plan_tools(body)
    if tools is not None and body.logprobs:
        raise OpenAIError("logprobs are not supported with tools (tool_choice \"none\" allows them).",
                          param="logprobs")
    prompts = _truncated([Prompt(await chat_prompt_ids(body, engine, tools, noun), None)],
                         _prompt_tokens_kept(body, engine))
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    base = _base_params(body, engine, defaults, logprobs=logprobs, prompt_logprobs=body.prompt_logprobs)
    if tools is not None and (schema := tools.constraint_schema()) is not None:
        if base.structured_outputs is not None:
            raise OpenAIError("A tool_choice that forces a call cannot be combined with response_format or "
                              "structured_outputs.", param="tool_choice")
        base = replace(base, structured_outputs=_constraint("tools", json=schema))
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    return _job(id_prefix, body, prompts, _fit_context(engine, base, prompts, max_tokens, noun, defaults)), tools


async def chat_prompt_ids(body: ChatCompletionRequest, engine: AsyncLLMEngine, tools: ToolPlan | None,
                          noun: str) -> list[int]:
    """The prompt a chat request sends the model: its messages (and the tools its plan shows the model)
    rendered by the chat template, with vLLM's template options; long conversations in a worker thread."""
    _check_messages(body.messages, noun)
    messages = [template_message(message) for message in body.messages]
    render = functools.partial(engine.prompts.chat_prompt_ids, messages,
                               tools.template_tools() if tools is not None else None, **_template_options(body))
    try:
        if len(messages) > MANY_MESSAGES or sum(len(m["content"]) for m in messages) > LONG_INPUT_CHARS:
            return await asyncio.to_thread(render)
        return render()
    except TemplateError as error:
        raise OpenAIError(f"The chat template rejected the {noun}: {error}", param=noun) from None


def _check_messages(messages: list[ChatMessage], noun: str) -> None:
    """What OpenAI refuses and a chat template would render without a word: a message with no content (an
    assistant's may hold tool calls instead) and a tool's answer that names no call."""
    for index, message in enumerate(messages):
        if message.content is None and not (message.role == "assistant" and message.tool_calls):
            param = f"{noun}[{index}].content"
            raise OpenAIError(f"Missing required parameter: '{param}'" + (
                " (an assistant message needs content or tool_calls)." if message.role == "assistant" else "."),
                param=param, code="missing_required_parameter")
        if message.role == "tool" and message.tool_call_id is None:
            param = f"{noun}[{index}].tool_call_id"
            raise OpenAIError(f"Missing required parameter: '{param}'.", param=param,
                              code="missing_required_parameter")


def _template_options(body: ChatCompletionRequest) -> dict[str, Any]:
    """vLLM's chat template options, checked: `continue_final_message` continues an assistant message, so it
    cannot also open a new turn."""
    if body.chat_template is not None:
        raise OpenAIError("A request's own chat_template is not accepted: the server's renders every chat "
                          "(PAGEDLLM_CHAT_TEMPLATE).", param="chat_template")
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


# ---- from request to SamplingParams: shared by the endpoints ------------------------------------------


def _completion_prompts(prompt: str | list) -> list[str | list[int]]:
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise OpenAIError("prompt must not be an empty list.", param="prompt")
    if isinstance(prompt[0], int):
        return [prompt]
    return list(prompt)


async def _tokenize(engine: AsyncLLMEngine, prompt: str | list[int], add_special_tokens: bool) -> Prompt:
    if not isinstance(prompt, str):
        return Prompt(list(prompt), None)
    return Prompt(await tokenize_text(engine, prompt, add_special_tokens), prompt)


async def tokenize_text(engine: AsyncLLMEngine, text: str, add_special_tokens: bool = True) -> list[int]:
    """A prompt's token ids, long ones in a worker thread (off the event loop)."""
    if len(text) > LONG_INPUT_CHARS:
        return await asyncio.to_thread(engine.prompts.tokenize, text, add_special_tokens)
    return engine.prompts.tokenize(text, add_special_tokens)


def _base_params(
    body: CompletionRequest | ChatCompletionRequest, engine: AsyncLLMEngine, defaults: Mapping[str, float | int], *,
    logprobs: int | None, prompt_logprobs: int | None = None
) -> SamplingParams:
    """The request's SamplingParams, `max_tokens` left to `_fit_context`; `defaults` for the fields it leaves
    out (the model's recommendations), then OpenAI's."""
    if body.stream_options is not None and not body.stream:
        raise OpenAIError("stream_options is only allowed when stream is true.", param="stream_options")
    if body.prompt_logprobs is not None and body.stream:  # NOTE: as vLLM: they would all come in one chunk
        raise OpenAIError("prompt_logprobs is not supported when stream is true.", param="prompt_logprobs")
    try:
        engine.prompts.validate_priority(body.priority)
    except RequestError as error:
        raise OpenAIError(f"{error}.", param="priority") from None
    vocab = engine.prompts.model_config.vocab_size
    stop_token_ids = body.stop_token_ids or []
    if any(t >= vocab for t in stop_token_ids):
        raise OpenAIError(f"stop_token_ids must be in [0, {vocab}).", param="stop_token_ids")
    logit_bias = _logit_bias(body.logit_bias, vocab)
    if body.allowed_token_ids and max(body.allowed_token_ids) >= vocab:
        raise OpenAIError(f"allowed_token_ids must be in [0, {vocab}).", param="allowed_token_ids")
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
            include_stop_str_in_output=bool(body.include_stop_str_in_output),
            skip_special_tokens=body.skip_special_tokens is not False,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            logit_bias=logit_bias,
            structured_outputs=structured_outputs,
            allowed_token_ids=body.allowed_token_ids,
            bad_words=body.bad_words or [],
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


def _prompt_tokens_kept(body: CompletionRequest | ChatCompletionRequest, engine: AsyncLLMEngine) -> int | None:
    """vLLM's `truncate_prompt_tokens` as a count: -1 stands for the model's context length."""
    keep = body.truncate_prompt_tokens
    if keep == 0:
        raise OpenAIError("truncate_prompt_tokens must be at least 1, or -1 (the model's context length).",
                          param="truncate_prompt_tokens", code="invalid_value")
    return engine.prompts.configs.scheduler.max_model_len if keep == -1 else keep


def _truncated(prompts: list[Prompt], keep: int | None) -> list[Prompt]:
    """vLLM's `truncate_prompt_tokens`: each prompt cut to its last `keep` tokens (its text, for echo, then
    comes from those tokens)."""
    if keep is None:
        return prompts
    return [prompt if len(prompt.token_ids) <= keep else Prompt(prompt.token_ids[-keep:], None) for prompt in prompts]


# what a client's request id may be to name the answer (it goes into ids and a response header)
_CLIENT_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")


def _job(id_prefix: str, body: CompletionRequest | ChatCompletionRequest, prompts: list[Prompt],
         params: list[SamplingParams]) -> Job:
    """NOTE: the answer's id is built from the client's request id (vLLM's `request_id`, which an X-Request-Id
    header sets: routes.py) where it is one; the client may send it twice, so its engine ids get a nonce."""
    client_id = body.request_id if body.request_id and _CLIENT_REQUEST_ID.fullmatch(body.request_id) else None
    return Job(f"{id_prefix}{client_id or uuid.uuid4().hex}", int(time.time()), body.model, body.n or 1, prompts,
               params, body.cache_salt, body.priority, _beam_search(body, params),
               nonce=f"-{uuid.uuid4().hex[:8]}" if client_id else "")


def _beam_search(body: CompletionRequest | ChatCompletionRequest,
                 params: list[SamplingParams]) -> list[BeamSearchParams] | None:
    """vLLM's `use_beam_search`: each prompt's n best beams instead of n samples (beam_search.py). As in vLLM,
    the sampling fields (temperature, top_p, penalties, stop strings, ...) do not apply; what the answer could
    not honour is refused: a stream, log-probabilities, structured outputs or a forced tool call."""
    if not body.use_beam_search:
        return None
    if body.stream:
        raise OpenAIError("use_beam_search is not supported when stream is true.", param="stream")
    if any(p.logprobs is not None or p.prompt_logprobs is not None for p in params):
        raise OpenAIError("use_beam_search is not supported with logprobs.", param="logprobs")
    if any(p.structured_outputs is not None for p in params):
        raise OpenAIError("use_beam_search is not supported with structured outputs or a forced tool call.",
                          param="use_beam_search")
    if (body.n or 1) > BeamSearchParams.MAX_WIDTH:
        raise OpenAIError(f"use_beam_search takes n up to {BeamSearchParams.MAX_WIDTH}.", param="n")
    if any(p.max_tokens == 0 for p in params):
        raise OpenAIError("use_beam_search needs max_tokens of at least 1.", param="max_tokens")
    return [BeamSearchParams(width=p.n, max_tokens=p.max_tokens, ignore_eos=p.ignore_eos,
                             length_penalty=body.length_penalty, skip_special_tokens=p.skip_special_tokens)
            for p in params]
