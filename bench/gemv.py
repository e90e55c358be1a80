"""Projections of a few tokens on the GPU: the fused Triton kernels (kernels/gemv.py) against cuBLAS
(`F.linear`) and the copy bandwidth, for the matrices of decode steps of 1 to 64 sequences.

Each call is timed inside a CUDA graph (triton.testing.do_bench_cudagraph), so launch gaps do not count;
bandwidth = the weight's bytes / time. NOTE: the graph cycles through copies of W of 256 MB or more in
all, as a decode step's layers do: a matrix that fits in L2 (50 MB) and is read back to back would be
read from L2 (o's 34 MB read at 5.4 TB/s so, 2026-12-01).

The fused line is each kernel as the model calls it (the norm's input already the residual sum; gate/up
with the SwiGLU epilogue; o and down adding the residual to their output), with programmatic dependent
launch off and, on compute capability 9+, on (`_pdl`: the graph's back-to-back calls overlap as a decode
step's chain of kernels does); the unfused line is cuBLAS plus the separate RMSNorm-with-residual-add or
SiLU-and-multiply kernel the model launches otherwise.

    python bench/gemv.py --rows 1,2,4,8,16,32,64 --out bench/results/gemv.json

(Rows above kernels/gemv.py's MAX_ROWS time cuBLAS alone: where the crossover lies.)

`--sweep` times the kernel (dependent launch on where the GPU has it) in every configuration of a grid
wider than the autotuner's (`sweep_configs`), per shape and row count, beside the autotuner's choice:
whether another tile shape would bring a projection closer to the copy bandwidth.

    python bench/gemv.py --sweep --rows 16 --shapes "llama3-8b qkv,llama3-8b down,llama2-7b o"
    python bench/gemv.py --sweep --rows 1 --shapes llama2-7b

`--interleave` times gate/up with its rows interleaved in blocks of each given size (0: the gate rows, then
the up rows; the model's CUDA layout is `swiglu_gemm.INTERLEAVE`, 128), and the shape `llama2-7b
gate_up_as_norm` reads the same matrix as a plain norm projection (no SwiGLU: one row stream a program, as
q/k/v and the LM head): whether gate/up's lower read rate (3.99 TB/s against the LM head's 4.14, H200,
2026-12-02) is its layout, its two row streams a program, or neither.

    python bench/gemv.py --rows 1 --shapes "llama2-7b gate_up,llama2-7b lm_head" --interleave 0,4,128
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
from concurrent.futures import ThreadPoolExecutor

import torch
import triton.runtime.errors
import triton.testing

from bento_pagedllm.kernels import activation, gemv, rms_norm
from bento_pagedllm.models.ops import supports_dependent_launch
from single_stream import copy_bandwidth

# (name, N, K, prologue): the projections of Llama-2-7B, Llama-3-8B and SmolLM2-135M
SHAPES = [  # NOTE: the LM head's norm has no residual to add either
    ("llama2-7b qkv", 12288, 4096, "norm"), ("llama2-7b o", 4096, 4096, "none"),
    ("llama2-7b gate_up", 22016, 4096, "swiglu"), ("llama2-7b down", 4096, 11008, "none"),
    ("llama2-7b lm_head", 32000, 4096, "norm"),
    # NOTE: a probe, not a projection of a model: gate/up's matrix read as q/k/v's and the LM head's are
    ("llama2-7b gate_up_as_norm", 22016, 4096, "norm"),
    ("llama3-8b qkv", 6144, 4096, "norm"), ("llama3-8b gate_up", 28672, 4096, "swiglu"),
    ("llama3-8b down", 4096, 14336, "none"), ("llama3-8b lm_head", 128256, 4096, "norm"),
    ("smollm2 qkv", 960, 576, "norm"), ("smollm2 o", 576, 576, "none"), ("smollm2 gate_up", 3072, 576, "swiglu"),
    ("smollm2 down", 576, 1536, "none"), ("smollm2 lm_head", 49152, 576, "norm"),
]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", default="1", help="tokens per step, comma-separated")
    parser.add_argument("--shapes", default="", help="only the shapes whose name starts with one of these")
    parser.add_argument("--sweep", action="store_true", help="every tile configuration of sweep_configs()")
    parser.add_argument("--interleave", default="0",
                        help="gate/up's row layouts to time, comma-separated (0: gate rows, then up rows; the "
                             "model's on CUDA: 128)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    dtype, eps = torch.bfloat16, 1e-5
    bandwidth = copy_bandwidth()
    prefixes = tuple(p for p in args.shapes.split(",") if p)
    rows = []
    for name, n, k, prologue in SHAPES:
        if prefixes and not name.startswith(prefixes):
            continue
        w = torch.randn(n, k, device="cuda", dtype=dtype) * k**-0.5
        layouts = map(int, args.interleave.split(",")) if prologue == "swiglu" else [0]
        for interleave, m in itertools.product(layouts, map(int, args.rows.split(","))):
            rows.append((sweep if args.sweep else measure)(name, n, k, prologue, m, w, eps, interleave))
            print(json.dumps(rows[-1]), flush=True)
        del w
    configs = gemv.tuned_configs()
    result = {"copy_bandwidth_tbs": bandwidth / 1e12, "gpu": torch.cuda.get_device_name(), "rows": rows,
              "tuned_configs": configs}
    print(json.dumps(configs, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


def _calls(n: int, k: int, prologue: str, m: int, w: torch.Tensor, eps: float, interleave: int = 0):
    """(fused(pdl, w, config=None), unfused(w)) for m tokens, as the model calls them: the norm's input is
    already the residual sum, o and down add the residual; gate/up's rows interleaved in blocks of
    `interleave` (0: none)."""
    dtype, device = w.dtype, w.device
    x = torch.randn(m, k, device=device, dtype=dtype)
    res, g = torch.randn(m, k, device=device, dtype=dtype), torch.ones(k, device=device, dtype=dtype)
    addend = torch.randn(m, n, device=device, dtype=dtype)
    if prologue == "norm":
        fused = lambda pdl, w, config=None: gemv.add_rms_norm_gemv(  # noqa: E731
            x, None, g, eps, w, pdl=pdl, config=config)
        unfused = lambda w: torch.nn.functional.linear(rms_norm.fused_add_rms_norm(x, res, g, eps)[0], w)  # noqa: E731
    elif prologue == "swiglu":
        fused = lambda pdl, w, config=None: gemv.add_rms_norm_gemv(  # noqa: E731
            x, None, g, eps, w, swiglu=True, pdl=pdl, config=config, interleave=interleave)
        unfused = lambda w: activation.silu_and_mul(  # noqa: E731
            torch.nn.functional.linear(rms_norm.fused_add_rms_norm(x, res, g, eps)[0], w), interleave=interleave)
    else:
        fused = lambda pdl, w, config=None: gemv.gemv(x, w, addend, pdl=pdl, config=config)  # noqa: E731
        unfused = lambda w: torch.nn.functional.linear(x, w)  # noqa: E731
    return fused, unfused, x


def _weight_copies(w: torch.Tensor) -> list[torch.Tensor]:
    """W and enough copies of it to make 256 MB or more (see the module's docstring)."""
    return [w] + [w.clone() for _ in range(-(-(256 << 20) // (w.numel() * w.element_size())) - 1)]


def _timed_us(fn, copies: list[torch.Tensor]) -> float:
    return triton.testing.do_bench_cudagraph(lambda: [fn(c) for c in copies], rep=50) * 1e3 / len(copies)


def sweep_configs(k: int, m: int, swiglu: bool = False) -> list[dict]:
    """m > 1, the tensor-core tile: 16 to 64 W rows by 128 to 512 columns (up to K), 3 to 6 pipeline stages,
    2 or 4 warps, whose stages (W's tile, twice with `swiglu`: gate and up, and the input's) fit in 200 KB
    of shared memory. m = 1, the CUDA-core kernel: 1 to 32 W rows by 256 to 4,096 columns, 1 to 8 warps,
    holding 8 to 64 products a thread (the configurations the autotuner tries hold 16 or 32)."""
    width = max(128, 1 << (k - 1).bit_length())
    configs = []
    if m == 1:
        for block_n, block_k, warps in itertools.product((1, 2, 4, 8, 16, 32), (256, 512, 1024, 2048, 4096),
                                                         (1, 2, 4, 8)):
            if block_k <= width and 8 <= block_n * block_k // (32 * warps) <= 64:
                configs.append({"BLOCK_N": block_n, "BLOCK_K": block_k, "num_warps": warps})
    else:
        for block_n, block_k, stages, warps in itertools.product((16, 32, 64), (128, 256, 512), (3, 4, 6), (2, 4)):
            w_rows = 2 * block_n if swiglu else block_n
            if block_k <= width and stages * (w_rows + gemv.row_tile(m)) * block_k * 2 <= 200 << 10:
                configs.append({"BLOCK_N": block_n, "BLOCK_K": block_k, "num_stages": stages, "num_warps": warps})
    # NOTE: and every configuration the autotuner may pick (kept by its pruning), so that its choice of each
    # process can be looked up in the sweep's in-graph timings
    tuned = [{**c.kwargs, "num_warps": c.num_warps, **({"num_stages": c.num_stages} if m > 1 else {})}
             for c in (gemv._row_configs() if m == 1 else gemv._tile_configs()) if c.kwargs["BLOCK_K"] <= width]
    return configs + [c for c in tuned if c not in configs]


def sweep(name: str, n: int, k: int, prologue: str, m: int, w: torch.Tensor, eps: float,
          interleave: int = 0) -> dict:
    """The kernel for m rows in every configuration of `sweep_configs`, with dependent launch where the GPU
    has it, against the autotuner's choice; the configurations compile first, in threads."""
    assert m <= gemv.MAX_ROWS, "the sweep times the Triton kernels"
    fused, _, _ = _calls(n, k, prologue, m, w, eps, interleave)
    pdl = supports_dependent_launch(w.device)
    configs = sweep_configs(k, m, swiglu=prologue == "swiglu")
    fused(pdl, w, configs[0])  # NOTE: the first compile alone sets up the device's cache the threads share

    def compiles(config: dict) -> bool:
        try:
            fused(pdl, w, config)
            return True
        except triton.runtime.errors.OutOfResources:  # NOTE: as the autotuner skips it
            return False

    with ThreadPoolExecutor(max_workers=gemv.COMPILE_THREADS) as pool:
        configs = configs[:1] + [c for c, ok in zip(configs[1:], pool.map(compiles, configs[1:])) if ok]
    torch.cuda.synchronize()
    copies = _weight_copies(w)
    fused(pdl, w)  # the autotuner's choice, tuned outside the graph
    weight_bytes = n * k * w.element_size()
    row = {"name": name, "n": n, "k": k, "rows": m, "prologue": prologue, "interleave": interleave,
           "weight_mb": weight_bytes / 1e6, "autotuned_us": _timed_us(functools.partial(fused, pdl), copies),
           "configs": []}
    for config in configs:
        us = _timed_us(lambda c: fused(pdl, c, config), copies)
        row["configs"].append({**config, "us": us, "tbs": weight_bytes / us / 1e6})
    row["configs"].sort(key=lambda c: c["us"])
    row["autotuned_tbs"] = weight_bytes / row["autotuned_us"] / 1e6
    return row


def measure(name: str, n: int, k: int, prologue: str, m: int, w: torch.Tensor, eps: float,
            interleave: int = 0) -> dict:
    """Time one projection of m tokens: fused (as the model calls it; with dependent launch where the GPU
    has it), cuBLAS with the separate kernels, cuBLAS alone."""
    fused, unfused, x = _calls(n, k, prologue, m, w, eps, interleave)
    weight_bytes = n * k * w.element_size()
    copies = _weight_copies(w)
    row = {"name": name, "n": n, "k": k, "rows": m, "prologue": prologue, "interleave": interleave,
           "weight_mb": weight_bytes / 1e6, "weight_copies": len(copies)}
    timed = [("cublas_unfused", unfused), ("cublas_matmul_only", lambda w: torch.nn.functional.linear(x, w))]
    if m <= gemv.MAX_ROWS:
        variants = [False, True] if supports_dependent_launch(w.device) else [False]
        for pdl in reversed(variants):
            fused(pdl, w)  # autotune outside the graph
            timed.insert(0, ("triton_fused" + ("_pdl" if pdl else ""), functools.partial(fused, pdl)))
    for label, fn in timed:
        us = _timed_us(fn, copies)
        row[f"{label}_us"] = us
        row[f"{label}_tbs"] = weight_bytes / us / 1e6
    return row


if __name__ == "__main__":
    main()
