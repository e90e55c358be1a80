"""The Llama family (Llama 2/3, TinyLlama, SmolLM2...) over a flat batch of tokens and a paged KV cache.

Numerics follow transformers' `LlamaForCausalLM` operation for operation (RMSNorm in float32, rotate-half
rotary embeddings, GQA, SwiGLU), so greedy tokens match it exactly in float32. The projections are fused
(q/k/v into one matrix, gate/up into one) to halve the number of matmuls; `load_weights` fuses
transformers-named tensors as they stream in.

Under tensor parallelism (`ParallelConfig.size > 1`) each rank holds `num_heads / size` query heads and
`num_kv_heads / size` KV heads (column-parallel q/k/v, row-parallel o_proj), a slice of the MLP's
intermediate features, and a range of the vocabulary (distributed/layers.py). Norms and the residual
stream are replicated. At size 1 the same layers are plain matmuls.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import nn

from ..attention import AttentionMetadata, NativeCpuAttentionBackend
from ..config import FUSED_GEMV_ROWS, ModelConfig
from ..distributed.layers import (
    ColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    VocabParallelEmbedding,
    vocab_parallel_logits,
)
from ..distributed.parallel_state import ParallelConfig
from ..kernels import cpu_ops
from .cpu_linear import CpuLinear
from .ops import NativeCpuOps, TorchOps, TritonOps, attention_backend_for, ops_for, supports_dependent_launch


def rotary_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2], with Llama-3 scaling when the config asks for it."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    old_len = scaling.original_max_position_embeddings
    low_wavelen = old_len / scaling.low_freq_factor
    high_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position, computed once in float32 exactly as transformers does."""

    def __init__(self, config: ModelConfig, max_positions: int) -> None:
        super().__init__()
        inv_freq = rotary_inv_freq(config)
        freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)  # [max_positions, head_dim]
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, parallel: ParallelConfig) -> None:
        super().__init__()
        h = config.hidden_size
        # this rank's heads: num_heads / size query heads over num_kv_heads / size KV heads
        self.num_heads = parallel.shard(config.num_attention_heads, "num_attention_heads")
        self.num_kv_heads = parallel.shard(config.num_key_value_heads, "num_key_value_heads")
        self.head_dim = config.head_dim
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.scale = config.head_dim**-0.5
        self.eps = config.rms_norm_eps
        self.input_layernorm = nn.Parameter(torch.ones(h))
        self.qkv_proj = ColumnParallelLinear(h, [config.q_size, config.kv_size, config.kv_size], parallel)
        self.o_proj = RowParallelLinear(config.q_size, h, parallel)
        self.post_attention_layernorm = nn.Parameter(torch.ones(h))
        self.gate_up_proj = ColumnParallelLinear(h, [config.intermediate_size] * 2, parallel)
        self.down_proj = RowParallelLinear(config.intermediate_size, h, parallel)

    def forward(self, hidden, residual, rotary_context, kv_cache, meta: AttentionMetadata, ops, backend):
        """hidden: the previous layer's output, residual: the running sum before it (None at layer 0, or
        when `hidden` already is the sum). Returns the same pair for the next layer (the add is fused into
        the next norm, or into the projection before it)."""
        num_tokens = hidden.shape[0]
        qkv, residual = ops.norm_and_project(hidden, residual, self.input_layernorm, self.eps, self.qkv_proj)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        # [num_tokens, num_heads / tp, head_dim] and [num_tokens, num_kv_heads / tp, head_dim]
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        # rotary embedding, the new K/V into the cache, attention: [num_tokens, num_heads / tp, head_dim]
        attn = backend.forward_new_tokens(q, k, v, kv_cache, meta, self.scale, ops, rotary_context)
        # [num_tokens, hidden], all-reduced (and, on the fused one-token path, already added to the residual)
        hidden, residual = ops.project(attn.reshape(num_tokens, self.q_size), self.o_proj, residual)
        # silu(gate) * up: [num_tokens, intermediate / tp]
        act, residual = ops.norm_and_activate(hidden, residual, self.post_attention_layernorm, self.eps,
                                              self.gate_up_proj)
        return ops.project(act, self.down_proj, residual)  # as o_proj: [num_tokens, hidden]


# transformers name suffix -> (our parameter, which shard of a fused matrix)
_FUSED = {
    "self_attn.q_proj.weight": ("qkv_proj.weight", 0),
    "self_attn.k_proj.weight": ("qkv_proj.weight", 1),
    "self_attn.v_proj.weight": ("qkv_proj.weight", 2),
    "mlp.gate_proj.weight": ("gate_up_proj.weight", 0),
    "mlp.up_proj.weight": ("gate_up_proj.weight", 1),
}
_RENAMED = {
    "self_attn.o_proj.weight": "o_proj.weight",
    "mlp.down_proj.weight": "down_proj.weight",
    "input_layernorm.weight": "input_layernorm",
    "post_attention_layernorm.weight": "post_attention_layernorm",
}


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig, max_positions: int, device: torch.device | None = None,
                 parallel: ParallelConfig | None = None, fused_gemv_rows: int = FUSED_GEMV_ROWS,
                 dependent_launch: bool = True, measured_tiles: bool = False) -> None:
        super().__init__()
        self.config = config
        self.parallel = parallel = parallel or ParallelConfig()
        device = device or torch.device("cpu")
        # NOTE: prepare_for_cpu may swap in NativeCpuOps
        pdl = dependent_launch and supports_dependent_launch(device)  # NOTE: the setting, where the GPU has it
        self.ops: TorchOps | TritonOps = ops_for(device, fused_gemv_rows, pdl, measured_tiles)
        self.backend = attention_backend_for(device, pdl)
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, parallel)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, parallel) for _ in range(config.num_hidden_layers))
        self.norm = nn.Parameter(torch.ones(config.hidden_size))
        self.lm_head = None if config.tie_word_embeddings else ParallelLMHead(
            config.vocab_size, config.hidden_size, parallel
        )
        self.rotary = RotaryEmbedding(config, max_positions)
        self.cpu_lm_head: CpuLinear | None = None
        # NOTE: set by prepare_for_cpu (each layer's weights in NativeCpuOps.one_token_layer's order): a single
        # token then runs each layer as one native call
        self.one_token_weights: list[list[torch.Tensor]] | None = None

    @property
    def lm_head_weight(self) -> torch.Tensor:
        """This rank's range of the vocabulary: [ceil(vocab / tp), hidden] (the whole table at tp 1)."""
        return (self.embed_tokens if self.lm_head is None else self.lm_head).weight

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)  # [num_tokens, hidden]
        rotary = self.ops.rotary_context(positions, self.rotary.cos, self.rotary.sin, hidden.dtype)
        residual = None
        one_token = self.one_token_weights is not None and input_ids.shape[0] == 1  # CPU single-stream decode
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches)):
            if one_token:
                hidden, residual = self.ops.one_token_layer(
                    layer, self.one_token_weights[i], hidden, residual, rotary, kv_cache, meta
                )
            else:
                hidden, residual = layer(hidden, residual, rotary, kv_cache, meta, self.ops, self.backend)
        return hidden if residual is None else residual + hidden  # [num_tokens, hidden], before the final norm

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """hidden: [num_rows, hidden] (already only the rows that need logits) -> [num_rows, vocab] on
        rank 0, None on the other ranks (which send their vocabulary range to rank 0)."""
        if self.cpu_lm_head is not None:
            hidden = self.ops.add_rms_norm(hidden, None, self.norm, self.config.rms_norm_eps)[0]
            return vocab_parallel_logits(hidden, self.cpu_lm_head, self.config.vocab_size, self.parallel)

        def norm_and_matmul(x: torch.Tensor) -> torch.Tensor:  # [num_rows, hidden] -> this rank's logits
            return self.ops.norm_and_matmul(x, None, self.norm, self.config.rms_norm_eps, self.lm_head_weight)[0]

        return vocab_parallel_logits(hidden, norm_and_matmul, self.config.vocab_size, self.parallel)

    # ---- weights -------------------------------------------------------------------------------
    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy transformers-named tensors into the fused (and, under tensor parallelism, sharded)
        parameters; every part of every parameter must be covered.

        NOTE: a sharded layer's `weight_loader` narrows the full tensor to this rank's slice before any
        copy or dtype conversion, so a rank touches only its share of a memory-mapped checkpoint.
        """
        params = dict(self.named_parameters())
        modules = dict(self.named_modules())
        expected = set()
        for target in params:
            owner = modules.get(target.rsplit(".", 1)[0]) if "." in target else None
            expected |= {(target, part) for part in range(getattr(owner, "num_parts", 1))}
        loaded: set[tuple[str, int]] = set()
        for name, tensor in weights:
            target, part = self._target_name(name)
            if target is None or target not in params:
                continue  # e.g. rotary buffers, or lm_head when tied (the embedding serves)
            owner = modules.get(target.rsplit(".", 1)[0]) if "." in target else None
            try:
                if hasattr(owner, "weight_loader"):
                    owner.weight_loader(tensor, part or 0)
                else:
                    dest = params[target]
                    if dest.shape != tensor.shape:
                        raise ValueError(f"expected shape {tuple(dest.shape)}, got {tuple(tensor.shape)}")
                    dest.copy_(tensor.to(dest.dtype))
            except ValueError as error:
                raise ValueError(f"{name}: {error}") from None
            loaded.add((target, part or 0))
        missing = expected - loaded
        if missing:
            raise ValueError(f"weights missing from checkpoint: {sorted(missing, key=str)[:8]}")

    def _target_name(self, name: str) -> tuple[str | None, int | None]:
        if name == "model.embed_tokens.weight":
            return "embed_tokens.weight", None
        if name == "model.norm.weight":
            return "norm", None
        if name == "lm_head.weight":
            return "lm_head.weight", None
        if not name.startswith("model.layers."):
            return None, None
        index, suffix = name[len("model.layers."):].split(".", 1)
        if suffix in _FUSED:
            target, shard = _FUSED[suffix]
            return f"layers.{index}.{target}", shard
        if suffix in _RENAMED:
            return f"layers.{index}.{_RENAMED[suffix]}", None
        if suffix == "self_attn.rotary_emb.inv_freq":  # older checkpoints' rotary buffer: computed here
            return None, None
        # NOTE: a layer's tensor this model has no place for (a bias, another architecture's norm) would be
        # dropped and the outputs silently wrong
        raise ValueError(f"{name}: a tensor the Llama architecture does not have")

    @torch.no_grad()
    def prepare_for_cpu(self, native_ops: bool = True) -> None:
        """Swap the projections and the LM head for CpuLinear (see cpu_linear.py for the measurements),
        and, in float32 with `native_ops`, the small operators and decode attention for the fused native
        ones (kernels/cpu_ops.cpp; built on first use, skipped with a warning where that fails), with a
        single token's layers run as one native call each."""
        native = native_ops and self.norm.dtype == torch.float32 and cpu_ops.load()
        if native:
            self.ops, self.backend = NativeCpuOps(), NativeCpuAttentionBackend()
        for layer in self.layers:
            for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
                getattr(layer, name).use_cpu_kernel()
        self.cpu_lm_head = CpuLinear(self.lm_head_weight)
        if self.lm_head is not None:
            self.lm_head = None  # NOTE: the CpuLinear copies serve; the row-major originals are freed
        if native and self.parallel.size == 1:  # NOTE: the native layer has no all-reduce
            self.one_token_weights = [
                [layer.input_layernorm, layer.qkv_proj.cpu_kernel.gemv_blocks, layer.o_proj.cpu_kernel.gemv_blocks,
                 layer.post_attention_layernorm, layer.gate_up_proj.cpu_kernel.gemv_blocks,
                 layer.down_proj.cpu_kernel.gemv_blocks]
                for layer in self.layers
            ]

    @torch.no_grad()
    def init_dummy_weights(self, seed: int = 0) -> None:
        """Random weights from the config alone (benchmarks), like vLLM's load_format='dummy'.

        NOTE: small normal weights keep activations finite through deep stacks; norms stay at one. Under
        tensor parallelism each rank draws its own shards (seeded by rank): the same distribution, though
        not the same model as one process with that seed.
        """
        seed = seed + 1_000_003 * self.parallel.rank
        generator = torch.Generator(device=self.embed_tokens.weight.device).manual_seed(seed)
        for name, param in self.named_parameters():
            if param.dim() == 1:
                param.fill_(1.0)
            else:
                param.normal_(0.0, 0.02, generator=generator)
