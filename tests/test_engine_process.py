"""The engine in its own process (`AsyncLLMEngine(engine_process=True)`): the same outputs as the engine on a
thread, rebuilt from deltas; aborts, time limits, failures and shutdown as in-process; a dead engine process
fails every open stream instead of hanging them."""

from __future__ import annotations

import asyncio
import os
import pickle
import signal
import subprocess
import sys

import pytest
from api_helpers import aborted_midway

from bento_pagedllm import AsyncLLMEngine, EngineArgs, SamplingParams
from bento_pagedllm.async_engine import (
    EngineObserver,
    EngineShuttingDownError,
    RequestFailedError,
    RequestLimits,
    RequestTimeoutError,
)
from bento_pagedllm.faults import FaultInjection

pytestmark = pytest.mark.timeout(300)

PARAMS = [
    SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
    SamplingParams(max_tokens=9, temperature=0.8, seed=7, logprobs=2, prompt_logprobs=1),
    SamplingParams(max_tokens=6, temperature=1.0, top_p=0.9, seed=3, n=2),
    SamplingParams(max_tokens=20, temperature=0.0, stop=["e"], ignore_eos=True),
]


def engine_args(model_dir: str) -> EngineArgs:
    return EngineArgs(model=model_dir, dtype="float32", device="cpu", num_kv_blocks=256, max_model_len=512,
                      max_num_seqs=32, max_num_batched_tokens=512)


class LastReport(EngineObserver):
    """Keeps the engine's last counts and sums the requests it ended."""

    def __init__(self) -> None:
        self.stats = None
        self.finished = self.aborted = self.timed_out = self.failed = 0

    def observe(self, report) -> None:
        self.stats = report.stats
        self.finished += len(report.finished)
        self.aborted += report.num_aborted
        self.timed_out += report.num_timed_out
        self.failed += report.num_failed

    def idle(self) -> bool:
        return self.stats is not None and self.stats.num_unfinished == 0 and self.stats.kv_blocks_used == 0


async def eventually(condition, timeout: float = 20.0) -> bool:
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition() and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.01)
    return condition()


@pytest.fixture(scope="module")
def observer() -> LastReport:
    return LastReport()


@pytest.fixture(scope="module")
def process_engine(tiny_llama3_dir, observer):
    engine = AsyncLLMEngine(engine_args(tiny_llama3_dir), engine_process=True, observer=observer,
                            token_hook=FaultInjection(seed=666, after_tokens=3))
    engine.start()
    yield engine
    engine.shutdown()


async def run_all(engine, prompts) -> list[list]:
    """Every output of every request, the requests run concurrently."""
    async def one(i, prompt, params):
        return [out async for out in engine.generate(prompt, params, request_id=f"same-{i}")]
    return await asyncio.gather(*(one(i, p, sp) for i, (p, sp) in enumerate(zip(prompts, PARAMS))))


def summary(outputs: list) -> list:
    last = outputs[-1]
    return [(c.index, c.text, c.token_ids, c.finish_reason, c.stop_reason, c.cumulative_logprob,
             None if c.logprobs is None else list(c.logprobs))
            for c in last.outputs] + [last.prompt, last.prompt_token_ids, last.finished, last.prompt_logprobs]


async def test_outputs_equal_the_engine_on_a_thread(tiny_llama3_dir, process_engine):
    prompts = ["The capital of France is", [5, 17, 42, 99, 3], "Once upon a time", "Here we go again"]
    threaded = AsyncLLMEngine(engine_args(tiny_llama3_dir))
    try:
        expected = await run_all(threaded, prompts)
    finally:
        threaded.shutdown()
    got = await run_all(process_engine, prompts)
    for mine, theirs in zip(got, expected):
        assert summary(mine) == summary(theirs)
        assert len(mine) == len(theirs)  # one output per step, as in-process
        assert all(out.prompt_logprobs == mine[-1].prompt_logprobs for out in mine)  # sent once, kept
        for out in mine:  # the deltas add up to the cumulative outputs, step by step
            for choice in out.outputs:
                assert choice.text.endswith(choice.delta_text)
                assert choice.token_ids[len(choice.token_ids) - len(choice.delta_token_ids):] == choice.delta_token_ids
    assert [c.stop_reason for c in got[3][-1].outputs] == ["e"]
    assert got[1][-1].prompt_logprobs[1].token_id == 17 and got[0][-1].prompt_logprobs is None


async def test_beam_search_through_the_engine_process(tiny_llama3_dir, process_engine):
    """The API's beam search reads each step's alternatives from the streams: the engine process's (rebuilt
    from deltas) give the beams the offline engine finds."""
    from bento_pagedllm import LLM, BeamSearchParams
    from bento_pagedllm.beam_search import beam_search_output

    params = BeamSearchParams(width=2, max_tokens=4)
    prompt = [5, 17, 42, 99, 3]
    got = await beam_search_output(process_engine, prompt, params, "beams")
    expected = LLM(tiny_llama3_dir, dtype="float32", device="cpu", num_kv_blocks=64).beam_search([prompt], params)
    assert [(c.token_ids, c.finish_reason) for c in got.outputs] == [
        (c.token_ids, c.finish_reason) for c in expected[0].outputs]
    assert await eventually(lambda: not process_engine.num_open_streams)


async def test_cancelling_the_consumer_aborts_in_the_engine_process(process_engine, observer):
    aborted = observer.aborted

    async def consume_forever():
        async for _ in process_engine.generate("Tell me everything", SamplingParams(max_tokens=400, ignore_eos=True)):
            pass

    task = asyncio.create_task(consume_forever())
    assert await eventually(lambda: observer.stats is not None and observer.stats.kv_blocks_used > 0)
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert await eventually(lambda: observer.aborted == aborted + 1 and observer.idle())
    assert process_engine.num_open_streams == 0


async def test_abort_ends_the_stream_in_the_engine_process(process_engine, observer):
    aborted = observer.aborted
    received = await aborted_midway(process_engine, "stopped", after=2)
    assert received[-1].finished and received[-1].outputs[0].finish_reason == "abort"
    assert await eventually(lambda: observer.aborted == aborted + 1 and observer.idle())
    assert process_engine.num_open_streams == 0


def test_a_script_without_the_main_guard_is_told_why(tiny_llama3_dir, tmp_path):
    """Under "spawn" the child re-imports the script: one that builds the engine at module level makes the
    child fail before its engine exists; the parent says so (it had raised a bare EOFError)."""
    script = tmp_path / "unguarded.py"
    script.write_text("from bento_pagedllm import AsyncLLMEngine, EngineArgs\n"
                      f"AsyncLLMEngine(EngineArgs(model={tiny_llama3_dir!r}, device='cpu', num_kv_blocks=64), "
                      "engine_process=True)\n")
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert result.returncode != 0
    assert "RuntimeError: the engine process exited before its engine was built" in result.stderr, result.stderr[-2000:]
    assert "__main__" in result.stderr


async def test_a_failing_request_fails_alone(process_engine, observer):
    failed = observer.failed
    bad = process_engine.generate("Fail me", SamplingParams(max_tokens=10, seed=666, ignore_eos=True))
    good = process_engine.generate("Not me", SamplingParams(max_tokens=10, seed=1, ignore_eos=True))

    async def last(stream):
        outputs = [out async for out in stream]
        return outputs[-1]

    results = await asyncio.gather(last(bad), last(good), return_exceptions=True)
    assert isinstance(results[0], RequestFailedError) and "injected" in str(results[0])
    assert results[1].finished and len(results[1].outputs[0].token_ids) == 10
    assert observer.failed == failed + 1


async def test_time_limit_and_shutdown(tiny_llama3_dir):
    observer = LastReport()
    engine = AsyncLLMEngine(engine_args(tiny_llama3_dir), engine_process=True, observer=observer,
                            limits=RequestLimits(request_timeout_s=0.3))
    child = engine._core.process
    try:
        with pytest.raises(RequestTimeoutError):
            async for _ in engine.generate("Keep going", SamplingParams(max_tokens=10_000, ignore_eos=True)):
                pass
        assert observer.timed_out == 1 and await eventually(observer.idle)
        stream = engine.submit([1, 2, 3], SamplingParams(max_tokens=400, ignore_eos=True))
        assert (await stream.__anext__()).outputs[0].token_ids
    finally:
        await asyncio.to_thread(engine.shutdown)
    with pytest.raises(EngineShuttingDownError):
        async for _ in stream:
            pass
    assert child.exitcode == 0 and not engine.is_running


async def test_a_dead_engine_process_fails_the_open_streams(tiny_llama3_dir):
    engine = AsyncLLMEngine(engine_args(tiny_llama3_dir), engine_process=True)
    engine.start()
    try:
        stream = engine.submit([1, 2, 3], SamplingParams(max_tokens=10_000, ignore_eos=True))
        await stream.__anext__()
        os.kill(engine._core.process.pid, signal.SIGKILL)
        with pytest.raises(RuntimeError, match="exited unexpectedly"):
            async for _ in stream:
                pass
        assert engine.dead_error is not None and not engine.is_running
        with pytest.raises(RuntimeError, match="failed"):
            engine.submit([1, 2, 3], SamplingParams(max_tokens=4))
    finally:
        engine.shutdown()


def test_an_engine_that_cannot_be_built_raises_in_the_constructor(tiny_llama3_dir):
    args = EngineArgs(model=tiny_llama3_dir, dtype="float32", device="cpu", num_kv_blocks=4, max_model_len=512)
    with pytest.raises(RuntimeError, match="max_model_len"):
        AsyncLLMEngine(args, engine_process=True)


class RequireFrozenHeap:
    """A token hook (it runs in the engine process) that fails its request unless the heap is frozen."""

    def __call__(self, seq, token) -> None:
        import gc

        if gc.get_freeze_count() == 0:
            raise RuntimeError("the engine process did not quiet its garbage collector")


async def test_the_engine_process_quiets_its_garbage_collector(tiny_llama3_dir):
    """EngineArgs.quiet_gc is off by default; the engine process, which lives exactly as long as its
    engine, turns it on for itself (and the parent's collector is left alone)."""
    import gc

    assert engine_args(tiny_llama3_dir).quiet_gc is False
    engine = AsyncLLMEngine(engine_args(tiny_llama3_dir), engine_process=True, token_hook=RequireFrozenHeap())
    engine.start()
    try:
        outputs = [out async for out in engine.generate([1, 2, 3], SamplingParams(max_tokens=4, ignore_eos=True))]
        assert len(outputs[-1].outputs[0].token_ids) == 4
    finally:
        await asyncio.to_thread(engine.shutdown)
    assert gc.get_freeze_count() == 0


def test_the_engine_loop_does_not_wait_for_the_serving_process_to_read(tiny_llama3_dir):
    """A step's message goes up the pipe from the child's sender thread: while the parent reads nothing
    (its reader thread held here, as a busy event loop holds it from the GIL), the engine still finishes
    its requests, messages far beyond what the pipe buffers. The finish times are stamped in the child."""
    import threading
    import time

    from bento_pagedllm.engine_loop import AddRequest
    from bento_pagedllm.engine_process import EngineProcess

    release, first_batch = threading.Event(), threading.Event()
    finished: dict[str, float] = {}
    sizes: list[int] = []

    def on_batch(report, deliveries) -> None:
        first_batch.set()
        release.wait()  # NOTE: the parent's reader stalls until the test lets it go
        sizes.append(len(pickle.dumps(deliveries)))
        for request_id, wire in deliveries:
            if not isinstance(wire, BaseException) and wire[1]:  # finished: its metrics' finished_time
                finished[request_id] = wire[3][3]

    core = EngineProcess(engine_args(tiny_llama3_dir), None, None, on_batch, lambda error: None)
    try:
        core.start()
        # 32 requests x 160 tokens with 5 log-probabilities each: megabytes of deltas, far beyond what the
        # pipe (a socket pair) buffers
        params = SamplingParams(max_tokens=160, temperature=0.0, ignore_eos=True, logprobs=5)
        for i in range(32):
            core.send(AddRequest(f"r{i}", None, [1, 5 + i, 9, 14], params, None))
        assert first_batch.wait(60)
        stalled_at = time.monotonic()
        time.sleep(STALL_S)  # the tiny model finishes all 32 in 1-2 s on this project's 2-core CPU
        release.set()
        deadline = time.monotonic() + 60
        while len(finished) < 32 and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        release.set()
        core.stop()
    assert len(finished) == 32
    took = max(finished.values()) - stalled_at
    assert took < STALL_S, f"the engine waited for the parent to read ({took:.1f} s after the stall began)"
    assert sum(sizes) > 800_000  # what went through the pipe while the parent did not read


STALL_S = 12.0
