"""The MLP's gate/up product and its SwiGLU in one GEMM, for prefill-sized steps:
y = silu(x W_gate^T) * (x W_up^T), with W's rows interleaved in blocks of `block` (`interleave_gate_up`).

Why: cuBLAS writes the [tokens, 2 x intermediate] product and a second kernel reads it back to write
silu(gate) * up: in a 16,384-token Llama-3-8B prefill step, 0.35-0.55 ms a layer on top of the GEMM's
5.65 ms (bench/gemm.py --swiglu and bench/elementwise.py, H200, 2026-12-01). Holding the gate and up
accumulators of the same columns in one program lets it store the activation alone. Two accumulators
with two W loads a step ran 14-16% below cuBLAS (the tokens' tile read twice from shared memory for the
tensor cores); with the rows interleaved, a tile of 2 x `block` W rows is one plain product, a block of
gate rows then the same block of up rows, split in the epilogue.

The program walks output tiles NUM_SMS apart (persistent; the loop flattened, so the next tile's loads
start while this one's last products run), GROUP_M row blocks at a time for L2; x and W arrive through
the tensor-memory accelerator (compute capability 9+).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .activation import silu_and_mul_ref, silu_and_mul_tile

# the gate/up rows interleave in blocks of this many: a tile of 2 x INTERLEAVE W rows holds the same gate and
# up rows (bench/gemm.py --swiglu, H200, 16384 tokens: blocks of 128 (tiles of 256 W rows) ran at 677-688
# TFLOP/s, blocks of 64 at 621-656, cuBLAS then the SiLU kernel at 623-668)
INTERLEAVE = 128
# (BLOCK_M, BLOCK_K, stages, warps) for a tile of 2 x block W rows (bench/gemm.py's best plain tile: 128 x
# 256 x 64, 3 stages, 8 warps)
CONFIG = (128, 64, 3, 8)


def interleave_gate_up(weight: torch.Tensor, block: int) -> torch.Tensor:
    """[W_gate; W_up] ([2N, K]) -> blocks of `block` gate rows, each followed by the same up rows."""
    rows, k = weight.shape
    assert rows % (2 * block) == 0, (rows, block)
    return weight.view(2, rows // 2 // block, block, k).transpose(0, 1).reshape(rows, k)


def deinterleave_gate_up(weight: torch.Tensor, block: int) -> torch.Tensor:
    """The inverse of `interleave_gate_up`."""
    rows, k = weight.shape
    return weight.view(rows // 2 // block, 2, block, k).transpose(0, 1).reshape(rows, k)


@triton.jit
def _tile_position(tile, num_m, num_n, GROUP_M: tl.constexpr):
    """The (row block, column block) of output tile `tile`: GROUP_M row blocks at a time, for L2."""
    group = tile // (GROUP_M * num_n)
    first_m = group * GROUP_M
    group_rows = tl.minimum(num_m - first_m, GROUP_M)
    return first_m + (tile % group_rows), (tile % (GROUP_M * num_n)) // group_rows


# NOTE: M (the step's tokens) not specialised: a step of a token count divisible by 16 and one of another count
# would each compile the kernel (Triton specialises integers on divisibility by 16), the second inside a
# served step: a cold H200 spent ~0.4 s of an 8B offline run's first prefill step on it (2026-12-02)
@triton.jit(do_not_specialize=["M"])
def _swiglu_gemm_kernel(x_desc, w_desc, y_desc, M, N, K, NUM_SMS: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    """N: y's columns (the intermediate size); W: [2N, K], interleaved in blocks of BLOCK rows."""
    num_m, num_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK)
    k_tiles = tl.cdiv(K, BLOCK_K)
    for tile in tl.range(tl.program_id(0), num_m * num_n, NUM_SMS, flatten=True):
        pid_m, pid_n = _tile_position(tile, num_m, num_n, GROUP_M)
        acc = tl.zeros((BLOCK_M, 2 * BLOCK), dtype=tl.float32)
        for kk in range(k_tiles):
            x = x_desc.load([pid_m * BLOCK_M, kk * BLOCK_K])  # [BLOCK_M, BLOCK_K]
            w = w_desc.load([pid_n * 2 * BLOCK, kk * BLOCK_K])  # [2 x BLOCK, BLOCK_K]: gate rows, then up rows
            acc = tl.dot(x, w.T, acc)
        gate, up = tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK)), (0, 2, 1)))  # [BLOCK_M, BLOCK] each
        dtype = y_desc.dtype  # NOTE: the products rounded to the model's dtype first, as cuBLAS's output is
        y_desc.store([pid_m * BLOCK_M, pid_n * BLOCK],
                     silu_and_mul_tile(gate.to(dtype).to(tl.float32), up.to(dtype).to(tl.float32), dtype))


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def swiglu_gemm(x: torch.Tensor, weight: torch.Tensor, block: int, config: tuple = CONFIG) -> torch.Tensor:
    """x: [M, K], weight: `interleave_gate_up([W_gate; W_up], block)`, [2N, K] -> silu(gate) * up, [M, N]."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    block_m, block_k, stages, warps = config
    (m, k), n = x.shape, weight.shape[0] // 2
    assert weight.shape[1] == k and n % block == 0 and x.is_contiguous() and weight.is_contiguous()
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    sms = _sm_count(x.device.index if x.device.index is not None else torch.cuda.current_device()) \
        if x.is_cuda else 4
    tiles = triton.cdiv(m, block_m) * (n // block)
    _swiglu_gemm_kernel[(min(sms, tiles),)](
        TensorDescriptor.from_tensor(x, [block_m, block_k]), TensorDescriptor.from_tensor(weight, [2 * block, block_k]),
        TensorDescriptor.from_tensor(out, [block_m, block]), m, n, k, NUM_SMS=sms, BLOCK_M=block_m, BLOCK=block,
        BLOCK_K=block_k, GROUP_M=8, num_stages=stages, num_warps=warps,
        enable_fp_fusion=False)  # NOTE: keep each rounding torch does (activation.py)
    return out


def swiglu_gemm_ref(x: torch.Tensor, weight: torch.Tensor, block: int) -> torch.Tensor:
    """The model's unfused path on the de-interleaved weight: the product rounded, then the activation."""
    return silu_and_mul_ref(torch.nn.functional.linear(x, deinterleave_gate_up(weight, block)))
