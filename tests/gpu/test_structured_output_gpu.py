"""Structured outputs on CUDA, through the decode graphs and async scheduling: every answer of a random model
fits its constraint, and float32 greedy answers equal the CPU engine's token for token. Skipped visibly
without CUDA."""

from __future__ import annotations

import json
import re

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: run on the GPU machine")

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "age"], "additionalProperties": False}
PHONE = "[0-9]{3}-[0-9]{4}"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    """A random Llama (vocabulary 4,096) with a small byte-level BPE tokenizer trained here (no model hub, no
    GGUF on the GPU machine): llguidance needs a real tokenizer to map tokens to bytes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=1000, special_tokens=["<unk>", "<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(['{"name": "Ann", "age": 31}, call 555-0123', "The quick brown fox."] * 50, trainer)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=4096, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=1024,
                         rms_norm_eps=1e-5, eos_token_id=1)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 2:
                param.normal_(0.0, 0.08)
    path = tmp_path_factory.mktemp("tiny_structured")
    model.save_pretrained(path)
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<eos>", unk_token="<unk>").save_pretrained(path)
    return str(path)


def generate(model_dir, device, dtype, params, prompts, **engine_kwargs):
    import gc

    from bento_pagedllm import LLM

    llm = LLM(model_dir, dtype=dtype, device=device, num_kv_blocks=64, max_model_len=512, **engine_kwargs)
    outs = llm.generate(prompts, params)
    llm.engine.shutdown()
    del llm
    gc.collect()
    return outs


def test_sampled_constrained_answers_fit_on_cuda(model_dir):
    from bento_pagedllm import SamplingParams, StructuredOutputs

    specs = [StructuredOutputs(json=json.dumps(PERSON)), StructuredOutputs(regex=PHONE),
             StructuredOutputs(choice=("yes", "no", "maybe"))]
    params = [SamplingParams(n=2, temperature=1.0, seed=i, max_tokens=120, structured_outputs=spec)
              for i, spec in enumerate(specs)]
    plain = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)  # in the same batches, unconstrained
    outs = generate(model_dir, "cuda", "bfloat16", [*params, plain], ["A person:", "Call", "Well?", "The"])
    for out in outs[:3]:
        assert [c.finish_reason for c in out.outputs] == ["stop", "stop"], out.outputs
    for choice in outs[0].outputs:
        value = json.loads(choice.text)
        assert set(value) == {"name", "age"} and 0 <= value["age"] <= 99
    assert all(re.fullmatch(PHONE, c.text) for c in outs[1].outputs)
    assert all(c.text in ("yes", "no", "maybe") for c in outs[2].outputs)
    assert len(outs[3].outputs[0].token_ids) == 16


def test_float32_greedy_constrained_answers_equal_the_cpus(model_dir):
    from bento_pagedllm import SamplingParams, StructuredOutputs

    specs = [StructuredOutputs(json=json.dumps(PERSON)), StructuredOutputs(regex=PHONE)]
    params = [SamplingParams(temperature=0.0, max_tokens=60, structured_outputs=spec) for spec in specs]
    prompts = ["A person:", "Call"]
    cuda = generate(model_dir, "cuda", "float32", params, prompts)
    cpu = generate(model_dir, "cpu", "float32", params, prompts, native_cpu_ops=False)
    assert [o.outputs[0].token_ids for o in cuda] == [o.outputs[0].token_ids for o in cpu]
    assert re.fullmatch(PHONE, cuda[1].outputs[0].text)
