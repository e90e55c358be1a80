"""Tool calling in chat completions (bento_pagedllm/openai/tools.py): through the `openai` client on the tiny
random Llama (forced calls always parse and fit their schemas, since they are generated under them), the
answer format's streamed and whole forms against each other, and the tools reaching the chat template."""

from __future__ import annotations

import json

import pytest
from api_helpers import HELLO, MODEL, error_of, wait_idle

from bento_pagedllm.openai.formats import Prompt, token_texts
from bento_pagedllm.openai.protocol import ChatCompletionRequest
from bento_pagedllm.openai.tools import ToolCallFormat, ToolPlan, parse_calls, plan_tools
from bento_pagedllm.outputs import CompletionOutput

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
                                       "required": ["zone"], "additionalProperties": False}}}


@pytest.fixture(autouse=True)
async def no_leaks(engine):
    yield
    assert await wait_idle(engine)


def check_weather(arguments: str) -> None:
    value = json.loads(arguments)
    assert set(value) == {"city", "unit"} and len(value["city"]) <= 12 and value["unit"] in ("celsius", "fahrenheit")


async def test_a_named_function_is_called_with_arguments_that_fit(oai):
    forced = {"type": "function", "function": {"name": "get_weather"}}
    out = await oai.chat.completions.create(model=MODEL, messages=HELLO, tools=[WEATHER, TIME], tool_choice=forced,
                                            temperature=1, seed=5, max_tokens=60, n=2)
    for choice in out.choices:
        assert choice.message.content is None and choice.finish_reason == "stop"
        (call,) = choice.message.tool_calls
        assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
        check_weather(call.function.arguments)
    stream = await oai.chat.completions.create(model=MODEL, messages=HELLO, tools=[WEATHER, TIME], tool_choice=forced,
                                               temperature=1, seed=5, max_tokens=60, n=2, stream=True)
    arguments, names, reasons = {0: "", 1: ""}, {}, {}
    async for chunk in stream:
        for choice in chunk.choices:
            for call in choice.delta.tool_calls or []:
                arguments[choice.index] += call.function.arguments or ""
                if call.function.name:
                    names[choice.index] = call.function.name
            if choice.finish_reason:
                reasons[choice.index] = choice.finish_reason
    assert arguments == {c.index: c.message.tool_calls[0].function.arguments for c in out.choices}
    assert names == {0: "get_weather", 1: "get_weather"} and reasons == {0: "stop", 1: "stop"}


async def test_required_makes_one_or_more_calls_of_the_given_tools(oai):
    out = await oai.chat.completions.create(model=MODEL, messages=HELLO, tools=[WEATHER, TIME], tool_choice="required",
                                            temperature=1, seed=2, max_tokens=120, n=3, parallel_tool_calls=False)
    for choice in out.choices:
        assert choice.finish_reason == "tool_calls", choice
        (call,) = choice.message.tool_calls  # parallel_tool_calls false: exactly one
        if call.function.name == "get_weather":
            check_weather(call.function.arguments)
        else:
            assert call.function.name == "get_time" and json.loads(call.function.arguments)["zone"] in ("UTC", "CET")
    streamed = await oai.chat.completions.create(model=MODEL, messages=HELLO, tools=[WEATHER, TIME],
                                                 tool_choice="required", temperature=1, seed=2, max_tokens=120, n=3,
                                                 parallel_tool_calls=False, stream=True)
    calls = {}
    async for chunk in streamed:
        for choice in chunk.choices:
            for call in choice.delta.tool_calls or []:
                calls[choice.index] = (call.function.name, call.function.arguments)
    assert calls == {c.index: (c.message.tool_calls[0].function.name, c.message.tool_calls[0].function.arguments)
                     for c in out.choices}


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
async def test_the_sdks_stream_helper_closes_each_call_and_matches_the_answer(oai, tool_choice):
    """The `openai` SDK's `chat.completions.stream`: each call's arguments end with their `done` event (which
    needs the finish reason in a chunk after them), and the final message is the non-streamed one (content
    null: no empty text either)."""
    request = dict(model=MODEL, messages=HELLO, tools=[WEATHER, TIME], tool_choice=tool_choice, temperature=1,
                   seed=5, max_tokens=120, parallel_tool_calls=False)
    whole = (await oai.chat.completions.create(**request)).choices[0]
    async with oai.chat.completions.stream(**request) as stream:
        kinds = [event.type async for event in stream]
        final = (await stream.get_final_completion()).choices[0]
    assert "tool_calls.function.arguments.done" in kinds and "content.delta" not in kinds, kinds
    assert final.message.content is None and whole.message.content is None
    assert [(c.function.name, c.function.arguments) for c in final.message.tool_calls] == [
        (c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    assert final.finish_reason == whole.finish_reason


async def test_auto_and_none_answer_in_text_when_the_answer_is_no_call(oai, engine):
    """A random model's free answer is not JSON naming a tool: text, as without tools (the same tokens:
    SmolLM2's template, which the tiny model has, ignores the tools)."""
    plain = await oai.chat.completions.create(model=MODEL, messages=HELLO, temperature=0, max_tokens=8)
    for choice in ("auto", "none", None):
        extra = {} if choice is None else {"tool_choice": choice}
        out = await oai.chat.completions.create(model=MODEL, messages=HELLO, tools=[WEATHER], temperature=0,
                                                max_tokens=8, **extra)
        assert out.choices[0].message.content == plain.choices[0].message.content
        assert out.choices[0].message.tool_calls is None and out.choices[0].finish_reason == "length"
    stream = await oai.chat.completions.create(model=MODEL, messages=HELLO, tools=[WEATHER], temperature=0,
                                               max_tokens=8, stream=True)
    assert "".join([c.choices[0].delta.content or "" async for c in stream if c.choices]) == \
        plain.choices[0].message.content


async def test_a_conversation_with_earlier_calls_and_their_results(oai):
    messages = [*HELLO,
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees"}]
    out = await oai.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], max_tokens=4,
                                            temperature=0)
    assert out.choices[0].finish_reason in ("length", "stop", "tool_calls")


@pytest.mark.parametrize("body,param", [
    ({"tool_choice": "required"}, "tool_choice"),  # no tools
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0].function.name"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tools": [WEATHER], "logprobs": True}, "logprobs"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"type": "function", "function": {
        "name": "get_weather", "arguments": "{not json"}}]}]}, "messages"),
])
async def test_bad_tool_requests(http, body, param):
    r = await http.post("/v1/chat/completions", json={"model": MODEL, "messages": HELLO, **body})
    assert error_of(r, 400)["param"] == param


# ---- the answer's format, alone --------------------------------------------------------------------


def output(text: str, reason: str | None) -> CompletionOutput:
    return CompletionOutput(index=0, text=text, token_ids=[1], cumulative_logprob=None, logprobs=None,
                            finish_reason=reason)


def streamed(fmt: ToolCallFormat, pieces: list[str], reason: str) -> list[dict]:
    chunks = []
    for i, piece in enumerate(pieces):
        chunk = fmt.delta(0, CompletionOutput(index=0, text="".join(pieces[: i + 1]), token_ids=[1] * (i + 1),
                                              cumulative_logprob=None, logprobs=None, delta_text=piece))
        if chunk is not None:
            chunks.append(chunk)
    return chunks + fmt.finish(0, reason)


def plan(mode: str, **kwargs) -> ToolPlan:
    body = ChatCompletionRequest.model_validate({"model": MODEL, "messages": HELLO, "tools": [WEATHER, TIME],
                                                 "tool_choice": mode, **kwargs})
    return plan_tools(body)


@pytest.mark.parametrize("answer,calls", [
    ('{"name": "get_time", "parameters": {"zone": "UTC"}}', [("get_time", '{"zone":"UTC"}')]),
    (' {"name": "get_time", "arguments": {"zone": "CET"}}', [("get_time", '{"zone":"CET"}')]),
    ('[{"name": "get_time", "parameters": {}}, {"name": "get_weather", "parameters": {"city": "Oslo", "unit": "celsius"}}]',
     [("get_time", "{}"), ("get_weather", '{"city":"Oslo","unit":"celsius"}')]),
    ('{"name": "launch_rocket", "parameters": {}}', None),  # not a given tool
    ('{"name": "get_time", "parameters": "UTC"}', None),
    ('{"zone": "UTC"', None),  # cut short
    ("The time is noon.", None),
])
def test_auto_reads_json_naming_a_tool_as_calls(answer, calls):
    auto = plan("auto")
    assert parse_calls(answer, auto) == calls
    fmt = ToolCallFormat(token_texts(None), auto)
    whole = fmt.choice(0, Prompt([1], None), output(answer, "stop"))
    chunks = streamed(ToolCallFormat(token_texts(None), auto), [answer[:5], answer[5:9], answer[9:]], "stop")
    if calls is None:
        assert whole["message"]["content"] == answer and whole["finish_reason"] == "stop"
        assert "".join(c["delta"].get("content", "") for c in chunks) == answer
        assert chunks[-1]["finish_reason"] == "stop"
    else:
        assert whole["message"]["content"] is None and whole["finish_reason"] == "tool_calls"
        assert [(c["function"]["name"], c["function"]["arguments"]) for c in whole["message"]["tool_calls"]] == calls
        (sent,) = [c for c in chunks if c["delta"]]  # JSON is held back, then sent as calls at the end
        assert [(c["function"]["name"], c["function"]["arguments"]) for c in sent["delta"]["tool_calls"]] == calls
        assert [c["index"] for c in sent["delta"]["tool_calls"]] == list(range(len(calls)))
        # the reason in a chunk of its own, after the calls (as OpenAI sends it)
        assert sent["finish_reason"] is None and chunks[-1] == {"index": 0, "delta": {}, "logprobs": None,
                                                                "finish_reason": "tool_calls"}


def test_text_streams_at_once_under_auto():
    fmt = ToolCallFormat(token_texts(None), plan("auto"))
    chunks = streamed(fmt, ["  ", "Hel", "lo"], "stop")
    assert [c["delta"] for c in chunks] == [{"content": "  Hel"}, {"content": "lo"}, {}]


def test_the_required_and_named_constraints():
    schema = json.loads(plan("required", parallel_tool_calls=False).constraint_schema())
    assert schema["maxItems"] == 1 and [i["properties"]["name"]["const"] for i in schema["items"]["anyOf"]] == [
        "get_weather", "get_time"]
    named = plan({"type": "function", "function": {"name": "get_time"}}).constraint_schema()
    assert json.loads(named) == TIME["function"]["parameters"]
    assert plan("none") is None and plan("auto").constraint_schema() is None


def test_tools_reach_a_chat_template_that_renders_them(engine):
    """A template that lists the tools (as Llama 3.1's does) shows the model their names; SmolLM2's ignores them."""
    tokenizer = engine.prompts.tokenizer
    template = tokenizer.chat_template
    tokenizer.chat_template = ("{% for tool in tools or [] %}TOOL {{ tool.function.name }}\n{% endfor %}"
                               "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}")
    try:
        ids = engine.prompts.chat_prompt_ids([{"role": "user", "content": "hi"}], plan("auto").template_tools())
        assert "TOOL get_weather\nTOOL get_time\nuser: hi" in tokenizer.decode(ids)
    finally:
        tokenizer.chat_template = template
