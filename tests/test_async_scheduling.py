"""Async scheduling: step N+1 is planned and launched before step N's tokens are read.

The oracle is the synchronous engine: the same requests must give the same tokens, texts, logprobs and
finish reasons, while the plans show that steps really were launched ahead (pending inputs).
"""

import pytest

from bento_pagedllm import LLM, SamplingParams
from bento_pagedllm.model_runner import HostInputs
from bento_pagedllm.sequence import PENDING_TOKEN

KWARGS = dict(dtype="float32", device="cpu", num_kv_blocks=40, max_model_len=512, max_num_batched_tokens=64)


@pytest.fixture(scope="module")
def engines(tiny_llama3_dir):
    return LLM(tiny_llama3_dir, **KWARGS), LLM(tiny_llama3_dir, async_scheduling=True, **KWARGS)


def mixed_requests():
    """Every kind of stop and sampler path, with prompts long enough to chunk and to preempt."""
    prompts = [f"Request {i}: " + "tell me more " * (3 + 9 * i) for i in range(8)]
    params = [
        SamplingParams(max_tokens=20, temperature=0.0, logprobs=2),
        SamplingParams(max_tokens=16, temperature=0.9, top_p=0.9, seed=3),
        SamplingParams(max_tokens=24, temperature=0.0, frequency_penalty=1.5, presence_penalty=0.5),
        SamplingParams(max_tokens=12, temperature=1.0, top_k=20, seed=11, n=2),
        SamplingParams(max_tokens=30, temperature=0.0, stop=["e"]),
        SamplingParams(max_tokens=9, temperature=0.0, repetition_penalty=1.3),
        SamplingParams(max_tokens=18, temperature=0.7, min_p=0.05, seed=5, min_tokens=4),
        SamplingParams(max_tokens=1, temperature=0.0),
    ]
    return prompts, params


def run(llm, prompts, params):
    engine = llm.engine
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        engine.add_request(f"r{i}", prompt, p)
    final, plans, first_step_outputs = {}, [], None
    while engine.has_unfinished_requests():
        outputs = engine.step()
        if first_step_outputs is None:
            first_step_outputs = outputs
        plans.append(engine.last_plan)
        final.update({out.request_id: out for out in outputs if out.finished})
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks and not engine.requests
    return [final[f"r{i}"] for i in range(len(prompts))], plans, first_step_outputs


def test_async_outputs_equal_sync_outputs(engines):
    sync_llm, async_llm = engines
    prompts, params = mixed_requests()
    expected, sync_plans, _ = run(sync_llm, prompts, params)
    got, async_plans, first = run(async_llm, prompts, params)
    assert first == []  # the first step's tokens are read by the second call
    assert async_llm.engine.scheduler.num_preemptions_total > 0  # preempted while steps were in flight
    for ours, theirs in zip(got, expected):
        assert len(ours.outputs) == len(theirs.outputs)
        for a, b in zip(ours.outputs, theirs.outputs):
            assert (a.token_ids, a.text, a.finish_reason, a.stop_reason) == (
                b.token_ids, b.text, b.finish_reason, b.stop_reason)
            if b.logprobs is not None:
                assert a.cumulative_logprob == pytest.approx(b.cumulative_logprob, abs=1e-4)
                assert [[t for t, _ in x.top] for x in a.logprobs] == [[t for t, _ in x.top] for x in b.logprobs]
                assert max(abs(x.logprob - y.logprob) for x, y in zip(a.logprobs, b.logprobs)) < 1e-4
    pending_inputs = sum(s.token_ids[-1] == PENDING_TOKEN for plan in async_plans for s in plan.seqs)
    assert pending_inputs > 0  # steps really were launched before their inputs reached the host
    assert not any(s.token_ids[-1] == PENDING_TOKEN for plan in sync_plans for s in plan.seqs)


def test_a_length_limit_wastes_no_step(engines):
    _, llm = engines
    outputs, plans, _ = run(llm, ["Count with me"], [SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)])
    assert len(outputs[0].outputs[0].token_ids) == 6
    rows = sum(len(plan.sampling_rows) for plan in plans)
    assert rows == 6  # the scheduler knows the pending sixth token is the last one


def test_a_stop_wastes_at_most_one_dropped_step(engines):
    sync_llm, llm = engines
    base = sync_llm.generate("Stop me", SamplingParams(max_tokens=12, temperature=0.0))[0].outputs[0]
    stop_id = base.token_ids[4]
    params = SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=[stop_id])
    outputs, plans, _ = run(llm, ["Stop me"], [params])
    out = outputs[0].outputs[0]
    assert out.token_ids == base.token_ids[: base.token_ids.index(stop_id) + 1]
    rows = sum(len(plan.sampling_rows) for plan in plans)
    assert rows == len(out.token_ids) + 1  # one token was sampled after the stop, and dropped


def test_penalised_requests_read_their_tokens_before_the_next_step(engines):
    _, llm = engines
    params = SamplingParams(max_tokens=8, temperature=0.0, frequency_penalty=1.0)
    _, plans, _ = run(llm, ["Penalties need history"], [params])
    assert not any(s.token_ids[-1] == PENDING_TOKEN for plan in plans for s in plan.seqs)


def test_abort_while_a_step_is_in_flight(engines):
    sync_llm, llm = engines
    engine = llm.engine
    engine.add_request("gone", "This one is aborted", SamplingParams(max_tokens=40, temperature=0.0))
    engine.add_request("kept", "This one carries on", SamplingParams(max_tokens=10, temperature=0.0))
    for _ in range(4):
        engine.step()
    assert engine._in_flight is not None
    assert engine.abort_request("gone")
    final = None
    while engine.has_unfinished_requests():
        final = next((o for o in engine.step() if o.finished), final)
    expected = sync_llm.generate("This one carries on", SamplingParams(max_tokens=10, temperature=0.0))[0]
    assert final.request_id == "kept" and final.outputs[0].token_ids == expected.outputs[0].token_ids
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_every_path_reads_a_pending_input_s_row_at_its_position_and_minus_one_elsewhere():
    """The one form of a step's pending inputs (ModelRunner: decode graphs, mixed graphs and eager steps
    fill them from it with kernels/tokens.py::fill_pending_ids)."""
    host = HostInputs(input_ids=[5, PENDING_TOKEN, 7, 8, PENDING_TOKEN], pending_positions=[1, 4],
                      pending_rows=[2, 0])
    assert host.pending_sources() == [-1, 2, -1, -1, 0]
    assert HostInputs(input_ids=[3, 4]).pending_sources() == [-1, -1]
