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
"""

from __future__ import annotations

import argparse
import functools
import json

import torch
import triton.testing

from bento_pagedllm.kernels import activation, gemv, rms_norm
from bento_pagedllm.models.ops import supports_dependent_launch
from single_stream import copy_bandwidth

# (name, N, K, prologue): the projections of Llama-2-7B, Llama-3-8B and SmolLM2-135M
SHAPES = [  # NOTE: the LM head's norm has no residual to add either
    ("llama2-7b qkv", 12288, 4096, "norm"), ("llama2-7b o", 4096, 4096, "none"),
    ("llama2-7b gate_up", 22016, 4096, "swiglu"), ("llama2-7b down", 4096, 11008, "none"),
    ("llama2-7b lm_head", 32000, 4096, "norm"),
    ("llama3-8b qkv", 6144, 4096, "norm"), ("llama3-8b gate_up", 28672, 4096, "swiglu"),
    ("llama3-8b down", 4096, 14336, "none"), ("llama3-8b lm_head", 128256, 4096, "norm"),
    ("smollm2 qkv", 960, 576, "norm"), ("smollm2 o", 576, 576, "none"), ("smollm2 gate_up", 3072, 576, "swiglu"),
    ("smollm2 down", 576, 1536, "none"), ("smollm2 lm_head", 49152, 576, "norm"),
]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", default="1", help="tokens per step, comma-separated")
    parser.add_argument("--shapes", default="", help="only the shapes whose name starts with one of these")
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
        for m in map(int, args.rows.split(",")):
            rows.append(measure(name, n, k, prologue, m, w, eps))
            print(json.dumps(rows[-1]), flush=True)
        del w
    configs = {str(key): str(cfg) for tuner in (gemv._tuned_one_row, gemv._tuned_rows)
               for key, cfg in tuner.cache.items()}
    result = {"copy_bandwidth_tbs": bandwidth / 1e12, "gpu": torch.cuda.get_device_name(), "rows": rows,
              "tuned_configs": configs}
    print(json.dumps(configs, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


def measure(name: str, n: int, k: int, prologue: str, m: int, w: torch.Tensor, eps: float) -> dict:
    """Time one projection of m tokens: fused (as the model calls it; with dependent launch where the GPU
    has it), cuBLAS with the separate kernels, cuBLAS alone."""
    dtype = w.dtype
    x = torch.randn(m, k, device="cuda", dtype=dtype)
    # as the model calls them: the norm's input is already the residual sum, o and down add the residual
    res, g = torch.randn(m, k, device="cuda", dtype=dtype), torch.ones(k, device="cuda", dtype=dtype)
    addend = torch.randn(m, n, device="cuda", dtype=dtype)
    if prologue == "norm":
        fused = lambda pdl, w: gemv.add_rms_norm_gemv(x, None, g, eps, w, pdl=pdl)  # noqa: E731
        unfused = lambda w: torch.nn.functional.linear(rms_norm.fused_add_rms_norm(x, res, g, eps)[0], w)  # noqa: E731
    elif prologue == "swiglu":
        fused = lambda pdl, w: gemv.add_rms_norm_gemv(x, None, g, eps, w, swiglu=True, pdl=pdl)  # noqa: E731
        unfused = lambda w: activation.silu_and_mul(  # noqa: E731
            torch.nn.functional.linear(rms_norm.fused_add_rms_norm(x, res, g, eps)[0], w))
    else:
        fused = lambda pdl, w: gemv.gemv(x, w, addend, pdl=pdl)  # noqa: E731
        unfused = lambda w: torch.nn.functional.linear(x, w)  # noqa: E731
    weight_bytes = n * k * w.element_size()
    copies = [w] + [w.clone() for _ in range(-(-(256 << 20) // weight_bytes) - 1)]
    row = {"name": name, "n": n, "k": k, "rows": m, "prologue": prologue, "weight_mb": weight_bytes / 1e6,
           "weight_copies": len(copies)}
    timed = [("cublas_unfused", unfused), ("cublas_matmul_only", lambda w: torch.nn.functional.linear(x, w))]
    if m <= gemv.MAX_ROWS:
        variants = [False, True] if supports_dependent_launch(w.device) else [False]
        for pdl in reversed(variants):
            fused(pdl, w)  # autotune outside the graph
            timed.insert(0, ("triton_fused" + ("_pdl" if pdl else ""), functools.partial(fused, pdl)))
    for label, fn in timed:
        us = triton.testing.do_bench_cudagraph(lambda: [fn(c) for c in copies], rep=50) * 1e3 / len(copies)
        row[f"{label}_us"] = us
        row[f"{label}_tbs"] = weight_bytes / us / 1e6
    return row


if __name__ == "__main__":
    main()
