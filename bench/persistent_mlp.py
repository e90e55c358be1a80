"""Would a persistent decode-layer kernel beat the chain of dependent launches? A measurement, not engine code.

A single-sequence decode step is a chain of ~5 kernels a layer (kernels/gemv.py: q/k/v, attention, o,
gate/up, down), each launched as a programmatic dependent of the one before. What a layer takes above its
weights' bytes (~14 us for Llama-2-7B on an H200) is each kernel's ramp and tail and the attention's
latency. The structural alternative: programs resident for the whole step, phases separated by grid-wide
barriers (an atomic counter) instead of kernel boundaries, so that no launch, no grid teardown and no wave
quantisation separates two projections.

This times the part of a layer after the attention, one token, Llama-2-7B shapes, over LAYERS layers (own
weights each, so nothing is read from L2):

    h = attn @ Wo^T + x;  a = silu(g) * u, [g; u] = rms_norm(h) @ Wgu^T;  x' = a @ Wd^T + h

- `chain`: the engine's kernels (gemv, add_rms_norm_gemv with the SwiGLU epilogue, gemv), dependent launch,
  autotuned, three launches a layer, in a CUDA graph;
- `persistent`: one launch for all layers, `programs` programs (a few per multiprocessor, all resident),
  each phase's row blocks dealt round-robin, a grid barrier between phases;
- `persistent_nosync`: the same without the barriers (wrong results): the persistent loops' own read rate,
  the floor of what barriers could give;
- `persistent_grids_pdl` (`--variants grids`): each projection its own kernel with a resident-sized grid
  looping over row blocks, dependent launch;
- `dataflow`: the persistent kernel with a counter per tile of each vector instead of barriers: a program
  waits only for the input tile it reads next.

Each prints us a layer (the layers' bytes at the copy bandwidth beside it) and the largest difference of
the output against the chain's (bf16; the sums may run in another order). Measured on an H200
(BENCHMARKS.md, twenty-eighth session): every persistent form slower than the chain.

    python bench/persistent_mlp.py --layers 8 --variants dataflow,barriers,grids --out persistent_mlp.json

NOTE: CUDA only: the barrier spins, and Triton's interpreter runs programs one after another. The grid must
fit on the GPU at once or the barrier never opens: the programs a multiprocessor holds are computed from
the compiled kernel's registers and warps, and larger grids are skipped.
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
import triton
import triton.language as tl
import triton.testing
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from bento_pagedllm.kernels import gemv
from bento_pagedllm.kernels.activation import silu_and_mul_tile
from bento_pagedllm.kernels.prefetch import prefetch_to_l2
from single_stream import copy_bandwidth

HIDDEN, INTER = 4096, 11008  # Llama-2-7B
EPS = 1e-5


@triton.jit
def _wait_count(counter_ptr, expected):
    """Spin until the counter reaches `expected` (acquire: what its producers stored before counting is
    visible; read it with `.cg`)."""
    seen = tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu")
    while seen < expected:
        seen = tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu")


@triton.jit
def _grid_barrier(counter_ptr, target, SYNC: tl.constexpr):
    """Wait until `target` arrivals are counted (this program's included). NOTE: every thread's stores are
    ordered before the count by the CTA barrier and the release; readers load with `.cg` (L2), since an
    SM's L1 may hold stale lines of what other programs wrote."""
    if SYNC:
        tl.debug_barrier()
        tl.atomic_add(counter_ptr, 1, sem="release", scope="gpu")
        _wait_count(counter_ptr, target)
        tl.debug_barrier()


@triton.jit
def _store_rows(acc, acc_up, inv_rms, rows, row_mask, addend_ptr, out_ptr, SWIGLU: tl.constexpr, ADD: tl.constexpr):
    """A row block's epilogue: its sums ([BLOCK_N, BLOCK_K] products) scaled by the norm, SwiGLU or the
    residual added, stored."""
    dtype = out_ptr.dtype.element_ty
    out = tl.sum(acc, axis=1) * inv_rms  # [BLOCK_N]
    if SWIGLU:
        up_out = tl.sum(acc_up, axis=1) * inv_rms
        out = silu_and_mul_tile(out.to(dtype).to(tl.float32), up_out.to(dtype).to(tl.float32), dtype)
        out = out.to(tl.float32)
    if ADD:  # NOTE: rounded as torch rounds both steps
        out = out.to(dtype).to(tl.float32) + tl.load(addend_ptr + rows, mask=row_mask, other=0.0,
                                                     cache_modifier=".cg").to(tl.float32)
    tl.store(out_ptr + rows, out.to(dtype), mask=row_mask)


@triton.jit
def _projection_phase(x_ptr, w_ptr, out_ptr, addend_ptr, norm_ptr, inv_rms, N, K, pid, num_programs,
                      NORM: tl.constexpr, SWIGLU: tl.constexpr, ADD: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOUBLE: tl.constexpr):
    """out[rows] = epilogue(prologue(x) @ W[rows]^T) for this program's row blocks (pid, pid + P, ...).
    The one-row kernel's arithmetic (kernels/gemv.py): float32 products summed once a block."""
    for block in range(pid, tl.cdiv(N, BLOCK_N), num_programs):
        rows = block * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
        row_mask = rows < N
        acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
        acc_up = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
        w_rows = w_ptr + rows.to(tl.int64)[:, None] * K  # [BLOCK_N, 1]
        up_rows = w_ptr + (rows + N).to(tl.int64)[:, None] * K
        if DOUBLE:  # W's next tile asked for before this one is used (kernels/gemv.py's plain one-row GEMV)
            first = tl.arange(0, BLOCK_K)
            first_mask = row_mask[:, None] & (first < K)[None, :]
            w_next = tl.load(w_rows + first[None, :], mask=first_mask, other=0.0)
            if SWIGLU:
                up_next = tl.load(up_rows + first[None, :], mask=first_mask, other=0.0)
        for k0 in range(0, K, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)  # [BLOCK_K]
            col_mask = cols < K
            x = tl.load(x_ptr + cols, mask=col_mask, other=0.0, cache_modifier=".cg").to(tl.float32)
            if NORM:
                x = x * tl.load(norm_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
            mask = row_mask[:, None] & col_mask[None, :]
            if DOUBLE:
                next_mask = row_mask[:, None] & (cols + BLOCK_K < K)[None, :]
                w = w_next
                w_next = tl.load(w_rows + (cols + BLOCK_K)[None, :], mask=next_mask, other=0.0)
                if SWIGLU:
                    up = up_next
                    up_next = tl.load(up_rows + (cols + BLOCK_K)[None, :], mask=next_mask, other=0.0)
            else:
                w = tl.load(w_rows + cols[None, :], mask=mask, other=0.0)
                if SWIGLU:
                    up = tl.load(up_rows + cols[None, :], mask=mask, other=0.0)
            acc += w.to(tl.float32) * x[None, :]
            if SWIGLU:
                acc_up += up.to(tl.float32) * x[None, :]
        _store_rows(acc, acc_up, inv_rms, rows, row_mask, addend_ptr, out_ptr, SWIGLU, ADD)


@triton.jit
def _inv_rms(x_ptr, K, eps, BLOCK_K: tl.constexpr):
    squares = tl.zeros([BLOCK_K], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + cols, mask=cols < K, other=0.0, cache_modifier=".cg").to(tl.float32)
        squares += x * x
    return tl.rsqrt(tl.sum(squares) / K + eps)


@triton.jit
def _mlp_layers_kernel(attn_ptr, xs_ptr, hs_ptr, acts_ptr, wo_ptr, wgu_ptr, wd_ptr, norm_ptr, counter_ptr,
                       num_layers, num_programs, eps, HIDDEN: tl.constexpr, INTER: tl.constexpr,
                       SYNC: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOUBLE: tl.constexpr):
    """xs: [layers + 1, HIDDEN] (x of each layer, then the output), hs: [layers, HIDDEN], acts: [layers,
    INTER]; the weights stacked by layer."""
    pid = tl.program_id(0)
    arrivals = 0
    for layer in range(num_layers):
        x_ptr = xs_ptr + layer * HIDDEN
        h_ptr = hs_ptr + layer * HIDDEN
        act_ptr = acts_ptr + layer * INTER
        wo = wo_ptr + layer * HIDDEN * HIDDEN  # NOTE: int32 offsets: main() bounds the layers
        wgu = wgu_ptr + layer * 2 * INTER * HIDDEN
        wd = wd_ptr + layer * HIDDEN * INTER
        _projection_phase(attn_ptr, wo, h_ptr, x_ptr, norm_ptr, 1.0, HIDDEN, HIDDEN, pid, num_programs,
                          False, False, True, BLOCK_N, BLOCK_K, DOUBLE)
        arrivals += num_programs
        _grid_barrier(counter_ptr, arrivals, SYNC)
        inv_rms = _inv_rms(h_ptr, HIDDEN, eps, BLOCK_K)
        _projection_phase(h_ptr, wgu, act_ptr, x_ptr, norm_ptr, inv_rms, INTER, HIDDEN, pid, num_programs,
                          True, True, False, BLOCK_N, BLOCK_K, DOUBLE)
        arrivals += num_programs
        _grid_barrier(counter_ptr, arrivals, SYNC)
        _projection_phase(act_ptr, wd, xs_ptr + (layer + 1) * HIDDEN, h_ptr, norm_ptr, 1.0, HIDDEN, INTER, pid,
                          num_programs,
                          False, False, True, BLOCK_N, BLOCK_K, DOUBLE)
        arrivals += num_programs
        _grid_barrier(counter_ptr, arrivals, SYNC)


@triton.jit
def _tile_blocks(tile, N, TILE: tl.constexpr, BLOCK_N: tl.constexpr):
    """How many BLOCK_N-row blocks produce the TILE elements of `tile` (the last tile may be short)."""
    return tl.cdiv(tl.minimum(N - tile * TILE, TILE), BLOCK_N)


@triton.jit
def _dataflow_phase(x_ptr, x_counts, x_len, w_ptr, out_ptr, out_counts, addend_ptr, addend_counts, norm_ptr,
                    N, K, eps, pid, num_programs, NORM: tl.constexpr, SWIGLU: tl.constexpr, ADD: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, W_FIRST: tl.constexpr):
    """`_projection_phase` without a barrier before it: a program waits only for the input tiles it is
    about to read (x_counts[t]: the producer's blocks done in tile t of BLOCK_K elements; x_len: the
    input's length, = K) and, before adding, for the addend tile of its rows; after storing its rows it
    counts them in out_counts. A bitmask remembers the input tiles already seen complete, so a program
    polls each at most once a phase. NOTE: every vector here is tiled by BLOCK_K, which BLOCK_N divides."""
    ready = 0  # bit t: input tile t seen complete
    for block in range(pid, tl.cdiv(N, BLOCK_N), num_programs):
        rows = block * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
        row_mask = rows < N
        w_rows = w_ptr + rows.to(tl.int64)[:, None] * K
        up_rows = w_ptr + (rows + N).to(tl.int64)[:, None] * K
        acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
        acc_up = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
        squares = tl.zeros([BLOCK_K], tl.float32)
        for tile in range(0, tl.cdiv(K, BLOCK_K)):
            cols = tile * BLOCK_K + tl.arange(0, BLOCK_K)
            col_mask = cols < K
            mask = row_mask[:, None] & col_mask[None, :]
            if W_FIRST:  # W asked for before the wait (more registers live across it)
                w = tl.load(w_rows + cols[None, :], mask=mask, other=0.0)
                if SWIGLU:
                    up = tl.load(up_rows + cols[None, :], mask=mask, other=0.0)
            if ((ready >> tile) & 1) == 0:
                _wait_count(x_counts + tile, _tile_blocks(tile, x_len, BLOCK_K, BLOCK_N))
                ready = ready | (1 << tile)
            if not W_FIRST:
                w = tl.load(w_rows + cols[None, :], mask=mask, other=0.0)
                if SWIGLU:
                    up = tl.load(up_rows + cols[None, :], mask=mask, other=0.0)
            x = tl.load(x_ptr + cols, mask=col_mask, other=0.0, cache_modifier=".cg").to(tl.float32)
            if NORM:
                squares += x * x
                x = x * tl.load(norm_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
            acc += w.to(tl.float32) * x[None, :]
            if SWIGLU:
                acc_up += up.to(tl.float32) * x[None, :]
        inv_rms = 1.0
        if NORM:
            inv_rms = tl.rsqrt(tl.sum(squares) / K + eps)
        out_tile = block * BLOCK_N // BLOCK_K
        if ADD:  # NOTE: o and down add the residual stream: its tile of these rows must be complete
            _wait_count(addend_counts + out_tile, _tile_blocks(out_tile, N, BLOCK_K, BLOCK_N))
        _store_rows(acc, acc_up, inv_rms, rows, row_mask, addend_ptr, out_ptr, SWIGLU, ADD)
        tl.debug_barrier()  # NOTE: every thread's stores before the count
        tl.atomic_add(out_counts + out_tile, 1, sem="release", scope="gpu")


MAX_TILES = tl.constexpr(16)  # counters a vector: tiles of BLOCK_K elements (11,008 / 1,024 -> 11)


@triton.jit
def _dataflow_layers_kernel(attn_ptr, xs_ptr, hs_ptr, acts_ptr, wo_ptr, wgu_ptr, wd_ptr, norm_ptr, counts_ptr,
                            num_layers, num_programs, eps, HIDDEN: tl.constexpr, INTER: tl.constexpr,
                            BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, W_FIRST: tl.constexpr):
    """The layers of `_mlp_layers_kernel` with tile counters instead of grid barriers. counts: [layers + 1,
    3, MAX_TILES] int32: per layer, the tiles done of x (the layer's input: layer 0's set full by the host),
    h and act. attn is an input (complete): its waits use x's counters of layer 0, which are full."""
    pid = tl.program_id(0)
    for layer in range(num_layers):
        x_ptr = xs_ptr + layer * HIDDEN
        h_ptr = hs_ptr + layer * HIDDEN
        act_ptr = acts_ptr + layer * INTER
        x_counts = counts_ptr + layer * 3 * MAX_TILES
        h_counts = x_counts + MAX_TILES
        act_counts = x_counts + 2 * MAX_TILES
        next_x_counts = x_counts + 3 * MAX_TILES
        wo = wo_ptr + layer * HIDDEN * HIDDEN
        wgu = wgu_ptr + layer * 2 * INTER * HIDDEN
        wd = wd_ptr + layer * HIDDEN * INTER
        _dataflow_phase(attn_ptr, counts_ptr, HIDDEN, wo, h_ptr, h_counts, x_ptr, x_counts, norm_ptr,
                        HIDDEN, HIDDEN, eps, pid, num_programs, False, False, True, BLOCK_N, BLOCK_K, W_FIRST)
        _dataflow_phase(h_ptr, h_counts, HIDDEN, wgu, act_ptr, act_counts, x_ptr, x_counts, norm_ptr,
                        INTER, HIDDEN, eps, pid, num_programs, True, True, False, BLOCK_N, BLOCK_K, W_FIRST)
        _dataflow_phase(act_ptr, act_counts, INTER, wd, xs_ptr + (layer + 1) * HIDDEN, next_x_counts, h_ptr,
                        h_counts, norm_ptr, HIDDEN, INTER, eps, pid, num_programs, False, False, True, BLOCK_N, BLOCK_K,
                        W_FIRST)


@triton.jit
def _phase_kernel(x_ptr, w_ptr, out_ptr, addend_ptr, norm_ptr, N, K, eps, num_programs, NORM: tl.constexpr,
                  SWIGLU: tl.constexpr, ADD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  DOUBLE: tl.constexpr, USE_PDL: tl.constexpr):
    """One projection as a kernel of its own with a persistent grid (`num_programs` programs looping over
    the row blocks), launched as a dependent of the kernel before: the chain's boundaries, the persistent
    kernel's loops. Before the wait each program asks L2 for its first block's first W tile."""
    pid = tl.program_id(0)
    if USE_PDL:
        rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        lines = tl.arange(0, BLOCK_K // 64) * 64
        prefetch_to_l2(w_ptr + tl.minimum(rows, N - 1).to(tl.int64)[:, None] * K + lines[None, :])
        gdc_wait()
        gdc_launch_dependents()
    if NORM:
        inv_rms = _inv_rms(x_ptr, K, eps, BLOCK_K)
    else:
        inv_rms = 1.0
    _projection_phase(x_ptr, w_ptr, out_ptr, addend_ptr, norm_ptr, inv_rms, N, K, pid, num_programs,
                      NORM, SWIGLU, ADD, BLOCK_N, BLOCK_K, DOUBLE)


def resident_programs(kernel, num_warps: int) -> int:
    """Programs of `kernel` (compiled) one H100/H200 multiprocessor holds at once: 64 warps, 64K registers,
    228 KB of shared memory (1 KB of it reserved per program)."""
    by_warps = 64 // num_warps
    by_regs = 65536 // (max(kernel.n_regs, 1) * 32 * num_warps)
    by_smem = (228 << 10) // (kernel.metadata.shared + 1024)
    return max(0, min(by_warps, by_regs, by_smem))


def _compiled(kernel, args: tuple, meta: dict):
    """`kernel` compiled for `args` and `meta`, its binary loaded (for its register count)."""
    compiled = kernel.warmup(*args, grid=(1,), **meta)
    if hasattr(compiled, "_init_handles"):
        compiled._init_handles()
    return compiled


def _record(row: dict, launch, outs: list, ref: list, layers: int, rows: list, check: bool = True) -> None:
    """Run `launch` once (its outputs against the chain's when `check`), then time it in a CUDA graph."""
    launch()
    torch.cuda.synchronize()
    if check:
        row["max_diff"] = {name: (a.float() - b.float()).abs().max().item()
                           for name, a, b in zip(("x", "h", "act"), outs, ref)}
    row["us_per_layer"] = triton.testing.do_bench_cudagraph(launch, rep=100) * 1e3 / layers
    rows.append(row)
    print(json.dumps(row), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--configs", default="4x1024x4,8x512x4,2x1024x4,4x1024x8",
                        help="BLOCK_N x BLOCK_K x warps of the persistent kernel, comma-separated")
    parser.add_argument("--per-sm", default="2,3,4,5,6,8", help="programs a multiprocessor, comma-separated")
    parser.add_argument("--variants", default="dataflow,barriers",
                        help="besides the chain: dataflow, barriers (with and without), grids, comma-separated")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.manual_seed(0)
    device, dtype, layers = torch.device("cuda"), torch.bfloat16, args.layers
    assert layers * 2 * INTER * HIDDEN < 2**31, "the kernel's weight offsets are int32"
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    bandwidth = copy_bandwidth()
    wo = torch.randn(layers, HIDDEN, HIDDEN, device=device, dtype=dtype) * HIDDEN**-0.5
    wgu = torch.randn(layers, 2 * INTER, HIDDEN, device=device, dtype=dtype) * HIDDEN**-0.5
    wd = torch.randn(layers, HIDDEN, INTER, device=device, dtype=dtype) * INTER**-0.5
    norm = 1.0 + 0.1 * torch.randn(HIDDEN, device=device, dtype=dtype)
    attn = torch.randn(1, HIDDEN, device=device, dtype=dtype)
    layer_bytes = (wo[0].numel() + wgu[0].numel() + wd[0].numel()) * 2
    bytes_us = layer_bytes / bandwidth * 1e6

    def chain(x):
        """The engine's kernels, layer after layer: [(h, act, x')] a layer."""
        outs = []
        for layer in range(layers):
            h = gemv.gemv(attn, wo[layer], x, pdl=True)
            act = gemv.add_rms_norm_gemv(h, None, norm, EPS, wgu[layer], swiglu=True, pdl=True)[0]
            x = gemv.gemv(act, wd[layer], h, pdl=True)
            outs.append((h, act, x))
        return outs

    x0 = torch.randn(1, HIDDEN, device=device, dtype=dtype)
    chain(x0)  # autotune outside the graph
    outs = chain(x0)
    ref = [torch.cat([x0] + [o[2] for o in outs]), torch.cat([o[0] for o in outs]), torch.cat([o[1] for o in outs])]
    torch.cuda.synchronize()
    rows = [{"variant": "chain", "us_per_layer": triton.testing.do_bench_cudagraph(lambda: chain(x0), rep=100)
             * 1e3 / layers, "tuned_configs": gemv.tuned_configs()}]
    print(json.dumps(rows[-1]), flush=True)

    for config in args.configs.split(",") if "grids" in args.variants else []:
        block_n, block_k, warps = map(int, config.split("x"))
        for double in (False, True):
            outs = [torch.empty_like(t) for t in ref]
            outs[0][0] = x0[0]
            xs, hs, acts = outs
            meta = dict(BLOCK_N=block_n, BLOCK_K=block_k, DOUBLE=double, USE_PDL=True, num_warps=warps, launch_pdl=True)
            fits = min(resident_programs(_compiled(_phase_kernel, (attn, wgu[0], acts, xs, norm, INTER, HIDDEN, EPS,
                                                                   sms), dict(meta, NORM=n, SWIGLU=n, ADD=not n)),
                                         warps) for n in (False, True))
            for per_sm in map(int, args.per_sm.split(",")):
                programs = per_sm * sms
                row = {"variant": "persistent_grids_pdl", "block_n": block_n, "block_k": block_k, "warps": warps,
                       "double_buffered": double, "per_sm": per_sm, "programs": programs, "resident_per_sm": fits}
                if per_sm > fits:  # NOTE: more would run as waves: not what this measures
                    continue

                def grids(programs=programs):
                    for layer in range(layers):
                        _phase_kernel[(programs,)](attn, wo[layer], hs[layer], xs[layer], norm, HIDDEN, HIDDEN, EPS,
                                                   programs, NORM=False, SWIGLU=False, ADD=True, **meta)
                        _phase_kernel[(programs,)](hs[layer], wgu[layer], acts[layer], xs[layer], norm, INTER, HIDDEN,
                                                   EPS, programs, NORM=True, SWIGLU=True, ADD=False, **meta)
                        _phase_kernel[(programs,)](acts[layer], wd[layer], xs[layer + 1], hs[layer], norm, HIDDEN,
                                                   INTER, EPS, programs, NORM=False, SWIGLU=False, ADD=True, **meta)

                _record(row, grids, outs, ref, layers, rows)

    dataflow_runs = itertools.product(args.configs.split(","), ((False, None), (True, None), (False, 128), (True, 128)))
    for config, (w_first, maxnreg) in dataflow_runs if "dataflow" in args.variants else []:
        block_n, block_k, warps = map(int, config.split("x"))
        outs = [torch.empty_like(t) for t in ref]
        outs[0][0] = x0[0]
        counts = torch.zeros(layers + 1, 3, MAX_TILES.value, dtype=torch.int32, device=device)
        initial = torch.zeros_like(counts)
        initial[0, 0, : HIDDEN // block_k] = block_k // block_n  # NOTE: layer 0's input (and attn) complete
        meta = dict(HIDDEN=HIDDEN, INTER=INTER, BLOCK_N=block_n, BLOCK_K=block_k, W_FIRST=w_first, num_warps=warps,
                    **({"maxnreg": maxnreg} if maxnreg else {}))
        compiled = _compiled(_dataflow_layers_kernel, (attn, *outs, wo, wgu, wd, norm, counts, layers, sms, EPS), meta)
        fits = resident_programs(compiled, warps)
        for per_sm in map(int, args.per_sm.split(",")):
            programs = per_sm * sms
            row = {"variant": "dataflow", "block_n": block_n, "block_k": block_k, "warps": warps, "per_sm": per_sm,
                   "w_before_wait": w_first, "maxnreg": maxnreg,
                   "programs": programs, "n_regs": compiled.n_regs, "resident_per_sm": fits}
            if per_sm > fits:  # NOTE: a waiting program would hold a multiprocessor its producer needs
                continue

            def dataflow(programs=programs):
                counts.copy_(initial)
                _dataflow_layers_kernel[(programs,)](attn, *outs, wo, wgu, wd, norm, counts, layers, programs, EPS,
                                                     **meta)

            _record(row, dataflow, outs, ref, layers, rows)

    counter = torch.zeros(1, dtype=torch.int32, device=device)
    for config in args.configs.split(",") if "barriers" in args.variants else []:
        block_n, block_k, warps = map(int, config.split("x"))
        for double in (False, True):
            for sync in (True, False):
                outs = [torch.empty_like(t) for t in ref]
                outs[0][0] = x0[0]
                meta = dict(HIDDEN=HIDDEN, INTER=INTER, SYNC=sync, BLOCK_N=block_n, BLOCK_K=block_k, DOUBLE=double,
                            num_warps=warps)
                compiled = _compiled(_mlp_layers_kernel, (attn, *outs, wo, wgu, wd, norm, counter, layers, sms, EPS),
                                     meta)
                fits = resident_programs(compiled, warps)
                for per_sm in map(int, args.per_sm.split(",")):
                    programs = per_sm * sms
                    row = {"variant": "persistent" if sync else "persistent_nosync", "block_n": block_n,
                           "block_k": block_k, "warps": warps, "double_buffered": double, "per_sm": per_sm,
                           "programs": programs, "n_regs": compiled.n_regs, "resident_per_sm": fits}
                    if per_sm > fits:  # NOTE: the barrier would never open
                        row["skipped"] = "not all resident"
                        print(json.dumps(row), flush=True)
                        continue

                    def launch(programs=programs):
                        counter.zero_()
                        _mlp_layers_kernel[(programs,)](attn, *outs, wo, wgu, wd, norm, counter, layers, programs,
                                                        EPS, **meta)

                    _record(row, launch, outs, ref, layers, rows, check=sync)
    for row in rows:
        if "us_per_layer" in row:
            row["bytes_ratio"] = bytes_us / row["us_per_layer"]
    result = {"gpu": torch.cuda.get_device_name(), "copy_bandwidth_tbs": bandwidth / 1e12, "layers": layers,
              "layer_mb": layer_bytes / 1e6, "bytes_us_per_layer": bytes_us, "rows": rows}
    print(json.dumps({k: v for k, v in result.items() if k != "rows"}))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
