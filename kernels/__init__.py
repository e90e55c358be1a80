"""Triton kernels, each beside a pure-torch reference of the same function (`*_ref`).

Installed as `bento_pagedllm.kernels` (see pyproject's package-dir), never as a top-level `kernels`.
NOTE: importing this package must stay cheap and free of side effects: nothing here imports triton at
module level, so the CPU path never needs it.
"""
