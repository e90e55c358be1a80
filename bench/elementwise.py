"""The element-wise kernels of prefill steps on the GPU: SiLU-and-multiply and the RMSNorm with the
residual add (kernels/activation.py, kernels/rms_norm.py) at prefill-sized steps, each in the launch
shape the model uses and in others, as bytes moved over time against the copy bandwidth.

Why: in a Llama-3-8B prefill step of 16,384 tokens, cuBLAS's gate/up product followed by the
SiLU-and-multiply took 6.20 ms against 5.65 for the product alone (bench/gemm.py --swiglu, 2026-12-01):
the activation seemed to move its 1.41 GB at ~2.6 TB/s against a copy's 4.28. This measures the kernels
alone, in the model's launch shape and others. Measured (2026-12-01, 8,192 rows): SiLU-and-multiply
already at 4.08-4.13 TB/s in the model's shape, 4.14-4.21 in the best other: nothing to gain there.

    python bench/elementwise.py --rows 8192,16384 --out bench/results/elementwise.json
"""

from __future__ import annotations

import argparse
import json

import torch
import triton
import triton.testing

from bento_pagedllm.kernels import activation, rms_norm
from single_stream import copy_bandwidth, device_facts, save

# (name, width): the intermediate size of the SiLU-and-multiply, the hidden size of the norm
ACTIVATIONS = [("llama2-7b silu_and_mul", 11008), ("llama3-8b silu_and_mul", 14336)]
NORMS = [("llama 7b/8b add_rms_norm", 4096)]
SILU_SHAPES = [(1024, 4), (1024, 8), (2048, 4), (2048, 8), (4096, 8), (4096, 16)]  # (BLOCK, warps)
NORM_WARPS = [4, 8, 16, 32]


def timed_us(fn) -> float:
    return triton.testing.do_bench_cudagraph(fn, rep=50) * 1e3


def measure_silu(name: str, inter: int, m: int) -> dict:
    x = torch.randn(m, 2 * inter, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(m, inter, device="cuda", dtype=x.dtype)
    moved = x.numel() * 2 + out.numel() * 2
    ref = activation.silu_and_mul(x)  # NOTE: the same arithmetic in every launch shape: equal bits
    row = {"name": name, "width": inter, "rows": m, "bytes": moved}
    us = timed_us(lambda: activation.silu_and_mul(x))
    row["model_us"], row["model_tbs"] = us, moved / us / 1e6
    for block, warps in SILU_SHAPES:
        def launch():
            activation._silu_and_mul_kernel[(m, triton.cdiv(inter, block))](
                x, out, x.stride(0), out.stride(0), inter, BLOCK=block, num_warps=warps, enable_fp_fusion=False)
        launch()
        assert torch.equal(out, ref), (name, block, warps)
        us = timed_us(launch)
        row[f"block{block}_warps{warps}_us"], row[f"block{block}_warps{warps}_tbs"] = us, moved / us / 1e6
    return row


def measure_norm(name: str, hidden: int, m: int) -> dict:
    x, residual = (torch.randn(m, hidden, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    weight = torch.randn(hidden, device="cuda", dtype=torch.bfloat16)
    out, total = torch.empty_like(x), torch.empty_like(x)
    moved = 4 * x.numel() * 2
    ref_out, ref_total = rms_norm.fused_add_rms_norm(x, residual, weight, 1e-5)
    row = {"name": name, "width": hidden, "rows": m, "bytes": moved}
    us = timed_us(lambda: rms_norm.fused_add_rms_norm(x, residual, weight, 1e-5))
    row["model_us"], row["model_tbs"] = us, moved / us / 1e6
    for warps in NORM_WARPS:
        def launch():
            rms_norm._rms_norm_kernel[(m,)](
                x, residual, weight, out, total, hidden, hidden, hidden, hidden, hidden, 1e-5,
                BLOCK=triton.next_power_of_2(hidden), ADD_RESIDUAL=True, num_warps=warps, enable_fp_fusion=False)
        launch()
        # NOTE: the warps change the order of the row's sum of squares: equal within its rounding
        assert torch.equal(total, ref_total), (name, warps)
        torch.testing.assert_close(out, ref_out, rtol=1e-2, atol=1e-2)
        us = timed_us(launch)
        row[f"warps{warps}_us"], row[f"warps{warps}_tbs"] = us, moved / us / 1e6
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", default="8192,16384", help="tokens per step, comma-separated")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    bandwidth = copy_bandwidth()
    rows = []
    for m in map(int, args.rows.split(",")):
        for name, inter in ACTIVATIONS:
            rows.append(measure_silu(name, inter, m))
            print(json.dumps(rows[-1]), flush=True)
        for name, hidden in NORMS:
            rows.append(measure_norm(name, hidden, m))
            print(json.dumps(rows[-1]), flush=True)
    save({**device_facts(bandwidth), "rows": rows}, args.out)


if __name__ == "__main__":
    main()
