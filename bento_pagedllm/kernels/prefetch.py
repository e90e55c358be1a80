"""Ask L2 for memory a program will read soon, without waiting for it: the part of a kernel that may run
before the kernel ahead of it ends (programmatic dependent launch, kernels/gemv.py) uses it for data that
kernel does not write."""

import triton
import triton.language as tl


@triton.jit
def prefetch_to_l2(ptrs):
    """One request per pointer (give one per 128-byte line); nothing comes back, so the program goes on.
    NOTE: L2 is where every write lands, so a prefetched line is never stale."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
                              is_pure=False, pack=1)
