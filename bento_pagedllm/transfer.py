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


ALIGNMENT_BYTES = 16


def pack_to_device(lists: dict[str, list[int]], dtype: torch.dtype, device: torch.device) -> dict[str, torch.Tensor]:
    """Several integer lists as device tensors of one dtype, through a single copy.

    NOTE: each list starts on a 16-byte boundary (the lists are padded): Triton compiles a kernel variant
    per pointer alignment class, so views at offsets that vary with the step's sizes made a fresh machine
    compile the prefill kernel inside a benchmark's clock (~1 s; bench/serve.py's triton_compiles_in_run)."""
    per_boundary = ALIGNMENT_BYTES // torch.empty(0, dtype=dtype).element_size()
    flat, starts = [], []
    for values in lists.values():
        starts.append(len(flat))
        flat += values
        flat += [0] * (-len(flat) % per_boundary)
    packed = to_device(torch.tensor(flat, dtype=dtype), device)
    return {name: packed[start : start + len(values)] for (name, values), start in zip(lists.items(), starts)}
