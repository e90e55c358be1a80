"""How fast can a kernel only READ the GPU's memory? The single-stream roofline divides the weights' bytes by
the copy bandwidth (bytes read + written by a large device-to-device copy, `single_stream.copy_bandwidth`);
a decode step only reads. Whether a one-row projection at ~92% of the copy bandwidth (H200, bench/gemv.py)
has room left depends on what a read-only stream reaches on the same machine.

Measured here, each over a 4 GiB buffer (many times the L2), median of timed repetitions:
- the copy bandwidth, as the roofline counts it;
- `torch.sum` of the buffer (bf16), bytes read / time;
- a Triton kernel that sums contiguous chunks of the buffer (a program per chunk, or one program per
  multiprocessor slot walking chunks `PROGRAMS` apart), in tiles of BLOCK elements, UNROLL tiles loaded
  before any is added (the loads in flight a program keeps), over a grid of those choices.

    python bench/read_ceiling.py --out bench/results/read_ceiling.json

`--matrices` asks the same of each one-row projection's bytes (Llama-2-7B's and Llama-3-8B's weights, 34 to
1,051 MB), timed as bench/gemv.py times the projection kernels (a CUDA graph cycling through copies of 256 MB
or more), beside those kernels on the same copies: whether a projection's read rate (3.5-4.1 TB/s on an H200)
is what a read-only kernel reaches over that many bytes, or below it.

    python bench/read_ceiling.py --matrices --out bench/results/read_matrices.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import os

import torch
import triton
import triton.language as tl
import triton.testing

import gemv as gemv_bench  # bench/gemv.py
from single_stream import copy_bandwidth, device_facts, save

BUFFER_BYTES = int(os.environ.get("READ_CEILING_BYTES", 4 << 30))


@triton.jit
def _read_kernel(x_ptr, out_ptr, num_chunks, CHUNK: tl.constexpr, BLOCK: tl.constexpr, UNROLL: tl.constexpr):
    """Sum chunks pid, pid + grid, ... of CHUNK elements; one float32 per program (so the loads stay)."""
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for chunk in range(tl.program_id(0), num_chunks, tl.num_programs(0)):
        base = x_ptr + tl.cast(chunk, tl.int64) * CHUNK
        for start in range(0, CHUNK, BLOCK * UNROLL):
            # every tile's load issued before the first is used (UNROLL 1, 2 or 4)
            offsets = base + start + tl.arange(0, BLOCK)
            t0 = tl.load(offsets)
            if UNROLL >= 2:
                t1 = tl.load(offsets + BLOCK)
            if UNROLL == 4:
                t2 = tl.load(offsets + 2 * BLOCK)
                t3 = tl.load(offsets + 3 * BLOCK)
            acc += t0.to(tl.float32)
            if UNROLL >= 2:
                acc += t1.to(tl.float32)
            if UNROLL == 4:
                acc += t2.to(tl.float32) + t3.to(tl.float32)
    tl.store(out_ptr + tl.program_id(0), tl.sum(acc))


def _seconds(fn) -> float:
    return triton.testing.do_bench(fn, warmup=5, rep=50, return_mode="median") / 1e3


def triton_read(x: torch.Tensor, expected: float, chunk: int, block: int, unroll: int, warps: int,
                programs: int) -> dict:
    """`programs` 0: one program per chunk; else that many programs walking the chunks."""
    num_chunks = x.numel() // chunk
    grid = programs or num_chunks
    out = torch.empty(grid, device=x.device, dtype=torch.float32)
    call = lambda: _read_kernel[(grid,)](x, out, num_chunks, CHUNK=chunk, BLOCK=block, UNROLL=unroll,  # noqa: E731
                                         num_warps=warps)
    call()
    assert abs(out.sum().item() - expected) <= 1e-3 * abs(expected) + 1.0, (out.sum().item(), expected)
    seconds = _seconds(call)
    return {"chunk_bytes": chunk * x.element_size(), "block": block, "unroll": unroll, "warps": warps,
            "programs": programs, "read_tbs": num_chunks * chunk * x.element_size() / seconds / 1e12}


def matrix_read(copies: list[torch.Tensor], chunk: int, block: int, unroll: int, warps: int) -> float:
    """Microseconds a read of one copy takes, one program per chunk, in a graph cycling through `copies`."""
    num_chunks = copies[0].numel() // chunk
    out = torch.empty(num_chunks, device=copies[0].device, dtype=torch.float32)
    call = lambda x: _read_kernel[(num_chunks,)](x, out, num_chunks, CHUNK=chunk, BLOCK=block,  # noqa: E731
                                                 UNROLL=unroll, num_warps=warps)
    call(copies[0])
    assert abs(out.sum().item() - copies[0].sum(dtype=torch.float32).item()) <= 1e-3 * copies[0].numel()
    return gemv_bench._timed_us(call, copies)


def matrices(bandwidth: float, models: tuple[str, ...] = ("llama2-7b", "llama3-8b"), quick: bool = False) -> list[dict]:
    """Per projection shape (one row) of `models`: the read kernel's configurations over the matrix's bytes,
    and the projection kernel (kernels/gemv.py as the model calls it) with dependent launch off and on."""
    rows = []
    grid = ((16, 32), (1024, 4096), (2,), (4, 8)) if quick else ((8, 16, 32), (1024, 2048, 4096), (1, 2), (4, 8))
    for name, n, k, prologue in gemv_bench.SHAPES:
        if not name.startswith(models) or name.endswith("as_norm"):
            continue
        w = torch.rand(n, k, device="cuda", dtype=torch.bfloat16) * k**-0.5
        row = gemv_bench.measure(name, n, k, prologue, 1, w, 1e-5)
        copies = [c.view(-1) for c in gemv_bench._weight_copies(w)]
        reads = []
        for chunk_kb, block, unroll, warps in itertools.product(*grid):
            chunk = chunk_kb * 1024 // 2
            if block * unroll > chunk or copies[0].numel() % chunk or block * unroll // (32 * warps) > 64:
                continue
            us = matrix_read(copies, chunk, block, unroll, warps)
            reads.append({"chunk_bytes": chunk * 2, "block": block, "unroll": unroll, "warps": warps, "us": us,
                          "read_tbs": n * k * 2 / us / 1e6})
        best = min(reads, key=lambda r: r["us"])
        row.update(read_best=best, read_us=best["us"], reads=reads,
                   fused_over_read=row["triton_fused_us"] / best["us"],
                   fused_pdl_over_read=row.get("triton_fused_pdl_us", float("nan")) / best["us"],
                   read_over_copy=best["read_tbs"] / (bandwidth / 1e12))
        print(json.dumps({key: v for key, v in row.items() if key != "reads"}), flush=True)
        rows.append(row)
        del w, copies
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    parser.add_argument("--matrices", action="store_true", help="the projections' bytes (see the docstring)")
    parser.add_argument("--models", default="llama2-7b,llama3-8b", help="--matrices: these models' projections")
    parser.add_argument("--quick", action="store_true", help="--matrices: 8 read configurations, not the full grid")
    args = parser.parse_args()
    bandwidth = copy_bandwidth()
    if args.matrices:
        rows = matrices(bandwidth, tuple(args.models.split(",")), args.quick)
        save({**device_facts(bandwidth), "rows": rows}, args.out)
        return
    x = torch.rand(BUFFER_BYTES // 2, device="cuda", dtype=torch.bfloat16)
    expected = x.sum(dtype=torch.float32).item()
    torch_sum = x.numel() * 2 / _seconds(lambda: x.sum(dtype=torch.float32)) / 1e12
    print(json.dumps({"copy_tbs": bandwidth / 1e12, "torch_sum_read_tbs": torch_sum}), flush=True)
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count
    rows = []
    for chunk_kb, block, unroll, warps, per_sm in itertools.product(
            (32, 256), (1024, 2048, 4096), (1, 2, 4), (4, 8), (0, 4, 8)):
        chunk = chunk_kb * 1024 // 2
        if block * unroll > chunk or block * unroll // (32 * warps) > 64:  # <= 64 values in flight a thread
            continue
        rows.append(triton_read(x, expected, chunk, block, unroll, warps, per_sm * sms))
        print(json.dumps(rows[-1]), flush=True)
    best = max(rows, key=lambda r: r["read_tbs"])
    result = {**device_facts(bandwidth), "torch_sum_read_tbs": torch_sum, "best_triton": best,
              "best_over_copy": best["read_tbs"] / (bandwidth / 1e12), "rows": rows}
    print(json.dumps({k: v for k, v in result.items() if k != "rows"}, indent=1))
    save(result, args.out)


if __name__ == "__main__":
    main()
