"""The small operators of a Llama layer, one implementation per device, chosen once and passed in.

`TorchOps` is the reference (transformers' numerics op for op) and the CPU path; `TritonOps` fuses each
operator into one Triton kernel for CUDA. The model calls the same four methods on either.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..attention import write_kv_cache_ref


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm: normalise in float32, cast back, then scale."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def rotate_half_apply(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """Rotary embedding, transformers' rotate-half convention. cos, sin: [num_tokens, 1, head_dim]."""
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class TorchOps:
    def add_rms_norm(self, x, residual, weight, eps):
        """(rms_norm(x + residual), x + residual); with no residual yet, (rms_norm(x), x)."""
        total = x if residual is None else residual + x  # NOTE: the order transformers adds in
        return rms_norm(total, weight, eps), total

    def rotary_context(self, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, dtype: torch.dtype):
        """Per-step rotary inputs: the tables looked up once for all layers (cheap on the CPU)."""
        return cos[positions].to(dtype)[:, None, :], sin[positions].to(dtype)[:, None, :]

    def rotary_and_store_kv(self, q, k, v, kv_cache, context, slot_mapping):
        """Rotate q and k, store k and v in their cache slots; returns the rotated q."""
        q, k = rotate_half_apply(q, k, *context)
        write_kv_cache_ref(k, v, *kv_cache, slot_mapping)
        return q

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)  # [num_tokens, intermediate] each
        return F.silu(gate) * up


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
