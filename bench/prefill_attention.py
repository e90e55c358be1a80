"""Prefill attention alone on the GPU: kernels/paged_prefill.py on the offline workload's prefill-heavy
steps, against the same kernel on one long prompt of the same token count (its best case) and torch's
flash SDPA on that long prompt (contiguous K/V: a bound the paged kernel can only approach).

Why: a profile of Llama-3-8B's 16,384-token steps gave prefill attention ~5% of them (BENCHMARKS.md,
issue 5). The workload's prompts are short (mean ~206 tokens), so a step is ~80 sequences of a few query
tiles each, where a program's fixed costs (finding its sequence, loading its queries, the diagonal tile)
weigh more than on one long prompt. This says how far the kernel is from its own long-prompt rate there,
and so what a faster short-prompt path could save.

The steps are those the scheduler makes when every request arrives at t=0: prompts in order, packed into
`--max-tokens` tokens a step, the last one of a step chunked into the next (its cached prefix then counts).
Each call is timed inside a CUDA graph (triton.testing.do_bench_cudagraph), one layer's attention.

    python bench/prefill_attention.py --shapes llama3-8b,llama2-7b --max-tokens 16384 --steps 3 --out out.json
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
import triton.testing

from bento_pagedllm.kernels.paged_prefill import paged_prefill_attention
from decode_attention import BLOCK_SIZE, HEAD_DIM, SHAPES
from single_stream import save


def prefill_steps(prompt_lens: list[int], max_tokens: int) -> list[list[tuple[int, int]]]:
    """The prefill steps of prompts arriving together: each step a list of (cached prefix, new tokens)
    per sequence, at most `max_tokens` new tokens in all; a prompt that does not fit is chunked (FCFS)."""
    steps, step, budget = [], [], max_tokens
    for length in prompt_lens:
        done = 0
        while done < length:
            take = min(length - done, budget)
            step.append((done, take))
            done += take
            budget -= take
            if budget == 0:
                steps.append(step)
                step, budget = [], max_tokens
    if step:
        steps.append(step)
    return steps


def causal_flops(step: list[tuple[int, int]], num_heads: int) -> float:
    """QK^T and PV multiply-adds of the keys each query sees (its prefix and itself), x2 flops."""
    pairs = sum(q * prefix + q * (q + 1) // 2 for prefix, q in step)
    return 4.0 * pairs * num_heads * HEAD_DIM


def measure_step(shape: str, step: list[tuple[int, int]], device: torch.device,
                 dtype: torch.dtype = torch.bfloat16) -> dict:
    """One layer's prefill attention over a step's sequences through the paged cache: us and TFLOP/s."""
    num_kv_heads, group = SHAPES[shape]
    num_heads = num_kv_heads * group
    contexts = [prefix + q for prefix, q in step]
    widths = [-(-c // BLOCK_SIZE) for c in contexts]
    cache_shape = (sum(widths) + 1, BLOCK_SIZE, num_kv_heads, HEAD_DIM)
    k_cache = torch.randn(cache_shape, device=device, dtype=dtype)
    v_cache = torch.randn(cache_shape, device=device, dtype=dtype)
    order = torch.randperm(sum(widths), device=device).int()  # the blocks scattered, as in a used pool
    tables = torch.zeros(len(step), max(widths), dtype=torch.int32, device=device)
    start = 0
    for i, width in enumerate(widths):
        tables[i, :width] = order[start:start + width]
        start += width
    query_lens = [q for _, q in step]
    starts = torch.tensor([0] + query_lens, device=device).cumsum(0).to(torch.int32)
    seq_lens = torch.tensor(contexts, device=device, dtype=torch.int32)
    q = torch.randn(sum(query_lens), num_heads, HEAD_DIM, device=device, dtype=dtype)

    def call():
        return paged_prefill_attention(q, k_cache, v_cache, tables, starts, seq_lens, max(query_lens),
                                       HEAD_DIM**-0.5)

    call()  # compile outside the graph
    us = triton.testing.do_bench_cudagraph(call, rep=50) * 1e3
    return {"shape": shape, "seqs": len(step), "tokens": sum(query_lens), "mean_query": sum(query_lens) / len(step),
            "longest_query": max(query_lens), "us": us, "tflops": causal_flops(step, num_heads) / us / 1e6}


def measure_flash_sdpa(shape: str, tokens: int, device: torch.device, dtype: torch.dtype = torch.bfloat16) -> dict:
    """torch's flash SDPA on one contiguous causal prompt of `tokens` tokens (K/V heads repeated)."""
    num_kv_heads, group = SHAPES[shape]
    num_heads = num_kv_heads * group
    q = torch.randn(1, num_heads, tokens, HEAD_DIM, device=device, dtype=dtype)
    k = torch.randn(1, num_kv_heads, tokens, HEAD_DIM, device=device, dtype=dtype)
    v = torch.randn_like(k)

    def call():
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=group > 1)

    call()
    us = triton.testing.do_bench_cudagraph(call, rep=50) * 1e3
    return {"shape": shape, "tokens": tokens, "us": us, "tflops": causal_flops([(0, tokens)], num_heads) / us / 1e6}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="llama3-8b,llama2-7b")
    parser.add_argument("--requests", default="bench/data/requests.jsonl")
    parser.add_argument("--max-tokens", type=int, default=16384, help="new tokens a step (the batch setting)")
    parser.add_argument("--steps", type=int, default=3, help="the workload's first steps to measure")
    parser.add_argument("--long", type=int, default=4096, help="the one long prompt's length")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    with open(args.requests) as f:
        prompt_lens = [len(json.loads(line)["prompt_ids"]) for line in f]
    device = torch.device("cuda")
    rows = []
    for shape in args.shapes.split(","):
        for index, step in enumerate(prefill_steps(prompt_lens, args.max_tokens)[: args.steps]):
            rows.append({"kind": "workload_step", "step": index, **measure_step(shape, step, device)})
            print(json.dumps(rows[-1]), flush=True)
        rows.append({"kind": "one_long_prompt", **measure_step(shape, [(0, args.long)], device)})
        print(json.dumps(rows[-1]), flush=True)
        rows.append({"kind": "flash_sdpa_long_prompt", **measure_flash_sdpa(shape, args.long, device)})
        print(json.dumps(rows[-1]), flush=True)
    save({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, args.out)


if __name__ == "__main__":
    main()
