"""Triton kernels, each beside a pure-torch reference of the same function (`*_ref`).

Imported as `bento_pagedllm.kernels` (the top-level `kernels` folder is a symlink here, for reading),
never as a top-level `kernels` package.
NOTE: importing this package must stay cheap and free of side effects: nothing here imports triton at
module level, so the CPU path never needs it.
"""
