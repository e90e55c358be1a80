"""Prompt log-probabilities (`SamplingParams.prompt_logprobs`, vLLM's parameter; the completions API's
`echo` with `logprobs`): every prompt token's log-probability given the tokens before it, its rank and the
top alternatives, against transformers' own forward pass over the prompt (float32, CPU).

The engine runs under memory pressure (preemption, recompute) and a small token budget (chunked prefill),
with and without async scheduling and prefix caching: a prompt scored in pieces, or recomputed, must give
each position's scores once and the same as one pass of the reference model.
"""

import pytest
import torch
from transformers import AutoModelForCausalLM

from bento_pagedllm import LLM, EngineArgs, LLMEngine, SamplingParams

GREEDY = dict(temperature=0.0)


# NOTE: two float32 forward passes in different orders differ by ~1e-6 in a log-probability, so a token
# whose neighbours in the distribution lie that close may swap places with them: ranks are checked within
# the tokens that close, and the top tokens are compared where their gaps exceed it
CLOSE = 1e-4


def reference_scores(model_dir: str, ids: list[int], k: int, device: str = "cpu", close: float = CLOSE):
    """transformers' log-probability of each prompt token after the first, the range of ranks it may take
    (its rank, counting ties within `close` either way), and the top k ids and log-probabilities."""
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()
    with torch.no_grad():
        logits = hf(torch.tensor([ids], device=device)).logits[0].float().cpu()
    logprobs = torch.log_softmax(logits, dim=-1)[:-1]  # [len - 1, vocab]
    targets = torch.tensor(ids[1:])
    chosen = logprobs.gather(1, targets[:, None])  # [len - 1, 1]
    ranks = list(zip(((logprobs > chosen + close).sum(-1) + 1).tolist(),
                     ((logprobs > chosen - close).sum(-1)).tolist()))
    top = logprobs.topk(k + 1, dim=-1)  # NOTE: one more: the first token left out, for the gaps
    return chosen[:, 0].tolist(), ranks, (top.indices.tolist(), top.values.tolist())


def check_scores(out, ids, expected, k, close: float = CLOSE):
    chosen, ranks, top = expected
    scores = out.prompt_logprobs
    assert len(scores) == len(ids) and scores[0] is None
    for position in range(1, len(ids)):
        score = scores[position]
        assert score.token_id == ids[position]
        assert score.logprob == pytest.approx(chosen[position - 1], abs=close)
        low, high = ranks[position - 1]
        assert low <= score.rank <= high
        assert len(score.top) == k
        if k:
            ids_ref, lps_ref = top[0][position - 1], top[1][position - 1]
            assert [lp for _, lp in score.top] == pytest.approx(lps_ref[:k], abs=close)
            for j, (token, _) in enumerate(score.top):
                gaps = [abs(lps_ref[j] - other) for i, other in enumerate(lps_ref) if i != j]
                if all(gap > close for gap in gaps):
                    assert token == ids_ref[j]


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async-scheduling"])
def test_prompt_scores_match_transformers_under_chunking_and_preemption(tiny_llama3_dir, async_scheduling):
    torch.manual_seed(1)
    lengths = [1, 2, 30, 170, 400]
    prompts = [torch.randint(3, 49152, (n,)).tolist() for n in lengths]
    engine = LLMEngine(EngineArgs(model=tiny_llama3_dir, dtype="float32", device="cpu", num_kv_blocks=40,
                                  max_model_len=640, max_num_batched_tokens=64, async_scheduling=async_scheduling))
    for i, ids in enumerate(prompts):
        engine.add_request(f"p{i}", ids, SamplingParams(max_tokens=20, prompt_logprobs=3, **GREEDY))
    final, chunked = {}, False
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
        plan = engine.last_plan
        chunked |= any(r.first_position > 0 for r in plan.prompt_score_rows)
    assert engine.scheduler.num_preemptions_total > 0 and chunked
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    for i, ids in enumerate(prompts):
        check_scores(final[f"p{i}"], ids, reference_scores(tiny_llama3_dir, ids, 3), 3)


def test_prompt_scores_ignore_the_prefix_cache_and_leave_outputs_unchanged(llm, tiny_llama3_dir):
    """A prompt whose prefix is cached is still scored from its first token; its generated tokens are those
    of the same request without scores; the prefix cache serves the next request without scores."""
    torch.manual_seed(2)
    ids = torch.randint(3, 49152, (90,)).tolist()
    plain = llm.generate([ids], SamplingParams(max_tokens=8, **GREEDY))[0]  # now cached
    assert plain.prompt_logprobs is None
    hits = llm.engine.block_manager.prefix_hit_tokens
    scored = llm.generate([ids], SamplingParams(max_tokens=8, prompt_logprobs=0, **GREEDY))[0]
    assert llm.engine.block_manager.prefix_hit_tokens == hits  # scored prompts take nothing from the cache
    assert scored.outputs[0].token_ids == plain.outputs[0].token_ids
    assert scored.metrics.num_cached_tokens == 0
    check_scores(scored, ids, reference_scores(tiny_llama3_dir, ids, 0), 0)
    again = llm.generate([ids], SamplingParams(max_tokens=8, **GREEDY))[0]
    assert again.metrics.num_cached_tokens > 0 and again.outputs[0].token_ids == plain.outputs[0].token_ids


def test_max_tokens_zero_scores_the_prompt_and_generates_nothing(llm, tiny_llama3_dir):
    ids = llm.tokenizer("The quick brown fox jumps over the lazy dog").input_ids
    out = llm.generate([ids], SamplingParams(max_tokens=0, prompt_logprobs=2, n=2, **GREEDY))[0]
    assert [c.token_ids for c in out.outputs] == [[], []] and [c.text for c in out.outputs] == ["", ""]
    assert all(c.finish_reason == "length" for c in out.outputs) and out.finished
    check_scores(out, ids, reference_scores(tiny_llama3_dir, ids, 2), 2)
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks and not llm.engine.requests


def test_n_choices_share_one_set_of_prompt_scores(llm):
    ids = list(range(200, 260))
    params = SamplingParams(n=3, max_tokens=5, temperature=1.0, seed=3, prompt_logprobs=1)
    out = llm.generate([ids], params)[0]
    assert len(out.outputs) == 3 and all(len(c.token_ids) == 5 for c in out.outputs)
    assert len(out.prompt_logprobs) == 60 and all(s is not None for s in out.prompt_logprobs[1:])


def test_prompt_logprobs_are_validated():
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21)
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=-1)
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=-1)


def test_offline_llm_returns_prompt_scores_with_its_outputs(tiny_llama3_dir):
    llm = LLM(tiny_llama3_dir, dtype="float32", device="cpu", num_kv_blocks=32, max_model_len=256)
    outs = llm.generate(["Hello there", "A longer prompt of several words"],
                        [SamplingParams(max_tokens=3, prompt_logprobs=0, **GREEDY), SamplingParams(max_tokens=3)])
    assert len(outs[0].prompt_logprobs) == len(outs[0].prompt_token_ids) and outs[1].prompt_logprobs is None
