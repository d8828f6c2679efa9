"""The block manager: allocation and reference counts, the chained block hash, prefix caching (collisions,
fully cached prompts, freed blocks reused until reallocated, publishing only computed blocks), decode growth,
out-of-blocks errors, and a random workload checked against its invariants."""
from __future__ import annotations

import random

import pytest

from minivllm.engine.block_manager import Block, BlockManager, OutOfBlocksError, block_hash, chain_hashes
from minivllm.testing import check_invariants


def computed(bm: BlockManager, tokens: list[int]) -> tuple[list[int], int]:
    "Allocate `tokens` and publish them all, as after their prefill."
    table, num_cached = bm.allocate(tokens)
    bm.cache_full_blocks(table, tokens, len(tokens))
    return table, num_cached


# ---------------------------------------------------------------------------------------------- hashes

def test_same_prefix_gives_same_hashes():
    a, b = list(range(12)) + [1], list(range(12)) + [2, 3]
    assert chain_hashes(a, 4) == chain_hashes(b, 4) == chain_hashes(list(range(12)), 4)
    assert len(chain_hashes(a, 4)) == 3 and chain_hashes([1, 2, 3], 4) == []


def test_hash_depends_on_every_earlier_block():
    a = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]
    c = [0, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]  # differs in the first block only
    ha, hc = chain_hashes(a, 4), chain_hashes(c, 4)
    assert all(x != y for x, y in zip(ha, hc))
    assert block_hash([5, 6, 7, 8]) != ha[1]  # the same tokens as a first block hash differently
    assert block_hash([1, 2], None) != block_hash([2, 1], None)
    assert isinstance(ha[0], int) and 0 <= ha[0] < 2**64


# ---------------------------------------------------------------------------------------------- allocation

def test_allocate_free_and_ref_counts():
    bm = BlockManager(8, 4)
    t1, c1 = bm.allocate(list(range(6)))
    t2, c2 = bm.allocate(list(range(100, 109)))
    assert (t1, c1, t2, c2) == ([0, 1], 0, [2, 3, 4], 0)
    assert bm.num_free_blocks == 3
    check_invariants(bm, [t1, t2], [list(range(6)), list(range(100, 109))])
    bm.free(t2)
    assert list(bm.free_block_ids) == [5, 6, 7, 4, 3, 2]  # least recently freed first, a table's tail first
    bm.free(t1)
    assert bm.num_free_blocks == 8
    check_invariants(bm, [])


def test_shared_block_freed_only_when_every_holder_is_freed():
    bm = BlockManager(8, 4)
    a, b = list(range(9)), list(range(8)) + [50, 51]
    ta, _ = computed(bm, a)
    tb, cached = bm.allocate(b)
    assert (tb[:2], cached) == (ta[:2], 8)
    assert [bm.blocks[x].ref_count for x in ta[:2]] == [2, 2]
    bm.free(ta)
    assert [bm.blocks[x].ref_count for x in ta[:2]] == [1, 1]
    assert not set(ta[:2]) & set(bm.free_block_ids)
    check_invariants(bm, [tb], [b])
    bm.free(tb)
    assert bm.num_free_blocks == 8
    check_invariants(bm, [])


def test_double_free_raises_and_changes_nothing():
    bm = BlockManager(4, 4)
    t, _ = bm.allocate(list(range(8)))
    bm.free(t)
    before = list(bm.free_block_ids)
    with pytest.raises(ValueError, match="already free: was this block table freed twice"):
        bm.free(t)
    assert list(bm.free_block_ids) == before and all(blk.ref_count == 0 for blk in bm.blocks)


def test_out_of_blocks():
    bm = BlockManager(3, 4)
    t, _ = bm.allocate(list(range(8)))
    assert bm.can_allocate(4) and not bm.can_allocate(5) and not bm.can_allocate(list(range(100, 105)))
    with pytest.raises(OutOfBlocksError, match=r"5 tokens need 2 free blocks of 4 tokens .* only 1 of 3 are free"):
        bm.allocate(list(range(100, 105)))
    assert bm.num_free_blocks == 1 and bm.prefix_cache_query_tokens == 8  # the failed call changed nothing
    assert not bm.can_grow(t, 13)
    with pytest.raises(OutOfBlocksError, match="check can_grow first"):
        bm.grow(t, 13)
    assert t == [0, 1]
    check_invariants(bm, [t], [list(range(8))])


@pytest.mark.parametrize("kwargs, message", [
    (dict(num_blocks=0, block_size=4), "num_blocks must be a positive integer"),
    (dict(num_blocks=4, block_size=0), "block_size must be a positive integer"),
    (dict(num_blocks=4.0, block_size=4), "num_blocks must be a positive integer"),
    (dict(num_blocks=4, block_size=True), "block_size must be a positive integer"),
])
def test_constructor_validates(kwargs, message):
    with pytest.raises(ValueError, match=message):
        BlockManager(**kwargs)


def test_empty_sequence_is_refused():
    with pytest.raises(ValueError, match="empty sequence"):
        BlockManager(4, 4).allocate([])


# ---------------------------------------------------------------------------------------------- prefix caching

def test_prefix_hits_are_counted_in_blocks_and_tokens():
    bm = BlockManager(16, 4)
    computed(bm, list(range(9)))
    _, cached = computed(bm, list(range(9)) + [40])
    assert cached == 8  # both full blocks of the first prompt
    _, cached = bm.allocate(list(range(12)) + [7])
    assert cached == 8  # the third block, tokens 8..11, was never computed
    assert (bm.prefix_cache_hit_blocks, bm.prefix_cache_hit_tokens) == (4, 16)
    assert bm.prefix_cache_query_tokens == 9 + 10 + 13
    assert "prefix-cache hits 16/32 tokens" in repr(bm)


@pytest.mark.parametrize("block_size", [1, 2, 4, 5])
@pytest.mark.parametrize("length", list(range(1, 14)))
def test_fully_cached_prompt_still_computes_its_last_token(length, block_size):
    bm = BlockManager(32, block_size)
    prompt = [(7 * i + 3) % 11 for i in range(length)]
    first, _ = computed(bm, prompt)
    again, cached = bm.allocate(prompt)
    assert cached == (length - 1) // block_size * block_size
    assert length - cached >= 1
    assert again[:cached // block_size] == first[:cached // block_size]
    assert not set(again[cached // block_size:]) & set(first)  # recomputed blocks are fresh, never shared
    longer, cached = bm.allocate(prompt + [99])
    assert cached == length // block_size * block_size  # every full block of the prompt is reused
    check_invariants(bm, [first, again, longer], [prompt, prompt, prompt + [99]])


def test_hash_collision_is_a_miss():
    bm = BlockManager(8, 4, hash_fn=lambda token_ids, prev_hash: 42)  # every block collides
    a = [1, 2, 3, 4, 9]
    ta, _ = computed(bm, a)
    assert bm.hash_to_block_id == {42: ta[0]}
    assert bm.cached_prefix([4, 3, 2, 1, 9]) == []
    assert bm.can_allocate([4, 3, 2, 1, 9])
    tb, cached = bm.allocate([4, 3, 2, 1, 9])
    assert cached == 0 and not set(tb) & set(ta)
    tc, cached = bm.allocate([1, 2, 3, 4, 7])  # a genuine hit is still a hit
    assert (tc[0], cached) == (ta[0], 4)
    assert bm.prefix_cache_hit_blocks == 1


def test_blocks_are_published_only_once_computed():
    bm = BlockManager(8, 4)
    prompt = list(range(12)) + [1]
    t1, _ = bm.allocate(prompt)  # allocated, not yet computed
    assert bm.cached_prefix(prompt) == [] and bm.num_cached_blocks == 0
    bm.cache_full_blocks(t1, prompt, 5)  # a first chunk of 5 tokens: one full block
    assert bm.cached_prefix(prompt) == t1[:1]
    assert bm.cache_full_blocks(t1, prompt, 13) == 2  # the rest: two more
    assert bm.cache_full_blocks(t1, prompt, 13) == 0  # nothing twice
    assert bm.cached_prefix(prompt) == t1[:3]
    with pytest.raises(ValueError, match="14 computed tokens do not fit 13 token ids"):
        bm.cache_full_blocks(t1, prompt, 14)


def test_freed_blocks_stay_cached_until_reallocated():
    bm = BlockManager(6, 4)
    prompt = list(range(9))
    t, _ = computed(bm, prompt)
    bm.free(t)
    assert (bm.num_free_blocks, bm.num_cached_blocks) == (6, 2)
    again, cached = bm.allocate(prompt)
    assert (again[:2], cached) == (t[:2], 8)
    bm.free(again)
    other, _ = bm.allocate(list(range(100, 120)))  # five fresh blocks: every free one but block 0
    assert other == [4, 5, 2, 3, 1]
    assert bm.cached_prefix(prompt) == [0] and bm.num_cached_blocks == 1
    bm.free(other)
    last, cached = bm.allocate(prompt)
    assert (last[0], cached) == (0, 4)
    check_invariants(bm, [last], [prompt])


def test_can_allocate_counts_hits_exactly():
    bm = BlockManager(4, 4)
    a = list(range(9))
    ta, _ = computed(bm, a)
    b = a[:8] + [99, 98]  # shares A's two full blocks, which A holds: needs one free block
    assert bm.num_free_blocks == 1 and not bm.can_allocate(len(b)) and bm.can_allocate(b)
    tb, cached = bm.allocate(b)
    assert (tb, cached, bm.num_free_blocks) == ([0, 1, 3], 8, 0)
    bm.free(ta); bm.free(tb)
    # now the hits are on free blocks: they are taken off the free list, so they count
    bm2 = BlockManager(3, 4)
    t, _ = computed(bm2, a)
    bm2.free(t)
    assert bm2.can_allocate(a) and not bm2.can_allocate(a + list(range(100, 104)))


def test_hits_are_taken_before_fresh_blocks_are_allocated():
    "A cached block at the front of the free list must not be overwritten by the same allocation that reuses it."
    bm = BlockManager(3, 4)
    prompt = list(range(8)) + [9]
    t, _ = computed(bm, prompt)  # blocks 0, 1 full, 2 partial
    bm.free(t)  # free list: 2, 1, 0
    t2, cached = bm.allocate(list(range(8)) + [50])
    assert (t2, cached) == ([0, 1, 2], 8)
    check_invariants(bm, [t2], [list(range(8)) + [50]])


# ---------------------------------------------------------------------------------------------- decode growth

def test_grow_and_publish_during_decode():
    bm = BlockManager(4, 4)
    tokens = [5, 6, 7, 8, 9, 10]
    table, _ = computed(bm, tokens)
    added = []
    for step in range(5):
        tokens.append(100 + step)
        added.append(bm.grow(table, len(tokens)))
        bm.cache_full_blocks(table, tokens, len(tokens))
    assert added == [[], [], [2], [], []]
    assert table == [0, 1, 2] and bm.num_cached_blocks == 2
    assert bm.grow(table, 3) == []  # already big enough
    next_turn = tokens[:8] + [1]
    t2, cached = bm.allocate(next_turn)
    assert cached == 8  # a later turn reuses prompt + answer
    check_invariants(bm, [table, t2], [tokens, next_turn])


# ---------------------------------------------------------------------------------------------- random workload

@pytest.mark.parametrize("seed", range(6))
def test_random_workload_keeps_invariants(seed):
    "Random prompts over a few shared prefixes, computed in chunks, grown, freed: invariants hold throughout."
    rng = random.Random(seed)
    block_size = rng.choice([1, 2, 4])
    bm = BlockManager(rng.randrange(8, 24), block_size)
    prefixes = [[rng.randrange(6) for _ in range(rng.randrange(0, 10))] for _ in range(3)]
    live: dict[int, tuple[list[int], list[int]]] = {}
    computed_upto: dict[int, int] = {}
    hits = 0
    for op in range(300):
        action = rng.random()
        if action < 0.35:
            tokens = rng.choice(prefixes) + [rng.randrange(6) for _ in range(rng.randrange(1, 8))]
            if bm.can_allocate(tokens):
                expected_hit = bm.cached_prefix(tokens)
                table, cached = bm.allocate(tokens)
                assert table[:len(expected_hit)] == expected_hit and cached == len(expected_hit) * block_size
                assert cached < len(tokens)
                hits += len(expected_hit)
                live[op], computed_upto[op] = (table, tokens), cached
            else:
                with pytest.raises(OutOfBlocksError):
                    bm.allocate(tokens)
        elif action < 0.65 and live:
            key = rng.choice(list(live))
            table, tokens = live[key]
            if computed_upto[key] < len(tokens):  # compute a chunk of the prompt
                computed_upto[key] = min(len(tokens), computed_upto[key] + rng.randrange(1, 6))
            else:  # decode: a new token, room for it
                if not bm.can_grow(table, len(tokens) + 1):
                    continue
                tokens.append(rng.randrange(6))
                bm.grow(table, len(tokens))
                computed_upto[key] = len(tokens)
            bm.cache_full_blocks(table, tokens, computed_upto[key])
        elif live:
            key = rng.choice(list(live))
            bm.free(live.pop(key)[0])
            computed_upto.pop(key)
        check_invariants(bm, [t for t, _ in live.values()], [k for _, k in live.values()])
    assert bm.prefix_cache_hit_blocks == hits
    for table, _ in live.values():
        bm.free(table)
    assert bm.num_free_blocks == bm.num_blocks
    assert isinstance(bm.blocks[0], Block)
