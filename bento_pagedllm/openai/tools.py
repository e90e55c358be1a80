"""Tool calling in chat completions: OpenAI's `tools`, `tool_choice` and `parallel_tool_calls`.

- a named function (`tool_choice: {"type": "function", "function": {"name": ...}}`): the answer is that
  function's arguments, generated under its parameters' JSON Schema (structured outputs): they always parse
  and fit; they stream as they come. Finish reason "stop", as vLLM answers.
- `"required"`: the answer is a JSON array of calls, `[{"name": ..., "parameters": {...}}, ...]` (one call
  when `parallel_tool_calls` is false), each under its function's schema; finish reason "tool_calls".
- `"auto"` (the default when tools are given): the model answers freely. An answer that is JSON naming a
  given tool (`{"name": ..., "parameters" | "arguments": {...}}`, or a list of those: Llama 3.1's JSON form,
  the one vLLM's `llama3_json` parser reads) becomes tool calls; anything else stays text. A streamed answer
  is held back only while it is JSON: text streams as it comes.
- `"none"`: the tools are not offered (vLLM's default), plain text.

The tools reach the model through its chat template (`tools=`), as in transformers and vLLM: a template
that ignores them (SmolLM2's does) shows the model nothing of them.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from ..outputs import CompletionOutput
from .errors import OpenAIError
from .formats import ChatFormat, Prompt, _TokenTexts
from .protocol import ChatCompletionRequest


@dataclass(frozen=True)
class ToolPlan:
    """How a chat request with tools is answered (module docstring)."""

    mode: Literal["named", "required", "auto"]
    functions: tuple[dict[str, Any], ...]  # {"name", "description", "parameters"} of each tool offered
    name: str | None = None  # the named function
    parallel: bool = True

    @property
    def names(self) -> frozenset[str]:
        return frozenset(f["name"] for f in self.functions)

    def template_tools(self) -> list[dict[str, Any]]:
        """The tools as chat templates take them (transformers' `tools=`: OpenAI's form)."""
        return [{"type": "function", "function": function} for function in self.functions]

    def constraint_schema(self) -> str | None:
        """The JSON Schema (text) the answer must match: the named function's arguments, or the array of
        calls; None under "auto". The routes check it (a tool's `parameters` may not be a schema: a 400)."""
        if self.mode == "named":
            (function,) = [f for f in self.functions if f["name"] == self.name]
            return json.dumps(_arguments_schema(function))
        if self.mode == "required":
            calls = [{"type": "object",
                      "properties": {"name": {"const": f["name"]}, "parameters": _arguments_schema(f)},
                      "required": ["name", "parameters"], "additionalProperties": False} for f in self.functions]
            schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
            if not self.parallel:
                schema["maxItems"] = 1
            return json.dumps(schema)
        return None


def _arguments_schema(function: dict[str, Any]) -> dict[str, Any]:
    return function.get("parameters") or {"type": "object", "properties": {}}


def plan_tools(body: ChatCompletionRequest) -> ToolPlan | None:
    """The request's ToolPlan, or None for a plain answer (no tools, or tool_choice "none"); 400s for a
    tool_choice that names no given tool or forces a call without tools."""
    choice = body.tool_choice
    if not body.tools:
        if choice not in (None, "none"):
            raise OpenAIError("tool_choice needs tools.", param="tool_choice")
        return None
    if choice == "none":
        return None
    functions = tuple(tool.function.model_dump(exclude_none=True, exclude={"strict"}) for tool in body.tools)
    names = [f["name"] for f in functions]
    if len(set(names)) != len(names):
        raise OpenAIError("Tool names must be unique.", param="tools")
    parallel = body.parallel_tool_calls is not False
    if choice is None or choice == "auto":
        return ToolPlan("auto", functions, parallel=parallel)
    if choice == "required":
        return ToolPlan("required", functions, parallel=parallel)
    if choice.function.name not in names:
        raise OpenAIError(f"tool_choice names {choice.function.name!r}, which is not among the tools.",
                          param="tool_choice")
    return ToolPlan("named", functions, name=choice.function.name, parallel=parallel)


def parse_calls(text: str, plan: ToolPlan) -> list[tuple[str, str]] | None:
    """(name, arguments as JSON text) of each call the answer makes, or None if it is not a set of calls."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    calls = []
    for item in value if isinstance(value, list) else [value]:
        if not isinstance(item, dict):
            return None
        arguments = item.get("parameters", item.get("arguments"))
        if item.get("name") not in plan.names or not isinstance(arguments, dict):
            return None
        # NOTE: compact, as OpenAI writes arguments and as a named function's come (the constraint's JSON)
        calls.append((item["name"], json.dumps(arguments, ensure_ascii=False, separators=(",", ":"))))
    return calls or None


def cannot_be_calls(text: str) -> bool:
    """Under "auto": the answer so far is text, not JSON (it does not start with `{` or `[`), so it will not
    be read as calls and may stream as it comes."""
    start = text.lstrip()
    return bool(start) and start[0] not in "{["


def _call(index: int, name: str, arguments: str) -> dict[str, Any]:
    return {"index": index, "id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


class ToolCallFormat(ChatFormat):
    """Chat choices as tool calls (module docstring). NOTE: one instance per API request: it holds each
    choice's state while it streams."""

    def __init__(self, texts: _TokenTexts, plan: ToolPlan, prompt_logprobs: int | None = None) -> None:
        super().__init__(texts, logprobs=False, prompt_logprobs=prompt_logprobs)
        self.plan = plan
        self._held: dict[int, str] = {}  # required, auto while JSON: the answer so far
        self._as_text: set[int] = set()  # auto: choices found to be text, streamed as such
        self._opened: set[int] = set()  # named: choices whose call's first delta went out

    def opening(self, index: int, prompt: Prompt) -> dict[str, Any]:
        """NOTE: content null, as OpenAI's tool-call streams open (and as the non-streamed message has it):
        an answer that turns out to be text (under "auto") streams its content after."""
        return {"index": index, "delta": {"role": "assistant", "content": None}, "logprobs": None,
                "finish_reason": None}

    def delta(self, index: int, choice: CompletionOutput) -> dict[str, Any] | None:
        text = choice.delta_text
        if not text:
            return None
        if self.plan.mode == "named":
            call: dict[str, Any] = {"index": 0, "function": {"arguments": text}}
            if index not in self._opened:
                self._opened.add(index)
                call = _call(0, self.plan.name, text)
            return self._chunk(index, {"tool_calls": [call]}, None)
        if index in self._as_text:
            return self._chunk(index, {"content": text}, None)
        held = self._held[index] = self._held.get(index, "") + text
        if self.plan.mode == "auto" and cannot_be_calls(held):
            self._as_text.add(index)  # NOTE: not JSON: text from now on, with what was held
            del self._held[index]
            return self._chunk(index, {"content": held}, None)
        return None

    def finish(self, index: int, reason: str | None) -> list[dict[str, Any]]:
        if self.plan.mode == "named" or index in self._as_text:
            return [self._chunk(index, {}, reason)]
        held = self._held.pop(index, "")
        calls = parse_calls(held, self.plan)
        if calls is None:
            text = [self._chunk(index, {"content": held}, None)] if held else []
            return text + [self._chunk(index, {}, reason)]
        return [self._chunk(index, {"tool_calls": [_call(i, *call) for i, call in enumerate(calls)]}, None),
                self._chunk(index, {}, "tool_calls")]

    def choice(self, index: int, prompt: Prompt, choice: CompletionOutput) -> dict[str, Any]:
        reason = choice.finish_reason
        if self.plan.mode == "named":
            calls: list[tuple[str, str]] | None = [(self.plan.name, choice.text)]
        else:
            calls = parse_calls(choice.text, self.plan)
            reason = "tool_calls" if calls is not None else reason
        message: dict[str, Any] = {"role": "assistant", "content": choice.text if calls is None else None,
                                   "refusal": None}
        if calls is not None:
            message["tool_calls"] = [{k: v for k, v in _call(i, *call).items() if k != "index"}
                                     for i, call in enumerate(calls)]
        return {"index": index, "message": message, "logprobs": None, "finish_reason": reason}

    @staticmethod
    def _chunk(index: int, delta: dict[str, Any], reason: str | None) -> dict[str, Any]:
        return {"index": index, "delta": delta, "logprobs": None, "finish_reason": reason}


def template_message(message) -> dict[str, Any]:
    """A chat message as chat templates take it: an assistant's tool calls with their arguments as objects
    (transformers' convention; OpenAI sends them as JSON text), a tool's answer with its call's id."""
    content = message.content
    if isinstance(content, list):
        content = "\n".join(part.text for part in content)
    item: dict[str, Any] = {"role": "system" if message.role == "developer" else message.role, "content": content or ""}
    if message.name is not None:
        item["name"] = message.name
    if message.tool_calls:
        calls = []
        for call in message.tool_calls:
            try:
                arguments = json.loads(call.function.arguments)
            except ValueError:
                raise OpenAIError(f"The arguments of tool call {call.function.name!r} are not valid JSON.",
                                  param="messages") from None
            calls.append({"id": call.id, "type": "function",
                          "function": {"name": call.function.name, "arguments": arguments}})
        item["tool_calls"] = calls
    if message.tool_call_id is not None:
        item["tool_call_id"] = message.tool_call_id
    return item
