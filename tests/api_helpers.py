"""Helpers shared by the tests that drive the OpenAI routes in process (tiny random Llama, real engine).
(api_fixtures.py has the fixtures over them.)"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time

import httpx
import openai
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect
from starlette.routing import Mount

from bento_pagedllm import AsyncLLMEngine, EngineArgs, SamplingParams
from bento_pagedllm.async_engine import RequestLimits
from bento_pagedllm.openai import build_openai_app

MODEL = "tiny-llama"
KEY = "sk-test-0123456789"
HELLO = [{"role": "user", "content": "Hello there, how are you?"}]
MAX_LEN = 1024


def tiny_engine(model_dir: str, *, max_model_len: int = MAX_LEN, max_num_seqs: int = 64,
                limits: RequestLimits = RequestLimits(), observer=None,
                scheduling_policy: str = "fcfs") -> AsyncLLMEngine:
    """An async engine over the tiny random Llama on the CPU (512 KV blocks of 16 tokens)."""
    return AsyncLLMEngine(EngineArgs(model=model_dir, dtype="float32", device="cpu", num_kv_blocks=512,
                                     max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                                     max_num_batched_tokens=1024, scheduling_policy=scheduling_policy),
                          limits=limits, observer=observer)


def mount(get_engine, **kwargs) -> Starlette:
    return Starlette(routes=[Mount("/v1", app=build_openai_app(get_engine, model_name=MODEL, **kwargs))])


def http_client(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://test")


async def aborted_midway(engine: AsyncLLMEngine, request_id: str, after: int) -> list:
    """The outputs a long request streamed before `engine.abort(request_id)`, called once `after` had come,
    ended it (the last one included)."""
    received = []

    async def consume():
        async for out in engine.generate("Go on and on", SamplingParams(max_tokens=900, ignore_eos=True),
                                         request_id=request_id):
            received.append(out)

    task = asyncio.create_task(consume())
    while len(received) < after and not task.done():
        await asyncio.sleep(0.005)
    engine.abort(request_id)
    await asyncio.wait_for(task, 10)
    return received


def is_idle(engine) -> bool:
    """No request in the engine, every KV block free."""
    bm = engine.engine.block_manager
    return not engine.engine.requests and bm.num_free_blocks == bm.num_blocks


async def wait_idle(engine, timeout: float = 10.0) -> bool:
    """The engine thread processes aborts between steps: wait until it has nothing left."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not is_idle(engine) and loop.time() < deadline:
        await asyncio.sleep(0.01)
    return is_idle(engine)


def wait_idle_blocking(engine, timeout: float = 10.0) -> bool:
    """`wait_idle` for tests without an event loop."""
    deadline = time.monotonic() + timeout
    while not is_idle(engine) and time.monotonic() < deadline:
        time.sleep(0.01)
    return is_idle(engine)


def sse_events(text: str) -> list:
    """Split an SSE body into its events, checking OpenAI's framing: `data: <json>\\n\\n` ... `data: [DONE]\\n\\n`."""
    assert text.endswith("\n\n")
    events = []
    for block in text[:-2].split("\n\n"):
        assert block.startswith("data: ") and "\n" not in block
        data = block[len("data: "):]
        events.append(data if data == "[DONE]" else json.loads(data))
    return events


def error_of(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


async def call_asgi(app, path: str, payload: dict, *, disconnect_after: int | None = None,
                    disconnect_delay: float | None = None, spec_version: str = "2.3", engine=None,
                    block_after_first_s: float = 0.0):
    """Call the ASGI app as a server would; the client goes away after `disconnect_after` body chunks (an
    `http.disconnect` with ASGI < 2.4, a failing send with 2.4; 0: before the response starts) or
    `disconnect_delay` seconds. `block_after_first_s` blocks the event loop that long after the first body
    chunk (a loop busy with other work).
    Returns (status, body chunks, engine requests running when each chunk was sent)."""
    body = json.dumps(payload).encode()
    gone = asyncio.Event()
    status, chunks, running = None, [], []
    sent_request = False
    if disconnect_after == 0:
        gone.set()

    async def receive():
        nonlocal sent_request
        if not sent_request:
            sent_request = True
            return {"type": "http.request", "body": body, "more_body": False}
        if disconnect_delay is not None:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(gone.wait(), disconnect_delay)
        else:
            await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        nonlocal status
        if gone.is_set() and spec_version >= "2.4":
            raise OSError("connection closed")
        if message["type"] == "http.response.start":
            status = message["status"]
        elif message.get("body"):
            chunks.append(message["body"])
            if len(chunks) == 1 and block_after_first_s:
                time.sleep(block_after_first_s)  # NOTE: blocking on purpose: the engine goes on meanwhile
            running.append(len(engine.engine.requests) if engine else None)
            if disconnect_after is not None and len(chunks) >= disconnect_after:
                gone.set()

    scope = {
        "type": "http", "asgi": {"version": "3.0", "spec_version": spec_version}, "http_version": "1.1",
        "method": "POST", "scheme": "http", "path": "/v1" + path, "raw_path": ("/v1" + path).encode(),
        "root_path": "", "query_string": b"", "server": ("test", 80), "client": ("127.0.0.1", 5000),
        "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
    }
    with contextlib.suppress(ClientDisconnect):
        await asyncio.wait_for(app(scope, receive, send), 30)
    return status, chunks, running


def openai_client(app, api_key: str = "unused") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url="http://test/v1", api_key=api_key, http_client=http_client(app),
                              max_retries=0)
