"""The pool of KV-cache blocks: allocation, sharing by reference count, copy-on-write, prefix caching.

Pure Python and exact: tests assert that after every scenario the free count returns to the total.
A block holds `block_size` consecutive token positions of one sequence; position p of a sequence lives in
slot `block_table[p // block_size] * block_size + p % block_size` of the cache.

Prefix caching: a full block is named by a hash of its tokens chained with the previous block's hash, so
equal names mean equal prefixes. NOTE: SHA-256 (as vLLM's), not Python's `hash`: a name is shared by
everyone whose prompt has it, so a crafted prompt must not be able to collide with another user's and read
its KV (~0.9 us a block on this project's CPU, against 0.17: ~10 ms of host time over a 500-request run).
Named blocks stay in the cache after their last user frees them; a new sequence takes the blocks of its
longest named prefix instead of computing them again. Free blocks are kept in least-recently-freed order
and a named one loses its name only when it is taken for new work (eviction happens only when memory is
needed).
NOTE: "free" counts every block with no user, named or not: all of them can be taken at any time.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict

from .sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # LRU first
        self._name_of: list[bytes | None] = [None] * num_blocks  # block -> its prefix hash
        self._cached: dict[bytes, int] = {}  # prefix hash -> block
        self.prefix_query_tokens = 0
        self.prefix_hit_tokens = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- prefix caching ------------------------------------------------------------------------
    def _prefix_hashes(self, seq: Sequence, num_blocks: int) -> list[bytes]:
        """Chained hashes of the sequence's first `num_blocks` full blocks (memoised on the sequence)."""
        hashes = seq.block_hashes
        bs = self.block_size
        while len(hashes) < num_blocks:
            i = len(hashes)
            parent = hashes[-1] if hashes else empty_prefix_name(seq.request.cache_salt)
            hashes.append(block_name(parent, seq.token_ids[i * bs : (i + 1) * bs]))
        return hashes  # NOTE: may be longer than asked (memo); callers index it

    def match_prefix(self, seq: Sequence) -> int:
        """Give a sequence with no blocks the cached blocks of its longest named prefix; returns the number
        of tokens they hold (now computed).

        NOTE: at least the last token is always left to compute, so the step that finishes the prompt
        produces its logits.
        """
        assert not seq.block_table and seq.num_computed_tokens == 0
        if not self.enable_prefix_caching:
            return 0
        full = (seq.num_tokens - 1) // self.block_size
        self.prefix_query_tokens += full * self.block_size
        for name in self._prefix_hashes(seq, full)[:full]:
            block = self._cached.get(name)
            if block is None:
                break
            if self.ref_counts[block] == 0:
                del self._free[block]
            self.ref_counts[block] += 1
            seq.block_table.append(block)
        seq.num_named_blocks = len(seq.block_table)
        hit = len(seq.block_table) * self.block_size
        self.prefix_hit_tokens += hit
        seq.num_computed_tokens = hit
        return hit

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Name the blocks that the sequence's computed and known tokens fill (after a step is launched,
        and again when its pending tokens are read)."""
        if not self.enable_prefix_caching:
            return
        full = min(seq.num_computed_tokens, seq.num_known_tokens) // self.block_size
        if full <= seq.num_named_blocks:
            return  # NOTE: incremental: each block is offered once, so a step costs O(new blocks)
        hashes = self._prefix_hashes(seq, full)
        for i in range(seq.num_named_blocks, full):
            block, name = seq.block_table[i], hashes[i]
            if self._name_of[block] is None and name not in self._cached:
                self._name_of[block] = name
                self._cached[name] = block
        seq.num_named_blocks = full

    # ---- allocation ----------------------------------------------------------------------------
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
        table = seq.block_table
        if (num_new_tokens == 1 and total <= len(table) * self.block_size
                and self.ref_counts[table[seq.num_computed_tokens // self.block_size]] == 1):
            return []  # NOTE: most decode steps: the slot is in a block the sequence alone holds
        num_missing = max(0, self.num_blocks_for(total) - len(table))
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
        # NOTE: freed tail first, so a sequence's tail blocks are evicted before its head, which other
        # prompts are likelier to share.
        for block in reversed(seq.block_table):
            self.ref_counts[block] -= 1
            assert self.ref_counts[block] >= 0, f"double free of block {block}"
            if self.ref_counts[block] == 0:
                self._free[block] = None
        seq.block_table = []
        seq.num_named_blocks = 0

    def _take(self) -> int:
        """The least recently freed block, its old name (if any) evicted."""
        block, _ = self._free.popitem(last=False)
        assert self.ref_counts[block] == 0
        name = self._name_of[block]
        if name is not None:
            del self._cached[name]
            self._name_of[block] = None
        self.ref_counts[block] = 1
        return block


def block_name(parent: bytes, token_ids: list[int]) -> bytes:
    """SHA-256 of the prefix's name and the block's token ids (8 bytes each, little-endian)."""
    return hashlib.sha256(parent + struct.pack(f"<{len(token_ids)}q", *token_ids)).digest()


def empty_prefix_name(cache_salt: str | None) -> bytes:
    """The name the first block chains from: empty, or a request's `cache_salt` (hashed, tagged so that it
    cannot equal a block's name: token ids pack with zero bytes the tag does not have)."""
    if cache_salt is None:
        return b""
    return hashlib.sha256(b"cache_salt:" + cache_salt.encode("utf-8", "surrogatepass")).digest()
