"""The GEMMs of big decode steps and of prefill on the GPU: cuBLAS as the model calls it (`F.linear`),
cuBLAS through cuBLASLt, and a persistent Triton GEMM (W through the tensor-memory accelerator), for the
projections of Llama-2-7B and Llama-3-8B at the row counts of the decode graphs' ladder.

Why: a Llama-3-8B offline run spends ~2.8 s in decode steps of 129-512 sequences, two thirds of it in
GEMMs at ~520 TFLOP/s, against ~670 for the 16,384-token prefill steps (torch profiler, 2026-12-01). At a
few hundred rows the output has few tiles (N = 4,096 in 128 x 128 tiles and 448 rows: 128 tiles for 132
multiprocessors), so the kernel cuBLAS picks for each row count decides the time. This measures, per row
count, what each path reaches, before anything in the model changes.

Each call is timed inside a CUDA graph (triton.testing.do_bench_cudagraph), cycling through copies of W
of 256 MB or more in all, as a step's layers do (a W that fits in L2 would otherwise be read from it).

    python bench/gemm.py --rows 128,256,384,448,480,512 --out bench/results/gemm.json

`--swiglu`: the gate/up projections of prefill-sized steps only, as the model runs them (cuBLAS, then the
SiLU-and-multiply kernel over its [rows, 2 x intermediate] output) against one persistent Triton GEMM
whose programs hold a gate tile and the matching up tile and store silu(gate) * up: the [rows, 2 x
intermediate] product is never written nor read back (16,384 Llama-3-8B rows: 940 MB written and read,
470 MB written, a layer).

    python bench/gemm.py --swiglu --rows 8192,16384 --shapes llama2-7b,llama3-8b

`--tunable`: PyTorch's TunableOp (each shape's cuBLAS/cuBLASLt algorithms timed on first use) in place of
the Triton GEMM: whether cuBLAS's own choice leaves anything at these row counts.

    python bench/gemm.py --tunable --rows 256,384,448,512,16384 --shapes llama3-8b
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import torch
import triton
import triton.language as tl
import triton.testing
from triton.tools.tensor_descriptor import TensorDescriptor

from bento_pagedllm.kernels.activation import silu_and_mul, silu_and_mul_tile
from bento_pagedllm.kernels.swiglu_gemm import _tile_position, interleave_gate_up, swiglu_gemm
from single_stream import copy_bandwidth, device_facts, save

SHAPES = [  # (name, N, K): y = x W^T, W [N, K]
    ("llama2-7b qkv", 12288, 4096), ("llama2-7b o", 4096, 4096), ("llama2-7b gate_up", 22016, 4096),
    ("llama2-7b down", 4096, 11008), ("llama2-7b lm_head", 32000, 4096),
    ("llama3-8b qkv", 6144, 4096), ("llama3-8b o", 4096, 4096), ("llama3-8b gate_up", 28672, 4096),
    ("llama3-8b down", 4096, 14336), ("llama3-8b lm_head", 128256, 4096),
]

# (BLOCK_M, BLOCK_N, BLOCK_K, stages, warps): the rows of x by the rows of W a tile
CONFIGS = [(128, 128, 64, 4, 8), (128, 256, 64, 3, 8), (64, 128, 64, 5, 4), (64, 256, 64, 4, 4),
           (128, 128, 128, 3, 8), (128, 64, 64, 5, 4)]


@triton.jit
def _persistent_matmul_kernel(x_desc, w_desc, y_desc, M, N, K, NUM_SMS: tl.constexpr, BLOCK_M: tl.constexpr,
                              BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    """y = x W^T. Each program walks the output tiles NUM_SMS apart (the loop flattened, so the next tile's
    loads start while this one's last products run); tiles go GROUP_M row blocks at a time for L2."""
    num_m, num_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    for tile in tl.range(tl.program_id(0), num_m * num_n, NUM_SMS, flatten=True):
        pid_m, pid_n = _tile_position(tile, num_m, num_n, GROUP_M)
        acc = _tile_product(x_desc, w_desc, pid_m, pid_n, k_tiles, BLOCK_M, BLOCK_N, BLOCK_K)
        y_desc.store([pid_m * BLOCK_M, pid_n * BLOCK_N], acc.to(y_desc.dtype))


@triton.jit
def _tile_product(x_desc, w_desc, pid_m, pid_n, k_tiles, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr):
    """x's row block pid_m times W's row block pid_n, transposed: [BLOCK_M, BLOCK_N] float32."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kk in range(k_tiles):
        x = x_desc.load([pid_m * BLOCK_M, kk * BLOCK_K])  # [BLOCK_M, BLOCK_K]
        w = w_desc.load([pid_n * BLOCK_N, kk * BLOCK_K])  # [BLOCK_N, BLOCK_K]
        acc = tl.dot(x, w.T, acc)
    return acc


@triton.jit
def _persistent_swiglu_kernel(x_desc, w_desc, y_desc, M, N, K, NUM_SMS: tl.constexpr, BLOCK_M: tl.constexpr,
                              BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    """y = silu(x W_gate^T) * (x W_up^T), W = [W_gate; W_up] ([2N, K]): the tiles of
    `_persistent_matmul_kernel`, each with the gate rows' accumulator and the up rows' beside it."""
    num_m, num_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    for tile in tl.range(tl.program_id(0), num_m * num_n, NUM_SMS, flatten=True):
        pid_m, pid_n = _tile_position(tile, num_m, num_n, GROUP_M)
        gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kk in range(k_tiles):
            x = x_desc.load([pid_m * BLOCK_M, kk * BLOCK_K])  # [BLOCK_M, BLOCK_K]
            # NOTE: the last gate tile may run into the up rows: its columns past N are not stored
            gate = tl.dot(x, w_desc.load([pid_n * BLOCK_N, kk * BLOCK_K]).T, gate)
            up = tl.dot(x, w_desc.load([N + pid_n * BLOCK_N, kk * BLOCK_K]).T, up)
        dtype = y_desc.dtype
        y = silu_and_mul_tile(gate.to(dtype).to(tl.float32), up.to(dtype).to(tl.float32), dtype)
        y_desc.store([pid_m * BLOCK_M, pid_n * BLOCK_N], y)


INTERLEAVED_CONFIGS = [(128, 256, 64, 3, 8), (128, 256, 64, 4, 8), (128, 128, 64, 4, 8), (128, 256, 32, 5, 8)]

SWIGLU_CONFIGS = [(128, 128, 64, 3, 8), (128, 128, 64, 4, 8), (128, 64, 64, 4, 4), (128, 64, 64, 5, 8),
                  (64, 128, 64, 4, 4), (128, 128, 32, 5, 8)]


def triton_swiglu(x: torch.Tensor, w: torch.Tensor, config: tuple, out: torch.Tensor) -> torch.Tensor:
    return _launch_persistent(_persistent_swiglu_kernel, x, w, w.shape[0] // 2, config, out)


def triton_interleaved_swiglu(x: torch.Tensor, w: torch.Tensor, config: tuple, out: torch.Tensor) -> torch.Tensor:
    """The model's kernel (kernels/swiglu_gemm.py); w: `interleave_gate_up(gate_up, config's BLOCK_N / 2)`."""
    block_m, block_n, block_k, stages, warps = config
    return swiglu_gemm(x, w, block_n // 2, config=(block_m, block_k, stages, warps))


def measure_swiglu(name: str, n2: int, k: int, m: int, w: torch.Tensor) -> dict:
    """cuBLAS + the SiLU-and-multiply kernel (the model's prefill) against the fused Triton GEMM."""
    x = torch.randn(m, k, device="cuda", dtype=w.dtype)
    out = torch.empty(m, n2 // 2, device="cuda", dtype=x.dtype)
    flops = 2 * m * n2 * k
    row = {"name": name, "n": n2, "k": k, "rows": m}
    ref = silu_and_mul(torch.nn.functional.linear(x, w)).float()
    us = timed_us(lambda w: silu_and_mul(torch.nn.functional.linear(x, w)), [w])
    row["cublas_then_silu_us"], row["cublas_then_silu_tflops"] = us, flops / us / 1e6
    us = timed_us(lambda w: torch.nn.functional.linear(x, w), [w])
    row["cublas_only_us"], row["cublas_only_tflops"] = us, flops / us / 1e6
    row.update(best_triton("triton_swiglu", SWIGLU_CONFIGS, lambda w, c: triton_swiglu(x, w, c, out), ref, [w],
                           flops))
    for half in sorted({config[1] // 2 for config in INTERLEAVED_CONFIGS}):  # W interleaved once per block size
        configs = [c for c in INTERLEAVED_CONFIGS if c[1] // 2 == half]
        row.update(best_triton(f"triton_interleaved{half}", configs,
                               lambda w, c: triton_interleaved_swiglu(x, w, c, out), ref, [interleave_gate_up(w, half)],
                               flops))
    return row


def triton_matmul(x: torch.Tensor, w: torch.Tensor, config: tuple, out: torch.Tensor) -> torch.Tensor:
    return _launch_persistent(_persistent_matmul_kernel, x, w, w.shape[0], config, out)


def _launch_persistent(kernel, x: torch.Tensor, w: torch.Tensor, n: int, config: tuple, out: torch.Tensor):
    """One program per multiprocessor (at most one per output tile); n: the output's columns."""
    block_m, block_n, block_k, stages, warps = config
    m, k = x.shape
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else 4
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    kernel[(min(sms, tiles),)](
        TensorDescriptor.from_tensor(x, [block_m, block_k]), TensorDescriptor.from_tensor(w, [block_n, block_k]),
        TensorDescriptor.from_tensor(out, [block_m, block_n]), m, n, k, NUM_SMS=sms, BLOCK_M=block_m,
        BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=8, num_stages=stages, num_warps=warps)
    return out


def best_triton(label: str, configs: list[tuple], launch, ref: torch.Tensor, copies: list[torch.Tensor],
                flops: int) -> dict:
    """The fastest configuration of `launch(w, config)` over `copies`, its error against `ref`, as
    {label}_us, _tflops, _config, _max_rel_error (nothing when none ran)."""
    best = None
    for config in configs:
        try:
            got = launch(copies[0], config).float()
            error = ((got - ref).abs().max() / ref.abs().max()).item()
            us = timed_us(lambda w: launch(w, config), copies)
        except Exception as e:  # noqa: BLE001 (a configuration that does not fit: shared memory)
            print(f"  {label} {config}: {type(e).__name__}", flush=True)
            continue
        print(f"  {label} {config}: {us:.1f} us, max rel error {error:.2e}", flush=True)
        if best is None or us < best[0]:
            best = (us, config, error)
    if best is None:
        return {}
    return {f"{label}_us": best[0], f"{label}_tflops": flops / best[0] / 1e6, f"{label}_config": list(best[1]),
            f"{label}_max_rel_error": best[2]}


def timed_us(fn, copies) -> float:
    return triton.testing.do_bench_cudagraph(lambda: [fn(c) for c in copies], rep=50) * 1e3 / len(copies)


def measure(name: str, n: int, k: int, m: int, copies: list[torch.Tensor], tunable: bool = False) -> dict:
    x = torch.randn(m, k, device="cuda", dtype=copies[0].dtype)
    out = torch.empty(m, n, device="cuda", dtype=x.dtype)
    flops = 2 * m * n * k
    row = {"name": name, "n": n, "k": k, "rows": m}
    ref = torch.nn.functional.linear(x, copies[0]).float()
    for library in ("cublas", "cublaslt"):
        torch.backends.cuda.preferred_blas_library(library)
        us = timed_us(lambda w: torch.nn.functional.linear(x, w), copies)
        row[f"{library}_us"], row[f"{library}_tflops"] = us, flops / us / 1e6
    torch.backends.cuda.preferred_blas_library("cublas")
    if tunable:
        row.update(tuned_linear(x, copies, flops))
    else:
        row.update(best_triton("triton", CONFIGS, lambda w, c: triton_matmul(x, w, c, out), ref, copies, flops))
    return row


def tuned_linear(x: torch.Tensor, copies: list[torch.Tensor], flops: int) -> dict:
    """F.linear through PyTorch's TunableOp: every cuBLAS / cuBLASLt algorithm its heuristics list for the
    shape, timed once on first use (outside the graph), the fastest kept; then timed as the others are.
    NOTE: only graphs could use it in the engine (tuning a new row count costs its time in the step)."""
    from torch.cuda import tunable

    tunable.enable(True)
    tunable.tuning_enable(True)
    tunable.set_filename(os.path.join(tempfile.gettempdir(), "tunableop_results.csv"))  # not the work tree
    tunable.set_max_tuning_duration(200)  # ms a shape
    try:
        start = time.perf_counter()
        torch.nn.functional.linear(x, copies[0])
        torch.cuda.synchronize()
        tuning_s = time.perf_counter() - start
        tunable.tuning_enable(False)
        us = timed_us(lambda w: torch.nn.functional.linear(x, w), copies)
        chosen = [list(r) for r in tunable.get_results()][-1:]
    finally:
        tunable.tuning_enable(False)
        tunable.enable(False)
    return {"tunable_us": us, "tunable_tflops": flops / us / 1e6, "tunable_tuning_s": tuning_s,
            "tunable_choice": chosen}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", default="128,256,320,384,448,480,512,16384", help="comma-separated")
    parser.add_argument("--shapes", default="llama3-8b", help="only the shapes whose name starts with one of these")
    parser.add_argument("--swiglu", action="store_true", help="the gate/up projections with SiLU-and-multiply")
    parser.add_argument("--tunable", action="store_true",
                        help="PyTorch's TunableOp (cuBLAS algorithms timed per shape) instead of the Triton GEMM")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    bandwidth = copy_bandwidth()
    prefixes = tuple(p for p in args.shapes.split(",") if p)
    rows = []
    for name, n, k in SHAPES:
        if prefixes and not name.startswith(prefixes) or (args.swiglu and "gate_up" not in name):
            continue
        if args.swiglu:
            w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k**-0.5
            for m in map(int, args.rows.split(",")):
                rows.append(measure_swiglu(name, n, k, m, w))
                print(json.dumps(rows[-1]), flush=True)
            del w
            continue
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k**-0.5
        weight_bytes = n * k * w.element_size()
        copies = [w] + [w.clone() for _ in range(-(-(256 << 20) // weight_bytes) - 1)]
        for m in map(int, args.rows.split(",")):
            rows.append(measure(name, n, k, m, copies if m <= 4096 else copies[:1], args.tunable))
            print(json.dumps(rows[-1]), flush=True)
        del w, copies
    save({**device_facts(bandwidth), "rows": rows}, args.out)


if __name__ == "__main__":
    main()
