"""The async engine: hundreds of concurrent streams, exact streamed text, aborts on cancellation."""

import asyncio

import pytest

from api_helpers import aborted_midway

from bento_pagedllm import AsyncLLMEngine, EngineArgs, RequestError, SamplingParams


@pytest.fixture(scope="module")
def engine(tiny_llama3_dir):
    engine = AsyncLLMEngine(EngineArgs(model=tiny_llama3_dir, dtype="float32", device="cpu", num_kv_blocks=512,
                                       max_model_len=1024, max_num_seqs=256, max_num_batched_tokens=1024,
                                       async_scheduling=True))
    yield engine
    engine.shutdown()


async def wait_idle(engine, timeout=10.0):
    """The engine thread processes aborts between steps: wait until it has nothing left."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while engine.engine.requests and loop.time() < deadline:
        await asyncio.sleep(0.01)
    bm = engine.engine.block_manager
    return not engine.engine.requests and bm.num_free_blocks == bm.num_blocks


async def collect(engine, prompt, params, request_id):
    deltas, token_deltas, steps, last = [], [], 0, None
    async for out in engine.generate(prompt, params, request_id=request_id):
        choice = out.outputs[0]
        deltas.append(choice.delta_text)
        token_deltas += choice.delta_token_ids
        steps += 1
        last = out
    return "".join(deltas), token_deltas, steps, last


async def test_hundreds_of_concurrent_streams_are_exact(engine):
    prompts = [f"Request number {i} says" for i in range(300)]
    params = [SamplingParams(max_tokens=4 + i % 13, temperature=0.0 if i % 2 else 0.9, seed=i) for i in range(300)]
    results = await asyncio.gather(*(collect(engine, p, sp, f"r{i}") for i, (p, sp) in enumerate(zip(prompts, params))))
    for (text, tokens, steps, last), sp in zip(results, params):
        choice = last.outputs[0]
        assert last.finished and choice.finish_reason in ("length", "stop")
        assert text == choice.text and tokens == choice.token_ids
        assert steps == len(choice.token_ids)  # one output per generated token: streamed, not buffered
    assert await wait_idle(engine)
    # the async engine gives the same greedy answer as a request alone
    alone = await collect(engine, prompts[1], params[1], "again")
    assert alone[1] == results[1][1]


async def test_cancelling_the_consumer_aborts_and_frees_blocks(engine):
    async def consume_forever():
        async for _ in engine.generate("Tell me everything", SamplingParams(max_tokens=900, ignore_eos=True),
                                       request_id="long"):
            pass

    task = asyncio.create_task(consume_forever())
    while not engine.engine.block_manager.num_used_blocks:
        await asyncio.sleep(0.005)
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert await wait_idle(engine)


async def test_abort_ends_the_stream_with_reason_abort(engine):
    """`abort(request_id)` from elsewhere (vLLM's): the request's stream ends with a last output whose choices
    end with "abort"; the engine holds nothing of it."""
    received = await aborted_midway(engine, "aborted", after=3)
    last = received[-1]
    assert last.finished and [c.finish_reason for c in last.outputs] == ["abort"]
    assert 3 <= len(last.outputs[0].token_ids) < 900
    assert "".join(out.outputs[0].delta_text for out in received) == last.outputs[0].text
    assert await wait_idle(engine) and engine.num_open_streams == 0
    engine.abort("aborted")  # an id the engine no longer holds: nothing happens


async def test_vllms_prompt_dicts_stream_as_their_text(engine):
    params = SamplingParams(max_tokens=4, temperature=0.0)
    text, tokens, _, last = await collect(engine, {"prompt": "Once upon"}, params, "dict")
    _, plain_tokens, _, _ = await collect(engine, "Once upon", params, "plain")
    assert tokens == plain_tokens and last.prompt == "Once upon" and text == last.outputs[0].text


async def test_breaking_out_of_the_stream_aborts(engine):
    stream = engine.generate("Stop early", SamplingParams(max_tokens=500, ignore_eos=True), request_id="brk")
    async for _ in stream:
        break
    await stream.aclose()
    assert await wait_idle(engine)


async def test_invalid_requests_raise_before_queueing(engine):
    with pytest.raises(RequestError):
        async for _ in engine.generate([5] * 2000, SamplingParams(max_tokens=1)):
            pass
    assert await wait_idle(engine)


async def test_duplicate_request_id_fails_alone(engine):
    first = engine.generate("one", SamplingParams(max_tokens=30, ignore_eos=True), request_id="dup")
    await first.__anext__()
    with pytest.raises(RequestError):
        async for _ in engine.generate("two", SamplingParams(max_tokens=3), request_id="dup"):
            pass
    rest = [out async for out in first]
    assert rest[-1].finished and len(rest[-1].outputs[0].token_ids) == 30
    assert await wait_idle(engine)
