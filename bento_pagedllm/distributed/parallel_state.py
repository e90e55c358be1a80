"""Who this process is in a tensor-parallel group, and the few collectives the model needs.

`ParallelConfig` is a small frozen handle passed explicitly to every layer that shards or communicates
(no module-level state is read). At `size == 1` every collective returns its input untouched, so one code
path serves one process and many.

NOTE: torch.distributed keeps one default process group per process: an engine with
`tensor_parallel_size > 1` creates it (`init_group`) and leaves it at shutdown (`leave_group`), so a
process holds at most one such engine at a time.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist

# NOTE: long enough for a big checkpoint's load on a slow rank (the first collective waits for it)
_TIMEOUT = datetime.timedelta(minutes=30)


class PeerAllReduce:
    """An all-reduce through peer memory over NVLink, for the messages of decode and small mixed steps.

    Why: a step of a 32-layer model all-reduces 65 times; inside a CUDA graph on the H200 pair
    (bench/allreduce.py, 2026-12-01) NCCL took 12 us for up to 64 KB, 19 us for 1 MB and 36 us for 4 MB,
    torch's two-shot kernel through peer memory 9, 12 and 22 us. Each rank copies its input into a buffer
    every rank has mapped (torch's symmetric memory); `symm_mem.two_shot_all_reduce_` has each rank sum
    its half of every rank's buffer and write the sums to every rank's buffer (plain loads and stores
    behind a barrier through signal pads, no multicast, so NVLink multicast stays off); the sum is copied
    back in place. Larger messages (big prefill steps) go to NCCL, as fast there.

    NOTE: built by every rank at group start (the rendezvous is collective), never lazily: the first
    all-reduce may run inside a CUDA graph capture.
    """

    MAX_BYTES = 8 << 20  # 1,024 tokens of a 4096-wide bf16 model

    def __init__(self, group: "dist.ProcessGroup", device: torch.device, dtype: torch.dtype) -> None:
        import torch.distributed._symmetric_memory as symm_mem

        self.group_name = group.group_name
        self.world_size = group.size()
        self.buffer = symm_mem.empty(self.MAX_BYTES // dtype.itemsize, dtype=dtype, device=device)
        symm_mem.rendezvous(self.buffer, group.group_name)

    def fits(self, x: torch.Tensor) -> bool:
        # NOTE: each rank's share must be whole 16-byte vectors (the kernel moves 16 bytes at a time)
        whole = x.numel() * x.element_size() % (16 * self.world_size) == 0
        return x.dtype == self.buffer.dtype and x.numel() <= self.buffer.numel() and whole

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        staged = self.buffer[: x.numel()]
        staged.copy_(x.reshape(-1))
        torch.ops.symm_mem.two_shot_all_reduce_(staged, "sum", self.group_name)
        return x.copy_(staged.view(x.shape))


@dataclass(frozen=True)
class ParallelConfig:
    """This rank's place in the tensor-parallel group. Rank 0 schedules and samples; the others
    ("workers") run the same forward on their shard of the heads and of the vocabulary."""

    size: int = 1
    rank: int = 0
    group: "dist.ProcessGroup | None" = None  # None at size 1
    peer_all_reduce: PeerAllReduce | None = None  # CUDA: small all-reduces through NVLink peer memory

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"bad tensor-parallel rank {self.rank} of {self.size}")
        if self.size > 1 and self.group is None:
            raise ValueError("tensor parallelism needs a process group")

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    def shard(self, total: int, what: str = "size") -> int:
        """This rank's part of an evenly split dimension (validated by EngineArgs before any process starts)."""
        if total % self.size:
            raise ValueError(f"{what} {total} is not divisible by tensor_parallel_size {self.size}")
        return total // self.size

    # ---- collectives (no-ops at size 1) ---------------------------------------------------------
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over ranks (row-parallel outputs, the vocabulary-parallel embedding), in place."""
        if self.size == 1:
            return x
        if self.peer_all_reduce is not None and self.peer_all_reduce.fits(x):
            return self.peer_all_reduce(x)
        dist.all_reduce(x, group=self.group)
        return x

    def all_reduce_min(self, value: int) -> int:
        """The smallest of every rank's value (the KV block count every rank can hold)."""
        if self.size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64, device=self.collective_device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return int(t.item())

    def gather_last_dim(self, x: torch.Tensor) -> torch.Tensor | None:
        """Rank 0 gets every rank's `x` concatenated along the last dimension; the others get None.

        x: [rows, n / size] on each rank -> [rows, n] on rank 0.
        """
        if self.size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)] if self.is_driver else None
        dist.gather(x, parts, dst=0, group=self.group)
        return torch.cat(parts, dim=-1) if self.is_driver else None

    def broadcast_from_driver(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank gets rank 0's `x` (same shape and dtype allocated on every rank)."""
        if self.size > 1:
            dist.broadcast(x, src=0, group=self.group)
        return x

    @property
    def collective_device(self) -> torch.device:
        backend = dist.get_backend(self.group) if self.group is not None else "gloo"
        return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")


def driver_store(size: int, host: str = "127.0.0.1") -> "dist.TCPStore":
    """Rank 0's rendezvous store, on a free port (the workers get `store.port`)."""
    return dist.TCPStore(host, 0, size, is_master=True, timeout=_TIMEOUT, wait_for_workers=False)


def worker_store(size: int, host: str, port: int) -> "dist.TCPStore":
    return dist.TCPStore(host, port, size, is_master=False, timeout=_TIMEOUT)


def init_group(size: int, rank: int, store: "dist.TCPStore", device: torch.device,
               dtype: torch.dtype = torch.float32, peer_all_reduce: bool = False) -> ParallelConfig:
    """Join the tensor-parallel group: NCCL on CUDA (one device per rank), gloo on the CPU; on CUDA also the
    peer-memory all-reduce for small messages of `dtype` where the GPUs can map each other's memory."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=_TIMEOUT)
    peer = None
    if device.type == "cuda" and peer_all_reduce:
        # NOTE: every rank decides alike (same machine, same torch), so all or none enter the rendezvous
        peer = PeerAllReduce(dist.group.WORLD, device, dtype)
    return ParallelConfig(size=size, rank=rank, group=dist.group.WORLD, peer_all_reduce=peer)


def leave_group() -> None:
    """Leave the group at shutdown, waiting for no other rank.

    NOTE: every step's work is finished by then (rank 0 has read it; a worker has synchronized). NCCL's
    graceful destroy (`destroy_process_group`) is collective and flushes outstanding work, and it hung
    on the H200 pair at shutdown; an abort is local to the rank, so one dead or slow rank cannot hang
    the others' shutdown.
    """
    if dist.is_initialized():
        dist.distributed_c10d._abort_process_group()
