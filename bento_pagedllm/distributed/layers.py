"""Linear and embedding layers sharded across a tensor-parallel group (Megatron-LM's scheme).

- `ColumnParallelLinear`: the output features are split; each rank computes its slice, no communication.
  A fused matrix (q/k/v, gate/up) is split part by part, so each rank holds its own heads of q, of k and
  of v (and its slice of gate with the matching slice of up).
- `RowParallelLinear`: the input features are split (the column-parallel slice feeds it directly); each
  rank computes a partial sum of the full output and an all-reduce adds them.
- `VocabParallelEmbedding`: each rank holds a contiguous range of the vocabulary; tokens outside the
  range look up zeros and an all-reduce adds the one non-zero row. The LM head reuses the same split:
  each rank computes its range's logits and rank 0 gathers them (`vocab_parallel_logits`).

At `parallel.size == 1` these are a plain linear layer and a plain embedding (the collectives are no-ops).
Each layer's `weight_loader` takes a full checkpoint tensor and keeps its rank's slice.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..models.cpu_linear import CpuLinear
from .parallel_state import ParallelConfig


class _ShardedLinear(nn.Module):
    """The matmul of a sharded linear layer: `F.linear` on the GPU, CpuLinear's kernels on the CPU."""

    weight: torch.Tensor

    def __init__(self, out_features: int, in_features: int, parallel: ParallelConfig) -> None:
        super().__init__()
        self.parallel = parallel
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.cpu_kernel: CpuLinear | None = None

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight) if self.cpu_kernel is None else self.cpu_kernel(x)

    def reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """This layer's communication after its matmul (none for a column-parallel layer), so a caller
        that computes the matmul itself (a fused kernel) still gets the layer's full output."""
        return partial

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.reduce(self.matmul(x))

    @torch.no_grad()
    def use_cpu_kernel(self) -> None:
        """Swap the row-major weight for CpuLinear's layouts (see cpu_linear.py).

        NOTE: the parameter is dropped, so the original row-major tensor is freed; `cpu_kernel.weight`
        rebuilds the matrix for inspection.
        """
        self.cpu_kernel = CpuLinear(self.weight.detach())
        del self._parameters["weight"]


class ColumnParallelLinear(_ShardedLinear):
    """y[..., this rank's slice of each part] = x W_slice^T. `out_sizes`: the full size of each fused part."""

    def __init__(self, in_features: int, out_sizes: Sequence[int], parallel: ParallelConfig) -> None:
        self.full_sizes = tuple(out_sizes)
        self.local_sizes = tuple(parallel.shard(size, "output size") for size in out_sizes)
        super().__init__(sum(self.local_sizes), in_features, parallel)

    @property
    def num_parts(self) -> int:
        return len(self.full_sizes)

    @torch.no_grad()
    def weight_loader(self, tensor: torch.Tensor, part: int = 0) -> None:
        """tensor: the full checkpoint matrix of part `part`, [full_sizes[part], in_features]."""
        _check_shape(tensor, (self.full_sizes[part], self.weight.shape[1]))
        local = self.local_sizes[part]
        offset = sum(self.local_sizes[:part])
        rows = tensor.narrow(0, self.parallel.rank * local, local)
        self.weight[offset : offset + local].copy_(rows.to(self.weight.dtype))


class RowParallelLinear(_ShardedLinear):
    """y = all_reduce(x_slice W_slice^T): x arrives already split (a column-parallel layer's output)."""

    def __init__(self, in_features: int, out_features: int, parallel: ParallelConfig) -> None:
        self.full_in_features = in_features
        super().__init__(out_features, parallel.shard(in_features, "input size"), parallel)

    num_parts = 1

    def reduce(self, partial: torch.Tensor) -> torch.Tensor:
        # partial: [num_tokens, out_features], this rank's share -> summed over ranks
        return self.parallel.all_reduce(partial)

    @torch.no_grad()
    def weight_loader(self, tensor: torch.Tensor, part: int = 0) -> None:
        """tensor: the full checkpoint matrix, [out_features, in_features]."""
        _check_shape(tensor, (self.weight.shape[0], self.full_in_features))
        local = self.weight.shape[1]
        self.weight.copy_(tensor.narrow(1, self.parallel.rank * local, local).to(self.weight.dtype))


class VocabParallelEmbedding(nn.Module):
    """Rows [start, start + rows_per_rank) of the vocabulary on each rank.

    NOTE: when the vocabulary does not split evenly, the last ranks' tables are padded with zero rows
    (no token looks them up; their logits are cut off after the gather).
    """

    num_parts = 1

    def __init__(self, vocab_size: int, hidden_size: int, parallel: ParallelConfig) -> None:
        super().__init__()
        self.parallel = parallel
        self.vocab_size = vocab_size
        self.rows_per_rank = -(-vocab_size // parallel.size)
        self.start = parallel.rank * self.rows_per_rank
        self.weight = nn.Parameter(torch.empty(self.rows_per_rank, hidden_size))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """NOTE: rows are gathered by indexing (`weight[ids]`), not `F.embedding`: on CUDA its index_select
        takes, for at most 16 ids, a kernel that copies a row at a time (Llama-3-8B on an H200: 7.5 us for 7
        ids, 12.8 for 13, inside every decode step of a few sequences), where indexing takes the vectorised
        gather at every count (2.0-2.5 us, 2026-12-02 profile). The same rows either way."""
        if self.parallel.size == 1:
            return self.weight[input_ids]  # [num_tokens, hidden]
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.rows_per_rank)
        hidden = self.weight[local.masked_fill(outside, 0)]  # [num_tokens, hidden]
        hidden.masked_fill_(outside[:, None], 0.0)
        return self.parallel.all_reduce(hidden)

    @torch.no_grad()
    def weight_loader(self, tensor: torch.Tensor, part: int = 0) -> None:
        """tensor: the full table, [vocab_size, hidden]."""
        _check_shape(tensor, (self.vocab_size, self.weight.shape[1]))
        stop = min(self.start + self.rows_per_rank, self.vocab_size)
        n = max(0, stop - self.start)
        self.weight[:n].copy_(tensor[self.start : self.start + n].to(self.weight.dtype))
        self.weight[n:].zero_()


class ParallelLMHead(VocabParallelEmbedding):
    """The output projection, split over the vocabulary like the embedding (its own weight when untied)."""

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        raise TypeError("the LM head is applied with vocab_parallel_logits")


def vocab_parallel_logits(
    hidden: torch.Tensor, matmul, vocab_size: int, parallel: ParallelConfig
) -> torch.Tensor | None:
    """Full logits on rank 0 (None on the other ranks) from each rank's vocabulary range.

    hidden: [num_rows, hidden]; `matmul` maps it to this rank's [num_rows, rows_per_rank] logits.
    """
    local = matmul(hidden)  # [num_rows, ceil(vocab / size)]
    logits = parallel.gather_last_dim(local)  # [num_rows, size * ceil(vocab / size)] on rank 0
    if logits is None or logits.shape[-1] == vocab_size:
        return logits
    return logits[:, :vocab_size]


def _check_shape(tensor: torch.Tensor, expected: tuple[int, ...]) -> None:
    if tuple(tensor.shape) != tuple(expected):
        raise ValueError(f"expected shape {tuple(expected)}, got {tuple(tensor.shape)}")
