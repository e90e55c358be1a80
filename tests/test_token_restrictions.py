"""vLLM's `allowed_token_ids` and `bad_words` (SamplingParams): what the engine may draw, checked on the
tokens it draws (the tiny random Llama-3 with SmolLM2's tokenizer, float32, CPU; with and without async
scheduling: a bad word's ban follows the tokens just drawn, so its steps are read before the next is planned).
"""

import pytest

from bento_pagedllm import SamplingParams
from bento_pagedllm.sampler import _bad_word_ends
from bento_pagedllm.structured_output import token_bitmask
from bento_pagedllm.tokenizer import bad_words_token_ids

PROMPTS = ["The capital of France is", "Once upon a time", "1, 2, 3,"]


def contains(tokens: list[int], word: tuple[int, ...]) -> bool:
    return any(tuple(tokens[i : i + len(word)]) == word for i in range(len(tokens) - len(word) + 1))


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_allowed_token_ids_are_the_only_tokens_drawn(llm, temperature):
    free = llm.generate(PROMPTS, SamplingParams(temperature=temperature, seed=3, max_tokens=12, ignore_eos=True))
    # the free outputs' own tokens but their first, and tokens they never drew
    allowed = sorted({t for out in free for t in out.outputs[0].token_ids[1:]} | {7, 11, 13})
    params = SamplingParams(temperature=temperature, seed=3, max_tokens=12, ignore_eos=True,
                            allowed_token_ids=allowed, logprobs=2)
    for before, out in zip(free, llm.generate(PROMPTS, params)):
        tokens = out.outputs[0].token_ids
        assert len(tokens) == 12 and set(tokens) <= set(allowed)
        # log-probabilities stay the model's own: the unrestricted distribution's
        assert all(lp.logprob <= 0.0 and len(lp.top) == 2 for lp in out.outputs[0].logprobs)
    if temperature == 0.0:  # greedy under the restriction: the best allowed token, the free one where allowed
        for before, out in zip(free, llm.generate(PROMPTS, params)):
            if before.outputs[0].token_ids[0] in allowed:
                assert out.outputs[0].token_ids[0] == before.outputs[0].token_ids[0]


def test_allowed_token_ids_under_a_grammar_leave_the_tokens_in_both(llm):
    """A grammar's mask and the allowed set together: of the choices, only the one spelt with allowed tokens."""
    from bento_pagedllm import StructuredOutputs

    london = llm.tokenizer("London", add_special_tokens=False).input_ids
    choice = StructuredOutputs(choice=("Paris", "London"))
    alone = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=8, structured_outputs=choice))
    assert "Paris" in [out.outputs[0].text for out in alone]  # the grammar alone picks either
    params = SamplingParams(temperature=0.0, max_tokens=8, structured_outputs=choice,
                            allowed_token_ids=london + [llm.tokenizer.eos_token_id])
    for out in llm.generate(PROMPTS, params):
        assert out.outputs[0].text == "London"


def bad_words_written(tokenizer, tokens: list[int]) -> tuple[list[str], tuple[tuple[int, ...], ...]]:
    """A word of two or three tokens the output wrote (its text tokenizes back to them) and a one-token one,
    with the token sequences they ban."""
    for length in (2, 3):
        for start in range(1, len(tokens) - length):
            words = [tokenizer.decode(tokens[start : start + length]), tokenizer.decode(tokens[:1])]
            banned = bad_words_token_ids(tokenizer, words)
            if any(len(word) == length and contains(tokens, word) for word in banned):
                return words, banned
    raise AssertionError("no word of the output tokenizes back to its tokens")


def test_bad_words_never_end_the_output(llm):
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    tokenizer = llm.tokenizer
    for prompt, before in zip(PROMPTS, llm.generate(PROMPTS, greedy)):
        words, banned = bad_words_written(tokenizer, before.outputs[0].token_ids)
        out = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True,
                                                  bad_words=words))[0].outputs[0].token_ids
        assert len(out) == 24 and not any(contains(out, word) for word in banned)


def test_bad_word_ends_follow_the_output():
    words = ((5,), (1, 2), (1, 2, 3), (9, 9))
    assert _bad_word_ends(words, ()) == {5}
    assert _bad_word_ends(words, (4, 1)) == {5, 2}
    assert _bad_word_ends(words, (1, 2)) == {5, 3}
    assert _bad_word_ends(words, (9,)) == {5, 9}


def test_token_bitmask_sets_exactly_the_given_tokens():
    vocab = 100
    mask = token_bitmask([0, 31, 32, 63, 99], vocab)
    assert mask.shape == (4,)
    bits = [(int(mask[t // 32]) >> (t % 32)) & 1 for t in range(vocab)]
    assert [t for t in range(vocab) if bits[t]] == [0, 31, 32, 63, 99]


@pytest.mark.parametrize("bad", [
    dict(allowed_token_ids=[]),
    dict(allowed_token_ids=[-1]),
], ids=["allowed empty", "allowed negative"])
def test_bad_restrictions_are_refused(bad):
    with pytest.raises(ValueError):
        SamplingParams(**bad)


def test_restrictions_checked_against_the_model(llm):
    from bento_pagedllm import RequestError

    with pytest.raises(RequestError, match="allowed_token_ids"):
        llm.generate("Hi", SamplingParams(allowed_token_ids=[49152]))
