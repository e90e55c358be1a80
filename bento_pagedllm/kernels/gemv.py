"""One-token projections (GEMV) with the operator before them folded in: y = W @ prologue(x).

Why: a single-stream decode step reads every weight once, so its time is the weights' bytes over the
read bandwidth. cuBLAS's GEMVs read at 0.88 of the copy bandwidth on the H200 and add split-K reduction
kernels; and each layer also launches two RMSNorms and a SiLU-and-multiply, 1 to 2 us each, whose only
job is to produce the GEMV's input vector. Here each program streams `BLOCK_N` rows of W in `BLOCK_K`
column tiles (wide, coalesced loads; the products accumulate in float32 and are summed once at the end)
and computes the input tile itself:

- `gemv`:                y = W x
- `add_rms_norm_gemv`:   y = W rms_norm(x + residual); also returns x + residual (the next residual)
- `silu_mul_gemv`:       y = W (silu(gate) * up), with gate and up the two halves of x
- `gemv` and `silu_mul_gemv` may also add a vector to y (the residual stream: `addend`), so the next
  norm reads one vector, not two, and nothing stores the sum separately

The input vector is tiny next to W (K values against N x K), so every program computes its input tiles
itself from L2: no second kernel. RMSNorm needs the whole row's mean of squares, which the program
gathers in the same pass and applies to its dot products at the end: rms_norm(x) . w = (g * x) . w / rms.
Program 0 alone stores x + residual.

Numerics: x + residual and silu(gate) * up are rounded to the input dtype like the unfused kernels
(rms_norm.py, activation.py); the dot products accumulate in float32, in another order than cuBLAS.
The norm is NOT rounded element by element as the unfused path rounds the normalised row (twice, to the
16-bit dtype): the scale comes after the sum. The two differ within that rounding (a relative 2^-8 per
term in bfloat16), which the tests bound; float32 models never take this path.

NOTE: for one row only (`x`: [1, K]); batches use cuBLAS, whose tensor-core GEMMs are better there. On
CUDA the tile sizes are autotuned per (N, K, prologue) on the first call (the model's warm-up, before any
graph capture); under Triton's interpreter a fixed configuration runs.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .activation import silu_and_mul_tile


@triton.jit
def _gemv_kernel(
    x_ptr, residual_ptr, norm_weight_ptr, w_ptr, addend_ptr, out_ptr, total_ptr,
    N, K, stride_w, eps,
    ADD_RESIDUAL: tl.constexpr, RMS_NORM: tl.constexpr, SILU_MUL: tl.constexpr, ADD_TO_OUTPUT: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    row_mask = rows < N
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * stride_w  # [BLOCK_N, 1]
    dtype = x_ptr.dtype.element_ty

    total_limit = tl.where(pid == 0, K, 0)  # NOTE: program 0 alone stores x + residual
    squares = tl.zeros([BLOCK_K], dtype=tl.float32)
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)  # [BLOCK_K]
        col_mask = cols < K
        if SILU_MUL:
            gate = tl.load(x_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
            up = tl.load(x_ptr + K + cols, mask=col_mask, other=0.0).to(tl.float32)
            x32 = silu_and_mul_tile(gate, up, dtype).to(tl.float32)
        else:
            x = tl.load(x_ptr + cols, mask=col_mask, other=0.0)
            if ADD_RESIDUAL:
                x = (x.to(tl.float32) + tl.load(residual_ptr + cols, mask=col_mask, other=0.0).to(tl.float32))
                x = x.to(dtype)  # NOTE: rounded, like torch's add
                tl.store(total_ptr + cols, x, mask=cols < total_limit)
            x32 = x.to(tl.float32)
            if RMS_NORM:  # the row's 1/rms scales the dot products at the end (one pass over x)
                squares += x32 * x32
                x32 = x32 * tl.load(norm_weight_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
        w = tl.load(w_rows + cols[None, :], mask=row_mask[:, None] & col_mask[None, :], other=0.0)
        acc += w.to(tl.float32) * x32[None, :]  # [BLOCK_N, BLOCK_K]
    out = tl.sum(acc, axis=1)  # [BLOCK_N]
    if RMS_NORM:
        out = out * tl.rsqrt(tl.sum(squares, axis=0) / K + eps)
    if ADD_TO_OUTPUT:  # the residual add after the projection, rounded as torch rounds both steps
        out = out.to(dtype).to(tl.float32) + tl.load(addend_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + rows, out.to(out_ptr.dtype.element_ty), mask=row_mask)


def _configs() -> list[triton.Config]:
    """Tiles of 1 to 32 rows by 128 to 2,048 columns: few rows give enough programs for small N, long rows
    make each load wide; more rows share the input tile's work (the SiLU's exp) among more weights."""
    shapes = [(1, 2048, 4), (2, 1024, 4), (2, 2048, 4), (2, 2048, 8), (4, 1024, 4), (4, 2048, 8), (8, 512, 4),
              (8, 1024, 8), (16, 256, 4), (16, 512, 8), (32, 128, 4), (32, 256, 8)]
    return [triton.Config({"BLOCK_N": n, "BLOCK_K": k}, num_warps=w) for n, k, w in shapes]


def _prune(configs, named_args, **kwargs):
    """Column tiles wider than the row waste their masked lanes: keep those up to the row's width."""
    width = max(128, triton.next_power_of_2(named_args["K"]))
    return [c for c in configs if c.kwargs["BLOCK_K"] <= width]


def _quick_bench(kernel_call, quantiles):
    """Autotuning runs at start-up: a short measurement per configuration is enough to rank them."""
    return triton.testing.do_bench(kernel_call, warmup=5, rep=20, quantiles=quantiles)


_tuned_kernel = triton.autotune(
    configs=_configs(), key=["N", "K", "ADD_RESIDUAL", "RMS_NORM", "SILU_MUL", "ADD_TO_OUTPUT"], do_bench=_quick_bench,
    prune_configs_by={"early_config_prune": _prune},
)(_gemv_kernel)

# NOTE: the interpreter (no CUDA) cannot time configurations; it runs this one. Triton reads the switch
# when kernels are decorated, at import: so does this module.
INTERPRETER_CONFIG = {"BLOCK_N": 4, "BLOCK_K": 64} if os.environ.get("TRITON_INTERPRET") == "1" else None


def _launch(x, weight, residual=None, norm_weight=None, eps=0.0, silu_mul=False, addend=None, config=None):
    """x: [1, K] ([1, 2K] with silu_mul), weight: [N, K] -> ([1, N], x + residual or None)."""
    n, k = weight.shape
    assert x.shape[0] == 1 and x.is_contiguous() and weight.stride(1) == 1
    assert x.shape[1] == (2 * k if silu_mul else k), (x.shape, weight.shape)
    out = torch.empty(1, n, dtype=x.dtype, device=x.device)
    total = torch.empty_like(x) if residual is not None else out  # NOTE: `out` is a placeholder, never written
    assert addend is None or (addend.shape == (1, n) and addend.is_contiguous() and addend.dtype == x.dtype)
    args = (x, residual if residual is not None else x, norm_weight if norm_weight is not None else x,
            weight, addend if addend is not None else x, out, total, n, k, weight.stride(0), eps)
    flags = dict(ADD_RESIDUAL=residual is not None, RMS_NORM=norm_weight is not None, SILU_MUL=silu_mul,
                 ADD_TO_OUTPUT=addend is not None)
    config = config or INTERPRETER_CONFIG
    if config is None:
        _tuned_kernel[lambda meta: (triton.cdiv(n, meta["BLOCK_N"]),)](*args, **flags, enable_fp_fusion=False)
    else:
        _gemv_kernel[(triton.cdiv(n, config["BLOCK_N"]),)](
            *args, **flags, **config, enable_fp_fusion=False  # NOTE: keep each rounding torch does
        )
    return out, (total if residual is not None else None)


def gemv(x: torch.Tensor, weight: torch.Tensor, addend: torch.Tensor | None = None,
         config: dict | None = None) -> torch.Tensor:
    """x: [1, K], weight: [N, K] -> x @ weight.T (+ addend), [1, N]. `config` fixes the tiles (tests)."""
    return _launch(x, weight, addend=addend, config=config)[0]


def add_rms_norm_gemv(
    x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
    config: dict | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual) @ weight.T, x + residual); with no residual, (rms_norm(x) @ weight.T, x)."""
    assert norm_weight.dtype == x.dtype, "the fused norm keeps the input dtype"
    out, total = _launch(x, weight, residual, norm_weight, eps, config=config)
    return out, (x if residual is None else total)


def silu_mul_gemv(x: torch.Tensor, weight: torch.Tensor, addend: torch.Tensor | None = None,
                  config: dict | None = None) -> torch.Tensor:
    """x: [1, 2K] (gate then up) -> (silu(gate) * up) @ weight.T (+ addend), [1, N]."""
    return _launch(x, weight, silu_mul=True, addend=addend, config=config)[0]


# ---- references: the unfused operators the model runs otherwise ----------------------------------
def gemv_ref(x: torch.Tensor, weight: torch.Tensor, addend: torch.Tensor | None = None) -> torch.Tensor:
    out = torch.nn.functional.linear(x, weight)
    return out if addend is None else out + addend


def add_rms_norm_gemv_ref(x, residual, norm_weight, eps, weight):
    from .rms_norm import fused_add_rms_norm_ref, rms_norm_ref

    if residual is None:
        return gemv_ref(rms_norm_ref(x, norm_weight, eps), weight), x
    normed, total = fused_add_rms_norm_ref(x, residual, norm_weight, eps)
    return gemv_ref(normed, weight), total


def silu_mul_gemv_ref(x: torch.Tensor, weight: torch.Tensor, addend: torch.Tensor | None = None) -> torch.Tensor:
    from .activation import silu_and_mul_ref

    return gemv_ref(silu_and_mul_ref(x), weight, addend)
