"""The batched sampler: every parameter has a test that fails if it is ignored."""

import math

import pytest
import torch

from bento_pagedllm.sampler import SamplingBatch, exponential_noise, mix_seed, sample
from bento_pagedllm.sampling_params import SamplingParams
from bento_pagedllm.scheduler import SamplingRow

VOCAB = 32


def rows_for(params_list, seeds=None, positions=None, prompts=None, outputs=None):
    rows = []
    for i, params in enumerate(params_list):
        rows.append(SamplingRow(
            seq_id=i, logits_index=i, params=params,
            rng_seed=(seeds or [mix_seed(i, 0)] * len(params_list))[i],
            output_position=(positions or [0] * len(params_list))[i],
            prompt_token_ids=tuple((prompts or [()] * len(params_list))[i]),
            output_token_ids=tuple((outputs or [()] * len(params_list))[i]),
        ))
    return tuple(rows)


def draw(logits, params_list, **kw):
    rows = rows_for(params_list, **kw)
    return sample(logits, SamplingBatch.from_rows(rows, logits.shape[-1], logits.device))


def empirical(logits_row, params, trials=4000):
    """Frequencies of each token over many independent streams (different seeds)."""
    logits = logits_row[None].repeat(trials, 1)
    out = draw(logits, [params] * trials, seeds=[mix_seed(s, 0) for s in range(trials)])
    return torch.bincount(out.token_ids, minlength=logits.shape[-1]).float() / trials


@pytest.fixture
def logits():
    torch.manual_seed(0)
    return torch.randn(4, VOCAB) * 2


def test_greedy_is_argmax_and_logprobs_are_log_softmax(logits):
    out = draw(logits, [SamplingParams(temperature=0.0, logprobs=3)] * 4)
    assert torch.equal(out.token_ids, logits.argmax(-1))
    reference = torch.log_softmax(logits, -1)
    assert torch.allclose(out.logprobs, reference.max(-1).values)
    top_lps, top_ids = reference.topk(3, -1)
    assert torch.equal(out.top_ids, top_ids) and torch.allclose(out.top_logprobs, top_lps)


def test_top_k_one_equals_greedy(logits):
    out = draw(logits, [SamplingParams(temperature=1.5, top_k=1)] * 4)
    assert torch.equal(out.token_ids, logits.argmax(-1))


def test_a_top_k_beyond_the_vocabulary_restricts_nothing(logits):
    """Any integer is a valid top_k (the API bounds it below only), 2**63 included: it draws as no top_k does."""
    seeds = [mix_seed(s, 0) for s in range(4)]
    huge = draw(logits, [SamplingParams(temperature=1.0, top_k=2**63)] * 4, seeds=seeds).token_ids
    assert torch.equal(huge, draw(logits, [SamplingParams(temperature=1.0)] * 4, seeds=seeds).token_ids)


def test_tiny_top_p_equals_greedy(logits):
    out = draw(logits, [SamplingParams(temperature=1.0, top_p=1e-6)] * 4)
    assert torch.equal(out.token_ids, logits.argmax(-1))


def test_min_p_one_equals_greedy(logits):
    out = draw(logits, [SamplingParams(temperature=1.0, min_p=1.0)] * 4)
    assert torch.equal(out.token_ids, logits.argmax(-1))


def test_temperature_sampling_follows_softmax_of_scaled_logits(logits):
    row = logits[0]
    for temperature in (0.5, 2.0):
        freq = empirical(row, SamplingParams(temperature=temperature))
        expected = torch.softmax(row / temperature, -1)
        assert (freq - expected).abs().max() < 0.03, temperature


def test_top_k_restricts_support_to_k_most_likely(logits):
    row = logits[1]
    freq = empirical(row, SamplingParams(temperature=1.0, top_k=3), trials=2000)
    allowed = set(row.topk(3).indices.tolist())
    assert set(torch.nonzero(freq).flatten().tolist()) <= allowed
    expected = torch.softmax(row[list(allowed)], -1)
    assert (freq[list(allowed)] - expected).abs().max() < 0.04


def test_top_p_keeps_the_smallest_nucleus(logits):
    row = logits[2]
    probs = torch.softmax(row, -1)
    sorted_probs, order = probs.sort(descending=True)
    top_p = float(sorted_probs[:2].sum()) - 1e-4  # the first two tokens reach p
    freq = empirical(row, SamplingParams(temperature=1.0, top_p=top_p), trials=2000)
    assert set(torch.nonzero(freq).flatten().tolist()) == set(order[:2].tolist())


def test_min_p_drops_tokens_below_the_scaled_maximum(logits):
    row = logits[3]
    probs = torch.softmax(row, -1)
    min_p = 0.3
    freq = empirical(row, SamplingParams(temperature=1.0, min_p=min_p), trials=2000)
    kept = set(torch.nonzero(probs >= min_p * probs.max()).flatten().tolist())
    assert set(torch.nonzero(freq).flatten().tolist()) == kept


def test_seed_reproduces_whatever_else_is_in_the_batch(logits):
    params = SamplingParams(temperature=1.0, seed=1234)
    seed = mix_seed(1234, 0)
    alone = draw(logits[:1], [params], seeds=[seed], positions=[7]).token_ids[0]
    others = [SamplingParams(temperature=0.7, top_k=5), SamplingParams(temperature=0.0)]
    batch = torch.stack([logits[2], logits[0], logits[1]])
    mixed = draw(batch, [others[0], params, others[1]], seeds=[99, seed, 5], positions=[0, 7, 3]).token_ids[1]
    assert alone == mixed
    # and a different seed or position gives a different stream
    draws = {int(draw(logits[:1], [params], seeds=[mix_seed(s, 0)], positions=[7]).token_ids[0]) for s in range(40)}
    assert len(draws) > 3


def test_noise_is_exponential_and_a_pure_function():
    seeds = torch.tensor([mix_seed(1, 0), mix_seed(2, 0)])
    positions = torch.tensor([0, 5])
    noise = exponential_noise(seeds, positions, 20000)
    assert torch.equal(noise, exponential_noise(seeds, positions, 20000))
    assert abs(noise.mean().item() - 1.0) < 0.03 and abs(noise.var().item() - 1.0) < 0.06
    assert (noise > 0).all()


def test_repetition_penalty_follows_transformers_rule():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0]])
    params = SamplingParams(temperature=0.0, repetition_penalty=2.0)
    # token 3 (the argmax, 3.0) was seen in the prompt: 3.0 / 2 = 1.5 < 2.0, so token 0 wins
    out = draw(logits, [params], prompts=[[3]])
    assert out.token_ids.tolist() == [0]
    penalised = draw(logits, [params], prompts=[[3, 1]])
    assert penalised.token_ids.tolist() == [0]
    # negative logits are multiplied: token 1 at -1.0 becomes -2.0, never the argmax; without penalty same
    assert draw(logits, [SamplingParams(temperature=0.0)]).token_ids.tolist() == [3]


def test_presence_and_frequency_penalties_follow_openai_formula():
    from bento_pagedllm.sampler import PenaltyBatch

    logits = torch.tensor([[1.0, 1.0, 1.0, 1.0]])
    rows = rows_for([SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)], outputs=[[1, 1, 2]])
    penalised = PenaltyBatch.from_rows(rows, 4, torch.device("cpu")).apply(logits)
    expected = torch.tensor([[1.0, 1.0 - 0.5 - 2 * 0.25, 1.0 - 0.5 - 0.25, 1.0]])
    assert torch.allclose(penalised, expected)
    out = draw(torch.tensor([[1.0, 1.2, 0.0, 0.0]]), [SamplingParams(temperature=0.0, frequency_penalty=0.5)],
               outputs=[[1]])
    assert out.token_ids.tolist() == [0]


def test_penalties_only_touch_their_rows():
    logits = torch.tensor([[1.0, 2.0], [1.0, 2.0]])
    out = draw(logits, [SamplingParams(temperature=0.0, presence_penalty=2.0), SamplingParams(temperature=0.0)],
               outputs=[[1], [1]])
    assert out.token_ids.tolist() == [0, 1]


@pytest.mark.parametrize("bad", [
    dict(temperature=-1), dict(top_p=0.0), dict(top_p=1.5), dict(top_k=-2), dict(min_p=2.0),
    dict(repetition_penalty=0.0), dict(presence_penalty=3.0), dict(frequency_penalty=-3.0), dict(n=0),
    dict(max_tokens=-1), dict(logprobs=21), dict(prompt_logprobs=21), dict(temperature=math.nan), dict(logit_bias={1: 100.5}),
    dict(logit_bias={-1: 1.0}), dict(logit_bias={1: math.nan}), dict(temperature=math.inf),
    dict(repetition_penalty=math.inf), dict(min_tokens=5, max_tokens=4), dict(stop_token_ids=[-1]),
])
def test_invalid_params_are_rejected(bad):
    with pytest.raises(ValueError):
        SamplingParams(**bad)


def test_min_tokens_bans_eos_and_stop_ids_until_reached():
    logits = torch.tensor([[0.0, 5.0, 4.0, 1.0]] * 3)  # token 1 (say eos) wins, then token 2
    rows = rows_for([SamplingParams(temperature=0.0, min_tokens=3, logprobs=0),
                     SamplingParams(temperature=0.0, min_tokens=3),
                     SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[2], ignore_eos=True)],
                    positions=[2, 3, 0])
    out = sample(logits, SamplingBatch.from_rows(rows, 4, logits.device, eos_token_ids=(1,)))
    # row 0 is still short of min_tokens: eos banned; row 1 reached it; row 2 ignores eos but bans stop id 2
    assert out.token_ids.tolist() == [2, 1, 1]
    assert torch.allclose(out.logprobs[0], torch.log_softmax(logits[0], -1)[2])  # logprobs stay the model's


def test_logit_bias_is_added_to_its_rows_after_the_penalties_and_before_the_bans():
    logits = torch.tensor([[2.0, 1.0, 0.0, 0.5]] * 4)
    rows = rows_for([SamplingParams(temperature=0.0, logit_bias={2: 2.5}, logprobs=0),  # 0.0 + 2.5 beats 2.0
                     SamplingParams(temperature=0.0, logit_bias={0: -100.0, 1: -0.75}),  # 0.25 < 0.5: token 3
                     SamplingParams(temperature=0.0),  # no bias: its own argmax
                     SamplingParams(temperature=0.0, presence_penalty=2.0, logit_bias={0: 1.5})],  # 2 - 2 + 1.5
                    outputs=[[], [], [], [0]])
    batch = SamplingBatch.from_rows(rows, 4, logits.device)
    assert not batch.plain_greedy
    out = sample(logits, batch)
    assert out.token_ids.tolist() == [2, 3, 0, 0]
    assert torch.allclose(out.logprobs[0], torch.log_softmax(logits[0], -1)[2])  # logprobs stay the model's
    # a ban (min_tokens) wins over any bias
    rows = rows_for([SamplingParams(temperature=0.0, min_tokens=1, logit_bias={1: 100.0})])
    banned = sample(logits[:1], SamplingBatch.from_rows(rows, 4, logits.device, eos_token_ids=(1,)))
    assert banned.token_ids.tolist() == [0]


def test_logit_bias_shifts_the_sampled_distribution(logits):
    params = SamplingParams(temperature=1.0, logit_bias={5: 3.0, 7: -100.0})
    biased = logits[0].clone()
    biased[5] += 3.0
    biased[7] -= 100.0
    freq = empirical(logits[0], params)
    assert freq[7] == 0
    assert (freq - torch.softmax(biased, -1)).abs().max() < 0.03


def test_no_logprobs_are_computed_unless_asked():
    logits = torch.randn(2, 16)
    out = sample(logits, SamplingBatch.from_rows(rows_for([SamplingParams(temperature=0.0)] * 2), 16, logits.device))
    assert out.logprobs is None and out.token_ids.tolist() == logits.argmax(-1).tolist()


def test_the_host_seed_mix_equals_the_tensor_hash():
    """mix_seed (Python integers) gives the bits `_splitmix64` (the device's int64 tensors) gives: a seeded
    request's noise must not depend on which side mixed its seed."""
    import random

    from bento_pagedllm import sampler

    rng = random.Random(0)
    for seed, stream in [(0, 0), (-5, 3), ((1 << 63) - 1, 7)] + [(rng.getrandbits(63), rng.randrange(8))
                                                                   for _ in range(200)]:
        mixed = sampler._signed64(seed * 0x100000001B3 + stream * sampler._GOLDEN)
        assert sampler.mix_seed(seed, stream) == int(sampler._splitmix64(torch.tensor([mixed]))[0])
