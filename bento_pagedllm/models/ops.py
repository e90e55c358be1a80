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


class TorchOps:
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


class TritonOps:
    """NOTE: imports Triton on first construction only, so the CPU path never needs it."""

    def __init__(self) -> None:
        from ..kernels import activation, rms_norm as norm, rotary

        self._norm, self._fused_norm = norm.rms_norm, norm.fused_add_rms_norm
        self._rotary_store_kv, self.silu_and_mul = rotary.rotary_and_store_kv, activation.silu_and_mul

    def add_rms_norm(self, x, residual, weight, eps):
        if residual is None:
            return self._norm(x, weight, eps), x
        return self._fused_norm(x, residual, weight, eps)

    def rotary_context(self, positions, cos, sin, dtype):
        return positions, cos, sin  # the kernel looks the tables up itself

    def rotary_and_store_kv(self, q, k, v, kv_cache, context, slot_mapping):
        return self._rotary_store_kv(q, k, v, *kv_cache, slot_mapping, *context)


def ops_for(device: torch.device) -> TorchOps | TritonOps:
    return TritonOps() if device.type == "cuda" else TorchOps()


def attention_backend_for(device: torch.device):
    if device.type == "cuda":
        from ..attention_triton import TritonAttentionBackend

        return TritonAttentionBackend()
    from ..attention import TorchAttentionBackend

    return TorchAttentionBackend()
