"""The batched sampler on CUDA draws what it draws on the CPU: its noise is a hash of (seed, position, token),
not a device generator, so the same rows give the same tokens on any device. Skipped visibly without CUDA."""

from __future__ import annotations

import pytest
import torch

from bento_pagedllm.sampler import SamplingBatch, mix_seed, sample
from bento_pagedllm.sampling_params import SamplingParams
from bento_pagedllm.scheduler import SamplingRow
from bento_pagedllm.structured_output import token_bitmask

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: run on the GPU machine")

VOCAB = 4096


def _rows() -> tuple[SamplingRow, ...]:
    """Every feature of the sampler at once: greedy and sampled rows, filters, penalties, logit bias, bans."""
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.0, logit_bias={7: 100.0}, logprobs=2),
        SamplingParams(temperature=0.9, top_k=50, seed=3),
        SamplingParams(temperature=1.2, top_p=0.8, min_p=0.05, logit_bias={11: 5.0, 12: -100.0}),
        SamplingParams(temperature=0.7, presence_penalty=1.0, frequency_penalty=0.5, repetition_penalty=1.3),
        SamplingParams(temperature=0.0, min_tokens=4, logit_bias={1: 100.0}),  # the ban on eos (1) wins
        SamplingParams(temperature=0.8, seed=5, allowed_token_ids=[3, 40, 41, 4000]),
        SamplingParams(temperature=0.0, bad_words=["x"], logit_bias={21: 100.0, 22: 90.0}),  # 21 banned after 8
    ]
    bad_words = {7: ((8, 21),)}
    return tuple(SamplingRow(seq_id=i, logits_index=i, params=p, rng_seed=mix_seed(i, 0), output_position=i % 3,
                             prompt_token_ids=(5, 6, 7), output_token_ids=(8, 9, 8), bad_words=bad_words.get(i, ()),
                             allowed_mask=token_bitmask(p.allowed_token_ids, VOCAB) if p.allowed_token_ids else None)
                 for i, p in enumerate(params))


def test_the_sampler_draws_the_same_tokens_on_cuda_and_on_the_cpu():
    torch.manual_seed(0)
    logits = torch.randn(8, VOCAB) * 3
    rows = _rows()
    cpu = sample(logits, SamplingBatch.from_rows(rows, VOCAB, torch.device("cpu"), eos_token_ids=(1,)))
    cuda_logits = logits.cuda()
    gpu = sample(cuda_logits, SamplingBatch.from_rows(rows, VOCAB, cuda_logits.device, eos_token_ids=(1,)))
    assert gpu.token_ids.cpu().tolist() == cpu.token_ids.tolist()
    assert gpu.token_ids[1].item() == 7 and gpu.token_ids[5].item() != 1
    assert gpu.token_ids[6].item() in (3, 40, 41, 4000) and gpu.token_ids[7].item() == 22
    assert torch.allclose(gpu.logprobs.cpu(), cpu.logprobs, atol=1e-5)
    assert torch.equal(gpu.top_ids.cpu(), cpu.top_ids)
