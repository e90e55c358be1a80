"""The small operators of a Llama layer, one implementation per device, chosen once and passed in.

`TorchOps` is the reference (transformers' numerics op for op) and the CPU path where no compiler is;
`NativeCpuOps` fuses each operator into one native CPU call (kernels/cpu_ops.cpp, float32), and adds a
whole one-token layer; `TritonOps` fuses each into one Triton kernel for CUDA. The model calls the same
four methods on any of them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..attention import write_kv_cache_ref
from ..config import FUSED_GEMV_ROWS, SWIGLU_GEMM_ROWS


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm: normalise in float32, cast back, then scale.

    NOTE: in float32 torch's fused `rms_norm` computes the same operations in the same order (bit-identical
    on 2,000 random inputs of 1 to 5 rows and scales 1e-3 to 1e3) in one call instead of eight: 16 vs 25
    us on this project's CPU, 61 times a SmolLM2 step. Other dtypes keep transformers' float32 round trip.
    """
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """sin with its first half negated: rotate_half(x) * sin == x.roll(half, -1) * signed_sin(sin)."""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def rotate_roll_apply(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """Rotary embedding, transformers' rotate-half convention (x * cos + rotate_half(x) * sin), bit for bit
    ((-a) * b == a * (-b) exactly), in 4 operations instead of 7 (21 vs 39 us for SmolLM2's q and k on
    this project's CPU). cos, sin_signed: [num_tokens, 1, head_dim]."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * sin_signed


class ComposedOps:
    """The projections with the operator before them, composed from the small operators; a device's ops
    may fuse a pair into one kernel (TritonOps, for one token). `linear`: a sharded linear layer (its
    `forward` includes its all-reduce); `weight`: a plain [out, in] matrix (the LM head)."""

    def norm_and_project(self, x, residual, norm_weight, eps, linear):
        """(linear(rms_norm(x + residual)), x + residual), the residual as in `add_rms_norm`."""
        normed, residual = self.add_rms_norm(x, residual, norm_weight, eps)
        return linear(normed), residual

    def norm_and_matmul(self, x, residual, norm_weight, eps, weight: torch.Tensor):
        normed, residual = self.add_rms_norm(x, residual, norm_weight, eps)
        return F.linear(normed, weight), residual

    def project(self, x, linear, residual):
        """(linear(x), residual); a fused path may return (residual + linear(x), None) instead: the sum
        the next `add_rms_norm` would make, which takes it with no residual."""
        return linear(x), residual

    def norm_and_activate(self, x, residual, norm_weight, eps, gate_up):
        """(silu(gate) * up, x + residual) of the fused gate/up projection over rms_norm(x + residual)."""
        out, residual = self.norm_and_project(x, residual, norm_weight, eps, gate_up)
        return self.silu_and_mul(out), residual

    def prepare_weights(self, layers) -> None:
        """Lay the loaded weights out as this path's kernels read them (nothing here)."""

    def row_counts_to_tune(self) -> tuple[int, ...]:
        """A row count for each kernel variant a projection may pick by its row count (none here)."""
        return ()


class TorchOps(ComposedOps):
    def add_rms_norm(self, x, residual, weight, eps):
        """(rms_norm(x + residual), x + residual); with no residual yet, (rms_norm(x), x)."""
        total = x if residual is None else residual + x  # NOTE: the order transformers adds in
        return rms_norm(total, weight, eps), total

    def rotary_context(self, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, dtype: torch.dtype):
        """Per-step rotary inputs: the tables looked up once for all layers (cheap on the CPU).
        Returns cos and signed_sin(sin), [num_tokens, 1, head_dim] each."""
        return cos[positions].to(dtype)[:, None, :], signed_sin(sin[positions].to(dtype))[:, None, :]

    def rotary_and_store_kv(self, q, k, v, kv_cache, context, slot_mapping):
        """Rotate q and k, store k and v in their cache slots; returns the rotated q."""
        q, k = rotate_roll_apply(q, *context), rotate_roll_apply(k, *context)
        write_kv_cache_ref(k, v, *kv_cache, slot_mapping)
        return q

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)  # [num_tokens, intermediate] each
        return F.silu(gate) * up


class NativeCpuOps(TorchOps):
    """The CPU's fused native operators (kernels/cpu_ops.cpp), float32 only: one call each instead of the
    4 to 8 eager operators of `TorchOps`, its reference. NOTE: construct only after `cpu_ops.load()`
    returned True."""

    def add_rms_norm(self, x, residual, weight, eps):
        return torch.ops.pagedllm_cpu.add_rms_norm(x, residual, weight, eps)

    def rotary_context(self, positions, cos, sin, dtype):
        """cos and signed_sin(sin) of each token, [num_tokens, head_dim] each."""
        return cos[positions], signed_sin(sin[positions])

    def rotary_and_store_kv(self, q, k, v, kv_cache, context, slot_mapping):
        return torch.ops.pagedllm_cpu.rotary_and_store_kv(q, k, v, *kv_cache, slot_mapping, *context)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.pagedllm_cpu.silu_and_mul(x)

    def one_token_layer(self, layer, weights, hidden, residual, rotary_context, kv_cache, meta):
        """`layer.forward` for a single token in one native call (the same kernels in the same order).
        weights: input norm, q/k/v column blocks, o blocks, post-attention norm, gate/up blocks, down blocks
        (LlamaForCausalLM.prepare_for_cpu lists them)."""
        return torch.ops.pagedllm_cpu.one_token_layer(
            hidden, residual, weights, layer.eps, layer.num_heads, layer.num_kv_heads,
            layer.head_dim, *kv_cache, meta.slot_mapping, *rotary_context, meta.block_tables, meta.seq_lens,
            layer.scale,
        )


class TritonOps(ComposedOps):
    """NOTE: imports Triton on first construction only, so the CPU path never needs it.

    Steps of up to `fused_gemv_rows` tokens (single-stream decode, small batches) run their 16-bit
    projections as one Triton kernel each, with the norm before them, the MLP's activation after gate/up,
    and (at tensor-parallel size 1) the residual add after o and down folded in (kernels/gemv.py). Bigger
    steps keep cuBLAS and the separate kernels. `dependent_launch`: the projections and the rotary kernel
    launch as programmatic dependents of the kernel before them (compute capability 9+ only).
    `tile_table_for`: a GPU whose measured tile table (if the package has one) the projections launch with.
    """

    def __init__(self, fused_gemv_rows: int = FUSED_GEMV_ROWS, dependent_launch: bool = False,
                 swiglu_gemm_rows: int = SWIGLU_GEMM_ROWS, tile_table_for: torch.device | None = None) -> None:
        from ..kernels import activation, gemv, rms_norm as norm, rotary, swiglu_gemm

        if not 0 <= fused_gemv_rows <= gemv.MAX_ROWS:
            raise ValueError(f"fused_gemv_rows must be 0 to {gemv.MAX_ROWS}, not {fused_gemv_rows}")
        if tile_table_for is not None:
            # NOTE: the process's autotuners are shared: a later engine of the process keeps these pins
            gemv.pin_tiles(gemv.measured_tiles(torch.cuda.get_device_name(tile_table_for)))
        self._norm, self._fused_norm = norm.rms_norm, norm.fused_add_rms_norm
        self._rotary_store_kv, self._silu_and_mul = rotary.rotary_and_store_kv, activation.silu_and_mul
        self._gemv, self._swiglu_gemm = gemv, swiglu_gemm
        self.fused_gemv_rows = fused_gemv_rows
        self.pdl = dependent_launch
        # NOTE: every row tile a projection will run with, compiled together at its first call (kernels/gemv.py)
        self._gemv_options = dict(pdl=dependent_launch, row_tiles=self.row_counts_to_tune())
        self.swiglu_gemm_rows = swiglu_gemm_rows
        # NOTE: set by prepare_weights: the gate/up rows interleaved in blocks of this many (0: gate rows, then up)
        self.gate_up_interleave = 0

    def prepare_weights(self, layers) -> None:
        """Interleave each gate/up matrix's rows in blocks of INTERLEAVE (kernels/swiglu_gemm.py), so that
        steps of `swiglu_gemm_rows` tokens or more take the activation in the product's epilogue: where
        the GPU has the tensor-memory accelerator (compute capability 9+), the weights are 16-bit and every
        layer's (this rank's) intermediate size is a multiple of it. NOTE: once, after loading; every path
        of this class then reads that layout (`gate_up_interleave`)."""
        from ..kernels.swiglu_gemm import INTERLEAVE

        weights = [layer.gate_up_proj.weight for layer in layers]
        if (self.gate_up_interleave or not weights or self.swiglu_gemm_rows <= 0
                or not all(w.is_cuda and w.dtype in (torch.float16, torch.bfloat16)
                           and w.shape[0] % (2 * INTERLEAVE) == 0 for w in weights)
                or torch.cuda.get_device_capability(weights[0].device)[0] < 9):
            return
        self.interleave_gate_up(weights, INTERLEAVE)

    @torch.no_grad()
    def interleave_gate_up(self, weights: list[torch.Tensor], block: int) -> None:
        """Interleave the gate/up matrices' rows in blocks of `block`, in place; the kernels read them so."""
        for weight in weights:
            weight.copy_(self._swiglu_gemm.interleave_gate_up(weight, block))
        self.gate_up_interleave = block

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        return self._silu_and_mul(x, interleave=self.gate_up_interleave)

    def row_counts_to_tune(self) -> tuple[int, ...]:
        """One row count per row tile of kernels/gemv.py up to `fused_gemv_rows` (1, 16, 32, 64)."""
        return tuple(sorted({self._gemv.row_tile(m) for m in range(1, self.fused_gemv_rows + 1)}))

    def _fused(self, x: torch.Tensor, weight: torch.Tensor) -> bool:
        return 0 < x.shape[0] <= self.fused_gemv_rows and weight.dtype in (torch.float16, torch.bfloat16)

    def norm_and_project(self, x, residual, norm_weight, eps, linear):
        if not self._fused(x, linear.weight):
            return super().norm_and_project(x, residual, norm_weight, eps, linear)
        out, residual = self._gemv.add_rms_norm_gemv(x, residual, norm_weight, eps, linear.weight, **self._gemv_options)
        return linear.reduce(out), residual

    def norm_and_matmul(self, x, residual, norm_weight, eps, weight):
        if not self._fused(x, weight):
            return super().norm_and_matmul(x, residual, norm_weight, eps, weight)
        return self._gemv.add_rms_norm_gemv(x, residual, norm_weight, eps, weight, **self._gemv_options)

    def norm_and_activate(self, x, residual, norm_weight, eps, gate_up):
        """NOTE: a rank's gate/up shard is its gate rows then the matching up rows (distributed/layers.py),
        interleaved in blocks by `prepare_weights` where it applies, the layouts the kernels' epilogues
        read; column-parallel, so nothing to reduce."""
        if self._fused(x, gate_up.weight):
            return self._gemv.add_rms_norm_gemv(x, residual, norm_weight, eps, gate_up.weight, swiglu=True,
                                                interleave=self.gate_up_interleave, **self._gemv_options)
        if self.gate_up_interleave and x.shape[0] >= self.swiglu_gemm_rows:
            normed, residual = self.add_rms_norm(x, residual, norm_weight, eps)
            return self._swiglu_gemm.swiglu_gemm(normed, gate_up.weight, self.gate_up_interleave), residual
        return super().norm_and_activate(x, residual, norm_weight, eps, gate_up)

    def project(self, x, linear, residual):
        """The residual joins the projection's output in the kernel where no all-reduce comes between."""
        if not self._fused(x, linear.weight):
            return linear(x), residual
        if residual is not None and linear.parallel.size == 1:
            return self._gemv.gemv(x, linear.weight, addend=residual, **self._gemv_options), None
        return linear.reduce(self._gemv.gemv(x, linear.weight, **self._gemv_options)), residual

    def add_rms_norm(self, x, residual, weight, eps):
        if residual is None:
            return self._norm(x, weight, eps), x
        return self._fused_norm(x, residual, weight, eps)

    def rotary_context(self, positions, cos, sin, dtype):
        return positions, cos, sin  # the kernel looks the tables up itself

    def rotary_and_store_kv(self, q, k, v, kv_cache, context, slot_mapping):
        return self._rotary_store_kv(q, k, v, *kv_cache, slot_mapping, *context, pdl=self.pdl)


def supports_dependent_launch(device: torch.device) -> bool:
    """Programmatic dependent launch needs a Hopper-or-later GPU (compute capability 9+)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def ops_for(device: torch.device, fused_gemv_rows: int = FUSED_GEMV_ROWS, dependent_launch: bool = False,
            measured_tiles: bool = False) -> TorchOps | TritonOps:
    """`dependent_launch`: already resolved for the device (`supports_dependent_launch`). `measured_tiles`:
    pin the package's tile table for this GPU, if it has one (kernels/gemv.py::measured_tiles)."""
    if device.type != "cuda":
        return TorchOps()
    return TritonOps(fused_gemv_rows, dependent_launch, tile_table_for=device if measured_tiles else None)


def attention_backend_for(device: torch.device, dependent_launch: bool = False):
    if device.type == "cuda":
        from ..attention_triton import TritonAttentionBackend

        return TritonAttentionBackend(device, dependent_launch)
    from ..attention import TorchAttentionBackend

    return TorchAttentionBackend()
