"""Host-to-device copies for a step's small inputs: packed, pinned and asynchronous.

NOTE: `torch.tensor(values, device="cuda")` copies from pageable memory, which blocks the host until the
GPU's queue reaches the copy: a step built from a dozen of them stalls a dozen times. Packing the lists
into one host tensor per dtype and copying it once, from pinned memory, without blocking, keeps the
step's only synchronisation at the read of the sampled token ids.
"""

from __future__ import annotations

import torch


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """One asynchronous copy (through pinned memory on CUDA); on the CPU the tensor itself."""
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def pack_to_device(lists: dict[str, list[int]], dtype: torch.dtype, device: torch.device) -> dict[str, torch.Tensor]:
    """Several integer lists as device tensors of one dtype, through a single copy."""
    flat = [value for values in lists.values() for value in values]
    packed = to_device(torch.tensor(flat, dtype=dtype), device)
    out, start = {}, 0
    for name, values in lists.items():
        out[name] = packed[start : start + len(values)]
        start += len(values)
    return out
