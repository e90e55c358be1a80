"""Faults, in process on the tiny random Llama: a request that fails inside the engine, a whole step that fails,
timeouts, backpressure, a graceful drain and a client gone before the first byte. Each test checks that what
went wrong stays with its request, that the others are served, that it is counted, and that nothing is left.
"""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from api_helpers import HELLO, MODEL, call_asgi, error_of, http_client, mount, sse_events, tiny_engine, wait_idle

from bento_pagedllm import AsyncLLMEngine, EngineArgs, LLMEngine, SamplingParams
from bento_pagedllm.async_engine import (
    EngineObserver,
    EngineOverloadedError,
    EngineShuttingDownError,
    RequestFailedError,
    RequestLimits,
    RequestTimeoutError,
)
from bento_pagedllm.faults import FaultInjection

FAULT_SEED = 666
LONG = SamplingParams(max_tokens=900, ignore_eos=True, temperature=0.0)
SHORT = SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.0)
CHAT = {"model": MODEL, "messages": HELLO}


class CountingObserver(EngineObserver):
    """Counts what the engine reports, as EngineMetrics does on /metrics."""

    def __init__(self) -> None:
        self.finished = self.aborted = self.timed_out = self.failed = self.rejected = 0

    def observe(self, report) -> None:
        self.finished += len(report.finished)
        self.failed += report.num_failed
        self.aborted += report.num_aborted
        self.timed_out += report.num_timed_out

    def observe_rejection(self) -> None:
        self.rejected += 1


class StepFailsOnce(LLMEngine):
    """The real engine, except that the step after `fail_next_step()` fails once its plan is made (KV blocks
    allocated, sequences running), as a device error in the forward pass would."""

    def __init__(self, args: EngineArgs) -> None:
        super().__init__(args)
        self._fail = False

    def fail_next_step(self) -> None:
        self._fail = True

    def step(self):
        if self._fail:
            self._fail = False
            self.scheduler.schedule()
            raise RuntimeError("the device went away")
        return super().step()


@pytest.fixture
def observer() -> CountingObserver:
    return CountingObserver()


@pytest.fixture
def make_engine(tiny_llama3_dir, observer):
    """A fresh engine per test (a drain cannot be undone), shut down afterwards."""
    engines: list[AsyncLLMEngine] = []

    def make(**kwargs) -> AsyncLLMEngine:
        engines.append(tiny_engine(tiny_llama3_dir, observer=observer, **kwargs))
        return engines[-1]

    yield make
    for engine in engines:
        engine.shutdown()


async def run(engine: AsyncLLMEngine, prompt: str, params: SamplingParams, request_id: str):
    """The request's outputs, or the exception that ended its stream."""
    outputs = []
    try:
        async for out in engine.generate(prompt, params, request_id=request_id):
            outputs.append(out)
    except Exception as error:  # noqa: BLE001 - what the test looks at
        return outputs, error
    return outputs, None


async def first_output(stream):
    return await stream.__anext__()


async def eventually(condition, timeout: float = 10.0) -> bool:
    """For what the engine thread does after the caller moved on (an abort is processed at its next turn)."""
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    return condition()


async def test_a_request_failing_inside_the_engine_fails_alone(make_engine, observer):
    engine = make_engine()
    engine.engine.token_hook = FaultInjection(seed=FAULT_SEED, after_tokens=3)
    params = [SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.8, seed=FAULT_SEED if i % 4 == 0 else i)
              for i in range(16)]
    results = await asyncio.gather(*(run(engine, f"Prompt {i} says", p, f"r{i}") for i, p in enumerate(params)))
    for (outputs, error), p in zip(results, params):
        if p.seed == FAULT_SEED:
            assert isinstance(error, RequestFailedError) and "InjectedFault" in str(error)
            assert len(outputs) == 2  # its first two tokens were streamed, then the stream ended with the error
        else:
            assert error is None and outputs[-1].finished and len(outputs[-1].outputs[0].token_ids) == 12
    assert (observer.failed, observer.finished) == (4, 12)
    assert await wait_idle(engine) and engine.num_open_streams == 0


async def test_a_failed_step_fails_its_requests_and_the_loop_goes_on(tiny_llama3_dir, observer):
    flaky = StepFailsOnce(EngineArgs(model=tiny_llama3_dir, dtype="float32", device="cpu", num_kv_blocks=512,
                                     max_model_len=1024))
    engine = AsyncLLMEngine(engine=flaky, observer=observer)
    try:
        streams = [engine.submit(engine.engine.tokenize(f"Prompt {i}"), LONG, f"r{i}") for i in range(3)]
        for stream in streams:
            await first_output(stream)
        flaky.fail_next_step()
        for stream in streams:
            with pytest.raises(RequestFailedError, match="the device went away"):
                async for _ in stream:
                    pass
        assert observer.failed == 3 and await wait_idle(engine)
        outputs, error = await run(engine, "After the failure", SHORT, "after")  # the loop still serves
        assert error is None and outputs[-1].outputs[0].finish_reason == "length"
        assert engine.is_running and engine.dead_error is None
    finally:
        engine.shutdown()


async def test_a_request_past_its_time_limit_is_aborted_and_reported(make_engine, observer):
    engine = make_engine(limits=RequestLimits(request_timeout_s=0.3))
    start = time.monotonic()
    (long_out, long_error), (short_out, short_error) = await asyncio.gather(
        run(engine, "Tell me everything", LONG, "long"), run(engine, "Be brief", SHORT, "short"))
    assert isinstance(long_error, RequestTimeoutError) and "0.3 s" in str(long_error)
    assert 0.3 <= time.monotonic() - start < 5 and len(long_out) < 900  # it was generating when it was ended
    assert short_error is None and short_out[-1].finished
    assert (observer.timed_out, observer.finished) == (1, 1) and await wait_idle(engine)
    # over HTTP: 504 with OpenAI's error object, or an error event once the stream has begun
    async with http_client(mount(lambda: engine)) as client:
        body = {**CHAT, "max_tokens": 900, "ignore_eos": True}
        error = error_of(await client.post("/v1/chat/completions", json=body), 504)
        assert error["code"] == "request_timeout" and error["type"] == "server_error"
        r = await client.post("/v1/chat/completions", json={**body, "stream": True})
        assert r.status_code == 200 and sse_events(r.text)[-1]["error"]["code"] == "request_timeout"
    assert observer.timed_out == 3 and await wait_idle(engine)


async def test_backpressure_bounds_the_waiting_requests(make_engine, observer):
    engine = make_engine(max_num_seqs=2, limits=RequestLimits(max_waiting_requests=2))
    ids = engine.engine.tokenize("Keep going")
    running = [engine.submit(ids, LONG, f"run{i}") for i in range(2)]
    for stream in running:
        await first_output(stream)  # both hold the engine's two seats
    waiting = [engine.submit(ids, LONG, f"wait{i}") for i in range(2)]
    assert engine.num_waiting == 2
    with pytest.raises(EngineOverloadedError):
        engine.submit(ids, SHORT, "one-too-many")
    assert observer.rejected == 1 and engine.num_waiting == 2  # refused: never queued
    # over HTTP: 503 with Retry-After and OpenAI's error object, streamed or not, before any byte of an answer
    async with http_client(mount(lambda: engine, retry_after_s=2)) as client:
        for stream in (False, True):
            r = await client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 4, "stream": stream})
            assert error_of(r, 503)["code"] == "engine_overloaded" and r.headers["retry-after"] == "2"
        # a batch larger than the cap could never be admitted: 400, not an invitation to retry
        r = await client.post("/v1/completions", json={"model": MODEL, "prompt": ["a", "b", "c"], "max_tokens": 1})
        assert error_of(r, 400)["param"] == "prompt"
    assert observer.rejected == 3
    # a seat frees up: a waiting request starts, and the queue has room for one more
    await running[0].aclose()
    await first_output(waiting[0])
    async with http_client(mount(lambda: engine)) as client:  # two prompts: all admitted or none
        r = await client.post("/v1/completions", json={"model": MODEL, "prompt": ["a", "b"], "max_tokens": 1})
        assert error_of(r, 503)["code"] == "engine_overloaded"
    assert engine.num_waiting == 1 and engine.num_open_streams == 3
    admitted = engine.submit(ids, SHORT, "admitted")
    for stream in (*running, *waiting, admitted):
        await stream.aclose()
    assert await wait_idle(engine) and engine.num_waiting == 0 and engine.num_open_streams == 0


async def test_drain_finishes_what_fits_in_the_grace_period_and_ends_the_rest(make_engine, observer):
    engine = make_engine()
    app = mount(lambda: engine)
    long_http = asyncio.create_task(call_asgi(app, "/chat/completions", {**CHAT, "max_tokens": 900,
                                                                        "ignore_eos": True, "stream": True}))
    long_task = asyncio.create_task(run(engine, "Tell me everything", LONG, "long"))
    short = engine.submit(engine.engine.tokenize("Be brief"), SamplingParams(max_tokens=10, ignore_eos=True), "short")
    while len(engine.engine.requests) < 3:
        await asyncio.sleep(0.01)
    # NOTE: 10 steps fit in the grace period even on a loaded 2-core machine (40 in 0.5 s did not, once, in
    # CI); 900 do not fit on any CPU this runs on (they would need steps of ~1 ms with HTTP streaming)
    engine.drain(grace_s=1.0)
    with pytest.raises(EngineShuttingDownError):
        engine.submit([1, 2, 3], SHORT, "late")
    async with http_client(app) as client:
        r = await client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 2})
        assert error_of(r, 503)["code"] == "server_shutting_down" and "retry-after" in r.headers
    outputs = [out async for out in short]  # finishes within the grace period
    assert outputs[-1].outputs[0].finish_reason == "length"
    long_out, long_error = await long_task
    assert isinstance(long_error, EngineShuttingDownError) and long_out  # it ran until the deadline
    status, chunks, _ = await long_http
    events = sse_events(b"".join(chunks).decode())
    assert status == 200 and events[-1]["error"]["code"] == "server_shutting_down"
    assert (observer.finished, observer.aborted) == (1, 2) and await wait_idle(engine)


async def test_a_client_gone_before_the_first_byte_aborts_its_request(make_engine, observer):
    engine = make_engine()
    app = mount(lambda: engine)
    payload = {**CHAT, "max_tokens": 900, "ignore_eos": True, "stream": True}
    status, chunks, _ = await call_asgi(app, "/chat/completions", payload, disconnect_after=0, spec_version="2.4")
    assert status is None and not chunks  # the response never started
    assert await eventually(lambda: observer.aborted == 1)
    assert await wait_idle(engine) and engine.num_open_streams == 0
    r = json.loads(b"".join((await call_asgi(app, "/chat/completions", {**CHAT, "max_tokens": 2}))[1]))
    assert r["usage"]["completion_tokens"] == 2  # and the next one is served
