"""Tensor parallelism on the CPU: gloo, 2 and 4 processes, float32, against one process.

The engine tests run the same workload (concurrent prompts with chunked prefill, preemption, a shared
prefix for the prefix cache, and a seeded n=2 request) at tp 1 and tp > 1 on the same checkpoint: the token
ids must be identical and the log-probabilities within 1e-5 (only the order of the all-reduce's
additions differs). The layer tests split weights over 2 ranks and compare with the dense layers.
"""

from __future__ import annotations

import gc
import json
import os
import time

import pytest
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F

from bento_pagedllm import LLM, EngineArgs, SamplingParams

# 8 query heads over 4 KV heads and an MLP of 128: divisible by 2 and 4. The vocabulary (1001) is not,
# so the vocabulary-parallel embedding and LM head pad their last range.
TINY = dict(
    vocab_size=1001, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8,
    num_key_value_heads=4, max_position_embeddings=512, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
    tie_word_embeddings=False, rope_theta=500000.0,
    rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 256},
)
# a small pool (24 blocks of 4 tokens) and a 32-token budget: prompts are prefilled in chunks and the
# running sequences outgrow the pool, so some are preempted and recomputed
ENGINE = dict(num_kv_blocks=24, block_size=4, max_num_batched_tokens=32, max_model_len=96, max_num_seqs=8)
SHARED = [(7 * j) % 997 + 3 for j in range(12)]  # 3 full blocks of a common prefix


def save_tiny(path, **overrides) -> str:
    """The tiny checkpoint (TINY with `overrides`) saved in transformers' format at `path`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**{**TINY, **overrides})).float()
    with torch.no_grad():  # NOTE: a wide init makes greedy choices clear-cut (see conftest.save_tiny_llama)
        for param in model.parameters():
            if param.dim() == 2:
                param.normal_(0.0, 0.08)
    model.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> str:
    return save_tiny(tmp_path_factory.mktemp("tiny_tp"))


def workload():
    prompts = [SHARED + [(i * 31 + j * 13) % 997 + 3 for j in range(6 + 7 * i)] for i in range(5)]
    prompts.append([(j * 17) % 997 + 3 for j in range(40)])
    greedy = SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True, logprobs=0)
    scored = SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True, logprobs=0, prompt_logprobs=2)
    sampled = SamplingParams(n=2, max_tokens=10, temperature=0.8, seed=123, ignore_eos=True)
    return prompts, [greedy, scored] + [greedy] * (len(prompts) - 3) + [sampled]


def run(path: str, **kwargs):
    llm = LLM(path, **ENGINE, **kwargs)
    prompts, params = workload()
    outputs = llm.generate(prompts, params)
    engine = llm.engine
    stats = dict(preemptions=engine.scheduler.num_preemptions_total,
                 prefix_hits=engine.block_manager.prefix_hit_tokens)
    result = []
    for o in outputs:
        request = [(c.token_ids, [lp.logprob for lp in c.logprobs] if c.logprobs else None) for c in o.outputs]
        if o.prompt_logprobs:  # the scored prompt's tokens and their log-probabilities, as one more row
            scores = o.prompt_logprobs[1:]
            request.append(([s.token_id for s in scores], [s.logprob for s in scores]))
        result.append(request)
    return llm, result, stats


@pytest.fixture(scope="module")
def reference(tiny_dir):
    llm, result, stats = run(tiny_dir)
    assert stats["preemptions"] > 0 and stats["prefix_hits"] > 0  # the workload exercises both
    return result


def assert_same(result, reference, logprob_tolerance: float = 1e-5) -> None:
    for request, expected in zip(result, reference, strict=True):
        for (ids, logprobs), (ref_ids, ref_logprobs) in zip(request, expected, strict=True):
            assert ids == ref_ids
            if ref_logprobs is not None:
                assert max(abs(a - b) for a, b in zip(logprobs, ref_logprobs, strict=True)) < logprob_tolerance


def alive(pids: list[int]) -> list[int]:
    """The pids that are still running (zombies, which exited but are not reaped, count as gone)."""
    out = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().split(")")[-1].split()[0] != "Z":
                    out.append(pid)
        except FileNotFoundError:
            pass
    return out


def test_tp2_greedy_matches_one_process_and_shutdown_stops_workers(tiny_dir, reference):
    llm, result, stats = run(tiny_dir, tensor_parallel_size=2)
    pids = llm.engine.workers.pids
    assert len(pids) == 1 and alive(pids) == pids
    # rank 0's KV cache holds its 2 of the 4 KV heads
    assert llm.engine.runner.kv_cache.shape[-2] == 2
    assert stats["preemptions"] > 0 and stats["prefix_hits"] > 0
    assert_same(result, reference)
    llm.engine.shutdown()
    assert alive(pids) == []


def test_tp2_async_scheduling_matches_and_gc_stops_workers(tiny_dir, reference):
    """Async scheduling: each step's inputs include tokens rank 0 sampled on the step before, which the
    workers get through a broadcast."""
    llm, result, _ = run(tiny_dir, tensor_parallel_size=2, async_scheduling=True)
    assert llm.engine.configs.async_scheduling
    assert_same(result, reference)
    pids = llm.engine.workers.pids
    del llm
    gc.collect()  # NOTE: the engine holds reference cycles; collecting it runs the workers' finalizer
    assert alive(pids) == []


def test_tp4_greedy_matches_one_process(tiny_dir, reference):
    llm, result, _ = run(tiny_dir, tensor_parallel_size=4)
    assert llm.engine.runner.kv_cache.shape[-2] == 1
    assert_same(result, reference)
    llm.engine.shutdown()


def test_a_dead_worker_fails_the_next_step_at_once(tiny_dir):
    """No hang, and no step after a failed one (the ranks could be out of step)."""
    import signal

    from bento_pagedllm.engine import LLMEngine

    engine = LLMEngine(EngineArgs(model=tiny_dir, tensor_parallel_size=2, **ENGINE))
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    engine.add_request("a", [5, 6, 7], params)
    while engine.has_unfinished_requests():
        engine.step()
    (pid,) = engine.workers.pids
    os.kill(pid, signal.SIGKILL)  # NOTE: the worker this test's engine started
    for _ in range(100):
        if not alive([pid]):
            break
        time.sleep(0.1)
    engine.add_request("b", [5, 6, 7], params)
    # rank 0 finds the pipe closed, or (when the send still went through) gloo's read fails in the first
    # all-reduce: an error either way, never a hang
    with pytest.raises(RuntimeError):
        engine.step()
    # and the group is over: every later step fails at once
    with pytest.raises(RuntimeError, match="tensor-parallel worker 1 is gone"):
        engine.step()
    engine.shutdown()  # aborts the group (NCCL could not finalize it with a dead rank)
    assert not torch.distributed.is_initialized()


def test_tensor_parallel_size_is_validated_before_any_process_starts(tiny_dir):
    from bento_pagedllm.engine import LLMEngine

    children = set(mp.active_children())
    with pytest.raises(ValueError, match="num_attention_heads .* not divisible by tensor_parallel_size 3"):
        LLMEngine(EngineArgs(model=tiny_dir, tensor_parallel_size=3, **ENGINE))
    with pytest.raises(ValueError, match="positive integer"):
        LLMEngine(EngineArgs(model=tiny_dir, tensor_parallel_size=0, **ENGINE))
    assert set(mp.active_children()) == children


def test_settings_take_the_tensor_parallel_size(monkeypatch):
    import shutil

    from bento_pagedllm.settings import ServiceSettings

    settings = ServiceSettings.from_env({"PAGEDLLM_TENSOR_PARALLEL_SIZE": "2"})
    assert settings.engine_args("/m").tensor_parallel_size == 2
    monkeypatch.setattr(shutil, "which", lambda name: "/usr/bin/nvidia-smi")
    assert settings.resources == {"gpu": 2}
    assert ServiceSettings.from_env({}).resources == {"gpu": 1}


# ---- the parallel layers against their dense equivalents, on 2 ranks ---------------------------------
def _layers_rank(rank: int, size: int, port: int, out_dir: str) -> None:
    """One rank: full weights drawn from the same seed on every rank, each rank loads its slices."""
    from bento_pagedllm.distributed.layers import (
        ColumnParallelLinear,
        RowParallelLinear,
        VocabParallelEmbedding,
        vocab_parallel_logits,
    )
    from bento_pagedllm.distributed.parallel_state import init_group, leave_group, worker_store

    torch.set_num_threads(1)
    parallel = init_group(size, rank, worker_store(size, "127.0.0.1", port), torch.device("cpu"))
    torch.manual_seed(0)
    x = torch.randn(5, 16)
    q, k, v = torch.randn(8, 16), torch.randn(4, 16), torch.randn(4, 16)
    w_row = torch.randn(6, 8)
    table = torch.randn(11, 16)  # 11 rows: the second rank's range is padded
    errors = {}

    column = ColumnParallelLinear(16, [8, 4, 4], parallel)
    for part, tensor in enumerate((q, k, v)):
        column.weight_loader(tensor, part)
    dense = [x @ w.T for w in (q, k, v)]
    # each rank: its slice of q, then of k, then of v
    expected = torch.cat([d.chunk(size, dim=-1)[rank] for d in dense], dim=-1)
    errors["column"] = (column(x) - expected).abs().max().item()
    column.use_cpu_kernel()
    errors["column_cpu_kernel"] = (column(x) - expected).abs().max().item()

    row = RowParallelLinear(8, 6, parallel)
    row.weight_loader(w_row)
    h = torch.randn(5, 8)
    errors["row"] = (row(h.chunk(size, dim=-1)[rank]) - h @ w_row.T).abs().max().item()

    embedding = VocabParallelEmbedding(11, 16, parallel)
    embedding.weight_loader(table)
    ids = torch.tensor([0, 5, 6, 10, 3, 10])
    errors["embedding"] = (embedding(ids) - F.embedding(ids, table)).abs().max().item()
    logits = vocab_parallel_logits(x, lambda t: F.linear(t, embedding.weight), 11, parallel)
    if rank == 0:
        errors["logits_shape"] = list(logits.shape)
        errors["logits"] = (logits - x @ table.T).abs().max().item()
    else:
        errors["logits"] = None if logits is None else "not None"
    leave_group()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(errors, f)


def test_parallel_layers_match_dense_layers(tmp_path):
    from bento_pagedllm.distributed.parallel_state import driver_store

    store = driver_store(2)  # NOTE: only the rendezvous; this process is no rank
    context = mp.get_context("spawn")
    procs = [context.Process(target=_layers_rank, args=(rank, 2, store.port, str(tmp_path))) for rank in range(2)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(120)
    assert [proc.exitcode for proc in procs] == [0, 0]
    ranks = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
    for errors in ranks:
        for name in ("column", "column_cpu_kernel", "row", "embedding"):
            assert errors[name] < 1e-5, (name, errors[name])
    assert ranks[0]["embedding"] == 0.0  # one non-zero row per token: the all-reduce adds only zeros to it
    assert ranks[0]["logits_shape"] == [5, 11] and ranks[0]["logits"] < 1e-5
    assert ranks[1]["logits"] is None  # only rank 0 gets the gathered logits
