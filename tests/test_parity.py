"""End to end: the engine's greedy tokens equal transformers' `generate`, under memory pressure.

Eight prompts of very different lengths go in at once; the KV cache is small enough that sequences are
preempted and recomputed, and the token budget small enough that long prompts are prefilled in chunks.
"""

import pytest
import torch
from transformers import AutoModelForCausalLM

from bento_pagedllm import LLMEngine, EngineArgs, SamplingParams

PARAGRAPH = (
    "The history of computing is a story of abstraction layered upon abstraction, from relays and vacuum "
    "tubes to transistors, integrated circuits, operating systems, compilers and the web. "
)


def prompts(tokenizer):
    texts = [
        "Hi",
        "What is the capital of France?",
        "Write a haiku about the sea.",
        "Summarise this text: " + PARAGRAPH * 2,
        "List three prime numbers.",
        "Explain paged attention. " + PARAGRAPH * 6,
        "Translate 'good morning' to Spanish.",
        "Continue the story: " + PARAGRAPH * 12,
    ]
    ids = [tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                         tokenize=True, return_dict=False) for t in texts]
    return [list(x) for x in ids]


def reference(model_dir, prompt_ids, max_new_tokens):
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    results = []
    for ids in prompt_ids:
        out = hf.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False,
                          output_logits=True, return_dict_in_generate=True, pad_token_id=0)
        tokens = out.sequences[0, len(ids):].tolist()
        logprobs = [torch.log_softmax(step[0].float(), -1)[t].item() for step, t in zip(out.logits, tokens)]
        results.append((tokens, logprobs))
    return results


def run_engine(model_dir, prompt_ids, max_new_tokens, **engine_kwargs):
    engine = LLMEngine(EngineArgs(model=model_dir, dtype="float32", device="cpu", **engine_kwargs))
    params = SamplingParams(temperature=0.0, max_tokens=max_new_tokens, logprobs=0)
    for i, ids in enumerate(prompt_ids):
        engine.add_request(f"p{i}", ids, params)
    final, partial_prefill_steps, mixed_steps = {}, 0, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
        plan = engine.last_plan
        partial_prefill_steps += any(not s.compute_logits for s in plan.seqs)
        mixed_steps += any(len(s.token_ids) == 1 for s in plan.seqs) and any(len(s.token_ids) > 1 for s in plan.seqs)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    stats = dict(preemptions=engine.scheduler.num_preemptions_total, partial_prefill_steps=partial_prefill_steps,
                 mixed_steps=mixed_steps)
    return [final[f"p{i}"].outputs[0] for i in range(len(prompt_ids))], stats


def check_parity(model_dir, prompt_ids, max_new_tokens, **engine_kwargs):
    outputs, stats = run_engine(model_dir, prompt_ids, max_new_tokens, **engine_kwargs)
    assert stats["preemptions"] > 0, stats
    assert stats["partial_prefill_steps"] > 0 and stats["mixed_steps"] > 0, stats
    expected = reference(model_dir, prompt_ids, max_new_tokens)
    for ours, (tokens, logprobs) in zip(outputs, expected):
        assert ours.token_ids == tokens
        ours_lp = [lp.logprob for lp in ours.logprobs]
        assert max(abs(a - b) for a, b in zip(ours_lp, logprobs)) < 1e-4
    return outputs


@pytest.mark.slow
def test_smollm2_greedy_matches_transformers(smollm2_hf_dir):
    from transformers import AutoTokenizer

    ids = prompts(AutoTokenizer.from_pretrained(smollm2_hf_dir))
    assert sorted(len(x) for x in ids)[0] < 40 and max(len(x) for x in ids) > 350
    # 40 blocks of 16 = 640 tokens for ~1,400 tokens of prompts and outputs: preemption must happen
    outputs = check_parity(smollm2_hf_dir, ids, 16, num_kv_blocks=40, max_model_len=640, max_num_batched_tokens=96)
    assert "Paris" in outputs[1].text


@pytest.mark.parametrize("async_scheduling,native_cpu_ops", [(False, True), (True, True), (False, False)],
                         ids=["sync", "async-scheduling", "torch-ops"])
def test_tiny_llama3_gqa_greedy_matches_transformers(tiny_llama3_dir, async_scheduling, native_cpu_ops):
    """The native CPU operators (the default) and the pure-torch reference operators both match."""
    torch.manual_seed(0)
    lengths = [1, 3, 17, 40, 95, 160, 250, 420]
    ids = [torch.randint(3, 49152, (n,)).tolist() for n in lengths]
    check_parity(tiny_llama3_dir, ids, 24, num_kv_blocks=48, max_model_len=768, max_num_batched_tokens=64,
                 async_scheduling=async_scheduling, native_cpu_ops=native_cpu_ops)
