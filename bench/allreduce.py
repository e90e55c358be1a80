"""All-reduce time by message size on the GPUs of one host: NCCL against torch's peer-memory kernels.

Why: a tensor-parallel decode step all-reduces twice a layer, [tokens, hidden] in bf16, and whether that
costs a few or a hundred microseconds decides how a step scales with the GPU count. Each path is timed
inside a CUDA graph (as the engine's decode steps run it): K all-reduces back to back, replayed, the
mean per call. NCCL's own settings come from the environment (run it again with NCCL_PROTO, NCCL_ALGO or
NCCL_MIN_NCHANNELS set to compare); NVLink multicast stays off.

    python bench/allreduce.py --gpus 2 --out allreduce.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

SIZES_KB = [16, 64, 256, 512, 1024, 2048, 4096, 8192, 32768, 131072]
PER_GRAPH = 20


def time_in_graph(op, replays: int = 10) -> float:
    """Mean microseconds per call of `op` captured PER_GRAPH times in one graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            op()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(PER_GRAPH):
            op()
    graph.replay()
    torch.cuda.synchronize()
    dist.barrier()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / (replays * PER_GRAPH)


def rank_main(rank: int, size: int, port: int, out: str | None) -> None:
    torch.cuda.set_device(rank)
    store = dist.TCPStore("127.0.0.1", port, size, is_master=rank == 0, timeout=datetime.timedelta(minutes=5))
    dist.init_process_group("nccl", store=store, rank=rank, world_size=size)
    group = dist.group.WORLD
    symm = None
    try:
        import torch.distributed._symmetric_memory as symm_mem

        symm = symm_mem.empty(max(SIZES_KB) * 1024 // 2, dtype=torch.bfloat16, device="cuda")
        symm_mem.rendezvous(symm, group.group_name)
    except Exception as error:  # noqa: BLE001 - a missing path is reported, not fatal
        print(f"rank {rank}: no symmetric memory: {error!r}", flush=True)
        symm = None
    rows = []
    for kb in SIZES_KB:
        n = kb * 1024 // 2
        x = torch.randn(n, dtype=torch.bfloat16, device="cuda")
        row = {"kb": kb, "nccl_us": time_in_graph(lambda: dist.all_reduce(x, group=group))}
        if symm is not None:
            staged = symm[:n]

            def one_shot():
                staged.copy_(x)
                return torch.ops.symm_mem.one_shot_all_reduce(staged, "sum", group.group_name)

            def two_shot():
                staged.copy_(x)
                torch.ops.symm_mem.two_shot_all_reduce_(staged, "sum", group.group_name)

            for name, op in (("one_shot_us", one_shot), ("two_shot_us", two_shot)):
                try:
                    row[name] = time_in_graph(op)
                except Exception as error:  # noqa: BLE001
                    row[name] = repr(error)[:200]
        rows.append(row)
        if rank == 0:
            print(json.dumps(row), flush=True)
    if rank == 0:
        env = {k: v for k, v in os.environ.items() if k.startswith(("NCCL_", "TORCH_SYMM"))}
        result = {"date": datetime.date.today().isoformat(), "gpus": size, "nccl": torch.cuda.nccl.version(),
                  "torch": torch.__version__, "env": env, "per_graph": PER_GRAPH, "rows": rows}
        if out:
            with open(out, "w") as f:
                json.dump(result, f, indent=2)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=int, default=2)
    parser.add_argument("--port", type=int, default=29511)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    mp.spawn(rank_main, args=(args.gpus, args.port, args.out), nprocs=args.gpus)


if __name__ == "__main__":
    main()
