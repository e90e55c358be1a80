"""Beam search (vLLM's `use_beam_search` / `LLM.beam_search`): the search alone on made-up distributions, and
the engine's beams against a search over transformers' own next-token log-probabilities (float32, CPU)."""

import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from bento_pagedllm import LLM, BeamSearchParams, RequestError, SamplingParams
from bento_pagedllm.beam_search import Beam, BeamSearch

EOS = 0


def test_each_step_keeps_the_width_best_and_end_of_sequence_finishes_a_beam():
    search = BeamSearch([7, 7], BeamSearchParams(width=2, max_tokens=3, length_penalty=0.0), {EOS})
    assert search.contexts() == [[7, 7]]
    search.advance([((5, -0.1), (EOS, -0.5), (6, -1.0), (8, -3.0))])  # EOS ends a beam, the next best live
    assert [(b.token_ids, b.cumulative_logprob) for b in search.live] == [([5], -0.1), ([6], -1.0)]
    assert [(b.token_ids, b.finished) for b in search.finished] == [([EOS], True)]
    assert search.contexts() == [[7, 7, 5], [7, 7, 6]]
    search.advance([((9, -2.0), (EOS, -2.5), (4, -3.0), (3, -3.5)),
                    ((1, -0.2), (2, -0.3), (EOS, -0.4), (3, -5.0))])
    assert [(b.token_ids, round(b.cumulative_logprob, 6)) for b in search.live] == [([6, 1], -1.2), ([6, 2], -1.3)]
    assert not search.done
    search.advance([((1, -1.0), (2, -2.0), (3, -3.0), (4, -4.0))] * 2)
    assert search.done and search.steps == 3
    # length_penalty 0: the score is the cumulative log-probability, finished and live beams alike
    assert [(b.token_ids, round(b.cumulative_logprob, 6)) for b in search.best()] == [([EOS], -0.5), ([6, EOS], -1.4)]


def test_the_score_divides_by_the_length_without_the_end_of_sequence_token():
    search = BeamSearch([1, 2, 3], BeamSearchParams(width=2, max_tokens=4, length_penalty=2.0), {EOS})
    assert search.score(Beam([4, 5], -2.0)) == -2.0 / 5**2
    assert search.score(Beam([4, EOS], -2.0, finished=True)) == -2.0 / 4**2
    ignoring = BeamSearch([1], BeamSearchParams(width=1, max_tokens=2, ignore_eos=True), {EOS})
    ignoring.advance([((EOS, -0.1), (3, -0.2))])
    assert [b.token_ids for b in ignoring.live] == [[EOS]] and not ignoring.finished


def test_the_width_is_bounded_by_the_logprobs_limit():
    with pytest.raises(ValueError, match="beam width"):
        BeamSearchParams(width=SamplingParams.MAX_LOGPROBS // 2 + 1, max_tokens=4)
    with pytest.raises(ValueError, match="max_tokens"):
        BeamSearchParams(width=2, max_tokens=0)


def reference_beams(model, prompt, width, max_tokens, eos, length_penalty):
    """The same search, written out over transformers' log-probabilities of the whole context each time."""
    def score(beam):
        tokens, cumulative, finished = beam
        return cumulative / (len(prompt) + len(tokens) - finished) ** length_penalty

    live, finished = [([], 0.0, False)], []
    for _ in range(max_tokens):
        candidates = []
        for tokens, cumulative, _ in live:
            with torch.no_grad():
                logits = model(torch.tensor([prompt + tokens], device=model.device)).logits[0, -1]
            top = torch.log_softmax(logits.double(), dim=-1).topk(2 * width)
            for logprob, token in zip(top.values.tolist(), top.indices.tolist()):
                beam = (tokens + [token], cumulative + logprob, token in eos)
                (finished if token in eos else candidates).append(beam)
        live = sorted(candidates, key=score, reverse=True)[:width]
    return sorted(finished + live, key=score, reverse=True)[:width]


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async-scheduling"])
def test_beams_match_a_search_over_transformers_logprobs(tiny_llama3_dir, async_scheduling):
    llm = LLM(tiny_llama3_dir, dtype="float32", device="cpu", num_kv_blocks=128, max_model_len=256,
              async_scheduling=async_scheduling)
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama3_dir, dtype=torch.float32).eval()
    prompts = [[1, 17, 99, 1000, 5], [3, 4]]
    params = BeamSearchParams(width=3, max_tokens=5, length_penalty=1.0)
    outs = llm.beam_search(prompts, params)
    for prompt, out in zip(prompts, outs):
        expected = reference_beams(hf, prompt, 3, 5, llm.engine.eos_token_ids, 1.0)
        assert out.finished and out.prompt_token_ids == prompt
        assert [c.index for c in out.outputs] == [0, 1, 2]
        assert [c.token_ids for c in out.outputs] == [tokens for tokens, _, _ in expected]
        for choice, (_, cumulative, finished) in zip(out.outputs, expected):
            assert math.isclose(choice.cumulative_logprob, cumulative, abs_tol=1e-4)
            assert choice.finish_reason == ("stop" if finished else "length")
            assert choice.text == llm.tokenizer.decode(choice.token_ids, skip_special_tokens=True)
    # one beam is greedy decoding
    greedy = llm.generate(prompts, SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
    single = llm.beam_search(prompts, BeamSearchParams(width=1, max_tokens=5, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in single] == [o.outputs[0].token_ids for o in greedy]
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks and not llm.engine.requests
    with pytest.raises(RequestError, match="maximum context length"):
        llm.beam_search([[1] * 252], params)  # 252 + 5 > 256
