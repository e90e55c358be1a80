"""Paged attention behind one interface: the metadata of a step and the backends that consume it.

A layer hands its projected q/k/v to `backend.forward_new_tokens`: the rotary embedding and the cache
write of the new keys and values (the ops' fused operator), then `backend.forward(q, kv_cache, metadata,
scale)`, which reads only the cache; a backend may fold the first two into its attention kernel (the
Triton one does for a single sequence's decode step). The metadata describes a varlen batch: sequence i
owns query tokens `query_start_loc[i]:query_start_loc[i+1]` (its new tokens this step), which sit at the
end of its `seq_lens[i]` context tokens in the cache, found through `block_tables[i]`. Prefill chunks,
decodes and recomputes are all the same shape of problem.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class AttentionMetadata:
    """Everything attention needs about a step, passed explicitly to every layer.

    Tensors live on the model's device; the `*_host` tuples are the same numbers on the host, so the
    torch path can plan its batching without a device synchronisation.
    """

    slot_mapping: torch.Tensor  # [num_tokens] int64, cache slot written by each new token
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    seq_lens: torch.Tensor  # [num_seqs] int32, context length after this step
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32, padded with 0
    query_lens_host: tuple[int, ...]
    seq_lens_host: tuple[int, ...]
    decode_indices: torch.Tensor  # [num_decodes] int64: sequences with exactly one new token
    decode_token_indices: torch.Tensor  # [num_decodes] int64: their token positions in the batch
    decode_indices_host: tuple[int, ...]

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens_host)


def write_kv_cache_ref(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store the new tokens' keys and values in their cache slots; a negative slot (padding) stores nothing.

    k, v: [num_tokens, num_kv_heads, head_dim]; caches: [num_blocks, block_size, num_kv_heads, head_dim].
    """
    num_kv_heads, head_dim = k.shape[1:]
    if bool((slot_mapping < 0).any()):
        keep = slot_mapping >= 0
        k, v, slot_mapping = k[keep], v[keep], slot_mapping[keep]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def _gather_context(cache: torch.Tensor, block_tables: torch.Tensor, max_len: int) -> torch.Tensor:
    """[num_seqs, max_len, num_kv_heads, head_dim] of cached tokens, read through the block tables."""
    num_seqs = block_tables.shape[0]
    block_size, num_kv_heads, head_dim = cache.shape[1:]
    num_blocks = -(-max_len // block_size)
    # NOTE: index_select over the flattened table, not advanced indexing: a third of the time on the CPU
    gathered = cache.index_select(0, block_tables[:, :num_blocks].reshape(-1))  # [seqs * blocks, bs, kv, d]
    return gathered.view(num_seqs, num_blocks * block_size, num_kv_heads, head_dim)[:, :max_len]


def paged_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: list[int],
    query_lens: list[int],
    scale: float,
) -> torch.Tensor:
    """Causal attention of a padded batch of queries over their paged contexts.

    q: [num_seqs, max_query_len, num_heads, head_dim], queries right-padded; query j of sequence i sits
    at position seq_lens[i] - query_lens[i] + j and sees every cached position up to its own.
    Returns [num_seqs, max_query_len, num_heads, head_dim] (padding rows are garbage).
    """
    num_seqs, max_q = q.shape[:2]
    max_len = max(seq_lens)
    k = _gather_context(k_cache, block_tables, max_len).transpose(1, 2)  # [seqs, kv_heads, max_len, d]
    v = _gather_context(v_cache, block_tables, max_len).transpose(1, 2)
    q = q.transpose(1, 2)  # [num_seqs, num_heads, max_q, head_dim]
    mask = None
    # NOTE: one sequence whose queries are its whole context is plain causal attention, no mask needed.
    if not (num_seqs == 1 and query_lens[0] == seq_lens[0]) and not (
        max_q == 1 and all(n == max_len for n in seq_lens)
    ):
        lens = torch.tensor(seq_lens, device=q.device)
        first_pos = lens - torch.tensor(query_lens, device=q.device)  # [num_seqs]
        query_pos = first_pos[:, None] + torch.arange(max_q, device=q.device)  # [num_seqs, max_q]
        key_pos = torch.arange(max_len, device=q.device)
        mask = (key_pos[None, None, :] <= query_pos[:, :, None]) & (key_pos[None, None, :] < lens[:, None, None])
        mask = mask[:, None]  # [num_seqs, 1, max_q, max_len]
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=mask is None and max_q > 1, scale=scale,
        enable_gqa=q.shape[1] != k.shape[1],
    )
    return out.transpose(1, 2)


class AttentionBackend:
    """What every backend shares: a layer's attention from its projected q/k/v."""

    def forward_new_tokens(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim], as projected (not yet rotated)
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
        scale: float,
        ops,  # the model's small operators (models/ops.py): their rotary_and_store_kv
        rotary_context,  # ops.rotary_context(...) of this step
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        q = ops.rotary_and_store_kv(q, k, v, kv_cache, rotary_context, meta.slot_mapping)
        return self.forward(q, kv_cache, meta, scale)

    def forward(self, q, kv_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        raise NotImplementedError


class TorchAttentionBackend(AttentionBackend):
    """The reference path (CPU): SDPA over contexts gathered from the paged cache.

    Decodes (one new token each) run as one padded batch; each prefill chunk runs on its own, so a long
    prompt never pads the decodes up to its length.
    """

    def decode(
        self,
        q: torch.Tensor,  # [num_decodes, num_heads, head_dim]: one new token per sequence
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        block_tables: torch.Tensor,  # [num_decodes, max_blocks]
        seq_lens: torch.Tensor,  # [num_decodes] int32
        seq_lens_host: list[int],
        scale: float,
    ) -> torch.Tensor:  # [num_decodes, num_heads, head_dim]
        k_cache, v_cache = kv_cache
        return paged_attention_ref(
            q[:, None], k_cache, v_cache, block_tables, seq_lens_host, [1] * len(seq_lens_host), scale
        )[:, 0]

    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        kv_cache: tuple[torch.Tensor, torch.Tensor],  # the step's keys and values already stored
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        k_cache, v_cache = kv_cache
        num_decodes = len(meta.decode_indices_host)
        if num_decodes == meta.num_seqs:  # the steady state: every sequence decodes one token
            return self.decode(q, kv_cache, meta.block_tables, meta.seq_lens, list(meta.seq_lens_host), scale)
        out = torch.empty_like(q)
        if num_decodes:
            tokens, seqs = meta.decode_token_indices, meta.decode_indices
            decode_seq_lens = [meta.seq_lens_host[i] for i in meta.decode_indices_host]
            out[tokens] = self.decode(
                q[tokens], kv_cache, meta.block_tables[seqs], meta.seq_lens[seqs], decode_seq_lens, scale
            )
        start = 0
        for i, (query_len, seq_len) in enumerate(zip(meta.query_lens_host, meta.seq_lens_host)):
            if query_len > 1:
                out[start : start + query_len] = paged_attention_ref(
                    q[None, start : start + query_len], k_cache, v_cache, meta.block_tables[i : i + 1],
                    [seq_len], [query_len], scale,
                )[0]
            start += query_len
        return out


class NativeCpuAttentionBackend(TorchAttentionBackend):
    """The CPU path with one native call for all the decodes of a step (kernels/cpu_ops.cpp): read
    straight through the block tables, no gathered copy of the contexts, float32. Prefill chunks keep
    SDPA, which is fast for many queries. NOTE: construct only after `cpu_ops.load()` returned True."""

    def decode(self, q, kv_cache, block_tables, seq_lens, seq_lens_host, scale):
        return torch.ops.pagedllm_cpu.decode_attention(q, *kv_cache, block_tables, seq_lens, scale)
