"""Decode attention alone on the GPU: kernels/paged_decode.py for a few sequences of one model shape, at
each split count, with the rotary embedding and cache write fused in (`NewKV`, the single-sequence decode
path) and without (the cache path). Answers: how many splits a context length wants, and what a layer's
attention of one token costs against its K/V bytes (the single-stream gap of BENCHMARKS.md, issue 4).

Each call is timed inside a CUDA graph (triton.testing.do_bench_cudagraph), launched plainly (no dependent
launch: there is no kernel ahead to overlap). "auto" is the split count the backend would choose
(`choose_num_splits`, given the context length).

    python bench/decode_attention.py --shape llama2-7b --seqs 1 --contexts 128,384,1024,4096 --out out.json

`--ragged 6,16,32` measures instead the batches of the offline workload's tail (bench/data/requests.jsonl,
every request decoding from step 0): at the first step with at most N sequences left, their contexts (prompt
+ step), so the lengths differ as they do there; each split count up to 32, the cache path; in the
workload's order and longest context first (the order the scheduler gives a decode step).
"""

from __future__ import annotations

import argparse
import json

import torch
import triton.testing

from bento_pagedllm.kernels.paged_decode import NewKV, choose_num_splits, paged_decode_attention

# (KV heads, query heads per KV head): the attention shapes of BENCHMARKS.md's models, head_dim 128
SHAPES = {"llama2-7b": (32, 1), "llama3-8b": (8, 4)}
HEAD_DIM, BLOCK_SIZE = 128, 16


def measure(shape: str, num_seqs: int, context: int, splits: list[int], fused: bool,
            device: torch.device, dtype: torch.dtype = torch.bfloat16) -> list[dict]:
    """One row per split count: microseconds and the K/V read rate for `num_seqs` sequences of `context`."""
    return measure_lengths(shape, [context] * num_seqs, splits, fused, device, dtype)


def tail_lengths(path: str, num_seqs: int) -> list[int]:
    """The contexts at the first decode step of the workload with at most num_seqs requests left."""
    with open(path) as f:
        requests = [json.loads(line) for line in f]
    step = 0
    while sum(r["max_tokens"] > step for r in requests) > num_seqs:
        step += 1
    return [len(r["prompt_ids"]) + step + 1 for r in requests if r["max_tokens"] > step]


def measure_lengths(shape: str, lengths: list[int], splits: list[int], fused: bool,
                    device: torch.device, dtype: torch.dtype = torch.bfloat16,
                    tiles: list[tuple[int, int, int] | None] = (None,)) -> list[dict]:
    """One row per split count (the auto rule's count added) and tile configuration (None: the kernel's
    own) for sequences of the given lengths: microseconds and the K/V read rate."""
    num_kv_heads, group = SHAPES[shape]
    num_heads = num_kv_heads * group
    num_seqs, context = len(lengths), max(lengths)
    blocks_per_seq = -(-context // BLOCK_SIZE)
    cache_shape = (num_seqs * blocks_per_seq + 1, BLOCK_SIZE, num_kv_heads, HEAD_DIM)
    k_cache = torch.randn(cache_shape, device=device, dtype=dtype)
    v_cache = torch.randn(cache_shape, device=device, dtype=dtype)
    tables = torch.randperm(num_seqs * blocks_per_seq, device=device).view(num_seqs, blocks_per_seq).int()
    seq_lens = torch.tensor(lengths, device=device, dtype=torch.int32)
    qkv = torch.randn(num_seqs, (num_heads + 2 * num_kv_heads) * HEAD_DIM, device=device, dtype=dtype)
    q = qkv[:, : num_heads * HEAD_DIM].view(num_seqs, num_heads, HEAD_DIM)
    new_kv = None
    if fused:
        k, v = (qkv[:, (num_heads + i * num_kv_heads) * HEAD_DIM:][:, : num_kv_heads * HEAD_DIM]
                .view(num_seqs, num_kv_heads, HEAD_DIM) for i in range(2))
        assert len(set(lengths)) == 1, "the fused path is measured at one length"
        last = tables[:, (context - 1) // BLOCK_SIZE].long() * BLOCK_SIZE + (context - 1) % BLOCK_SIZE
        inv_freq = 1e4 ** -(torch.arange(0, HEAD_DIM, 2, device=device) / HEAD_DIM)
        angles = torch.arange(context, device=device)[:, None] * inv_freq[None, :]  # [context, HEAD_DIM / 2]
        angles = torch.cat((angles, angles), dim=-1)  # the model's table layout (models/llama.py)
        new_kv = NewKV(k, v, last, angles.cos(), angles.sin())
    counters = torch.zeros(num_seqs * num_kv_heads, dtype=torch.int32, device=device)
    kv_bytes = 2 * sum(lengths) * num_kv_heads * HEAD_DIM * k_cache.element_size()
    auto = choose_num_splits(context, num_seqs, num_heads, num_kv_heads, device)
    rows = []
    for n in sorted(set(splits) | {auto}):
        for tile in tiles:
            def call(n=n, tile=tile):
                return paged_decode_attention(q, k_cache, v_cache, tables, seq_lens, HEAD_DIM**-0.5, num_splits=n,
                                              split_counters=counters, new_kv=new_kv, tile=tile)
            try:
                call()  # compile outside the graph
            except triton.runtime.errors.OutOfResources as error:  # a sweep's tile that does not fit
                print(f"skipped tile {tile}: {error}", flush=True)
                continue
            us = triton.testing.do_bench_cudagraph(call, rep=50) * 1e3
            rows.append({"shape": shape, "seqs": num_seqs, "context": context, "mean_context": sum(lengths) / num_seqs,
                         "fused_rotary": fused, "splits": n, "auto": n == auto, "tile": tile,
                         "us": us, "kv_tbs": kv_bytes / us / 1e6})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def sweep_tiles() -> list[tuple[int, int, int] | None]:
    """The kernel's own tile, then (keys per tile, warps, stages) around it."""
    return [None] + [(block_n, warps, stages) for block_n in (32, 64, 128) for warps in (4, 8)
                     for stages in (1, 2, 3, 4)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="llama2-7b", choices=sorted(SHAPES))
    parser.add_argument("--seqs", default="1", help="sequence counts, comma-separated")
    parser.add_argument("--contexts", default="128,256,384,512,1024,2048,4096")
    parser.add_argument("--splits", default="1,2,4,8,16,32,64")
    parser.add_argument("--ragged", default="", help="tail batch sizes of the offline workload, comma-separated")
    parser.add_argument("--tile-sweep", action="store_true",
                        help="with --ragged: the auto split count only, in every tile of sweep_tiles()")
    parser.add_argument("--orders", default="workload,longest_first",
                        help="with --ragged: the batch orders measured (longest_first: the scheduler's)")
    parser.add_argument("--requests", default="bench/data/requests.jsonl")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    splits = [int(s) for s in args.splits.split(",")]
    rows = []
    for num_seqs in map(int, filter(None, args.ragged.split(","))):
        lengths = tail_lengths(args.requests, num_seqs)
        if not lengths:  # NOTE: the workload's last requests end together: no step has 1..num_seqs left
            print(f"no decode step of the workload has 1 to {num_seqs} sequences left: skipped", flush=True)
            continue
        if args.tile_sweep:  # as the scheduler lists a decode step, at the split count the backend picks
            for row in measure_lengths(args.shape, sorted(lengths, reverse=True), [], False, torch.device("cuda"),
                                       tiles=sweep_tiles()):
                rows.append({**row, "order": "longest_first"})
            continue
        # in the workload's order, then as the scheduler lists a decode step (longest context first)
        for order, ordered in (("workload", lengths), ("longest_first", sorted(lengths, reverse=True))):
            if order not in args.orders.split(","):
                continue
            for row in measure_lengths(args.shape, ordered, [n for n in splits if n <= 32], False, torch.device("cuda")):
                rows.append({**row, "order": order})
    for num_seqs in map(int, filter(None, args.seqs.split(","))):
        for context in map(int, args.contexts.split(",")):
            for fused in (True, False):
                rows.extend(measure(args.shape, num_seqs, context, splits, fused, torch.device("cuda")))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
