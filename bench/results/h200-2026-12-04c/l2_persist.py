"""Does a persisting L2 window keep a weight slice in the L2 across steps, and how do the ways of setting it
behave (issue 4)? One read of X (a [rows, 4096] bfloat16 matrix times a vector) after a 1 GiB read that
flushes the normal L2, timed with CUDA events:

- `plain`: no window;
- `stream_eager`: a side stream whose access policy window covers X, the read launched eagerly on it;
- `stream_captured`: a graph captured on such a stream (does capture carry the stream's window?);
- `graph_nodes_F`: a graph captured plainly whose kernel nodes get a window over the first F of the set-aside
  (`l2_cache.set_graph_window`), X as large as that window;
- `default_stream`: whether the legacy default stream takes a window at all.

Usage: python bench/l2_persist.py --out l2.json
"""

import argparse
import json
import statistics

import torch

from bento_pagedllm import l2_cache

HIDDEN = 4096


def timed_reads(read, stream: torch.cuda.Stream, flush: torch.Tensor, repeats: int = 30) -> float:
    """Median microseconds of `read()` on `stream`, each after a read of `flush`."""
    times = []
    with torch.cuda.stream(stream):
        for _ in range(repeats + 3):
            flush.sum()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(stream)
            read()
            end.record(stream)
            times.append((start, end))
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) * 1e3 for s, e in times[3:])


def matrix(num_bytes: int) -> torch.Tensor:
    return torch.randn(num_bytes // (2 * HIDDEN), HIDDEN, device="cuda", dtype=torch.bfloat16)


def graph_of(read, stream: torch.cuda.Stream, keep_graph: bool = False) -> torch.cuda.CUDAGraph:
    with torch.cuda.stream(stream):
        read()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph(keep_graph=keep_graph)
    with torch.cuda.graph(graph, stream=stream):
        read()
    return graph


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    device = torch.device("cuda")
    torch.cuda.init()
    sizes = l2_cache.l2_sizes(device)
    reserve = min(sizes.max_persisting, sizes.total * 3 // 4)
    result = {"device": torch.cuda.get_device_name(), "l2_bytes": sizes.total,
              "max_persisting_bytes": sizes.max_persisting, "max_window_bytes": sizes.max_window,
              "reserve_bytes": reserve}
    print(result, flush=True)
    l2_cache.set_aside(device, reserve)
    flush = torch.ones(1 << 29, device=device, dtype=torch.bfloat16)  # 1 GiB
    vector = torch.randn(HIDDEN, device=device, dtype=torch.bfloat16)
    x = matrix(int(reserve * 0.75))
    result["x_bytes"] = x.numel() * 2

    def read(m=x):
        return torch.mv(m, vector)

    times = {"plain": timed_reads(read, torch.cuda.Stream(), flush)}
    l2_cache.reset_persisting_lines()
    side = torch.cuda.Stream()
    l2_cache.set_stream_window(side, l2_cache.AccessWindow.over(x, x.numel() * 2))
    times["stream_eager"] = timed_reads(read, side, flush)
    l2_cache.reset_persisting_lines()
    captured = torch.cuda.Stream()
    l2_cache.set_stream_window(captured, l2_cache.AccessWindow.over(x, x.numel() * 2))
    graph = graph_of(read, captured)
    times["stream_captured"] = timed_reads(graph.replay, captured, flush)
    for fraction in (0.5, 0.75, 0.9, 1.0, 1.25):
        l2_cache.reset_persisting_lines()
        m = matrix(int(reserve * fraction))
        stream = torch.cuda.Stream()
        times[f"plain_{fraction}"] = timed_reads(lambda: read(m), stream, flush)
        graph = graph_of(lambda: read(m), stream, keep_graph=True)
        result[f"kernel_nodes_{fraction}"] = l2_cache.set_graph_window(graph, l2_cache.AccessWindow.over(m, m.numel() * 2))
        graph.instantiate()
        times[f"graph_nodes_{fraction}"] = timed_reads(graph.replay, stream, flush)
        del graph, m
    l2_cache.reset_persisting_lines()
    try:
        l2_cache.set_stream_window(torch.cuda.default_stream(), l2_cache.AccessWindow.over(x, x.numel() * 2))
        times["default_stream"] = timed_reads(read, torch.cuda.default_stream(), flush)
    except RuntimeError as error:
        result["default_stream_error"] = str(error)
    result["read_us"] = times
    for name, us in times.items():
        print(f"{name:>20}: {us:8.2f} us", flush=True)
    print(json.dumps(result), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
