"""OpenAI's Responses API (`POST /v1/responses`), in process, on a real engine over the tiny random Llama.

The oracle is the chat endpoint: a Responses request asks the model what a chat request asks (the same
prompt tokens, the same greedy text), and the streamed events rebuild exactly the non-streamed response.
Driven by httpx over ASGI and by the official `openai` client (`responses.create`, `responses.stream`,
`responses.parse`).
"""

from __future__ import annotations

import json

import pydantic
import pytest
from api_helpers import HELLO, MODEL, call_asgi, error_of, wait_idle

from bento_pagedllm import SamplingParams
from bento_pagedllm.faults import InjectedFault
from bento_pagedllm.openai.formats import token_texts
from bento_pagedllm.openai.protocol import ResponsesRequest
from bento_pagedllm.openai.responses import Job
from bento_pagedllm.openai.responses_api import ResponseBuilder
from bento_pagedllm.openai.tools import ToolPlan
from bento_pagedllm.tokenizer import apply_chat_template

WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                          "required": ["city"], "additionalProperties": False}}
TIME = {"type": "function", "name": "get_time",
        "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
                       "additionalProperties": False}}


@pytest.fixture(autouse=True)
async def no_leaks(engine):
    """Every test leaves no request and no used KV block behind."""
    yield
    assert await wait_idle(engine)


def typed_events(text: str) -> list[dict]:
    """Split a Responses SSE body into its events, checking the framing: `event: <type>\\ndata: <json>\\n\\n`,
    the type repeated in the data, sequence numbers 0, 1, 2, ..., no [DONE]."""
    assert text.endswith("\n\n")
    events = []
    for block in text[:-2].split("\n\n"):
        head, data = block.split("\n")
        assert head.startswith("event: ") and data.startswith("data: ")
        event = json.loads(data[len("data: "):])
        assert event["type"] == head[len("event: "):]
        events.append(event)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return events


# ---- text ---------------------------------------------------------------------------------------------


async def test_a_response_answers_what_chat_answers(oai, engine):
    instructions = "You are terse."
    chat = await oai.chat.completions.create(
        model=MODEL, messages=[{"role": "system", "content": instructions}, *HELLO], max_tokens=24, temperature=0)
    response = await oai.responses.create(model=MODEL, instructions=instructions, input=HELLO[0]["content"],
                                          max_output_tokens=24, temperature=0)
    assert response.id.startswith("resp_") and response.object == "response" and response.model == MODEL
    assert response.output_text == chat.choices[0].message.content
    (item,) = response.output
    assert item.type == "message" and item.role == "assistant" and item.id.startswith("msg_")
    assert [part.type for part in item.content] == ["output_text"]
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == chat.usage.completion_tokens
    assert response.usage.total_tokens == chat.usage.total_tokens
    assert response.usage.output_tokens_details.reasoning_tokens == 0
    assert response.instructions == instructions and response.store is False and response.error is None
    finished = "incomplete" if chat.choices[0].finish_reason == "length" else "completed"
    assert response.status == item.status == finished


async def test_input_messages_render_as_chat_messages(oai, engine):
    """A list of messages (text parts, an earlier answer as output_text, a developer message) is the chat
    conversation the template renders: the same prompt tokens."""
    conversation = [
        {"role": "developer", "content": "Answer in French."},
        {"role": "user", "content": [{"type": "input_text", "text": "Hello"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Bonjour"}]},
        {"role": "user", "content": "How are you?"},
    ]
    response = await oai.responses.create(model=MODEL, input=conversation, max_output_tokens=2, temperature=0)
    expected = apply_chat_template(engine.tokenizer, [
        {"role": "system", "content": "Answer in French."}, {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Bonjour"}, {"role": "user", "content": "How are you?"}])
    assert response.usage.input_tokens == len(expected)


async def test_streamed_events_rebuild_the_response(oai, http):
    request = dict(model=MODEL, input="Tell me a story.", max_output_tokens=20, temperature=0)
    whole = await oai.responses.create(**request)
    assert whole.status == "incomplete" and whole.incomplete_details.reason == "max_output_tokens"

    r = await http.post("/v1/responses", json={**request, "stream": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = typed_events(r.text)
    kinds = [e["type"] for e in events]
    deltas = kinds.count("response.output_text.delta")
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", *["response.output_text.delta"] * deltas,
                     "response.output_text.done", "response.content_part.done", "response.output_item.done",
                     "response.incomplete"]
    assert deltas > 5  # token by token, not one lump
    assert events[0]["response"]["status"] == "in_progress" and events[0]["response"]["output"] == []
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert text == whole.output_text == events[-4]["text"] == events[-3]["part"]["text"]
    final = events[-1]["response"]
    assert final["status"] == "incomplete" and final["output"][0]["content"][0]["text"] == text
    usage = whole.usage.model_dump(exclude_none=True)
    assert {k: v for k, v in final["usage"].items() if k != "input_tokens_details"} == {
        k: v for k, v in usage.items() if k != "input_tokens_details"}
    # the same prompt again: its full blocks came from the prefix cache, and the usage says so
    assert final["usage"]["input_tokens_details"]["cached_tokens"] == (usage["input_tokens"] - 1) // 16 * 16 > 0
    item_id = events[2]["item"]["id"]
    assert all(e.get("item_id", item_id) == item_id for e in events[3:-1])

    # the SDK's stream helper reads the same events (NOTE: its get_final_response() wants response.completed,
    # which an answer cut by max_output_tokens does not end with, at OpenAI's either)
    async with oai.responses.stream(**request) as stream:
        streamed = [event async for event in stream]
    assert streamed[-1].type == "response.incomplete" and streamed[-1].response.output_text == text
    assert streamed[-2].type == "response.output_item.done"


async def test_cache_salt_keeps_the_prefix_cache_within_the_salt(http):
    """vLLM's cache_salt on responses, as on chat: the same input again hits the cache under its salt only."""
    request = {"model": MODEL, "input": "Salted: " + " ".join(str(i) for i in range(40)), "max_output_tokens": 2}

    async def cached(salt: str) -> int:
        body = (await http.post("/v1/responses", json={**request, "cache_salt": salt})).json()
        return body["usage"]["input_tokens_details"]["cached_tokens"]

    assert await cached("a") == 0 and await cached("a") > 0 and await cached("b") == 0


async def test_logit_bias_steers_the_answer_as_on_chat(oai, engine):
    """vLLM's logit_bias on responses: +100 makes one token every greedy choice, as chat's does."""
    forced = 1234
    response = await oai.responses.create(model=MODEL, input="Hi", max_output_tokens=4, temperature=0,
                                          extra_body={"logit_bias": {str(forced): 100}})
    assert response.output_text == engine.tokenizer.decode([forced] * 4)
    assert response.usage.output_tokens == 4


async def test_log_probabilities_as_chat_reports_them(oai, http):
    chat = await oai.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=8, temperature=0,
                                             logprobs=True, top_logprobs=2)
    request = dict(model=MODEL, input=HELLO[0]["content"], max_output_tokens=8, temperature=0,
                   include=["message.output_text.logprobs"], top_logprobs=2)
    response = await oai.responses.create(**request)
    logprobs = response.output[0].content[0].logprobs
    assert [lp.model_dump() for lp in logprobs] == [lp.model_dump() for lp in chat.choices[0].logprobs.content]
    # what names items this server never makes adds nothing (Codex-style clients send it)
    plain = await oai.responses.create(**{**request, "include": ["reasoning.encrypted_content"], "top_logprobs": 0})
    assert plain.output_text == response.output_text and plain.output[0].content[0].logprobs == []
    assert len(logprobs) == response.usage.output_tokens and all(len(lp.top_logprobs) == 2 for lp in logprobs)
    events = typed_events((await http.post("/v1/responses", json={**request, "stream": True})).text)
    streamed = [lp for e in events if e["type"] == "response.output_text.delta" for lp in e["logprobs"]]
    done = next(e for e in events if e["type"] == "response.output_text.done")
    assert streamed == done["logprobs"] == [lp.model_dump() for lp in logprobs]


# ---- structured outputs and tools ------------------------------------------------------------------------


class City(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=10)
    population: int = pydantic.Field(ge=0, le=10**7)


async def test_text_format_constrains_the_answer(oai):
    request = dict(model=MODEL, input="A city, as JSON.", text_format=City, temperature=0, max_output_tokens=60)
    parsed = await oai.responses.parse(**request)
    assert parsed.status == "completed"
    assert isinstance(parsed.output_parsed, City)
    value = json.loads(parsed.output_text)
    assert set(value) == {"name", "population"}
    async with oai.responses.stream(**request) as stream:  # streamed, through the SDK's helper
        deltas = [event.delta async for event in stream if event.type == "response.output_text.delta"]
        final = await stream.get_final_response()
    assert "".join(deltas) == final.output_text == parsed.output_text and final.output_parsed == parsed.output_parsed
    loose = await oai.responses.create(model=MODEL, input="JSON please.", text={"format": {"type": "json_object"}},
                                       temperature=0, max_output_tokens=60)
    if loose.status == "completed":
        assert isinstance(json.loads(loose.output_text), dict)


async def test_a_named_function_is_called_with_valid_arguments(oai, http):
    request = dict(model=MODEL, input="Weather in Paris?", tools=[WEATHER, TIME],
                   tool_choice={"type": "function", "name": "get_weather"}, temperature=0, max_output_tokens=40)
    response = await oai.responses.create(**request)
    (call,) = response.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id.startswith("call_")
    assert call.status == "completed" and set(json.loads(call.arguments)) == {"city"}
    assert response.tool_choice.name == "get_weather" and [t.name for t in response.tools] == ["get_weather",
                                                                                               "get_time"]
    events = typed_events((await http.post("/v1/responses", json={**request, "stream": True})).text)
    kinds = [e["type"] for e in events]
    assert kinds[2] == "response.output_item.added" and events[2]["item"]["type"] == "function_call"
    assert kinds[-3:] == ["response.function_call_arguments.done", "response.output_item.done",
                          "response.completed"]
    arguments = "".join(e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta")
    assert arguments == events[-3]["arguments"] == call.arguments
    assert kinds.count("response.function_call_arguments.delta") > 1  # they stream


async def test_required_makes_calls_and_their_outputs_go_back(oai, engine):
    first = await oai.responses.create(model=MODEL, input="What time is it?", tools=[TIME, WEATHER],
                                       tool_choice="required", parallel_tool_calls=False, temperature=0,
                                       max_output_tokens=60)
    (call,) = first.output
    assert call.type == "function_call" and call.name in ("get_time", "get_weather")
    arguments = json.loads(call.arguments)
    # the conversation goes back as input: the call and its output render as chat's tool_calls and tool message
    follow_up = [{"role": "user", "content": "What time is it?"},
                 {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
                 {"type": "function_call_output", "call_id": call.call_id, "output": "12:00"}]
    second = await oai.responses.create(model=MODEL, input=follow_up, max_output_tokens=4, temperature=0)
    expected = engine.prompts.chat_prompt_ids([
        {"role": "user", "content": "What time is it?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "12:00"}], None)
    assert second.usage.input_tokens == len(expected)
    assert second.output[0].type == "message"


def builder(plan: ToolPlan | None) -> ResponseBuilder:
    job = Job("resp_test", 0, MODEL, 1, [], [SamplingParams()])
    return ResponseBuilder(job, ResponsesRequest(model=MODEL, input="x"), plan, token_texts(None))


USAGE = {"input_tokens": 3, "output_tokens": 5}


def test_under_auto_json_naming_a_tool_becomes_calls_and_text_streams_at_once():
    plan = ToolPlan("auto", ({"name": "get_time", "parameters": TIME["parameters"]},))
    calls = builder(plan)
    assert calls.add_text(' {"name": "get_time", ') == [] and calls.add_text('"parameters": {"zone": "UTC"}}') == []
    events = calls.finish("stop", USAGE)
    assert [e["type"] for e in events] == [
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    (call,) = calls.final["output"]
    assert call["type"] == "function_call" and call["name"] == "get_time" and call["status"] == "completed"
    assert json.loads(call["arguments"]) == {"zone": "UTC"}

    text = builder(plan)
    assert [e["type"] for e in text.add_text("  Hel")] == [
        "response.output_item.added", "response.content_part.added", "response.output_text.delta"]
    assert text.add_text("lo")[0]["delta"] == "lo"
    text.finish("length", USAGE)
    assert text.final["status"] == "incomplete" and text.final["output"][0]["content"][0]["text"] == "  Hello"

    # JSON that names no given tool is the answer's text, whole, at the end
    other = builder(plan)
    assert other.add_text('{"name": "nope"}') == []
    other.finish("stop", USAGE)
    assert other.final["output"][0]["type"] == "message"
    assert other.final["output"][0]["content"][0]["text"] == '{"name": "nope"}'


def test_an_empty_answer_is_still_a_message():
    empty = builder(None)
    empty.finish("stop", USAGE)
    (item,) = empty.final["output"]
    assert item["type"] == "message" and item["content"][0]["text"] == ""


# ---- errors and disconnects ---------------------------------------------------------------------------


@pytest.mark.parametrize("body,param", [
    ({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id"),
    ({"input": "x", "background": True}, "background"),
    ({"input": "x", "reasoning": {"effort": "high"}}, "reasoning"),
    ({"input": "x", "include": ["message.output_text.nope"]}, "include"),
    ({"input": "x", "top_logprobs": 21}, "top_logprobs"),
    ({"input": "x", "top_logprobs": 2, "tools": [WEATHER]}, "logprobs"),
    ({"input": []}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]},
     "input[0].content[0].type"),
    ({"input": "x", "truncation": "auto"}, "truncation"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nope"}}}},
     "response_format"),
    ({"input": "x", "tool_choice": "required"}, "tool_choice"),
    ({"input": "x", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "x", "max_output_tokens": 5000}, "input"),
    ({"input": "x", "logit_bias": {"99999999": 1}}, "logit_bias"),
    ({"input": "x", "priority": 1}, "priority"),  # the FCFS engine
])
async def test_bad_requests(http, body, param):
    error = error_of(await http.post("/v1/responses", json={"model": MODEL, **body}), 400)
    assert error["param"] == param, error


async def test_unknown_model(http):
    error = error_of(await http.post("/v1/responses", json={"model": "gpt-4o", "input": "x"}), 404)
    assert error["code"] == "model_not_found"


def fail_at_the_third_token(seq, token) -> None:
    """A token hook (the engine's fault-injection point) that fails every request at its 3rd token."""
    if seq.num_known_output_tokens + 1 >= 3:
        raise InjectedFault("injected sampling fault")


async def test_a_failure_is_a_500_or_ends_the_stream_with_response_failed(engine, http):
    body = {"model": MODEL, "input": "Hi", "max_output_tokens": 50, "temperature": 0}
    engine.engine.token_hook = fail_at_the_third_token
    try:
        assert error_of(await http.post("/v1/responses", json=body), 500)["type"] == "server_error"
        r = await http.post("/v1/responses", json={**body, "stream": True})
    finally:
        engine.engine.token_hook = None
    assert r.status_code == 200  # the status line was sent before the failure
    events = typed_events(r.text)
    assert events[0]["type"] == "response.created" and events[-1]["type"] == "response.failed"
    failed = events[-1]["response"]
    assert failed["status"] == "failed" and failed["error"]["code"] == "server_error"
    assert "InjectedFault" not in r.text  # internals stay in the log


async def test_a_client_gone_mid_stream_aborts_the_request(app, engine):
    status, chunks, running = await call_asgi(
        app, "/responses", {"model": MODEL, "input": "Go on", "stream": True, "max_output_tokens": 500,
                            "temperature": 0}, disconnect_after=3, engine=engine)
    assert status == 200 and 3 <= len(chunks) < 10
    assert all(running[1:])  # streamed while it generated, not buffered
    assert not engine._active_ids  # its engine stream closed when the app returned
    assert await wait_idle(engine)  # aborted, its blocks freed
