"""OpenAI's Responses API, `POST /responses`: a chat request in other clothes, answered as a `response`.

`instructions` is a system message, `input` the conversation (a string, or messages, the model's earlier
function calls and their outputs), `text.format` the response_format, and function tools come unnested.
`chat_request()` turns the request into a ChatCompletionRequest, so the prompt, the sampling parameters, the
structured-output constraint and the tool plan are the chat route's, built by the same code. What differs is
the answer: a `response` object whose `output` holds items (a `message` whose content is one `output_text`
part, or `function_call` items), and when streamed, typed Server-Sent Events (`response.created`,
`response.output_item.added`, `response.output_text.delta`, ..., `response.completed`) numbered by
`sequence_number`. `ResponseBuilder` makes both from the same text, so they cannot disagree.

Stateless, as vLLM is unless told to store: `previous_response_id` and `background` are refused, and the
answer says `"store": false`. An answer cut by `max_output_tokens` has status "incomplete"
(`incomplete_details.reason: "max_output_tokens"`); a failure mid-stream ends it with `response.failed`.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from typing import Any

from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ..async_engine import AsyncLLMEngine
from ..outputs import RequestOutput
from ..sampling_params import SamplingParams
from ..sequence import TokenLogprob
from . import errors
from .errors import OpenAIError
from .formats import _TokenTexts, token_logprobs
from .protocol import FIELD_NAMES, ChatCompletionRequest, FunctionCallItem, FunctionCallOutputItem, ResponsesRequest
from .responses import Job, JobStreams, SSEResponse, WritePacer, encode_json, prompt_tokens_cached, until_disconnect
from .tools import ToolPlan, cannot_be_calls, parse_calls


LOGPROBS = "message.output_text.logprobs"  # what `include` may ask for: each output token's log-probability
# the rest of OpenAI's includables name parts of items this server never makes (tool calls it does not run,
# image inputs, reasoning): asking for them adds nothing, as it would at OpenAI for an answer without them
NOTHING_TO_INCLUDE = frozenset({
    "file_search_call.results", "web_search_call.results", "web_search_call.action.sources",
    "message.input_image.image_url", "computer_call_output.output.image_url", "code_interpreter_call.outputs",
    "reasoning.encrypted_content"})


def chat_request(body: ResponsesRequest) -> ChatCompletionRequest:
    """The chat request that asks the same of the model (module docstring); 400s for what is not served."""
    if body.previous_response_id is not None:
        raise OpenAIError("previous_response_id is not supported: this server stores no responses; send the "
                          "conversation in input.", param="previous_response_id")
    if body.background:
        raise OpenAIError("background is not supported.", param="background")
    unknown = [name for name in body.include or [] if name != LOGPROBS and name not in NOTHING_TO_INCLUDE]
    if unknown:
        raise OpenAIError(f"include {unknown[0]!r} is not one of OpenAI's includables.", param="include")
    if body.reasoning is not None and body.reasoning.effort not in (None, "none"):
        raise OpenAIError("reasoning.effort is not supported: the served model does not reason.", param="reasoning")
    messages: list[dict[str, Any]] = []
    if body.instructions:
        messages.append({"role": "system", "content": body.instructions})
    if isinstance(body.input, str):
        messages.append({"role": "user", "content": body.input})
    else:
        for item in body.input:
            if isinstance(item, FunctionCallItem):  # NOTE: calls join the assistant's message, as chat sends them
                call = {"id": item.call_id, "type": "function",
                        "function": {"name": item.name, "arguments": item.arguments}}
                if messages and messages[-1]["role"] == "assistant":
                    messages[-1].setdefault("tool_calls", []).append(call)
                else:
                    messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            elif isinstance(item, FunctionCallOutputItem):
                messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
            else:
                content = item.content if isinstance(item.content, str) else [
                    {"type": "text", "text": part.text} for part in item.content]
                messages.append({"role": item.role, "content": content})
    fields: dict[str, Any] = {
        "model": body.model, "messages": messages, "max_completion_tokens": body.max_output_tokens,
        "temperature": body.temperature, "top_p": body.top_p, "stream": body.stream,
        "parallel_tool_calls": body.parallel_tool_calls, "response_format": _response_format(body),
        "cache_salt": body.cache_salt, "priority": body.priority, "logit_bias": body.logit_bias,
    }
    if LOGPROBS in (body.include or []) or body.top_logprobs:
        fields.update(logprobs=True, top_logprobs=body.top_logprobs or 0)
    if body.tools:
        fields["tools"] = [{"type": "function", "function": tool.model_dump(exclude={"type"}, exclude_none=True)}
                           for tool in body.tools]
    choice = body.tool_choice
    if choice is not None:
        fields["tool_choice"] = choice if isinstance(choice, str) else {"type": "function",
                                                                        "function": {"name": choice.name}}
    try:
        return ChatCompletionRequest.model_validate(fields)
    except ValidationError as error:  # NOTE: what passed ResponsesRequest's checks passes these
        raise errors.from_validation_error(error, FIELD_NAMES) from None


def _response_format(body: ResponsesRequest) -> dict[str, Any] | None:
    fmt = body.text.format if body.text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    if fmt.schema_ is None:
        raise OpenAIError("text.format of type json_schema needs a schema.", param="text.format")
    return {"type": "json_schema", "json_schema": {"name": fmt.name or "response", "schema": fmt.schema_,
                                                   "strict": fmt.strict}}


def _echoed(body: ResponsesRequest, applied: SamplingParams) -> dict[str, Any]:
    """The request's settings as a response repeats them; temperature and top_p as `applied` (the model's
    recommended defaults fill what the request left out)."""
    fmt = body.text.format if body.text is not None and body.text.format is not None else None
    return {
        "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens,
        "metadata": body.metadata or {},
        "parallel_tool_calls": body.parallel_tool_calls is not False,
        "previous_response_id": None,
        "reasoning": {"effort": None, "summary": None},
        "store": False,
        "temperature": applied.temperature,
        "text": {"format": {"type": "text"} if fmt is None else fmt.model_dump(by_alias=True, exclude_none=True)},
        "tool_choice": body.tool_choice if isinstance(body.tool_choice, str) or body.tool_choice is None
        else body.tool_choice.model_dump(),
        "tools": [tool.model_dump(exclude_none=True) for tool in body.tools or []],
        "top_p": applied.top_p,
        "truncation": "disabled",
        "user": body.user,
    }


class ResponseBuilder:
    """One response's output items, and its stream's events, from the answer's text as it comes.

    `add_text(delta)` and `finish(...)` return the events that text adds (a caller that does not stream
    drops them and answers `final`, the response `finish` completed). How the text becomes items depends on
    the tool plan (tools.py): no plan, a message streamed as it comes; a named function, one function call
    whose arguments stream; under "required" the text is held and read as calls at the end; under "auto" it
    is held only while it is JSON (it may be calls), then streams as a message. NOTE: one instance per
    request; events are encoded by the caller before it calls again (items are completed in place)."""

    def __init__(self, job: Job, body: ResponsesRequest, plan: ToolPlan | None, texts: _TokenTexts) -> None:
        self.job = job
        self.plan = plan
        self.texts = texts
        self.echoed = _echoed(body, job.params[0])
        self.output: list[dict[str, Any]] = []
        self._sequence = 0
        self._open: dict[str, Any] | None = None  # the message or function call being streamed
        self._text = ""  # the open item's text (a message's) or arguments (a call's)
        self._logprobs: list[dict[str, Any]] = []  # the open message's tokens' (when asked for)
        self._unsent_logprobs: list[TokenLogprob] = []  # tokens that added no text yet (a partial character)
        self._held: str | None = "" if plan is not None and plan.mode != "named" else None
        self.final: dict[str, Any] | None = None  # the whole response, once finished

    # ---- the response object and its events ---------------------------------------------------------
    def response(self, status: str, usage: dict[str, Any] | None = None, error: dict[str, str] | None = None,
                 incomplete: str | None = None) -> dict[str, Any]:
        return {
            "id": self.job.id, "object": "response", "created_at": self.job.created, "status": status,
            "background": False, "error": error,
            "incomplete_details": None if incomplete is None else {"reason": incomplete},
            "model": self.job.model, "output": self.output, "usage": usage, **self.echoed,
        }

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return event

    def opening(self) -> list[dict[str, Any]]:
        return [self.event("response.created", response=self.response("in_progress")),
                self.event("response.in_progress", response=self.response("in_progress"))]

    def failed(self, error: OpenAIError) -> dict[str, Any]:
        detail = error.to_dict()["error"]
        return self.event("response.failed", response=self.response(
            "failed", error={"code": detail["code"] or detail["type"], "message": detail["message"]}))

    # ---- text in, items out ----------------------------------------------------------------------
    def add_text(self, text: str, logprobs: list[TokenLogprob] | None = None) -> list[dict[str, Any]]:
        """NOTE: `logprobs` only without tools (the chat path refuses both at once), so never held."""
        self._unsent_logprobs += logprobs or []
        if not text:
            return []
        if self._held is None:
            return self._stream(text)
        self._held += text
        if self.plan is not None and self.plan.mode == "auto" and cannot_be_calls(self._held):
            held, self._held = self._held, None  # NOTE: not JSON: a message from now on, with what was held
            return self._stream(held)
        return []

    def finish(self, finish_reason: str | None, usage: dict[str, Any]) -> list[dict[str, Any]]:
        """The closing events: the open item done (or the held text as calls or a message), then the
        response completed, or incomplete when the answer ran out of tokens."""
        status = "incomplete" if finish_reason == "length" else "completed"
        events = []
        if self._held is not None:
            held, self._held = self._held, None
            calls = parse_calls(held, self.plan) if self.plan is not None else None
            for name, arguments in calls or []:
                events += self._open_call(name)
                events += self._stream(arguments)
                events += self._close(status)
            if calls is None and held:
                events += self._stream(held)
        if self._open is None and not self.output:  # NOTE: an empty answer is still a message
            events += self._open_message()
        events += self._close(status)
        incomplete = "max_output_tokens" if status == "incomplete" else None
        self.final = self.response(status, usage, incomplete=incomplete)
        events.append(self.event(f"response.{status}", response=self.final))
        return events

    def _stream(self, text: str) -> list[dict[str, Any]]:
        events = []
        if self._open is None:
            events += self._open_call(self.plan.name) if self.plan is not None and self.plan.mode == "named" \
                else self._open_message()
        self._text += text
        where = {"item_id": self._open["id"], "output_index": len(self.output) - 1}
        if self._open["type"] == "message":
            logprobs = token_logprobs(self.texts, self._unsent_logprobs)
            self._logprobs += logprobs
            self._unsent_logprobs = []
            events.append(self.event("response.output_text.delta", **where, content_index=0, delta=text,
                                     logprobs=logprobs))
        else:
            events.append(self.event("response.function_call_arguments.delta", **where, delta=text))
        return events

    def _open_message(self) -> list[dict[str, Any]]:
        item = {"id": f"msg_{uuid.uuid4().hex}", "type": "message", "status": "in_progress", "role": "assistant",
                "content": []}
        events = self._add_item(item)
        events.append(self.event("response.content_part.added", item_id=item["id"], output_index=len(self.output) - 1,
                                 content_index=0, part=_text_part("")))
        return events

    def _open_call(self, name: str) -> list[dict[str, Any]]:
        return self._add_item({"id": f"fc_{uuid.uuid4().hex}", "type": "function_call", "status": "in_progress",
                               "arguments": "", "call_id": f"call_{uuid.uuid4().hex[:24]}", "name": name})

    def _add_item(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        self._open, self._text, self._logprobs = item, "", []
        self.output.append(item)
        return [self.event("response.output_item.added", output_index=len(self.output) - 1, item=dict(item))]

    def _close(self, status: str) -> list[dict[str, Any]]:
        item, text = self._open, self._text
        if item is None:
            return []
        self._open = None
        where = {"item_id": item["id"], "output_index": len(self.output) - 1}
        if item["type"] == "message":
            self._logprobs += token_logprobs(self.texts, self._unsent_logprobs)  # NOTE: tokens of no text
            part = _text_part(text, self._logprobs)
            events = [self.event("response.output_text.done", **where, content_index=0, text=text,
                                 logprobs=self._logprobs),
                      self.event("response.content_part.done", **where, content_index=0, part=part)]
            item["content"] = [part]
        else:
            events = [self.event("response.function_call_arguments.done", **where, name=item["name"],
                                 arguments=text)]
            item["arguments"] = text
        item["status"] = status
        events.append(self.event("response.output_item.done", output_index=where["output_index"], item=item))
        return events


def _text_part(text: str, logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


def usage(job: Job, out: RequestOutput) -> dict[str, Any]:
    """The finished answer's token counts; `cached_tokens`: its prompt tokens found in the prefix cache."""
    output_tokens = len(out.outputs[0].token_ids)
    return {"input_tokens": job.prompt_tokens, "input_tokens_details": {"cached_tokens": prompt_tokens_cached(out)},
            "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": job.prompt_tokens + output_tokens}


# ---- answering ---------------------------------------------------------------------------------------


async def respond_response(
    request: Request, engine: AsyncLLMEngine, job: Job, builder: ResponseBuilder, stream: bool,
    report: Callable[[Exception], OpenAIError], stream_interval: int,
) -> Response:
    """Admit the job (refusals raise here, before any byte is sent), then answer in one body or as events."""
    streams = JobStreams(engine, job)
    if stream:
        return SSEResponse(_events(streams, job, builder, report, stream_interval), on_close=streams.close)
    try:
        (out,) = await until_disconnect(request, streams.final_outputs())
    finally:
        streams.close()
    (choice,) = out.outputs
    builder.add_text(choice.text, choice.logprobs)
    builder.finish(choice.finish_reason, usage(job, out))
    return JSONResponse(builder.final)


def _sse(event: dict[str, Any]) -> str:
    return f"event: {event['type']}\ndata: {encode_json(event)}\n\n"


async def _events(streams: JobStreams, job: Job, builder: ResponseBuilder,
                  report: Callable[[Exception], OpenAIError], stream_interval: int) -> AsyncIterator[str]:
    """The events as OpenAI sends them, written when a `WritePacer` says (as chat chunks are)."""
    pending: list[str] = []
    try:
        yield "".join(map(_sse, builder.opening()))
        pacer = WritePacer(streams, stream_interval)
        async with aclosing(streams.outputs()) as outputs:
            async for _, out in outputs:
                (choice,) = out.outputs
                pending += map(_sse, builder.add_text(choice.delta_text, choice.delta_logprobs))
                pacer.add(len(choice.delta_token_ids), choice.finished)
                if choice.finished:
                    pending += map(_sse, builder.finish(choice.finish_reason, usage(job, out)))
                if pending and pacer.due():
                    yield "".join(pending)
                    pending = []
                    pacer.wrote()
        if pending:
            yield "".join(pending)
    except Exception as error:  # noqa: BLE001 - the status line is sent: report it in the stream
        yield "".join(pending) + _sse(builder.failed(report(error)))
