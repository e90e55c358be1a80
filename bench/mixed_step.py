"""Where a mixed step's time goes: the eager forward (no CUDA graph) of B decoding sequences plus one new
prompt of P tokens, against the device time of the same work and against the replay of its CUDA graph
(decode graphs; mixed-step graphs up to `max_mixed_graph_tokens`), inputs uploaded included.

Prints, per (B, P): the host's launch time (forward returns, nothing waited for), the device time (CUDA
events), and the wall time to completion. A launch time above the device time means the step is bound by
the host (Python and kernel launches), which a CUDA graph of mixed steps would remove.

    python bench/mixed_step.py --shape llama2-7b --out mixed.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def metadata(batch: int, prompt: int, context: int, block_size: int, device):
    """B decodes at `context` tokens, then one prompt of `prompt` new tokens: inputs and AttentionMetadata."""
    from bento_pagedllm.attention import AttentionMetadata

    query_lens = [1] * batch + ([prompt] if prompt else [])
    seq_lens = [context] * batch + ([prompt] if prompt else [])
    width = -(-max(seq_lens) // block_size)
    tables = [[i * width + j for j in range(width)] for i in range(len(seq_lens))]
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    slots, positions = [], []
    for table, q, s in zip(tables, query_lens, seq_lens):
        for p in range(s - q, s):
            positions.append(p)
            slots.append(table[p // block_size] * block_size + p % block_size)
    decode = list(range(batch)) if prompt else list(range(batch))

    def t(values, dtype):
        return torch.tensor(values, dtype=dtype, device=device)

    meta = AttentionMetadata(
        slot_mapping=t(slots, torch.int64), query_start_loc=t(starts, torch.int32), seq_lens=t(seq_lens, torch.int32),
        block_tables=t(tables, torch.int32), query_lens_host=tuple(query_lens), seq_lens_host=tuple(seq_lens),
        decode_indices=t(decode, torch.int64), decode_token_indices=t([starts[i] for i in decode], torch.int64),
        decode_indices_host=tuple(decode),
    )
    ids = t([7] * starts[-1], torch.int64)
    host = dict(input_ids=[7] * starts[-1], positions=positions, slots=slots, query_lens=query_lens,
                seq_lens=seq_lens, tables=tables)
    return ids, t(positions, torch.int64), meta, len(tables) * width, host


def time_forward(model, args, runs: int) -> dict:
    host, device, wall = [], [], []
    for i in range(runs + 2):
        torch.cuda.synchronize()
        start_event, end_event = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        start_event.record()
        model(*args)
        end_event.record()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        if i >= 2:
            host.append((t1 - t0) * 1e3)
            device.append(start_event.elapsed_time(end_event))
            wall.append((t2 - t0) * 1e3)
    return {"host_launch_ms": statistics.median(host), "device_ms": statistics.median(device),
            "wall_ms": statistics.median(wall)}


def profile_graph(runner, host: dict, path: str) -> None:
    """The kernels of 5 replays of the decode graph, by total device time."""
    from torch.profiler import ProfilerActivity, profile

    os.makedirs(os.path.dirname(path), exist_ok=True)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            runner.graphs.run(host["input_ids"], host["positions"], host["slots"], host["seq_lens"], host["tables"],
                              [-1] * len(host["input_ids"]))
        torch.cuda.synchronize()
    with open(path, "w") as f:
        f.write(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=70))


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="llama2-7b")
    parser.add_argument("--batches", default="1,40,256")
    parser.add_argument("--prompts", default="0,200,1000")
    parser.add_argument("--context", type=int, default=400)
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--profile-dir", default=None, help="a torch.profiler kernel table per decode graph here")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--max-batch", type=int, default=256, help="max_num_seqs and the biggest decode graph")
    parser.add_argument("--fused-gemv-rows", type=int, default=None, help="EngineArgs.fused_gemv_rows (default: the engine's)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    from serve import shape_dir

    from bento_pagedllm import LLMEngine
    from bento_pagedllm.config import EngineArgs

    engine = LLMEngine(EngineArgs(model=shape_dir(args.shape), load_format="dummy", dtype="bfloat16",
                                  max_num_seqs=args.max_batch, max_graph_batch=args.max_batch,
                                  max_model_len=args.max_model_len,
                                  max_num_batched_tokens=8192,
                                  **({} if args.fused_gemv_rows is None else {"fused_gemv_rows": args.fused_gemv_rows})))
    runner, model = engine.runner, engine.runner.model
    bs = engine.configs.cache.block_size
    rows = []
    for batch in map(int, args.batches.split(",")):
        for prompt in map(int, args.prompts.split(",")):
            ids, positions, meta, blocks, host = metadata(batch, prompt, args.context, bs, runner.device)
            if blocks > runner.num_blocks:
                continue
            row = {"batch": batch, "prompt": prompt, "context": args.context, "tokens": int(ids.shape[0])}
            row.update(time_forward(model, (ids, positions, runner.kv_caches, meta), args.runs))
            # the graphs replayed with the step's real inputs (the engine's path)
            if prompt == 0 and runner.graphs is not None and runner.graphs.fits(batch):
                replay = time_forward(lambda: runner.graphs.run(
                    host["input_ids"], host["positions"], host["slots"], host["seq_lens"], host["tables"],
                    [-1] * len(host["input_ids"])), (), args.runs)
                row.update({f"graph_{k}": v for k, v in replay.items()})
                if args.profile_dir:
                    profile_graph(runner, host, os.path.join(args.profile_dir, f"{args.shape}_b{batch}_c{args.context}.txt"))
            elif runner.mixed_graphs is not None and runner.mixed_graphs.fits(len(host["input_ids"]), batch + 1):
                replay = time_forward(lambda: runner.mixed_graphs.run(
                    host["input_ids"], host["positions"], host["slots"], host["query_lens"], host["seq_lens"],
                    host["tables"], [-1] * len(host["input_ids"])), (), args.runs)
                row.update({f"graph_{k}": v for k, v in replay.items()})
            print(json.dumps(row), flush=True)
            rows.append(row)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"shape": args.shape, "device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
