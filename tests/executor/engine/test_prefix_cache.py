"""The prefix cache's parts without a model: chained block keys, the block pool's reference counts and LRU
eviction of free cached blocks, and how many blocks a request may take and register."""

from __future__ import annotations

import pytest

from executor_service.engine.block_pool import BlockPool
from executor_service.engine.prefix_cache import PrefixCache, hash_block_tokens, tokens_after_block
from executor_service.engine.request import Request
from executor_service.errors import KVCacheFull
from executor_service.sample.sampling import SamplingSettings

BLOCK = 4


def request(prompt: list[int], output: list[int] | None = None) -> Request:
    made = Request("r", prompt, SamplingSettings(), 8, frozenset(), lambda _: None)
    made.output_ids = list(output or [])
    return made


def test_a_key_depends_on_the_parent_and_every_token() -> None:
    root = hash_block_tokens(None, [1, 2, 3, 4])
    assert hash_block_tokens(None, [1, 2, 3, 4]) == root
    assert hash_block_tokens(root, [5, 6, 7, 8]) != hash_block_tokens(None, [5, 6, 7, 8])
    assert hash_block_tokens(root, [5, 6, 7, 8]) != hash_block_tokens(root, [5, 6, 7, 9])
    assert hash_block_tokens(None, [1, 2, 3, 4, 5]) != root  # EAGLE's keys carry the next block's first token
    assert len({hash_block_tokens(None, [t]) for t in (0, 1, 256, 2**31, 2**40)}) == 5  # ids are 64-bit


def test_drafter_dependence_on_the_next_token() -> None:
    assert tokens_after_block("eagle") == tokens_after_block("eagle3") == 1
    assert tokens_after_block("dflash") == tokens_after_block(None) == 0


def test_pool_counts_holds_and_refuses_a_double_free() -> None:
    pool = BlockPool(4)
    blocks = pool.allocate(3)
    assert pool.num_used == 3 and pool.num_free == 1
    pool.touch(blocks[:1])
    pool.free(blocks)
    assert pool.num_used == 1  # the touched block is still held once
    pool.free(blocks[:1])
    assert pool.num_used == 0
    with pytest.raises(RuntimeError, match="freed more often"):
        pool.free(blocks[:1])
    with pytest.raises(KVCacheFull):
        pool.allocate(5)


def test_free_cached_blocks_are_kept_then_evicted_least_recent_first() -> None:
    pool = BlockPool(4)
    a, b, c, d = pool.allocate(4)
    for block, key in ((a, b"a"), (b, b"b"), (c, b"c")):
        assert pool.cache(block, key)
    assert not pool.cache(d, b"a")  # the prefix is held by a already: d stays unshared
    pool.free([b])
    pool.free([a])
    pool.free([c, d])
    assert pool.num_free == 4 and pool.num_cached_free == 3 and pool.lookup(b"a") == a
    assert pool.allocate(1) == [d]  # a block holding nothing reusable goes first
    assert pool.allocate(1) == [b] and pool.lookup(b"b") is None  # then the least recently freed: evicted
    pool.touch([c])  # a hit on a free cached block takes it out of the free queue
    assert pool.num_free == 1 and pool.num_free_among([a, c]) == 1
    assert pool.allocate(1) == [a] and pool.lookup(b"a") is None
    assert pool.lookup(b"c") == c  # held: never handed out, never evicted
    with pytest.raises(KVCacheFull):
        pool.allocate(1)


def test_reset_forgets_free_prefixes_only() -> None:
    pool = BlockPool(2)
    a, b = pool.allocate(2)
    pool.cache(a, b"a")
    pool.cache(b, b"b")
    pool.free([a])
    pool.reset_prefix_cache()
    assert pool.lookup(b"a") is None and pool.lookup(b"b") == b and pool.num_cached_free == 0


@pytest.mark.parametrize(
    ("prompt_len", "after", "taken"),
    [(8, 0, 1), (9, 0, 2), (12, 0, 2), (8, 1, 1), (9, 1, 2), (13, 1, 3)],
)
def test_the_last_token_is_always_computed(prompt_len: int, after: int, taken: int) -> None:
    """A prompt of whole blocks takes all but its last block: the last token's logits sample the first output."""
    pool = BlockPool(8)
    cache = PrefixCache(pool, BLOCK, after)
    owner = request(list(range(16)))
    owner.block_ids = pool.allocate(4)
    owner.num_computed_tokens = 16
    cache.cache_blocks(owner)
    assert owner.num_cached_blocks == (16 - after) // BLOCK
    assert cache.computed_blocks(request(list(range(prompt_len)))) == owner.block_ids[:taken]


def test_registration_waits_for_the_tokens_after_a_block() -> None:
    """With EAGLE's one token after, a block is registered once that token is in the prompt; never on output."""
    pool = BlockPool(4)
    cache = PrefixCache(pool, BLOCK, 1)
    owner = request(list(range(8)), output=[99])
    owner.block_ids = pool.allocate(3)
    owner.num_computed_tokens = 4  # chunked prefill: block 0 written, token 4 is a prompt token
    cache.cache_blocks(owner)
    assert owner.num_cached_blocks == 1
    owner.num_computed_tokens = 9
    cache.cache_blocks(owner)
    assert owner.num_cached_blocks == 1  # block 1's key would need token 8: an output, not the prompt
    other = request([0, 1, 2, 3, 50, 51, 52, 53, 54])
    assert cache.computed_blocks(other) == []  # same block 0, another token after it: another key


def test_counts_are_taken_at_the_first_admission_only() -> None:
    pool = BlockPool(4)
    cache = PrefixCache(pool, BLOCK, 0)
    first = request(list(range(10)))
    cache.admitted(first, [0, 1])
    cache.admitted(first, [0])  # resumed after a preemption
    assert (first.num_computed_tokens, first.cached_prompt_tokens) == (4, 8)
    assert cache.stats().queries == 10 and cache.stats().hits == 8 and cache.stats().hit_rate == 0.8
