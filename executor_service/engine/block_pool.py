"""The KV cache's block ids: reference counts, free blocks, and the prefix cache's hash of each block.

A block is held by every request whose block table lists it (its reference count). When the count drops to
zero the block is free, but a block that holds a cached prefix keeps its content and hash: a later request
with the same prefix takes it back (`touch`) instead of recomputing it. New blocks come first from the free
blocks that hold nothing reusable, then from the cached ones, least recently freed first (LRU eviction);
only then does a cached block lose its hash and get overwritten. A block in use is never handed out.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable

from executor_service.errors import KVCacheFull

BlockHash = bytes


class BlockPool:
    """Block ids with reference counts; allocation is all-or-nothing."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self.block_hashes: list[BlockHash | None] = [None] * num_blocks
        self._cached: dict[BlockHash, int] = {}  # hash -> the block holding that prefix
        self._free_plain: deque[int] = deque(range(num_blocks))  # free, nothing to reuse: taken first
        self._free_cached: OrderedDict[int, None] = OrderedDict()  # free, cached prefix; least recent first

    @property
    def num_free(self) -> int:
        """Blocks no request holds (cached ones included: they are evicted when needed)."""
        return len(self._free_plain) + len(self._free_cached)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def num_cached_free(self) -> int:
        """Free blocks that still hold a reusable prefix."""
        return len(self._free_cached)

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    def can_allocate(self, count: int) -> bool:
        return count <= self.num_free

    def allocate(self, count: int) -> list[int]:
        """`count` blocks held once each; evicts the least recently freed cached blocks when it must."""
        if count > self.num_free:
            raise KVCacheFull(f"KV cache full: {count} blocks asked, {self.num_free} free")
        blocks = []
        for _ in range(count):
            if self._free_plain:
                block = self._free_plain.popleft()
            else:
                block, _ = self._free_cached.popitem(last=False)
                self._evict(block)
            self.ref_counts[block] = 1
            blocks.append(block)
        return blocks

    def free(self, blocks: Iterable[int]) -> None:
        """Drop one hold on each block. A request frees its blocks last first, so that of a cached prefix the
        tail is evicted before the head (which more requests share). Raises on a block not held: a double
        free would let two requests write one block."""
        for block in blocks:
            if self.ref_counts[block] <= 0:
                raise RuntimeError(f"KV block {block} freed more often than it was taken")
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                if self.block_hashes[block] is None:
                    self._free_plain.append(block)
                else:
                    self._free_cached[block] = None

    def touch(self, blocks: Iterable[int]) -> None:
        """Take one more hold on cached blocks (a prefix hit); free ones leave the free queue."""
        for block in blocks:
            if self.ref_counts[block] == 0:
                del self._free_cached[block]  # only cached blocks are found by a lookup
            self.ref_counts[block] += 1

    def num_free_among(self, blocks: Iterable[int]) -> int:
        """How many of these (cached) blocks are free: touching them takes them out of `num_free`."""
        return sum(1 for block in blocks if self.ref_counts[block] == 0)

    def lookup(self, block_hash: BlockHash) -> int | None:
        return self._cached.get(block_hash)

    def cache(self, block: int, block_hash: BlockHash) -> bool:
        """Record that a held block holds the prefix `block_hash`; False when another block already does
        (two requests computed the same prefix at once: this one stays unshared)."""
        if self.ref_counts[block] <= 0:
            raise RuntimeError(f"KV block {block} cached while free")
        if block_hash in self._cached or self.block_hashes[block] is not None:
            return False
        self._cached[block_hash] = block
        self.block_hashes[block] = block_hash
        return True

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (the free blocks keep nothing reusable); blocks in use keep theirs."""
        for block in self._free_cached:
            self._evict(block)
            self._free_plain.append(block)
        self._free_cached.clear()

    def _evict(self, block: int) -> None:
        block_hash = self.block_hashes[block]
        if block_hash is not None:
            del self._cached[block_hash]
            self.block_hashes[block] = None
