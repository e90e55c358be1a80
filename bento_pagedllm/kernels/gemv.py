"""Projections of one to a few tokens (GEMV and skinny GEMM) with the operators around them folded in:
y = epilogue(prologue(x) @ W.T), x: [M, K] with M <= MAX_ROWS.

Why: a decode step of a few sequences reads every weight once, so its time is the weights' bytes over the
read bandwidth. cuBLAS's one-row products read at 0.71 to 0.99 of the copy bandwidth on the H200,
depending on the shape (bench/gemv.py), and add split-K reduction kernels; and each layer also launches
two RMSNorms and a SiLU-and-multiply, 1 to 2 us each, whose only job is to produce the projection's input.
Here each program streams `BLOCK_N` rows of W in `BLOCK_K` column tiles (wide, coalesced loads) and
computes the input tile itself:

- `gemv`:                y = x W^T
- `add_rms_norm_gemv`:   y = rms_norm(x + residual) W^T; also returns x + residual (the next residual)
- `add_rms_norm_gemv(swiglu=True)`: y = silu(g) * u, [g; u] = rms_norm(x + residual) [W_gate; W_up]^T:
  each program takes BLOCK_N rows of W_gate and the same rows of W_up, so the MLP's activation is its
  epilogue and the down projection reads a plain vector (a SiLU in the down projection's prologue was
  recomputed by every program over the whole row: 3.2 TB/s against 4.1 for o's plain GEMV)
- `gemv` may also add a matrix to y (the residual stream: `addend`), so the next norm reads one input,
  not two, and nothing stores the sum separately

One row multiplies on the CUDA cores (float32 products summed once at the end); more rows are padded to
a tile of 16 to 64 and multiplied on the tensor cores (`tl.dot`, W's rows on their M side, the tokens
on their N side), whose loop Triton pipelines through shared memory. The input is tiny next to W (M x K
values against N x K), so every program computes its input tiles itself from L2: no second kernel.
RMSNorm needs each row's mean of squares, which the program gathers in the same pass and applies to its
dot products at the end: rms_norm(x) . w = (g * x) . w / rms. Program 0 alone stores x + residual.

`pdl` (CUDA, compute capability 9+): the kernel is launched as a programmatic dependent of the one
before it, so its programs start while that kernel's last ones finish; each asks L2 for its first W
tile (a plain GEMV, whose W tiles are double-buffered, loads it), then waits (`gdc_wait`) before it
reads anything another kernel writes. One row lets the next kernel launch right after its wait; a tile
only after its loop (see the kernel). A decode step is a chain of ~6 kernels a layer, and each boundary
otherwise leaves the memory system idle for the launch and the first loads' latency.

Numerics: x + residual and silu(gate) * up are rounded to the input dtype like the unfused kernels
(rms_norm.py, activation.py, from the rounded projections); the dot products accumulate in float32, in
another order than cuBLAS. The norm is NOT rounded element by element as the unfused path rounds the
normalised row (twice, to the 16-bit dtype): the scale comes after the sum; the tensor-core path rounds
g * x once, to W's dtype. The two differ within that rounding (a relative 2^-8 per term in bfloat16),
which the tests bound; float32 models never take this path.

NOTE: for at most MAX_ROWS rows; bigger batches use cuBLAS, whose GEMMs are better there. On CUDA the tiles
are autotuned per (N, K, prologue, epilogue, row tile) on the first call (the model's warm-up before
each graph capture), except the keys a GPU's measured table pins (`measured_tiles`, `pin_tiles`: tiles
searched by the whole decode step's time, bench/tile_search.py); under Triton's interpreter fixed
configurations run.
"""

from __future__ import annotations

import ast
import json
import os
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from .activation import gate_up_index, silu_and_mul_tile
from .prefetch import prefetch_to_l2


@triton.jit(do_not_specialize=["M"])
def _gemv_kernel(
    x_ptr, residual_ptr, norm_weight_ptr, w_ptr, addend_ptr, out_ptr, total_ptr,
    M, N, K, stride_w, eps,
    ADD_RESIDUAL: tl.constexpr, RMS_NORM: tl.constexpr, SWIGLU: tl.constexpr, ADD_TO_OUTPUT: tl.constexpr,
    USE_PDL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    INTERLEAVE: tl.constexpr = 0,
):
    """One program: all M rows of x against BLOCK_N rows of W (with SWIGLU, BLOCK_N gate rows and the
    BLOCK_N up rows N below them). BLOCK_M 1: float32 products summed once at the end (CUDA cores);
    BLOCK_M >= 16: the rows padded to a tensor-core tile, `tl.dot` per column tile."""
    pid = tl.program_id(0)
    tokens = tl.arange(0, BLOCK_M)  # [BLOCK_M]
    token_mask = tokens < M
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]: rows of W, columns of the output
    row_mask = rows < N
    gate_index, up_index = gate_up_index(rows, N, INTERLEAVE)  # [BLOCK_N] each: SWIGLU's gate and up rows of W
    w_rows = w_ptr + gate_index.to(tl.int64)[:, None] * stride_w  # [BLOCK_N, 1]
    up_rows = w_ptr + up_index.to(tl.int64)[:, None] * stride_w  # [BLOCK_N, 1]: SWIGLU's up rows
    x_rows = x_ptr + tokens[:, None] * K  # [BLOCK_M, 1]; NOTE: x, residual contiguous
    dtype = x_ptr.dtype.element_ty
    # NOTE: a plain one-row GEMV (o, down: no norm prologue) double-buffers W in registers: the next tile is
    # asked for before this one is used, the first before the dependent-launch wait (W is read-only). On an
    # H200 (Llama-2-7B, with PDL) o went 7.5 -> 6.2 us and down 24.1 -> 23.0; with the norm's registers
    # too (q/k/v, gate/up) it was slower (25.2 -> 28.2 us), so those keep one tile and the L2 prefetch.
    if BLOCK_M == 1 and not RMS_NORM:  # double-buffered
        first = tl.arange(0, BLOCK_K)
        w_next = tl.load(w_rows + first[None, :], mask=row_mask[:, None] & (first < K)[None, :], other=0.0)
    if USE_PDL:
        # NOTE: launched before the kernel ahead of it ends (programmatic dependent launch), the program
        # may touch nothing that kernel writes until gdc_wait returns. W is read-only: its first tile is
        # loaded (double-buffered) or asked of L2 while that kernel's last programs run, and the next
        # kernel may launch from now on.
        if BLOCK_M > 1 or RMS_NORM:  # not double-buffered
            tl.static_assert(BLOCK_K >= 64, "a prefetch per 64 columns: a 128-byte line of 16-bit weights")
            lines = tl.minimum(tl.arange(0, BLOCK_K // 64) * 64, K - 1)[None, :]  # [1, BLOCK_K / 64]
            safe_rows = tl.minimum(gate_index, (2 * N if INTERLEAVE else N) - 1)  # [BLOCK_N]
            prefetch_to_l2(w_ptr + safe_rows.to(tl.int64)[:, None] * stride_w + lines)
            if SWIGLU:
                prefetch_to_l2(w_ptr + tl.minimum(up_index, 2 * N - 1).to(tl.int64)[:, None] * stride_w + lines)
        gdc_wait()
        if BLOCK_M == 1:
            gdc_launch_dependents()

    total_limit = tl.where(pid == 0, K, 0)  # NOTE: program 0 alone stores x + residual
    squares = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.float32)
    # the accumulators: [BLOCK_N, BLOCK_K] products (one row) or [BLOCK_N, BLOCK_M] dot products (W's rows
    # are the tensor cores' M side, which allows their widest instructions; the tokens are their N side)
    acc = tl.zeros([BLOCK_N, BLOCK_K if BLOCK_M == 1 else BLOCK_M], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_N, BLOCK_K if BLOCK_M == 1 else BLOCK_M], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)  # [BLOCK_K]
        col_mask = cols < K
        x_mask = token_mask[:, None] & col_mask[None, :]  # [BLOCK_M, BLOCK_K]
        x = tl.load(x_rows + cols[None, :], mask=x_mask, other=0.0)
        if ADD_RESIDUAL:
            offsets = tokens[:, None] * K + cols[None, :]
            x = (x.to(tl.float32) + tl.load(residual_ptr + offsets, mask=x_mask, other=0.0).to(tl.float32))
            x = x.to(dtype)  # NOTE: rounded, like torch's add
            tl.store(total_ptr + offsets, x, mask=x_mask & (cols < total_limit)[None, :])
        x32 = x.to(tl.float32)
        if RMS_NORM:  # each row's 1/rms scales its dot products at the end (one pass over x)
            squares += x32 * x32
            x32 = x32 * tl.load(norm_weight_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
        w_mask = row_mask[:, None] & col_mask[None, :]
        if BLOCK_M == 1 and not RMS_NORM:  # double-buffered
            w = w_next
            next_cols = cols + BLOCK_K
            next_mask = row_mask[:, None] & (next_cols < K)[None, :]
            w_next = tl.load(w_rows + next_cols[None, :], mask=next_mask, other=0.0)
        else:
            w = tl.load(w_rows + cols[None, :], mask=w_mask, other=0.0)  # [BLOCK_N, BLOCK_K]
        acc = _accumulate(acc, w, x32, BLOCK_M)
        if SWIGLU:
            acc_up = _accumulate(acc_up, tl.load(up_rows + cols[None, :], mask=w_mask, other=0.0), x32, BLOCK_M)
    if USE_PDL and BLOCK_M > 1:
        # NOTE: a tile lets the next kernel launch only after its loop: launched at its start, the next
        # kernel's waiting programs took the multiprocessors the tile's later programs (and their pipeline
        # stages in shared memory) needed, and 1-16-row steps ran 1.5% slower (2026-12-01s run 2). Here
        # only the epilogue and the launch's latency overlap.
        gdc_launch_dependents()
    out = _finish(acc, BLOCK_M)  # [BLOCK_N, BLOCK_M]
    if RMS_NORM:
        inv_rms = tl.rsqrt(tl.sum(squares, axis=1) / K + eps)[None, :]  # [1, BLOCK_M]
        out = out * inv_rms
    if SWIGLU:  # silu(gate) * up from the rounded projections, as the unfused kernels see them
        up = _finish(acc_up, BLOCK_M)
        if RMS_NORM:
            up = up * inv_rms
        out = silu_and_mul_tile(out.to(dtype).to(tl.float32), up.to(dtype).to(tl.float32), dtype).to(tl.float32)
    out_offsets = tokens[None, :] * N + rows[:, None]  # [BLOCK_N, BLOCK_M]
    out_mask = token_mask[None, :] & row_mask[:, None]
    if ADD_TO_OUTPUT:  # the residual add after the projection, rounded as torch rounds both steps
        out = out.to(dtype).to(tl.float32) + tl.load(addend_ptr + out_offsets, mask=out_mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + out_offsets, out.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _accumulate(acc, w, x32, BLOCK_M: tl.constexpr):
    """acc [BLOCK_N, BLOCK_K] += w * x (one row), or acc [BLOCK_N, BLOCK_M] += w @ x^T (tensor cores)."""
    if BLOCK_M == 1:
        acc = acc + w.to(tl.float32) * x32
    elif w.dtype == tl.float32:
        acc = tl.dot(w, tl.trans(x32), acc, input_precision="ieee")
    else:  # NOTE: the input tile is rounded to W's dtype for the tensor cores
        acc = tl.dot(w, tl.trans(x32.to(w.dtype)), acc)
    return acc


@triton.jit
def _finish(acc, BLOCK_M: tl.constexpr):
    """The dot products, [BLOCK_N, BLOCK_M]."""
    if BLOCK_M == 1:
        out = tl.sum(acc, axis=1)[:, None]
    else:
        out = acc
    return out


def _row_configs() -> list[triton.Config]:
    """One row (CUDA cores): tiles of 1 to 32 rows of W by 128 to 2,048 columns: few rows give enough
    programs for small N, long rows make each load wide; more rows share the input tile's work (the
    norm's sum of squares) among more weights. NOTE: each of these won for some projection of
    Llama-2-7B, Llama-3-8B or SmolLM2 on an H200 (bench/gemv.py, 2026-12-01); every configuration costs a
    compile per kernel variant on a fresh machine's first start."""
    shapes = [(1, 2048, 4), (2, 1024, 4), (2, 2048, 4), (2, 2048, 8), (4, 1024, 4), (8, 512, 4), (8, 1024, 8),
              (16, 512, 8), (32, 128, 4), (32, 256, 8)]
    return [triton.Config({"BLOCK_N": n, "BLOCK_K": k}, num_warps=w) for n, k, w in shapes]


def _tile_configs() -> list[triton.Config]:
    """A few rows (tensor cores): 32 to 128 rows of W by 64 to 512 columns, the W tiles pipelined through
    shared memory in 3 to 6 stages (the loads in flight that a bandwidth-bound loop needs). NOTE: as for
    `_row_configs`, those that won somewhere (16-row tiles and 4-warp 128 x 128 tiles never did); 32 x 512
    in 2 warps and 4 stages and 64 x 256 in 4 stages were the best at 16 rows for o, down and Llama-3-8B's
    q/k/v in `bench/gemv.py --sweep` (11.2-30.5 us against 12.2-31.7 for the autotuner's choice without
    them, H200, 2026-12-02). NOTE: 32 x 256 in 4 warps and 4 stages is left out: never the best in the
    in-graph sweeps at 16 or 32 rows (2nd to 24th), the autotuner's short timings picked it for o in some
    processes, and those processes' decode steps of 2-32 sequences took ~0.2 ms more (Llama-3-8B offline,
    bench/results/h200-2026-12-02g run 4). So is 32 x 512 in 4 warps and 3 stages: never the best in-graph
    (4-7% behind on o and down, 2-3.5x on the projections with a norm), yet chosen for o's 16-row tile in
    two of four processes of one call, whose 2-16-sequence steps took ~0.1 ms more (4.48 against 4.38 ms;
    h200-2026-12-02h run 1)."""
    shapes = [(32, 512, 2, 4), (64, 64, 4, 6), (64, 128, 4, 6), (64, 256, 4, 3),
              (64, 256, 4, 4), (64, 256, 8, 3), (128, 64, 4, 4), (128, 128, 8, 3)]
    return [triton.Config({"BLOCK_N": n, "BLOCK_K": k}, num_warps=w, num_stages=s) for n, k, w, s in shapes]


# NOTE: the 32-row tile tries under half the tile configurations: each one costs every projection a compile
# and a timing at a cold start, and the 32-row tiles' full set made a Llama-2-7B cold start 6-10 s slower
# (H200, 2026-12-01). These are among the most frequent winners at 32 rows over the Llama-2-7B and
# Llama-3-8B projections in bench/results/h200-2026-12-01j (small row blocks for N = 4,096, big ones for
# gate/up and the LM head), and 64 x 256 in 3 stages: Llama-3-8B's q/k/v at 32 rows in 18.7 us against 26.2
# for the autotuner's choice among the others (`bench/gemv.py --sweep --rows 32`, h200-2026-12-02d run 3;
# with the norm in the prologue, narrow row blocks recompute it for more programs: 32 x 256 took 57 us).
# 32 x 256 in 4 stages is no longer among them (`_tile_configs`).
TILE_32_SHAPES = {(64, 128, 4, 6), (64, 256, 4, 3), (128, 64, 4, 4), (128, 128, 8, 3)}


# a tile configuration must give at least this many programs (row blocks of W) where some configuration
# does: fewer leave most of an H200's 132 multiprocessors idle (`_prune`)
MIN_TILE_PROGRAMS = 64


def _prune(configs, named_args, **kwargs):
    """Column tiles wider than the row waste their masked lanes: keep those up to the row's width; the
    32-row tile keeps TILE_32_SHAPES only; a plain one-row projection (o, down) no blocks of 32 rows of W;
    a tile (2+ rows) no row blocks so tall that fewer than MIN_TILE_PROGRAMS programs remain (given `N`).

    NOTE: o's 32-row tile (N = 4,096) was tuned to 128 x 64 (4 warps, 4 stages) in one process of
    h200-2026-12-02i run 4: 32 programs for 132 multiprocessors, and its decode steps of 17-32 sequences
    took 5.39-5.55 ms against 4.93-5.10 in the next process (64 x 128); Llama-3-8B q/k/v's 128 x 128
    (48 programs) took 26.2 us at 32 rows against 18.7 for 64 x 256 in-graph (h200-2026-12-02d run 3). No
    such tile was the best in-graph for any projection of N <= 6,144.

    NOTE: 32 x 256 in 8 warps, the best one-row tile of q/k/v and the LM head (a norm in their prologue),
    read o and down 1.38x and 1.45x slower than their best in-graph (Llama-2-7B, H200, bench/gemv.py
    --sweep, h200-2026-12-02d run 2), yet the autotuner chose it for o in 1 process of 32 (~+3% a
    single-stream step); with double buffering (a plain projection's) each program holds two such tiles."""
    width = max(128, triton.next_power_of_2(named_args["K"]))
    kept = [c for c in configs if c.kwargs["BLOCK_K"] <= width]
    if kwargs.get("BLOCK_M") == 1 and not kwargs.get("RMS_NORM"):
        kept = [c for c in kept if c.kwargs["BLOCK_N"] < 32] or kept
    if kwargs.get("BLOCK_M") == 32:
        kept = [c for c in kept if (c.kwargs["BLOCK_N"], c.kwargs["BLOCK_K"], c.num_warps, c.num_stages)
                in TILE_32_SHAPES] or kept
    if kwargs.get("BLOCK_M", 1) > 1 and "N" in named_args:
        def programs(config) -> int:
            return triton.cdiv(named_args["N"], config.kwargs["BLOCK_N"])

        if max(map(programs, kept)) >= MIN_TILE_PROGRAMS:  # NOTE: a small model's projections keep every tile
            kept = [c for c in kept if programs(c) >= MIN_TILE_PROGRAMS]
    return kept


def _quick_bench(kernel_call, quantiles):
    """Autotuning runs at start-up: a short measurement per configuration is enough to rank them."""
    return triton.testing.do_bench(kernel_call, warmup=5, rep=20, quantiles=quantiles)


# what the autotuners key their choice on (then Triton appends the tensor arguments' dtypes)
TUNING_KEY = ["N", "K", "BLOCK_M", "ADD_RESIDUAL", "RMS_NORM", "SWIGLU", "ADD_TO_OUTPUT", "USE_PDL", "INTERLEAVE"]


def _autotuned(configs: list[triton.Config]):
    """NOTE: tuned per row tile (BLOCK_M: 1, 16, 32 or 64) too: a decode graph's batch picks its tile."""
    return triton.autotune(
        configs=configs, key=TUNING_KEY, do_bench=_quick_bench, prune_configs_by={"early_config_prune": _prune},
    )(_gemv_kernel)


_tuned_one_row, _tuned_rows = _autotuned(_row_configs()), _autotuned(_tile_configs())


def tuned_configs() -> dict[str, dict]:
    """What the autotuners chose in this process, per tuning key (N, K, row tile, flags, dtypes): for
    benchmarks to record, since the choice is re-made (and may differ) in every process; `pin_tiles`
    takes such a record back."""
    return {str(key): _fields(config) for tuner in (_tuned_one_row, _tuned_rows) for key, config in tuner.cache.items()}


def _fields(config: triton.Config) -> dict:
    """A configuration as JSON-ready fields (tile shape, warps, stages), as tables hold it."""
    return {**config.kwargs, "num_warps": config.num_warps, "num_stages": config.num_stages}


def _parse_key(key_text: str) -> tuple:
    """A `tuned_configs()` key back as the tuple the autotuner looks up."""
    key = ast.literal_eval(key_text)  # NOTE: str() of a tuple of ints, bools and dtype names
    assert isinstance(key, tuple) and len(key) > len(TUNING_KEY), key_text
    return key


def tuning_flags(key_text: str) -> dict:
    """A tuning key (a `tuned_configs()` key) by name: N, K, BLOCK_M and the flags of TUNING_KEY."""
    return dict(zip(TUNING_KEY, _parse_key(key_text)))


def tile_candidates(key_text: str) -> list[dict]:
    """The configurations the autotuner times for a tuning key, as fields for `pin_tiles` (those a
    projection's first call compiles ahead)."""
    flags = tuning_flags(key_text)
    return [_fields(config) for config in _offered(flags["N"], flags["K"], flags)]


# the one-row tiles measured fastest in a whole decode step, per GPU (bench/tile_search.py; `measured_tiles`)
TILE_TABLES = Path(__file__).parent / "tiles"


def tile_table_path(gpu_name: str) -> Path:
    """Where the package keeps a GPU's tile table: its `torch.cuda.get_device_name()`, word characters only."""
    return TILE_TABLES / (re.sub(r"[^A-Za-z0-9]+", "_", gpu_name).strip("_") + ".json")


def measured_tiles(gpu_name: str) -> dict[str, dict]:
    """The package's tile table for a GPU (its `torch.cuda.get_device_name()`), for `pin_tiles`; {} if none.
    NOTE: its keys name dtypes and flags (dependent launch, gate/up's interleaved rows): a model run
    otherwise meets none of them and is autotuned."""
    path = tile_table_path(gpu_name)
    return load_tile_table(path) if path.exists() else {}


def load_tile_table(path: str) -> dict[str, dict]:
    """A table for `pin_tiles` from a JSON file: a `tuned_configs()` record, or a file holding one under
    "table" (a packaged table, a bench/tile_search.py result)."""
    with open(path) as f:
        table = json.load(f)
    return table.get("table", table)


def pin_tiles(table: dict[str, dict]) -> None:
    """Make this process launch each tuning key of `table` (a `tuned_configs()` of an earlier process)
    with its recorded configuration, untimed; keys not in it are autotuned as before.

    Why: the autotuner ranks configurations by short timings of each kernel alone, and those rankings
    differ from process to process: four processes of one Llama-2-7B package on one H100 picked three
    tile sets for gate/up and o, and their decode steps took 4.70 to 4.79 ms (bench/results/
    gpu-2026-12-07/run5). A table from a fast process replays its choice."""
    block_m_at = TUNING_KEY.index("BLOCK_M")
    for text, fields in table.items():
        key = _parse_key(text)
        tiles = {name: fields[name] for name in ("BLOCK_N", "BLOCK_K")}
        _tuner(key[block_m_at]).cache[key] = triton.Config(tiles, num_warps=fields["num_warps"],
                                                           num_stages=fields["num_stages"])


def _offered(n: int, k: int, flags: dict) -> list[triton.Config]:
    """The configurations the autotuner times for a projection variant (`flags`: its row tile and flags)."""
    return _prune(_tuner(flags["BLOCK_M"]).configs, {"N": n, "K": k}, **flags)


def _tuner(block_m: int):
    """The autotuned kernel of a row tile: CUDA cores for one row, tensor cores for more."""
    return _tuned_one_row if block_m == 1 else _tuned_rows


# the kernel variants (shapes, flags, dtypes) whose configurations were compiled ahead of their autotuning
_compiled_ahead: set[tuple] = set()
# (kernel, device) pairs with a first compile done: their per-device caches exist
_kernels_set_up: set[tuple] = set()
COMPILE_THREADS = min(16, os.cpu_count() or 1)


def compile_configs_ahead(kernel, launches: list[dict], args: tuple, device: torch.device,
                          threads: int = COMPILE_THREADS) -> None:
    """Compile `kernel` for each of `launches` (a variant's flags with one configuration's options), in
    `threads` threads, without launching it.

    Why: the autotuner compiles a configuration when it first times it, one after another; on a fresh
    H200 a Llama-2-7B start-up spent ~24 s compiling (31.6 s cold against 7.7 s with Triton's cache
    warm, 2026-12-01), close to the 35 s it may take; in threads it started cold in 22-26 s, and with
    every row tile's configurations in one pool (the caller's `row_tiles`, up to 16 threads) in 23.5 s
    where the variant-by-variant pools took 26.7 s (bench/results/h200-2026-12-01t). Compiling runs LLVM
    and ptxas outside the GIL, so threads overlap most of it. NOTE: each compile takes the
    launch's own arguments and options, so it lands under the key the autotuner's launch looks up, and
    that launch finds it compiled."""
    launches = list(launches)
    if not launches:
        return
    if (kernel, device) not in _kernels_set_up:
        # NOTE: the kernel's first compile on a device alone: it sets up the per-device cache the threads share
        kernel.warmup(*args, grid=(1,), **launches.pop(0))
        _kernels_set_up.add((kernel, device))
    with ThreadPoolExecutor(max_workers=threads) as pool:
        for future in [pool.submit(kernel.warmup, *args, grid=(1,), **launch) for launch in launches]:
            future.result()


MAX_ROWS = 64  # NOTE: TritonOps sends more rows to cuBLAS; bench/gemv.py measures the crossover

# NOTE: the interpreter (no CUDA) cannot time configurations; it runs these. Triton reads the switch
# when kernels are decorated, at import: so does this module.
INTERPRETER_CONFIGS = ({"BLOCK_N": 4, "BLOCK_K": 64}, {"BLOCK_N": 16, "BLOCK_K": 32}) \
    if os.environ.get("TRITON_INTERPRET") == "1" else None


def row_tile(num_rows: int) -> int:
    """BLOCK_M: 1 for one row, else the rows padded to a tensor-core tile of 16, 32 or 64."""
    assert 1 <= num_rows <= MAX_ROWS, num_rows
    return 1 if num_rows == 1 else max(16, triton.next_power_of_2(num_rows))


def _flags(residual, norm_weight, swiglu: bool, addend, pdl: bool, block_m: int, interleave: int) -> dict:
    """The kernel's flags and launch options for a row tile of a projection."""
    return dict(ADD_RESIDUAL=residual is not None, RMS_NORM=norm_weight is not None, SWIGLU=swiglu,
                ADD_TO_OUTPUT=addend is not None, USE_PDL=pdl, BLOCK_M=block_m, INTERLEAVE=interleave,
                launch_pdl=pdl, enable_fp_fusion=False)  # NOTE: keep each rounding torch does


def _launch(x, weight, residual=None, norm_weight=None, eps=0.0, swiglu=False, addend=None, pdl=False,
            config=None, row_tiles=(), interleave=0):
    """x: [M, K], weight: [N, K] ([2N, K] with swiglu) -> ([M, N], x + residual or None). `row_tiles`: the
    other row tiles the caller launches this projection with: compiled ahead with this call's."""
    n, k = weight.shape
    n = n // 2 if swiglu else n
    m = x.shape[0]
    assert x.is_contiguous() and weight.stride(1) == 1 and x.shape[1] == k, (x.shape, weight.shape)
    assert not swiglu or weight.shape[0] == 2 * n
    assert not interleave or (swiglu and n % interleave == 0), (interleave, n)
    assert residual is None or (residual.shape == x.shape and residual.is_contiguous())
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    total = torch.empty_like(x) if residual is not None else out  # NOTE: `out` is a placeholder, never written
    assert addend is None or (addend.shape == (m, n) and addend.is_contiguous() and addend.dtype == x.dtype)
    if m == 0:
        return out, (total if residual is not None else None)
    block_m = row_tile(m)
    args = (x, residual if residual is not None else x, norm_weight if norm_weight is not None else x,
            weight, addend if addend is not None else x, out, total, m, n, k, weight.stride(0), eps)
    flags = _flags(residual, norm_weight, swiglu, addend, pdl, block_m, interleave)
    config = config or (INTERPRETER_CONFIGS and INTERPRETER_CONFIGS[block_m > 1])
    if config is None:
        def variant(tile_flags: dict) -> tuple:
            return n, k, x.dtype, weight.dtype, tuple(sorted(tile_flags.items()))

        # NOTE: a projection's first call (its launching tile not yet compiled) compiles, before the
        # autotuner's first, serial, pass over its configs, every configuration of every row tile not yet
        # compiled, in one pool (M is not specialised: one call's arguments serve them all); later calls
        # only look their tile up (the LM head runs outside the graphs, every step)
        if variant(flags) not in _compiled_ahead:
            launches = []
            for tile in sorted({block_m, *row_tiles}):
                tile_flags = _flags(residual, norm_weight, swiglu, addend, pdl, tile, interleave)
                if variant(tile_flags) not in _compiled_ahead:
                    _compiled_ahead.add(variant(tile_flags))
                    launches += [{**tile_flags, **c.all_kwargs()} for c in _offered(n, k, tile_flags)]
            compile_configs_ahead(_gemv_kernel, launches, args, x.device)
        _tuner(block_m)[lambda meta: (triton.cdiv(n, meta["BLOCK_N"]),)](*args, **flags)
    else:
        _gemv_kernel[(triton.cdiv(n, config["BLOCK_N"]),)](*args, **flags, **config)
    return out, (total if residual is not None else None)


def gemv(x: torch.Tensor, weight: torch.Tensor, addend: torch.Tensor | None = None, pdl: bool = False,
         config: dict | None = None, row_tiles: tuple[int, ...] = ()) -> torch.Tensor:
    """x: [M, K], weight: [N, K] -> x @ weight.T (+ addend), [M, N]. `config` fixes the tiles (tests).
    `pdl`: launch as a programmatic dependent of the kernel before (CUDA, compute capability 9+).
    `row_tiles`: the row tiles (`row_tile`) the caller will launch this projection with: on the first
    call their autotuning configurations are compiled together, in threads."""
    return _launch(x, weight, addend=addend, pdl=pdl, config=config, row_tiles=row_tiles)[0]


def add_rms_norm_gemv(
    x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
    swiglu: bool = False, pdl: bool = False, config: dict | None = None, row_tiles: tuple[int, ...] = (),
    interleave: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual) @ weight.T, x + residual); with no residual, (rms_norm(x) @ weight.T, x).

    swiglu: weight is the fused [gate; up] matrix, [2N, K] (with `interleave`, its rows interleaved in
    blocks of that many: kernels/swiglu_gemm.py); the first result is silu(gate) * up, [M, N] (the MLP's
    activation, so the down projection reads one plain vector)."""
    assert norm_weight.dtype == x.dtype, "the fused norm keeps the input dtype"
    out, total = _launch(x, weight, residual, norm_weight, eps, swiglu=swiglu, pdl=pdl, config=config,
                         row_tiles=row_tiles, interleave=interleave)
    return out, (x if residual is None else total)


# ---- references: the unfused operators the model runs otherwise ----------------------------------
def gemv_ref(x: torch.Tensor, weight: torch.Tensor, addend: torch.Tensor | None = None) -> torch.Tensor:
    out = torch.nn.functional.linear(x, weight)
    return out if addend is None else out + addend


def add_rms_norm_gemv_ref(x, residual, norm_weight, eps, weight, swiglu=False):
    from .activation import silu_and_mul_ref
    from .rms_norm import fused_add_rms_norm_ref, rms_norm_ref

    if residual is None:
        normed, total = rms_norm_ref(x, norm_weight, eps), x
    else:
        normed, total = fused_add_rms_norm_ref(x, residual, norm_weight, eps)
    out = gemv_ref(normed, weight)
    return (silu_and_mul_ref(out) if swiglu else out), total
