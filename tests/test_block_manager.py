"""Block tables, ref counts, the prefix cache and its invariants (pure Python, no model)."""

import pytest

from minivllm.block_manager import MiniBlockManager
from minivllm.sampling_params import SamplingParams
from minivllm.sequence import Sequence


def seq(rid, tokens):
    return Sequence(rid, list(tokens), SamplingParams())


def test_blocks_are_allocated_as_tokens_arrive():
    bm = MiniBlockManager(num_blocks=8, block_size=4)
    s = seq("a", range(5))
    assert bm.allocate(s, 1) and len(s.block_table) == 1
    assert bm.allocate(s, 4) and len(s.block_table) == 1  # still fits in the first block
    assert bm.allocate(s, 5) and len(s.block_table) == 2
    assert bm.num_free_blocks == 6
    bm.check_invariants([s])
    bm.free(s)
    assert s.block_table == [] and bm.num_free_blocks == 8
    bm.check_invariants([])


def test_allocation_is_all_or_nothing():
    bm = MiniBlockManager(num_blocks=3, block_size=4)
    a, b = seq("a", range(8)), seq("b", range(8))
    assert bm.allocate(a, 8)
    assert not bm.allocate(b, 8)  # needs 2, only 1 free
    assert b.block_table == [] and bm.num_free_blocks == 1
    bm.check_invariants([a, b])


def test_invariant_check_catches_a_leak_and_a_double_owner():
    bm = MiniBlockManager(num_blocks=4, block_size=2)
    a = seq("a", range(3))
    bm.allocate(a, 3)
    with pytest.raises(AssertionError, match="ref count"):
        bm.check_invariants([])  # a's blocks now look leaked
    b = seq("b", range(2))
    b.block_table = [a.block_table[0]]  # stolen without a ref count
    with pytest.raises(AssertionError, match="ref count"):
        bm.check_invariants([a, b])


def _computed(bm, s):
    """Pretend the forward wrote every token's KV, then register the full blocks."""
    assert bm.allocate(s, s.num_tokens)
    s.cached_token_count = s.num_tokens
    bm.register_computed_blocks(s)


def test_prefix_cache_shares_full_blocks_and_keeps_the_last_token():
    bm = MiniBlockManager(num_blocks=16, block_size=4, enable_prefix_caching=True)
    a = seq("a", range(10))
    _computed(bm, a)
    b = seq("b", list(range(10)) + [99])
    assert bm.match_prefix(b) == 8  # two full blocks; the third is partial
    assert b.block_table == a.block_table[:2]
    assert bm.blocks[a.block_table[0]].ref_count == 2
    c = seq("c", range(8))  # fully cached prompt: the last block is recomputed for logits
    assert bm.match_prefix(c) == 4
    bm.check_invariants([a, b, c])
    for s in (a, b, c):
        bm.free(s)
    bm.check_invariants([])
    assert bm.num_free_blocks == 16 and len(bm.evictable) == 2


def test_freed_blocks_stay_cached_and_are_evicted_lru():
    bm = MiniBlockManager(num_blocks=4, block_size=2, enable_prefix_caching=True)
    a = seq("a", [1, 2, 3, 4, 5])
    _computed(bm, a)
    bm.free(a)
    assert len(bm.evictable) == 2 and len(bm.free_blocks) == 2
    again = seq("a2", [1, 2, 3, 4, 9])
    assert bm.match_prefix(again) == 4
    bm.free(again)
    hog = seq("hog", range(100, 106))  # needs 3 blocks: 2 unhashed free + evicts 1 (the LRU one)
    assert bm.allocate(hog, 6)
    assert len(bm.evictable) == 1 and len(bm.hash_to_block) == 1
    survivor = next(iter(bm.evictable))
    first = seq("x", [1, 2, 3, 4, 5])
    # The tail block [3, 4] was freed first (tail first), so it is evicted first; [1, 2] survives.
    assert bm.match_prefix(first) == 2 and first.block_table == [survivor]
    bm.check_invariants([hog, first])


def test_hash_collisions_never_serve_wrong_blocks(monkeypatch):
    monkeypatch.setattr(MiniBlockManager, "chain_hash", staticmethod(lambda parent, tokens: 42))
    bm = MiniBlockManager(num_blocks=8, block_size=2, enable_prefix_caching=True)
    a = seq("a", [1, 2, 3, 4, 5])
    _computed(bm, a)
    assert len(bm.hash_to_block) == 1  # everything collides: only the first block got the slot
    b = seq("b", [7, 8, 3, 4, 5])  # different first block, same hash
    assert bm.match_prefix(b) == 0
    c = seq("c", [1, 2, 7, 7, 5])
    assert bm.match_prefix(c) == 2  # the true first block only
    bm.check_invariants([a, b, c])


def test_a_reused_parent_cuts_the_chain():
    """Once a prefix's first block is evicted and reused, its cached children are unreachable."""
    bm = MiniBlockManager(num_blocks=3, block_size=2, enable_prefix_caching=True)
    a = seq("a", [1, 2, 3, 4, 0])
    _computed(bm, a)
    parent, child = a.block_table[:2]
    bm.free(a)
    assert bm.blocks[child].parent == (parent, bm.blocks[parent].generation)
    bm.evictable.move_to_end(child)  # the parent becomes the least recently used
    x = seq("x", [9, 9, 0])
    _computed(bm, x)
    assert parent in x.block_table and child in bm.evictable
    assert bm.match_prefix(seq("again", [1, 2, 3, 4, 0])) == 0
    bm.check_invariants([x])


def test_identical_new_prefixes_in_one_step_do_not_clash():
    bm = MiniBlockManager(num_blocks=8, block_size=2, enable_prefix_caching=True)
    a, b = seq("a", [1, 2, 3, 4, 5]), seq("b", [1, 2, 3, 4, 6])
    assert bm.match_prefix(a) == 0 and bm.match_prefix(b) == 0
    for s in (a, b):
        bm.allocate(s, s.num_tokens)
    assert not set(a.block_table) & set(b.block_table)
    for s in (a, b):
        s.cached_token_count = s.num_tokens
        bm.register_computed_blocks(s)
    assert all(bm.hash_to_block[h] in a.block_table for h in bm.hash_to_block)  # first registration wins
    bm.check_invariants([a, b])
    bm.free(a), bm.free(b)
    bm.check_invariants([])


def test_children_of_a_duplicate_block_link_to_the_registered_chain():
    """b computes the same first block as a (a duplicate), then its own second block: findable in full."""
    bm = MiniBlockManager(num_blocks=8, block_size=2, enable_prefix_caching=True)
    a, b = seq("a", [1, 2, 0]), seq("b", [1, 2, 5, 6, 0])
    for s in (a, b):
        bm.allocate(s, s.num_tokens)
    for s in (a, b):
        s.cached_token_count = s.num_tokens
        bm.register_computed_blocks(s)
    c = seq("c", [1, 2, 5, 6, 9])
    assert bm.match_prefix(c) == 4
    assert c.block_table == [a.block_table[0], b.block_table[1]]
    bm.check_invariants([a, b, c])
