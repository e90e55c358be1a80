"""The GPU attention path: the same interface as TorchAttentionBackend, served by Triton kernels.

Each step's new K/V go into the paged cache with the rotary kernel, then one attention launch serves the
whole varlen batch: the split-K decode kernel when every sequence decodes one token (the steady state),
the prefill kernel otherwise (mixed steps, decodes included, in a single launch). A single sequence's
decode step (single-stream decode) skips the rotary kernel: the decode kernel rotates and stores itself.

NOTE: nothing here synchronises with the device: launch sizes come from the metadata's host tuples,
never from `.item()`/`.tolist()` on its tensors, so a step's layers queue up without stalls.
"""

from __future__ import annotations

import torch

from .attention import AttentionBackend, AttentionMetadata
from .kernels.paged_decode import NewKV, choose_num_splits, paged_decode_attention
from .kernels.paged_prefill import paged_prefill_attention


# (sequence, KV head) pairs the split counters cover: decode splits only batches of fewer pairs than two
# waves of programs (kernels/paged_decode.py::choose_num_splits), a few hundred on any GPU
MAX_SPLIT_PAIRS = 4096


class TritonAttentionBackend(AttentionBackend):
    """Paged attention with Triton kernels (CUDA; the CPU only under TRITON_INTERPRET=1, for tests).

    NOTE: owns the split decode kernel's counters, allocated zeroed with the backend (before any graph
    capture) and never reallocated: graphs hold their address, and each launch leaves them zero.
    `dependent_launch`: decode attention launches as a programmatic dependent of the kernel before it
    (kernels/gemv.py says why; compute capability 9+ only).
    """

    def __init__(self, device: torch.device | str, dependent_launch: bool = False) -> None:
        self.split_counters = torch.zeros(MAX_SPLIT_PAIRS, dtype=torch.int32, device=device)
        self.pdl = dependent_launch

    def forward_new_tokens(self, q, k, v, kv_cache, meta, scale, ops, rotary_context):
        """A single sequence's decode step: the decode kernel does the rotary embedding and the cache write
        itself (one launch, no kernel boundary between). NOTE: only for one sequence: batches ran slower
        fused than through the rotary kernel and attention, and no faster with the fused kernel's registers
        capped (kernels/paged_decode.py has the figures)."""
        if not (meta.num_seqs == 1 and len(meta.decode_indices_host) == 1):
            return super().forward_new_tokens(q, k, v, kv_cache, meta, scale, ops, rotary_context)
        _, cos, sin = rotary_context  # NOTE: TritonOps' context: positions (seq_len - 1 here), tables
        return self._decode(q, kv_cache, meta, scale, NewKV(k, v, meta.slot_mapping, cos, sin))

    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        kv_cache: tuple[torch.Tensor, torch.Tensor],  # each [num_blocks, block_size, num_kv_heads, head_dim]
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        k_cache, v_cache = kv_cache
        if len(meta.decode_indices_host) == meta.num_seqs:  # every sequence decodes one token
            return self._decode(q, kv_cache, meta, scale, None)
        return paged_prefill_attention(
            q, k_cache, v_cache, meta.block_tables, meta.query_start_loc, meta.seq_lens,
            max(meta.query_lens_host), scale,
        )

    def _decode(self, q, kv_cache, meta, scale, new_kv: NewKV | None) -> torch.Tensor:
        """NOTE: one query token per sequence, so the tokens are the sequences, in order."""
        k_cache, v_cache = kv_cache
        num_splits = choose_num_splits(max(meta.seq_lens_host), meta.num_seqs, q.shape[1], k_cache.shape[2],
                                       q.device)
        return paged_decode_attention(
            q, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale, num_splits=num_splits,
            split_counters=self.split_counters, pdl=self.pdl, new_kv=new_kv,
        )
