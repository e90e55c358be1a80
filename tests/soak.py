"""The soak's clients: `clients` concurrent streaming clients that send requests until a deadline, each request
one of several behaviours, and check that every one ends with a complete answer or a clean error.

Behaviours: stream to the end (chat, completions or the Responses API, greedy or sampled, n of 1 or 2, some with a
logit_bias, a grammar or a forced tool call), a non-streamed request, leave before the first token, leave mid-stream, leave at
the last chunk, a request the server's fault hook fails (its `seed`), a request too long for the server's time
limit, and a hand-written bad input. A 503 (backpressure) is a clean answer too: the client waits for Retry-After
and goes on.

A request is *lost* when it ends any other way: a transport error, a malformed or truncated stream, an
unexpected status or error, a hang. The soak's test asserts that none is.
"""

from __future__ import annotations

import asyncio
import collections
import enum
import json
import random
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field

import httpx
from bad_inputs import BadInput

FAULT_SEED = 424242  # the server runs with PAGEDLLM_FAULT_INJECTION_SEED set to it
QUESTIONS = ["What is the capital of France?", "Name three primary colors.", "How many legs does a spider have?",
             "Write a haiku about the sea.", "What is 12 times 12?", "Give me a synonym for happy.",
             "Why is the sky blue?", "Describe a cat in one sentence.", "What is the boiling point of water?",
             "List two planets.", "Tell me a fun fact about octopuses.", "Say hello in Spanish."]
OPENINGS = ["Once upon a time", "The three primary colors are", "In the beginning", "My favourite recipe is",
            "The quick brown fox", "Here is a list of fruits:", "The history of Rome", "Dear diary, today"]
SYSTEM = {"role": "system", "content": "You are a helpful assistant who answers briefly and kindly. " * 8}


class Behaviour(enum.Enum):
    COMPLETE = "complete"
    NON_STREAMED = "non_streamed"
    LEAVE_BEFORE_FIRST_TOKEN = "leave_before_first_token"
    LEAVE_MID_STREAM = "leave_mid_stream"
    LEAVE_AT_LAST_CHUNK = "leave_at_last_chunk"
    FAULT = "fault"
    OVERTIME = "overtime"
    BAD_INPUT = "bad_input"


WEIGHTS = {Behaviour.COMPLETE: 62, Behaviour.NON_STREAMED: 5, Behaviour.LEAVE_BEFORE_FIRST_TOKEN: 5,
           Behaviour.LEAVE_MID_STREAM: 6, Behaviour.LEAVE_AT_LAST_CHUNK: 5, Behaviour.FAULT: 5,
           Behaviour.OVERTIME: 1, Behaviour.BAD_INPUT: 11}
DISCONNECT_OUTCOMES = ("left_before_first_token", "left_mid_stream", "left_at_last_chunk")


class Lost(Exception):
    """A request that ended neither with a complete answer nor with a clean error."""


@dataclass
class SoakTally:
    """What the clients saw. `outcomes` counts each request once; `admitted` counts the 200s (each one engine
    request, the /metrics side of the accounting)."""

    outcomes: collections.Counter = field(default_factory=collections.Counter)
    paths: collections.Counter = field(default_factory=collections.Counter)  # the well-formed requests' endpoints
    admitted: int = 0
    lost: list[str] = field(default_factory=list)

    def note(self, outcome: str) -> None:
        self.outcomes[outcome] += 1

    @property
    def requests(self) -> int:
        return sum(self.outcomes.values())


@dataclass(frozen=True)
class SoakPlan:
    url: str  # the server's base URL
    api_key: str
    clients: int
    duration_s: float
    request_timeout_s: float  # the server's PAGEDLLM_REQUEST_TIMEOUT_SECONDS
    max_model_len: int
    bad_inputs: list[BadInput]
    seed: int = 0


async def run_soak(plan: SoakPlan) -> SoakTally:
    """Run the clients until the deadline; every request in flight at the deadline still runs to its end."""
    tally = SoakTally()
    bad = iter(range(10**9))
    # NOTE: idle pooled connections are dropped after 2 s, before the server's keep-alive timeout (uvicorn's 5 s,
    # httpx's default expiry too): at equal timeouts a client could send on a connection the server was closing
    # and get a ReadError before any response (a lost request in a 40 s soak, 2026-12-03), a race of the pool,
    # not of the server, which OpenAI's clients retry and this one does not
    limits = httpx.Limits(max_connections=plan.clients * 2, max_keepalive_connections=plan.clients,
                          keepalive_expiry=2.0)
    timeout = httpx.Timeout(connect=30, read=plan.request_timeout_s + 90, write=30, pool=60)
    async with httpx.AsyncClient(base_url=plan.url + "/v1", headers={"Authorization": f"Bearer {plan.api_key}"},
                                 limits=limits, timeout=timeout) as client:
        deadline = time.monotonic() + plan.duration_s
        await asyncio.gather(*(_client(client, plan, random.Random(plan.seed * 1000 + i), deadline, tally, bad)
                               for i in range(plan.clients)))
    return tally


async def _client(client: httpx.AsyncClient, plan: SoakPlan, rng: random.Random, deadline: float,
                  tally: SoakTally, bad) -> None:
    while time.monotonic() < deadline:
        behaviour = _pick(rng, plan, deadline)
        try:
            if behaviour is Behaviour.BAD_INPUT:
                outcome = await _send_bad_input(client, plan.bad_inputs[next(bad) % len(plan.bad_inputs)])
            else:
                outcome = await _send(client, behaviour, rng, plan, tally)
        except (Lost, httpx.HTTPError, ValueError, KeyError, TypeError) as error:
            tally.lost.append(f"{behaviour.value}: {type(error).__name__}: {error}")
            outcome = "lost"
        tally.note(outcome)
        if outcome == "rejected":
            await asyncio.sleep(rng.uniform(0.5, 1.5))  # Retry-After says 1 s: spread the retries around it


LOOKUP_TOOL = {"type": "function", "function": {"name": "lookup", "parameters": {
    "type": "object", "properties": {"word": {"type": "string", "maxLength": 10}}, "required": ["word"]}}}


def _pick(rng: random.Random, plan: SoakPlan, deadline: float) -> Behaviour:
    weights = dict(WEIGHTS)
    if deadline - time.monotonic() < plan.request_timeout_s:
        del weights[Behaviour.OVERTIME]  # NOTE: keeps the soak's tail no longer than a normal request's
    return rng.choices(list(weights), list(weights.values()))[0]


def _request(behaviour: Behaviour, rng: random.Random, plan: SoakPlan) -> tuple[str, dict]:
    """(path, body) of a well-formed request for `behaviour`."""
    chat = rng.random() < 0.5
    if chat:
        messages = [{"role": "user", "content": f"{rng.choice(QUESTIONS)} (#{rng.randrange(10**6)})"}]
        body = {"messages": [SYSTEM, *messages] if rng.random() < 0.3 else messages}
    else:
        body = {"prompt": f"{rng.choice(OPENINGS)} {rng.randrange(10**6)}"}
    body.update(model="smollm2-135m-instruct", max_tokens=rng.randint(4, 24), stream=True,
                stream_options={"include_usage": True})
    if rng.random() < 0.5:
        body.update(temperature=0.0)
    else:
        body.update(temperature=0.8, top_p=0.95, seed=rng.randrange(10**6))
    if behaviour is Behaviour.COMPLETE and rng.random() < 0.15:
        body["n"] = 2
    if rng.random() < 0.1:  # OpenAI's logit_bias: a few tokens of SmolLM2's vocabulary pushed or kept out
        body["logit_bias"] = {str(rng.randrange(49152)): rng.choice([-100, -5, 5, 100]) for _ in range(3)}
    # structured outputs (each token under a grammar's mask; the grammar may end the answer after a token or
    # two, so only where the behaviour does not need a long one)
    if behaviour in (Behaviour.COMPLETE, Behaviour.NON_STREAMED) and rng.random() < 0.1:
        kind = rng.choice(["choice", "regex", "tool"] if chat else ["choice", "regex"])
        if kind == "tool":  # a forced tool call: generated under its arguments' schema
            body.update(tools=[LOOKUP_TOOL], tool_choice=rng.choice(
                ["required", {"type": "function", "function": {"name": "lookup"}}]))
        else:
            body["structured_outputs"] = {"choice": ["yes", "no", "maybe"]} if kind == "choice" else {
                "regex": "[a-z]{1,8}( [a-z]{1,8}){0,3}"}
    if behaviour is Behaviour.NON_STREAMED:
        body["stream"] = False
        del body["stream_options"]
    if behaviour is Behaviour.FAULT:
        body.update(temperature=0.8, seed=FAULT_SEED, ignore_eos=True, max_tokens=16)
    if behaviour is Behaviour.OVERTIME:
        body.update(ignore_eos=True, max_tokens=plan.max_model_len - 400)
    if chat and behaviour in RESPONSE_BEHAVIOURS and rng.random() < 0.2:
        return "/responses", _as_response_request(body)
    return ("/chat/completions" if chat else "/completions"), body


# what a Responses request may do here (its API has no seed for the fault hook, no ignore_eos for overtime)
RESPONSE_BEHAVIOURS = (Behaviour.COMPLETE, Behaviour.NON_STREAMED, Behaviour.LEAVE_BEFORE_FIRST_TOKEN,
                       Behaviour.LEAVE_MID_STREAM)


def _as_response_request(chat: dict) -> dict:
    """The chat request as the Responses API asks it (one answer: n, logit_bias and the grammar stay behind;
    a forced tool call goes along, its tool unnested)."""
    body = {"model": chat["model"], "input": chat["messages"], "max_output_tokens": chat["max_tokens"],
            "stream": chat["stream"], "temperature": chat["temperature"], "top_p": chat.get("top_p", 1.0)}
    if "tools" in chat:
        choice = chat["tool_choice"]
        body.update(tools=[{"type": "function", **tool["function"]} for tool in chat["tools"]],
                    tool_choice=choice if isinstance(choice, str) else {"type": "function", "name": "lookup"})
    return body


async def _send_bad_input(client: httpx.AsyncClient, case: BadInput) -> str:
    r = await client.request(case.method, case.path, content=case.body, headers=case.headers)
    if r.status_code == 503:
        _check_error(r.json(), "engine_overloaded")
        return "rejected"
    if r.status_code != case.status:
        raise Lost(f"bad input {case.name!r}: {r.status_code}, expected {case.status}")
    _check_error(r.json())
    return "bad_input_refused"


async def _send(client: httpx.AsyncClient, behaviour: Behaviour, rng: random.Random, plan: SoakPlan,
                tally: SoakTally) -> str:
    path, body = _request(behaviour, rng, plan)
    tally.paths[path] += 1
    if not body["stream"]:
        return await _send_non_streamed(client, path, body, tally)
    async with client.stream("POST", path, json=body) as r:
        if r.status_code == 503:
            await r.aread()
            _check_error(r.json(), "engine_overloaded")
            if r.headers.get("retry-after") is None:
                raise Lost("503 without Retry-After")
            return "rejected"
        if r.status_code != 200:
            raise Lost(f"status {r.status_code}: {(await r.aread())[:300]!r}")
        tally.admitted += 1
        if behaviour is Behaviour.LEAVE_BEFORE_FIRST_TOKEN:
            return "left_before_first_token"  # NOTE: leaving the block unread closes the connection
        async with aclosing(_sse_events(r)) as events:
            if behaviour is Behaviour.LEAVE_MID_STREAM:
                return await _leave_mid_stream(events, rng.randint(1, 4))
            if behaviour is Behaviour.LEAVE_AT_LAST_CHUNK:
                return await _leave_at_last_chunk(events)
            if path == "/responses":
                return await _read_response_to_the_end(events, body)
            return await _read_to_the_end(events, behaviour, body)


async def _send_non_streamed(client: httpx.AsyncClient, path: str, body: dict, tally: SoakTally) -> str:
    r = await client.post(path, json=body)
    if r.status_code == 503:
        _check_error(r.json(), "engine_overloaded")
        return "rejected"
    if r.status_code == 504:
        _check_error(r.json(), "request_timeout")
        tally.admitted += 1
        return "timed_out"
    if r.status_code != 200:
        raise Lost(f"status {r.status_code}: {r.text[:300]}")
    tally.admitted += 1
    answer = r.json()
    if path == "/responses":
        _check_response(answer, body)
    else:
        _check_usage(answer["usage"], body, [c["finish_reason"] for c in answer["choices"]])
    return "complete"


async def _sse_events(r: httpx.Response) -> AsyncIterator[dict | str]:
    """The events of an SSE body, each a JSON object or "[DONE]" (the Responses API's `event:` lines, which
    repeat their data's type, are passed over); anything else in the body is a loss."""
    async for line in r.aiter_lines():
        if not line or line.startswith("event: "):
            continue
        if not line.startswith("data: "):
            raise Lost(f"not an SSE data line: {line[:100]!r}")
        data = line[len("data: "):]
        yield data if data == "[DONE]" else json.loads(data)


async def _leave_mid_stream(events: AsyncIterator[dict | str], after: int) -> str:
    seen = 0
    async for event in events:
        if event != "[DONE]" and "error" in event:
            return _clean_stream_error(event, Behaviour.LEAVE_MID_STREAM)  # it ran out of time first
        seen += 1
        if seen >= after or event == "[DONE]":
            break
    return "left_mid_stream"


async def _leave_at_last_chunk(events: AsyncIterator[dict | str]) -> str:
    async for event in events:
        if event == "[DONE]":
            raise Lost("[DONE] before the finish chunk")
        if "error" in event:
            return _clean_stream_error(event, Behaviour.LEAVE_AT_LAST_CHUNK)  # it ran out of time first
        if any(choice.get("finish_reason") for choice in event["choices"]):
            return "left_at_last_chunk"
    raise Lost("stream ended without a finish chunk")


async def _read_to_the_end(events: AsyncIterator[dict | str], behaviour: Behaviour, body: dict) -> str:
    """A whole stream: either complete (every choice finished once, usage, [DONE] last) or one clean error."""
    finish: dict[int, str] = {}
    usage = None
    async for event in events:
        if event == "[DONE]":
            if behaviour is Behaviour.FAULT:
                raise Lost("the injected fault did not fire")
            if len(finish) != body.get("n", 1) or usage is None:
                raise Lost(f"[DONE] with finishes {finish} and usage {usage}")
            _check_usage(usage, body, list(finish.values()))
            return "complete"
        if "error" in event:
            return _clean_stream_error(event, behaviour)
        if event.get("usage"):
            usage = event["usage"]
        for choice in event["choices"]:
            if choice["index"] in finish:
                raise Lost(f"choice {choice['index']} went on after its finish chunk")
            if choice.get("finish_reason"):
                finish[choice["index"]] = choice["finish_reason"]
    raise Lost("the stream ended without [DONE] or an error event")


async def _read_response_to_the_end(events: AsyncIterator[dict | str], body: dict) -> str:
    """A whole Responses stream: events numbered 0, 1, 2, ... ending with the response completed or incomplete
    (a consistent one, `_check_response`), or failed by the server's time limit."""
    expected = 0
    async for event in events:
        if event == "[DONE]" or event["sequence_number"] != expected:
            raise Lost(f"out of order in a Responses stream: {str(event)[:200]}")
        expected += 1
        if event["type"] == "response.failed":
            error = event["response"]["error"]
            if error["code"] == "request_timeout":
                return "timed_out"
            raise Lost(f"unexpected response.failed: {error}")
        if event["type"] in ("response.completed", "response.incomplete"):
            _check_response(event["response"], body)
            return "complete"
    raise Lost("a Responses stream ended without its response")


def _check_response(response: dict, body: dict) -> None:
    """Every token accounted for: 1 to max_output_tokens of them, exactly that many when the answer was cut."""
    usage, limit = response["usage"], body["max_output_tokens"]
    tokens = usage["output_tokens"]
    cut = response["status"] == "incomplete"
    if response["status"] not in ("completed", "incomplete") or not 1 <= tokens <= limit or (cut and tokens != limit):
        raise Lost(f"response {response['status']} with usage {usage} for max_output_tokens={limit}")
    if usage["total_tokens"] != usage["input_tokens"] + tokens or not response["output"]:
        raise Lost(f"response usage {usage}, output {response['output']}")


def _clean_stream_error(event: dict, behaviour: Behaviour) -> str:
    """The outcome of a stream that ended with an error event, if that error was to be expected."""
    error = event["error"]
    _check_error(event)
    if behaviour is Behaviour.FAULT and error["type"] == "server_error" and error["code"] is None:
        return "failed_as_injected"
    if error["code"] == "request_timeout":
        return "timed_out"
    raise Lost(f"unexpected error event: {error}")


def _check_error(body: dict, code: str | None = None) -> None:
    if set(body) != {"error"} or set(body["error"]) != {"message", "type", "param", "code"}:
        raise Lost(f"not OpenAI's error object: {body}")
    if code is not None and body["error"]["code"] != code:
        raise Lost(f"error code {body['error']['code']!r}, expected {code!r}")


def _check_usage(usage: dict, body: dict, finish_reasons: list[str]) -> None:
    """Every token accounted for: between 1 and max_tokens per choice, exactly max_tokens when all hit the length."""
    n, max_tokens = body.get("n", 1), body["max_tokens"]
    tokens = usage["completion_tokens"]
    if not n <= tokens <= n * max_tokens or (set(finish_reasons) == {"length"} and tokens != n * max_tokens):
        raise Lost(f"usage {usage} for n={n}, max_tokens={max_tokens}, finishes {finish_reasons}")
    finishes_known = not set(finish_reasons) - {"stop", "length", "tool_calls"}
    if not finishes_known or usage["total_tokens"] != usage["prompt_tokens"] + tokens:
        raise Lost(f"finishes {finish_reasons}, usage {usage}")
