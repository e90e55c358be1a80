"""The engine on CUDA (Triton kernels) against transformers on the same GPU: exact in float32, close in
bfloat16. Skipped visibly without CUDA; run it on the GPU machine."""

from __future__ import annotations

import gc
from types import SimpleNamespace

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: run on the GPU machine")

LENGTHS = [1, 3, 17, 40, 95, 160, 250, 420]
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """A random Llama-3 style model (GQA 4:1, head_dim 64, llama3 rope scaling), no tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from conftest import LLAMA3_ROPE

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=4096, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=1024,
                         rms_norm_eps=1e-5, rope_theta=500000.0, rope_scaling=LLAMA3_ROPE, eos_token_id=None)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 2:
                param.normal_(0.0, 0.08)  # peaked distributions: greedy ties are rare
    path = tmp_path_factory.mktemp("tiny_gpu")
    model.save_pretrained(path)
    return str(path)


def prompts():
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(3, 4096, (n,), generator=generator).tolist() for n in LENGTHS]


def reference(model_dir, dtype):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).cuda().eval()
    out = []
    for ids in prompts():
        gen = hf.generate(torch.tensor([ids], device="cuda"), max_new_tokens=NEW_TOKENS, do_sample=False,
                          output_logits=True, return_dict_in_generate=True, pad_token_id=0)
        tokens = gen.sequences[0, len(ids):].tolist()
        logprobs = [torch.log_softmax(step[0].float(), -1)[t].item() for step, t in zip(gen.logits, tokens)]
        out.append((tokens, logprobs))
    return out


def run_engine(model_dir, dtype, stats: dict | None = None, logprobs: int | None = 0,
               prompt_logprobs: int | None = None, **engine_kwargs):
    """The prompts' final outputs (greedy); `stats`, where given, gets what the run did (and the requests'
    prompt log-probabilities, where asked)."""
    from bento_pagedllm import LLMEngine, EngineArgs, SamplingParams

    # a small cache and token budget: preemption and chunked prefill happen, as in the CPU parity tests
    engine = LLMEngine(EngineArgs(model=model_dir, dtype=dtype, device="cuda", num_kv_blocks=48,
                                  max_model_len=768, max_num_batched_tokens=64, **engine_kwargs))
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, logprobs=logprobs, ignore_eos=True,
                            prompt_logprobs=prompt_logprobs)
    for i, ids in enumerate(prompts()):
        engine.add_request(f"p{i}", ids, params)
    final, logit_rows, compute_logits = {}, [], engine.model.compute_logits
    if stats is not None:  # the row counts the LM head multiplies (wrapped on this instance alone)
        engine.model.compute_logits = lambda hidden: logit_rows.append(hidden.shape[0]) or compute_logits(hidden)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
        if stats is not None and engine.last_plan is not None:
            stats.setdefault("step_rows", set()).add(len(engine.last_plan.sampling_rows))
    assert engine.scheduler.num_preemptions_total > 0
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    if stats is not None:
        mixed = engine.runner.mixed_graphs
        stats["mixed_replays"] = mixed.replays if mixed is not None else 0
        stats["logit_rows"], stats["buckets"] = set(logit_rows), engine.runner.logit_row_buckets
        del engine.model.compute_logits  # NOTE: the wrapper made a reference cycle through the model
    # NOTE: the engine and its graphs go now, not in a collector pass during a later engine's capture
    del engine
    gc.collect()
    torch.cuda.synchronize()
    if stats is not None:
        stats["prompt_logprobs"] = [final[f"p{i}"].prompt_logprobs for i in range(len(LENGTHS))]
    return [final[f"p{i}"].outputs[0] for i in range(len(LENGTHS))]


def test_float32_greedy_matches_transformers_exactly(tiny_dir, monkeypatch):
    stats = {}
    ours = run_engine(tiny_dir, "float32", stats)  # decode and mixed steps replay CUDA graphs
    assert stats["mixed_replays"] > 0
    # the LM head saw only the row counts run at start-up (ModelRunner.logits), steps of other counts padded
    assert stats["logit_rows"] <= set(stats["buckets"]) and stats["step_rows"] - set(stats["buckets"])
    eager = run_engine(tiny_dir, "float32", enforce_eager=True)
    assert [o.token_ids for o in ours] == [o.token_ids for o in eager]
    decode_graphs_only = run_engine(tiny_dir, "float32", max_mixed_graph_tokens=0)
    assert [o.token_ids for o in decode_graphs_only] == [o.token_ids for o in eager]
    # no log-probabilities asked: the sampler's plain greedy path (kernels/tokens.py's argmax)
    plain_greedy = run_engine(tiny_dir, "float32", logprobs=None)
    assert [o.token_ids for o in plain_greedy] == [o.token_ids for o in eager]
    from bento_pagedllm import cuda_graphs

    # contexts here reach ~450 tokens: with a 256-token bound, both graph classes (splits chosen for the
    # short bound, and for max_model_len) replay
    monkeypatch.setattr(cuda_graphs, "SHORT_CONTEXT", 256)
    two_classes = run_engine(tiny_dir, "float32")
    assert [o.token_ids for o in two_classes] == [o.token_ids for o in eager]
    # every decode batch replayed on the biggest graph (as DecodeGraphs.use_faster_graphs may route one):
    # the same tokens, and the LM head still takes the step's own bucket of rows
    routed_stats = {}
    monkeypatch.setattr(cuda_graphs, "MIN_TIMED_BATCH", 1)
    monkeypatch.setattr(cuda_graphs, "faster_graph_sizes", lambda sizes, replay_ms: {s: sizes[-1] for s in sizes})
    routed = run_engine(tiny_dir, "float32", routed_stats)
    assert [o.token_ids for o in routed] == [o.token_ids for o in eager]
    assert routed_stats["logit_rows"] <= set(routed_stats["buckets"]) and len(routed_stats["logit_rows"]) > 1
    for out, (tokens, logprobs) in zip(ours, reference(tiny_dir, torch.float32)):
        assert out.token_ids == tokens
        assert max(abs(a.logprob - b) for a, b in zip(out.logprobs, logprobs)) < 1e-3


@pytest.mark.parametrize("graphs", [True, False], ids=["cuda-graphs", "eager"])
def test_float32_prompt_scores_match_transformers(tiny_dir, graphs):
    """Prompt log-probabilities on CUDA (scored in chunks, recomputed after preemption, through the mixed
    graphs or eagerly) against transformers' forward pass on the same GPU; the generated tokens unchanged.
    NOTE: 1e-3 nats, as for the sampled tokens' log-probabilities above (float32, other summation orders)."""
    from test_prompt_logprobs import check_scores, reference_scores

    stats = {}
    ours = run_engine(tiny_dir, "float32", stats, prompt_logprobs=3, enforce_eager=not graphs)
    assert (stats["mixed_replays"] > 0) == graphs  # NOTE: every step before the last prompt's end scores
    for out, scores, ids, (tokens, _) in zip(ours, stats["prompt_logprobs"], prompts(),
                                             reference(tiny_dir, torch.float32)):
        assert out.token_ids == tokens
        check_scores(SimpleNamespace(prompt_logprobs=scores), ids, reference_scores(tiny_dir, ids, 3, "cuda", 1e-3),
                     3, close=1e-3)


def test_float32_beam_search_matches_a_search_over_transformers(tiny_dir):
    """Beam search on CUDA (each step's one-token requests through the graphs, their top log-probabilities
    from the GPU sampler) against the same search over transformers' float32 log-probabilities on the GPU."""
    from transformers import AutoModelForCausalLM

    from bento_pagedllm import LLM, BeamSearchParams
    from test_beam_search import reference_beams

    hf = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).cuda().eval()
    llm = LLM(tiny_dir, dtype="float32", device="cuda", num_kv_blocks=64, max_model_len=768)
    prompts_ = prompts()[2:5]
    outs = llm.beam_search(prompts_, BeamSearchParams(width=4, max_tokens=8, length_penalty=0.7))
    for prompt, out in zip(prompts_, outs):
        expected = reference_beams(hf, prompt, 4, 8, llm.engine.eos_token_ids, 0.7)
        assert [c.token_ids for c in out.outputs] == [tokens for tokens, _, _ in expected]
        for choice, (_, cumulative, _) in zip(out.outputs, expected):
            assert abs(choice.cumulative_logprob - cumulative) < 1e-3
    del llm
    gc.collect()
    torch.cuda.synchronize()


def test_bfloat16_agrees_with_transformers_bfloat16(tiny_dir):
    """NOTE on the tolerance: bfloat16 keeps 8 significant bits (relative error ~0.4%), and our kernels
    accumulate in a different order than cuBLAS/SDPA, so logits differ by ~1e-2; where two tokens are
    that close, greedy may legitimately pick the other and the sequences diverge from there. We require
    the first token of every prompt to agree, most prompts to agree for 8+ tokens, and the chosen tokens'
    log-probabilities on the common prefix to agree within 0.1 nats."""
    from bento_pagedllm.kernels import gemv

    ours = run_engine(tiny_dir, "bfloat16")
    # batches of up to 32 decoding sequences project through the tensor-core tiles of kernels/gemv.py
    assert any(key[:2] == (4096, 256) for key in gemv._tuned_rows.cache)
    long_agreements = 0
    for out, (tokens, logprobs) in zip(ours, reference(tiny_dir, torch.bfloat16)):
        common = 0
        while common < len(tokens) and out.token_ids[common] == tokens[common]:
            common += 1
        assert common >= 1
        long_agreements += common >= 8
        assert max(abs(out.logprobs[i].logprob - logprobs[i]) for i in range(common)) < 0.1
    assert long_agreements >= 6


def run_single_stream(model_dir, dtype, ids, **engine_kwargs):
    from bento_pagedllm import LLMEngine, EngineArgs, SamplingParams

    # NOTE: a small cache: the two engines of a test must fit beside each other (cycles free them late)
    engine = LLMEngine(EngineArgs(model=model_dir, dtype=dtype, device="cuda", max_model_len=768, num_kv_blocks=64,
                                  **engine_kwargs))
    engine.add_request("one", ids, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, logprobs=0, ignore_eos=True))
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            final = out.outputs[0] if out.finished else final
    engine.shutdown()
    return final


def test_a_bfloat16_single_stream_through_the_fused_projections(tiny_dir):
    """One sequence alone: every decode step runs the fused one-token GEMVs (kernels/gemv.py). Against
    the cuBLAS path and transformers, with the bfloat16 test's tolerance argument (above): the first
    tokens agree and the chosen tokens' log-probabilities on the common prefix agree within 0.1 nats."""
    from bento_pagedllm.kernels import gemv

    ids = prompts()[5]  # 160 tokens
    fused = run_single_stream(tiny_dir, "bfloat16", ids)
    # the LM head of this model (4,096 x 256, the norm folded in) was tuned: the fused path ran
    assert any(key[:2] == (4096, 256) for key in gemv._tuned_one_row.cache)
    plain = run_single_stream(tiny_dir, "bfloat16", ids, fused_gemv_rows=0)
    (tokens, logprobs), = [ref for n, ref in zip(LENGTHS, reference(tiny_dir, torch.bfloat16)) if n == len(ids)]
    for other_tokens, other_logprobs in ((plain.token_ids, [lp.logprob for lp in plain.logprobs]), (tokens, logprobs)):
        common = 0
        while common < NEW_TOKENS and fused.token_ids[common] == other_tokens[common]:
            common += 1
        assert common >= 8
        assert max(abs(fused.logprobs[i].logprob - other_logprobs[i]) for i in range(common)) < 0.1
