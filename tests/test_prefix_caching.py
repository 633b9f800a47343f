"""Prefix caching, in the style of vLLM's prefix-caching tests, against our BlockManager.

Each test spells out the exact block ids, ref counts and free order it expects, worked out
by hand from the contract: allocate from the head of the free queue, release last block
first to the tail, register blocks only in ``hash_blocks`` after a step, confirm hits by
tokens, never take a prompt's last block from the cache.
"""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from course_pkg import BlockManager, NoFreeBlocksError, Sequence
from course_pkg.block_manager import PrefixCacheStats, compute_hash
from course_pkg.scheduler import STEP_STATE
from course_pkg.undo import transaction
from course_pkg.foils import TokenCheckBlockManager, UnguardedBlockManager
from tests.helpers import admit, compute_all, state


def refs(bm: BlockManager) -> list[int]:
    return [b.ref_count for b in bm.blocks]


@pytest.fixture(params=["deque", "linked"])
def free_queue(request):
    return request.param


def test_miss_then_hit(free_queue):
    bm = BlockManager(10, 4, free_queue=free_queue)
    a = admit(bm, range(14))  # 3 full blocks + 2 tokens
    assert a.block_table == [0, 1, 2, 3]
    assert a.num_cached_tokens == 14 and len(bm.hash_to_block_id) == 3
    b = admit(bm, list(range(12)) + [100, 101])
    assert b.block_table == [0, 1, 2, 4]
    assert refs(bm)[:5] == [2, 2, 2, 1, 1]
    assert (bm.prefix_cache_stats.queries, bm.prefix_cache_stats.hits) == (28, 12)
    assert bm.prefix_cache_stats.hit_rate == 12 / 28


def test_free_order_after_two_releases_and_the_order_a_miss_takes(free_queue):
    bm = BlockManager(10, 4, free_queue=free_queue)
    a = admit(bm, range(14))
    b = admit(bm, list(range(12)) + [100, 101])
    bm.deallocate(a)  # blocks 0-2 are still held by b; only a's own last block is freed
    assert list(bm.free_block_ids) == [5, 6, 7, 8, 9, 3]
    bm.deallocate(b)  # last block first: the shared prefix reaches the tail last
    assert list(bm.free_block_ids) == [5, 6, 7, 8, 9, 3, 4, 2, 1, 0]
    c = admit(bm, range(200, 220))  # 5 blocks, no hit: taken from the head, in order
    assert c.block_table == [5, 6, 7, 8, 9]
    d = admit(bm, range(300, 311))  # 3 blocks: 3 and 4, then 2 -- the prefix's third block
    assert d.block_table == [3, 4, 2]
    h0 = compute_hash([0, 1, 2, 3])
    h1 = compute_hash([4, 5, 6, 7], h0)
    h2 = compute_hash([8, 9, 10, 11], h1)
    # Blocks 0 and 1 still serve the prefix; block 2's entry went when it was overwritten.
    assert bm.hash_to_block_id[h0] == 0 and bm.hash_to_block_id[h1] == 1
    assert h2 not in bm.hash_to_block_id


def test_a_hit_block_is_never_handed_out_again_by_the_same_allocation(free_queue):
    bm = BlockManager(3, 2, free_queue=free_queue)
    a = admit(bm, [1, 2, 3])  # block 0 = [1, 2] registered, block 1 partial
    bm.deallocate(a)
    x = admit(bm, [7, 8, 9])  # takes blocks 2 and 1
    bm.deallocate(x)
    assert list(bm.free_block_ids) == [0, 1, 2]  # the cached block 0 is now at the head
    b = admit(bm, [1, 2, 5, 6, 7], compute=False)
    assert b.block_table == [0, 1, 2]  # 0 revived from the queue before any fresh block was popped
    assert refs(bm) == [1, 1, 1] and len(bm.free_block_ids) == 0


def test_a_failed_allocation_changes_nothing(free_queue):
    bm = BlockManager(4, 2, free_queue=free_queue)
    admit(bm, [1, 2, 3, 4, 5])  # 3 blocks, 2 registered
    before = state(bm)
    b = Sequence([1, 2, 3, 4, 9, 9, 9, 9], block_size=2)  # 2 hits + 2 fresh, 1 free
    assert bm.can_allocate(b) == -1
    with pytest.raises(NoFreeBlocksError, match="needs 2 free blocks, 1 is free"):
        bm.allocate(b, 2)
    with pytest.raises(NoFreeBlocksError):
        bm.allocate(b, 0)
    assert state(bm) == before
    assert b.block_table == [] and b.num_cached_tokens == 0


def test_caching_disabled_gives_no_hits():
    bm = BlockManager(10, 4, enable_prefix_caching=False)
    a = admit(bm, range(14))
    assert bm.hash_to_block_id == {} and all(blk.hash == -1 for blk in bm.blocks)
    b = Sequence(list(range(14)), block_size=4)
    assert bm.can_allocate(b) == 0
    bm.allocate(b, 0)
    assert set(a.block_table).isdisjoint(b.block_table)
    assert (bm.prefix_cache_stats.queries, bm.prefix_cache_stats.hits) == (28, 0)


def test_hit_rate_over_a_window_of_recent_requests():
    bm = BlockManager(20, 4, max_recent_requests=2)
    admit(bm, range(9))                   # miss: 9 queried, 0 hit
    admit(bm, list(range(8)) + [50])      # 8 of 9
    admit(bm, list(range(8)) + [51, 52])  # 8 of 10
    stats = bm.prefix_cache_stats
    assert (stats.requests, stats.queries, stats.hits) == (3, 28, 16)
    assert stats.hit_rate == 16 / 28
    assert stats.recent_hit_rate == 16 / 19  # the first request has left the window
    assert list(stats.recent) == [(9, 8), (10, 8)]


def test_prefix_cache_stats_window_by_hand():
    stats = PrefixCacheStats(max_recent_requests=3)
    assert stats.hit_rate == 0.0 and stats.recent_hit_rate == 0.0
    for queries, hits in [(10, 0), (10, 10), (20, 5), (5, 5), (5, 0)]:
        stats.record(queries, hits)
    assert stats.hit_rate == 20 / 50
    assert stats.recent_hit_rate == 10 / 30
    with pytest.raises(ValueError, match="max_recent_requests"):
        PrefixCacheStats(0)


def test_kv_cache_usage_counts_held_blocks_only():
    bm = BlockManager(8, 4)
    assert bm.kv_cache_usage == 0.0
    a = admit(bm, range(9))  # 3 blocks
    b = admit(bm, list(range(8)) + [70])  # 2 shared + 1 new
    assert bm.kv_cache_usage == 4 / 8
    bm.deallocate(a)
    bm.deallocate(b)
    assert bm.kv_cache_usage == 0.0  # free-but-cached blocks are free


def test_a_forced_collision_falls_back_to_a_fresh_block(monkeypatch):
    bm = BlockManager(6, 2)
    monkeypatch.setattr(bm, "compute_hash", lambda token_ids, prefix=-1: 42)  # every block collides
    a = admit(bm, [1, 2, 3])
    assert bm.hash_to_block_id == {42: 0}
    b = Sequence([5, 6, 7], block_size=2)
    assert bm.can_allocate(b) == 0  # hash 42 is found, but block 0 holds [1, 2], not [5, 6]
    bm.allocate(b, 0)
    assert b.block_table == [2, 3] and refs(bm)[:4] == [1, 1, 1, 1]
    assert a.block_table == [0, 1]


class UnguardedTokenCheckBlockManager(UnguardedBlockManager, TokenCheckBlockManager):
    """Neither defence: no stale-entry guard, and hits confirmed by the block's tokens only."""


def test_the_stale_entry_guard_and_the_wrong_hit_without_it():
    """Block content X = [5, 6] after prefix P = [1, 2] (request a), then the same content X
    after another prefix Q = [7, 8] (request c) in the very same physical block."""
    results = {}
    for cls in (BlockManager, UnguardedBlockManager, UnguardedTokenCheckBlockManager):
        bm = cls(4, 2)
        a = admit(bm, [1, 2, 5, 6, 9])
        assert a.block_table == [0, 1, 2]
        h_p = compute_hash([1, 2])
        h_px = compute_hash([5, 6], h_p)
        bm.deallocate(a)  # free queue [3, 2, 1, 0], blocks 0 and 1 still cached
        d = admit(bm, [11])  # takes block 3
        c = admit(bm, [7, 8, 5, 6])  # takes 2 and 1: block 1 now holds X after Q
        assert c.block_table == [2, 1]
        assert bm.blocks[1].token_ids == [5, 6] and bm.blocks[1].hash == compute_hash([5, 6], compute_hash([7, 8]))
        bm.deallocate(c)
        bm.deallocate(d)
        results[cls] = (h_px in bm.hash_to_block_id, bm.can_allocate(Sequence([1, 2, 5, 6, 4], block_size=2)))
    # The guard dropped P+X's entry when block 1 was handed out again: only P is a hit.
    assert results[BlockManager] == (False, 1)
    # Without it the stale entry still points at block 1, whose tokens match; the exact check
    # sees that block 1 follows Q, not P, and refuses the hit.
    assert results[UnguardedBlockManager] == (True, 1)
    # Without both defences it is a wrong hit, on K/V computed after Q.
    assert results[UnguardedTokenCheckBlockManager] == (True, 2)


def test_same_prompt_admitted_in_the_same_step_and_the_guard_keeps_other_blocks_entries(free_queue):
    """Two sequences with the same prompt admitted in the same step: the second finds no
    hit (nothing is registered before the step), both compute the prefix, and the index
    ends up pointing at the second one's blocks. Reusing the first one's blocks later must
    not drop those entries: the guard deletes an entry only if it points at the reused block."""
    bm = BlockManager(12, 2, free_queue=free_queue)
    a = admit(bm, [1, 2, 3, 4, 5], compute=False)
    b = admit(bm, [1, 2, 3, 4, 5], compute=False)
    assert b.num_cached_tokens == 0 and a.block_table == [0, 1, 2] and b.block_table == [3, 4, 5]
    compute_all(bm, a)
    compute_all(bm, b)
    h1 = compute_hash([1, 2])
    h2 = compute_hash([3, 4], h1)
    assert bm.hash_to_block_id == {h1: 3, h2: 4}  # the later registration wins
    assert bm.blocks[0].hash == h1 and bm.blocks[1].hash == h2  # a's blocks keep their hash
    bm.deallocate(a)
    assert list(bm.free_block_ids) == [6, 7, 8, 9, 10, 11, 2, 1, 0]
    admit(bm, range(100, 118))  # 9 fresh blocks: a's blocks 2, 1, 0 are overwritten too
    assert bm.hash_to_block_id[h1] == 3 and bm.hash_to_block_id[h2] == 4
    bm.deallocate(b)
    assert bm.can_allocate(Sequence([1, 2, 3, 4, 6], block_size=2)) == 2


def test_the_last_block_of_a_fully_cached_prompt_is_recomputed():
    bm = BlockManager(10, 4)
    admit(bm, range(8))  # exactly 2 full blocks, both registered
    assert len(bm.hash_to_block_id) == 2
    b = admit(bm, range(8), compute=False)
    assert b.num_cached_tokens == 4  # block 1 is in the cache, but one token must be computed
    assert b.block_table == [0, 2]


def test_decoded_blocks_are_reused_by_the_next_turn_of_a_chat():
    bm = BlockManager(10, 4)
    turn1 = admit(bm, range(6))  # prompt: 1 full block + 2 tokens
    for t in (50, 51, 52, 53):  # decode: the 2nd block fills with 4, 5, 50, 51
        turn1.append_token(t)
        bm.may_append(turn1)
        compute_all(bm, turn1)
    assert len(bm.hash_to_block_id) == 2  # the prompt block and the decoded block
    bm.deallocate(turn1)
    turn2 = admit(bm, list(range(6)) + [50, 51, 52, 53, 60, 61, 62], compute=False)
    assert turn2.num_cached_tokens == 8
    assert turn2.block_table[:2] == [0, 1]


# ---------------------------------------------------------------- the hash, against Nano-vLLM's bytes

def _nano_vllm_hash(token_ids, prefix=-1):
    """Nano-vLLM's ``compute_hash``: the parent's hash as 8 little-endian bytes, then numpy int64s."""
    import numpy as np
    import xxhash

    h = xxhash.xxh64()
    if prefix != -1:
        h.update(prefix.to_bytes(8, "little"))
    h.update(np.array(token_ids, dtype=np.int64).tobytes())
    return h.intdigest()


@settings(max_examples=300, deadline=None)
@given(tokens=st.lists(st.integers(0, 2**63 - 1), min_size=1, max_size=40),
       prefix=st.one_of(st.just(-1), st.integers(0, 2**64 - 1)))
def test_compute_hash_hashes_the_bytes_nano_vllm_hashes(tokens, prefix):
    assert compute_hash(tokens, prefix) == _nano_vllm_hash(tokens, prefix)


# ---------------------------------------------------------------- the exact prefix names

def _random_admissions(bm, rng, n, vocab=3, max_blocks=4):
    """Admit, compute and release ``n`` random prompts over a tiny vocabulary (so prefixes
    repeat); yield (sequence, hit blocks) right after each admission."""
    holding = []
    for _ in range(n):
        seq = Sequence([rng.randrange(vocab) for _ in range(rng.randint(1, max_blocks * bm.block_size + 1))],
                       block_size=bm.block_size)
        while (hits := bm.can_allocate(seq)) == -1:
            bm.deallocate(holding.pop(0))
        bm.allocate(seq, hits)
        yield seq, hits
        compute_all(bm, seq)
        holding.append(seq)


def test_every_hit_holds_exactly_its_prefix_and_the_names_stay_bounded():
    """Thousands of registrations of repeating prefixes: every hit block was computed after
    exactly the request's tokens (a shadow record of each block's whole prefix says so), each
    registered block's name is in the dictionary, and the sweep keeps it to twice the pool."""
    import random

    rng = random.Random(7)
    bm = BlockManager(24, 2)
    prefix_of: dict[int, tuple] = {}   # block id -> the whole token prefix its K/V were computed after
    sizes, hits_seen = [], 0
    for seq, hits in _random_admissions(bm, rng, 3000, vocab=3, max_blocks=10):
        for i, block_id in enumerate(seq.block_table[:hits]):
            assert prefix_of[block_id] == tuple(seq.token_ids[:(i + 1) * bm.block_size])
        hits_seen += hits
        for i, block_id in enumerate(seq.block_table[hits:], start=hits):   # fresh blocks: new content
            prefix_of[block_id] = tuple(seq.token_ids[:(i + 1) * bm.block_size])
        for block in bm.blocks:
            if block.prefix_id != -1:
                assert bm._prefix_ids[block.hash][0] == block.prefix_id
        sizes.append(len(bm._prefix_ids))
        assert sizes[-1] <= 2 * bm.num_blocks + 4096 + 1
    assert hits_seen > 500                      # the prefixes did repeat
    assert any(b < a for a, b in zip(sizes, sizes[1:]))   # and a sweep ran


def test_a_colliding_prefix_gets_an_id_of_its_own(monkeypatch):
    """Every hash forced to 42: the first prefix keeps the entry; each other prefix gets an id
    that no other block shares -- the same colliding prefix computed twice gets two ids (a
    possible lost hit for their children, never a wrong hit). Hits still go through the index."""
    bm = BlockManager(8, 2)
    monkeypatch.setattr(bm, "compute_hash", lambda token_ids, prefix=-1: 42)
    a = admit(bm, [1, 2, 3])
    b = admit(bm, [5, 6, 7], compute=False)     # b and c in the same step: neither hits the other
    c = admit(bm, [5, 6, 8], compute=False)
    compute_all(bm, b)
    compute_all(bm, c)
    first, second, third = (bm.blocks[s.block_table[0]] for s in (a, b, c))
    assert bm._prefix_ids == {42: (first.prefix_id, (-1, [1, 2], None))}
    assert len({first.prefix_id, second.prefix_id, third.prefix_id}) == 3
    assert bm.hash_to_block_id == {42: third.block_id}
    assert bm.can_allocate(Sequence([5, 6, 9], block_size=2)) == 1     # c's block: same tokens, no parent
    assert bm.can_allocate(Sequence([1, 2, 9], block_size=2)) == 0     # the index holds [5, 6], not [1, 2]


def test_a_sweep_inside_a_failed_transaction_is_undone():
    bm = BlockManager(8, 1)
    start = 0
    while len(bm._prefix_ids) <= 2 * bm.num_blocks + 4096 - 6:   # 5 new names per request
        bm.deallocate(admit(bm, range(start, start + 5)))
        start += 5
    before = dict(bm._prefix_ids), bm._next_prefix_id, state(bm)
    with pytest.raises(RuntimeError, match="step failed"):
        with transaction(bm, follow=STEP_STATE):
            admit(bm, range(10**6, 10**6 + 6))           # its 6 new names push the dictionary over
            assert len(bm._prefix_ids) < len(before[0])   # swept
            raise RuntimeError("step failed")
    assert (dict(bm._prefix_ids), bm._next_prefix_id, state(bm)) == before
