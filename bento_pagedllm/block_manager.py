"""The pool of KV-cache blocks: allocation, sharing by reference count, copy-on-write and freeing.

Pure Python and exact: tests assert that after every scenario the free count returns to the total.
A block holds `block_size` consecutive token positions of one sequence; position p of a sequence lives in
slot `block_table[p // block_size] * block_size + p % block_size` of the cache.
"""

from __future__ import annotations

from collections import deque

from .sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref_counts = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _shared_blocks_to_write(self, seq: Sequence, num_new_tokens: int) -> list[int]:
        """Indices into the block table of existing blocks that this step writes but others also use."""
        first = seq.num_computed_tokens // self.block_size
        last = min((seq.num_computed_tokens + num_new_tokens - 1) // self.block_size, len(seq.block_table) - 1)
        return [i for i in range(first, last + 1) if self.ref_counts[seq.block_table[i]] > 1]

    def allocate_slots(self, seq: Sequence, num_new_tokens: int) -> list[tuple[int, int]] | None:
        """Make room for positions [num_computed, num_computed + num_new_tokens) of `seq`.

        Returns the (src, dst) block copies the model runner must do first (copy-on-write of shared
        blocks), or None, changing nothing, when the pool is too small right now.
        """
        total = seq.num_computed_tokens + num_new_tokens
        num_missing = max(0, self.num_blocks_for(total) - len(seq.block_table))
        shared = self._shared_blocks_to_write(seq, num_new_tokens)
        if num_missing + len(shared) > len(self._free):
            return None
        copies = []
        for i in shared:
            src = seq.block_table[i]
            dst = self._take()
            self.ref_counts[src] -= 1
            seq.block_table[i] = dst
            copies.append((src, dst))
        seq.block_table.extend(self._take() for _ in range(num_missing))
        return copies

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """The child shares every block of the parent."""
        child.block_table = list(parent.block_table)
        for block in child.block_table:
            self.ref_counts[block] += 1

    def free(self, seq: Sequence) -> None:
        # NOTE: freed in reverse so the tail blocks, least likely shared, are reused last (LRU-friendly).
        for block in reversed(seq.block_table):
            self.ref_counts[block] -= 1
            assert self.ref_counts[block] >= 0, f"double free of block {block}"
            if self.ref_counts[block] == 0:
                self._free.append(block)
        seq.block_table = []

    def _take(self) -> int:
        block = self._free.popleft()
        assert self.ref_counts[block] == 0
        self.ref_counts[block] = 1
        return block
