"""Automatic prefix caching: the KV blocks of full prompt prefixes, found again by a hash of their tokens.

A block's K/V is a function of the tokens up to its end (and, for an EAGLE drafter, one token past it: see
`tokens_after_block`), so its key is a hash chained over the block's tokens and its parent's key, as vLLM's
block cache does: two blocks with the same tokens after different prefixes never share a key. One key
covers both caches, the target's and the drafter's, because they share block ids; a block is registered
only once both were written for its positions (`cache_blocks`, after the step's drafter pass).

A request admitted from the queue takes the longest run of its leading blocks that are cached
(`computed_blocks`) and computes from there. At least one token is always computed: the last prompt
token's logits sample the first output. Blocks in use are shared (reference counts, `BlockPool`); a freed
block keeps its content and key until it is evicted, least recently freed first.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

from executor_service.engine.block_pool import BlockHash, BlockPool
from executor_service.engine.request import Request


def hash_block_tokens(parent: BlockHash | None, token_ids: Sequence[int]) -> BlockHash:
    """The key of a block: sha256 over its parent's key and its token ids (a collision would hand a request
    another prefix's K/V, so no 64-bit hash)."""
    digest = hashlib.sha256(parent or b"specdec-prefix-root")
    digest.update(array("q", token_ids).tobytes())
    return digest.digest()


def tokens_after_block(method: str | None) -> int:
    """How many tokens past a block its K/V depends on, besides its own and the earlier ones.

    The target's K/V and hidden state at position p depend on tokens 0..p only. The drafter's cache depends
    on what its context pass stores at p: EAGLE and EAGLE-3 run their layer on [the target's features at p;
    the embedding of token p + 1], so the last position of a block depends on the first token of the next
    block: 1, and the key of a block includes that token (a request whose prompt goes on differently after
    the block must not take the drafter's K/V of it). DFlash stores context K/V projected from the target's
    features at p alone: 0, like the target without a drafter."""
    return 1 if method in ("eagle", "eagle3") else 0


@dataclass(frozen=True)
class PrefixCacheStats:
    """What GetLoads and the metrics report: prompt tokens looked up at admission, those found cached, and
    the free blocks that still hold reusable prefixes."""

    queries: int = 0
    hits: int = 0
    cached_free_blocks: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class PrefixCache:
    def __init__(self, pool: BlockPool, block_size: int, tokens_after: int) -> None:
        self.pool, self.block_size, self.tokens_after = pool, block_size, tokens_after
        self.queries = 0  # prompt tokens looked up (first admissions only)
        self.hits = 0

    def stats(self) -> PrefixCacheStats:
        return PrefixCacheStats(self.queries, self.hits, self.pool.num_cached_free)

    def reset(self) -> None:
        """Forget cached prefixes and counts (after the warm-up, whose requests are not served work)."""
        self.pool.reset_prefix_cache()
        self.queries = self.hits = 0

    def computed_blocks(self, request: Request) -> list[int]:
        """The longest run of the request's leading blocks held in the cache, found without taking them.
        Bounded so that the last token is computed and each block's key tokens are known."""
        limit = (request.num_tokens - max(1, self.tokens_after)) // self.block_size
        blocks: list[int] = []
        for block_hash in self._hashes(request, limit):
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def admitted(self, request: Request, cached: list[int]) -> None:
        """Book an admission that took `cached` (already touched): the request computes after them."""
        request.num_computed_tokens = len(cached) * self.block_size
        request.num_cached_blocks = len(cached)
        if request.cached_prompt_tokens is None:  # its first admission; a preempted one's resume is not a query
            request.cached_prompt_tokens = request.num_computed_tokens
            self.queries += len(request.prompt_ids)
            self.hits += request.num_computed_tokens

    def cache_blocks(self, request: Request, written: int | None = None) -> None:
        """Register the request's full prompt blocks whose K/V the last step finished writing (the target's
        and the drafter's: `written` positions, default its computed tokens) and whose key tokens are all prompt
        tokens."""
        written = request.num_computed_tokens if written is None else min(written, request.num_computed_tokens)
        full = min(written, len(request.prompt_ids) - self.tokens_after) // self.block_size
        if full <= request.num_cached_blocks:
            return
        hashes = self._hashes(request, full)
        for index in range(request.num_cached_blocks, full):
            self.pool.cache(request.block_ids[index], hashes[index])
        request.num_cached_blocks = full

    def _hashes(self, request: Request, count: int) -> list[BlockHash]:
        """The keys of the request's first `count` blocks (computed once per request: tokens never change)."""
        hashes, size = request.block_hashes, self.block_size
        while len(hashes) < count:
            start = len(hashes) * size
            tokens = request.token_ids(start, start + size + self.tokens_after)
            hashes.append(hash_block_tokens(hashes[-1] if hashes else None, tokens))
        return hashes[:count]
