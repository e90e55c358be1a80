"""Engine behaviour through the public API: choices, stops, limits, seeds, logprobs, penalties, aborts."""

import json
import shutil

import pytest
import torch

from bento_pagedllm import LLM, RequestError, SamplingParams

GREEDY = dict(temperature=0.0)


def all_free(llm):
    bm = llm.engine.block_manager
    return bm.num_free_blocks == bm.num_blocks and not llm.engine.requests


def test_text_and_token_prompts_give_the_same_output(llm):
    text_out = llm.generate("Hello, my name is", SamplingParams(max_tokens=8, **GREEDY))[0]
    ids = llm.tokenizer("Hello, my name is").input_ids
    ids_out = llm.generate([ids], SamplingParams(max_tokens=8, **GREEDY))[0]
    assert text_out.prompt_token_ids == ids
    assert text_out.outputs[0].token_ids == ids_out.outputs[0].token_ids
    assert text_out.outputs[0].text == llm.tokenizer.decode(ids_out.outputs[0].token_ids, skip_special_tokens=True)
    assert all_free(llm)


def test_max_tokens_gives_length(llm):
    out = llm.generate("Once upon a time", SamplingParams(max_tokens=7, **GREEDY))[0].outputs[0]
    assert len(out.token_ids) == 7 and out.finish_reason == "length"


def test_n_choices_share_the_prompt_blocks(llm):
    engine = llm.engine
    prompt = list(range(100, 140))  # 40 tokens: 3 blocks, the last one partial
    request = engine.add_request("fork", prompt, SamplingParams(n=3, max_tokens=6, temperature=1.0, seed=7))
    engine.step()  # the prompt is computed once, then forked
    assert len(request.seqs) == 3
    tables = [s.block_table for s in request.seqs]
    assert tables[0] == tables[1] == tables[2]
    assert engine.block_manager.num_used_blocks == 3
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            final = out
    assert [c.index for c in final.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 6 for c in final.outputs)
    assert len({tuple(c.token_ids) for c in final.outputs}) > 1  # independent random streams
    assert all_free(llm)
    greedy = llm.generate([prompt], SamplingParams(n=2, max_tokens=6, **GREEDY))[0]
    assert greedy.outputs[0].token_ids == greedy.outputs[1].token_ids


def test_stop_string_spanning_tokens_is_not_returned(llm):
    base = llm.generate("The weather today", SamplingParams(max_tokens=12, **GREEDY))[0].outputs[0]
    tokenizer = llm.tokenizer
    # a stop string made of the end of token 4 and the start of token 5
    t4 = tokenizer.decode(base.token_ids[:5])
    t5 = tokenizer.decode(base.token_ids[:6])
    cut = len(tokenizer.decode(base.token_ids[:4]))
    stop = t4[-2:] + t5[len(t4):len(t4) + 2]
    assert len(stop) >= 3 and stop in base.text
    out = llm.generate("The weather today", SamplingParams(max_tokens=12, stop=[stop], **GREEDY))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == base.text[: base.text.index(stop)]
    assert stop not in out.text and len(out.text) >= cut - 2
    kept = llm.generate("The weather today", SamplingParams(max_tokens=12, stop=stop, include_stop_str_in_output=True,
                                                            **GREEDY))[0].outputs[0]
    assert kept.text == base.text[: base.text.index(stop) + len(stop)]


def test_stop_token_ids(llm):
    base = llm.generate("Numbers:", SamplingParams(max_tokens=10, **GREEDY))[0].outputs[0]
    stop_id = base.token_ids[3]
    first = base.token_ids.index(stop_id)
    out = llm.generate("Numbers:", SamplingParams(max_tokens=10, stop_token_ids=[stop_id], **GREEDY))[0].outputs[0]
    assert out.token_ids == base.token_ids[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id


def test_eos_stops_unless_ignored(smol):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    out = smol.chat(messages, SamplingParams(max_tokens=40, **GREEDY))[0].outputs[0]
    assert out.finish_reason == "stop" and out.token_ids[-1] == 2 and len(out.token_ids) < 40
    assert "<|im_end|>" not in out.text
    longer = smol.chat(messages, SamplingParams(max_tokens=len(out.token_ids) + 5, ignore_eos=True, **GREEDY))[0]
    assert longer.outputs[0].finish_reason == "length"
    assert longer.outputs[0].token_ids[: len(out.token_ids)] == out.token_ids
    assert len(longer.outputs[0].token_ids) == len(out.token_ids) + 5


def test_seed_reproduces_regardless_of_the_batch(llm):
    params = SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, seed=42)
    alone = llm.generate("A seeded prompt", params)[0].outputs[0].token_ids
    others = [SamplingParams(max_tokens=10, temperature=0.8), SamplingParams(max_tokens=5, **GREEDY)]
    batch = llm.generate(["Other one", "A seeded prompt", "Third"], [others[0], params, others[1]])
    assert batch[1].outputs[0].token_ids == alone
    unseeded = {tuple(llm.generate("A seeded prompt", SamplingParams(max_tokens=10, temperature=1.0))[0]
                      .outputs[0].token_ids) for _ in range(3)}
    assert len(unseeded) > 1


def test_logprobs_of_chosen_and_top_alternatives(llm):
    out = llm.generate("Logprobs please", SamplingParams(max_tokens=5, logprobs=3, **GREEDY))[0].outputs[0]
    assert len(out.logprobs) == 5
    for token_id, lp in zip(out.token_ids, out.logprobs):
        assert lp.token_id == token_id and len(lp.top) == 3
        assert lp.top[0] == (token_id, pytest.approx(lp.logprob))  # greedy: the chosen is the most likely
        assert lp.top[0][1] >= lp.top[1][1] >= lp.top[2][1]
    assert out.cumulative_logprob == pytest.approx(sum(lp.logprob for lp in out.logprobs))
    assert all(lp.rank == 1 for lp in out.logprobs)  # greedy: the most likely, rank 1 (vLLM's Logprob.rank)
    # sampled: each token's rank is one more than the count of tokens more likely than it
    hot = llm.generate("Logprobs please", SamplingParams(max_tokens=8, logprobs=20, temperature=5.0, seed=3))[0]
    for lp in hot.outputs[0].logprobs:
        surely_above = sum(other > lp.logprob + 1e-5 for _, other in lp.top)
        maybe_above = sum(other > lp.logprob - 1e-5 for _, other in lp.top) - 1  # NOTE: itself, or a near-tie
        assert lp.rank >= surely_above + 1 and (lp.rank > 20 or lp.rank <= maybe_above + 1)


def test_frequency_penalty_reduces_repetition(llm):
    base = llm.generate("Hello there", SamplingParams(max_tokens=24, **GREEDY))[0].outputs[0].token_ids
    penalised = llm.generate("Hello there", SamplingParams(max_tokens=24, frequency_penalty=2.0, **GREEDY))[0]
    ids = penalised.outputs[0].token_ids
    assert len(set(base)) < len(base)  # the random model repeats itself greedily
    assert len(set(ids)) > len(set(base))


def test_logit_bias_steers_the_batch_row_by_row(llm):
    """A biased request among plain ones: its tokens follow the bias, the others are what they were alone."""
    prompts = ["Hello there", "Once upon a time"]
    alone = [o.outputs[0].token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=8, **GREEDY))]
    forced = SamplingParams(max_tokens=8, ignore_eos=True, logit_bias={alone[0][0] + 1: 100.0}, **GREEDY)
    outs = llm.generate(prompts, [forced, SamplingParams(max_tokens=8, **GREEDY)])
    assert outs[0].outputs[0].token_ids == [alone[0][0] + 1] * 8
    assert outs[1].outputs[0].token_ids == alone[1]


def test_too_long_and_invalid_prompts_are_rejected_up_front(llm):
    with pytest.raises(RequestError, match="by 1"):
        llm.generate([[5] * 1025], SamplingParams(max_tokens=1))
    with pytest.raises(RequestError):
        llm.generate([[49152]], SamplingParams(max_tokens=1))
    with pytest.raises(RequestError):
        llm.generate([[]], SamplingParams(max_tokens=1))
    with pytest.raises(RequestError, match="logit_bias"):
        llm.generate([[5]], SamplingParams(max_tokens=1, logit_bias={49152: 1.0}))
    assert all_free(llm)


def test_a_batch_is_admitted_whole_or_not_at_all(llm):
    """One prompt the engine refuses aborts those of its batch admitted before it (vLLM's); one SamplingParams
    per prompt, or a ValueError (not a batch cut short)."""
    with pytest.raises(RequestError, match="by 1"):
        llm.generate(["Hi", [5] * 1025], SamplingParams(max_tokens=500, ignore_eos=True))
    assert all_free(llm)
    with pytest.raises(ValueError, match="one SamplingParams per prompt: 2 for 3 prompts"):
        llm.generate(["a", "b", "c"], [SamplingParams(max_tokens=1)] * 2)
    assert all_free(llm)


def test_vllms_prompt_dicts(llm):
    """vLLM's TextPrompt and TokensPrompt dicts, alone or in a list, as their text and token ids."""
    ids = llm.tokenizer("Hello, my name is").input_ids
    params = SamplingParams(max_tokens=5, **GREEDY)
    plain = llm.generate(["Hello, my name is", ids], params)
    dicts = llm.generate([{"prompt": "Hello, my name is"}, {"prompt_token_ids": ids}], params)
    assert [o.outputs[0].token_ids for o in dicts] == [o.outputs[0].token_ids for o in plain]
    assert dicts[0].prompt == "Hello, my name is" and dicts[1].prompt is None
    alone = llm.generate({"prompt_token_ids": ids}, params)
    assert len(alone) == 1 and alone[0].outputs[0].token_ids == plain[1].outputs[0].token_ids
    with pytest.raises(RequestError, match="got keys \\['multi_modal_data', 'prompt'\\]"):
        llm.generate({"prompt": "Hi", "multi_modal_data": {}}, params)
    assert all_free(llm)


def test_context_limit_ends_with_length(llm):
    out = llm.generate([[7] * 1020], SamplingParams(max_tokens=100, ignore_eos=True, **GREEDY))[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 4


def test_abort_frees_blocks_at_once(llm):
    engine = llm.engine
    engine.add_request("a", list(range(1, 300)), SamplingParams(max_tokens=50))
    engine.add_request("b", list(range(1, 30)), SamplingParams(max_tokens=50))
    engine.step()
    engine.step()
    assert engine.block_manager.num_used_blocks > 0
    assert engine.abort_request("a") and engine.abort_request("b")
    assert not engine.abort_request("a")
    assert all_free(llm) and not engine.scheduler.has_work()


def test_min_tokens_defers_eos(smol):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    short = smol.chat(messages, SamplingParams(max_tokens=40, **GREEDY))[0].outputs[0]
    assert short.finish_reason == "stop" and len(short.token_ids) < 20
    longer = smol.chat(messages, SamplingParams(max_tokens=40, min_tokens=20, **GREEDY))[0].outputs[0]
    assert len(longer.token_ids) >= 20 and 2 not in longer.token_ids[:20]
    assert longer.token_ids[: len(short.token_ids) - 1] == short.token_ids[:-1]  # same until eos was due


def test_garbage_is_collected_between_steps_from_a_few_young_objects(monkeypatch):
    """engine.collect_garbage_between_steps: no pass under GC_STEP_YOUNG young objects; from there a pass of
    the oldest generation due on the collector's own schedule by volume (it never reaches its threshold):
    young passes GC_YOUNG_THRESHOLD / GC_STEP_YOUNG times as often, so as many more per middle pass."""
    import gc

    from bento_pagedllm import engine

    passes = []

    def record(phase, info):
        if phase == "start":
            passes.append(info["generation"])

    thresholds = gc.get_threshold()
    gc.collect()
    gc.callbacks.append(record)
    try:
        # NOTE: 15,000 young objects at a time stay well under the collector's own threshold (no automatic pass)
        gc.set_threshold(20_000, 3, 1_000_000)
        monkeypatch.setattr(engine, "GC_STEP_YOUNG", 10_000)  # so 2 x 3 young passes make a middle one due
        engine.collect_garbage_between_steps()
        assert passes == []  # a handful of young objects
        kept = [[] for _ in range(15_000)]
        engine.collect_garbage_between_steps()
        assert passes == [0] and gc.get_count()[0] < 100
        for _ in range(5):
            kept += [[] for _ in range(15_000)]
            engine.collect_garbage_between_steps()
        assert passes == [0] * 6
        kept += [[] for _ in range(15_000)]
        engine.collect_garbage_between_steps()  # six young passes made the middle generation due
        assert passes == [0] * 6 + [1]
        del kept
    finally:
        gc.callbacks.remove(record)
        gc.set_threshold(*thresholds)


def test_a_quiet_gc_engine_collects_between_steps_only(tiny_llama3_dir, monkeypatch):
    """With quiet_gc every step with work calls collect_garbage_between_steps once, after its launch."""
    import gc

    from bento_pagedllm import engine

    calls = []
    monkeypatch.setattr(engine, "collect_garbage_between_steps", lambda: calls.append(1))
    thresholds = gc.get_threshold()
    try:
        llm = LLM(tiny_llama3_dir, num_kv_blocks=64, quiet_gc=True)
        steps = []
        monkeypatch.setattr(llm.engine.scheduler, "update_computed",
                            lambda plan, inner=llm.engine.scheduler.update_computed: (steps.append(plan), inner(plan)))
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
        assert len(calls) == len(steps) > 0
        llm.engine.shutdown()
    finally:
        gc.unfreeze()
        gc.set_threshold(*thresholds)
    calls.clear()
    LLM(tiny_llama3_dir, num_kv_blocks=64).generate([[1, 2, 3]], SamplingParams(max_tokens=2, temperature=0.0))
    assert calls == []  # the default (quiet_gc off): the collector's own schedule


def test_quiet_gc_freezes_the_startup_heap_until_shutdown(tiny_llama3_dir):
    """EngineArgs.quiet_gc (the engine process sets it): the heap built at start-up is frozen and young
    objects are collected less often; shutdown makes the frozen objects collectable again."""
    import gc

    from bento_pagedllm.engine import GC_YOUNG_THRESHOLD

    thresholds = gc.get_threshold()
    assert LLM(tiny_llama3_dir, num_kv_blocks=64).engine.configs.quiet_gc is False  # the default
    try:
        llm = LLM(tiny_llama3_dir, num_kv_blocks=64, quiet_gc=True)
        assert gc.get_freeze_count() > 0 and gc.get_threshold()[0] == GC_YOUNG_THRESHOLD
        out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
        assert len(out[0].outputs[0].token_ids) == 3
        llm.engine.shutdown()
        assert gc.get_freeze_count() == 0
    finally:
        gc.unfreeze()
        gc.set_threshold(*thresholds)


def test_packed_step_inputs_start_on_16_byte_boundaries():
    """Each list of a packed upload starts 16-byte aligned whatever the lengths before it (Triton compiles a
    kernel variant per pointer alignment: a misaligned view would compile one mid-run), values intact."""
    import torch

    from bento_pagedllm.transfer import pack_to_device

    for dtype in (torch.int32, torch.int64):
        for n in range(1, 7):
            lists = {"a": list(range(n)), "b": [7] * (n + 1), "empty": [], "c": [-1, 2, 3]}
            packed = pack_to_device(lists, dtype, torch.device("cpu"))
            base = packed["a"].data_ptr()
            for name, values in lists.items():
                assert (packed[name].data_ptr() - base) % 16 == 0
                assert packed[name].dtype == dtype and packed[name].tolist() == values


def test_padded_lm_head_rows_change_no_output(tiny_llama3_dir):
    """ModelRunner.logits on CUDA pads a step's logit rows up to a bucket (the LM head then meets only row
    counts run at start-up) and keeps the step's own rows: here the same padding forced on the CPU gives the
    same tokens and log-probabilities, and the LM head sees only bucket counts."""
    llm = LLM(tiny_llama3_dir, dtype="float32", device="cpu", num_kv_blocks=128, max_model_len=1024)
    prompts = [list(range(10, 10 + n)) for n in (5, 9, 14)]  # three rows: not a bucket below
    params = SamplingParams(max_tokens=6, logprobs=1, **GREEDY)
    plain = llm.generate(prompts, params)
    runner = llm.engine.runner
    runner.logit_row_buckets = (1, 2, 4, 8)
    rows, compute_logits = [], runner.model.compute_logits
    runner.model.compute_logits = lambda hidden: rows.append(hidden.shape[0]) or compute_logits(hidden)
    padded = llm.generate(prompts, params)
    assert set(rows) <= {1, 2, 4, 8} and 4 in rows
    # a decode graph bigger than the step's bucket (DecodeGraphs.graph_size): the LM head takes fewer rows
    rows.clear()
    hidden = torch.randn(8, runner.model.config.hidden_size)
    torch.testing.assert_close(runner.logits(hidden, 3), compute_logits(hidden[:3]), rtol=0, atol=0)
    assert rows == [4]
    for a, b in zip(plain, padded):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert len(b.outputs[0].logprobs) == 6
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert x.token_id == y.token_id and abs(x.logprob - y.logprob) < 1e-5
            assert [t for t, _ in x.top] == [t for t, _ in y.top]


def test_the_eager_warm_up_step_reads_the_cache_and_writes_nothing(tiny_llama3_dir):
    """ModelRunner.warm_up_eager_step (run at start-up on CUDA): a prefill-sized eager step over sequences of
    at most max_model_len tokens that leaves the KV cache exactly as it was, and the engine's outputs after
    it are those of an engine that never ran it."""
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    before = LLM(tiny_llama3_dir, num_kv_blocks=64, max_model_len=128, max_num_batched_tokens=300)
    expected = before.generate([[5, 6, 7, 8]], params)[0].outputs[0].token_ids
    llm = LLM(tiny_llama3_dir, num_kv_blocks=64, max_model_len=128, max_num_batched_tokens=300)
    runner = llm.engine.runner
    runner.kv_cache.normal_()  # NOTE: any content: the step must neither change it nor fail on it
    cache = runner.kv_cache.clone()
    runner.warm_up_eager_step(300)  # three sequences: 128 + 128 + 44 tokens
    assert torch.equal(runner.kv_cache, cache)
    runner.kv_cache.zero_()
    assert llm.generate([[5, 6, 7, 8]], params)[0].outputs[0].token_ids == expected


def test_generate_without_params_takes_the_models_recommended_sampling(tiny_llama3_dir, tmp_path):
    """As vLLM's LLM: no SamplingParams means the model's generation_config.json sampling (here top_k 1, so
    greedy, and 4 tokens), not just SamplingParams' defaults."""
    model_dir = tmp_path / "model"
    shutil.copytree(tiny_llama3_dir, model_dir)
    config = json.loads((model_dir / "generation_config.json").read_text())
    (model_dir / "generation_config.json").write_text(json.dumps({**config, "top_k": 1, "max_new_tokens": 4}))
    llm = LLM(str(model_dir), dtype="float32", device="cpu", num_kv_blocks=64)
    assert llm.default_sampling_params() == SamplingParams(top_k=1, max_tokens=4)
    prompt = [[5, 6, 7, 8]]
    (plain,) = llm.generate(prompt)
    (greedy,) = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    assert plain.outputs[0].token_ids == greedy.outputs[0].token_ids[:len(plain.outputs[0].token_ids)]
    assert len(plain.outputs[0].token_ids) <= 4


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async-scheduling"])
def test_priority_policy_runs_lower_values_first(tiny_llama3_dir, async_scheduling):
    """vLLM's scheduling_policy="priority": with one seat, the requests run one at a time in priority order
    (then arrival), and each gives what it gives alone (greedy)."""
    llm = LLM(tiny_llama3_dir, dtype="float32", device="cpu", num_kv_blocks=64, max_num_seqs=1,
              scheduling_policy="priority", async_scheduling=async_scheduling)
    params = SamplingParams(max_tokens=3, ignore_eos=True, **GREEDY)
    prompts = [[1, 2, 3], [4, 5, 6, 7], [8, 9], [10, 11, 12]]
    outs = llm.generate(prompts, params, priority=[2, 0, 1, 0])
    order = sorted(range(4), key=lambda i: outs[i].metrics.first_scheduled_time)
    assert order == [1, 3, 2, 0]
    # each ran alone: it finished before the next was scheduled
    for before, after in zip(order, order[1:]):
        assert outs[before].metrics.finished_time <= outs[after].metrics.first_scheduled_time
    alone = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in alone]
    assert all_free(llm)


def test_a_priority_needs_the_priority_policy(llm, tiny_llama3_dir):
    with pytest.raises(RequestError, match="priority scheduling policy"):
        llm.engine.add_request(None, [1, 2, 3], SamplingParams(max_tokens=2), priority=1)
    with pytest.raises(ValueError, match="priority"):
        llm.generate([[1, 2]], SamplingParams(max_tokens=2), priority=[0, 1])  # one per prompt
    assert all_free(llm)
    with pytest.raises(ValueError, match="scheduling_policy"):
        LLM(tiny_llama3_dir, device="cpu", scheduling_policy="lifo")


@pytest.mark.parametrize("setting, message", [
    ({"max_model_len": 0}, "max_model_len must be a positive integer"),
    ({"max_num_batched_tokens": 0}, "max_num_batched_tokens must be a positive integer"),
    ({"enable_prefix_caching": "no"}, "enable_prefix_caching must be True or False, got 'no'"),
    ({"async_scheduling": 1}, "async_scheduling must be True or False"),
    ({"device": "gpu"}, "device 'gpu': expected 'auto', 'cpu', 'cuda' or 'cuda:N'"),
    ({"device": "mps"}, "device 'mps': expected"),
    pytest.param({"device": "cuda"}, "this torch sees no CUDA device",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is here")),
])
def test_engine_args_are_checked_when_the_engine_is_built(tiny_llama3_dir, setting, message):
    """Settings that would be read as something else (0 as the default, "no" as on) or fail deep inside are
    refused up front, naming the setting."""
    from bento_pagedllm import EngineArgs, LLMEngine

    with pytest.raises(ValueError, match=message):
        LLMEngine(EngineArgs(model=tiny_llama3_dir, dtype="float32", **{"device": "cpu", **setting}))
