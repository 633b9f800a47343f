"""One test per semantic of the core contract (ARCHITECTURE.md, 'The contract of the core')."""
from __future__ import annotations

import math

import pytest

from course_pkg import Block, BlockManager, NoFreeBlocksError, Sequence, compute_hash
from tests.helpers import admit, check_invariants, compute_all, state


# ------------------------------------------------------------------ Block and Sequence

def test_block_reset_hands_out_an_owned_block():
    b = Block(3)
    assert (b.ref_count, b.hash, b.token_ids) == (0, -1, [])
    b.update(1234, [1, 2])
    b.ref_count = 0
    b.reset()
    assert (b.block_id, b.ref_count, b.hash, b.token_ids) == (3, 1, -1, [])


@pytest.mark.parametrize("block_size", [1, 2, 3, 16])
def test_sequence_logical_blocks(block_size):
    for n in range(1, 40):
        seq = Sequence(list(range(100, 100 + n)), block_size=block_size)
        assert seq.num_blocks == math.ceil(n / block_size)
        assert 1 <= seq.last_block_num_tokens <= block_size
        joined = [t for i in range(seq.num_blocks) for t in seq.block(i)]
        assert joined == seq.token_ids
        assert len(seq.block(seq.num_blocks - 1)) == seq.last_block_num_tokens


def test_sequences_keep_their_own_block_size():
    a, b = Sequence([1, 2, 3], block_size=2), Sequence([1, 2, 3], block_size=3)
    assert (a.num_blocks, b.num_blocks) == (2, 1)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_sequence_rejects_bad_block_size(bad):
    with pytest.raises(ValueError, match="block_size"):
        Sequence([1], block_size=bad)


def test_sequence_rejects_empty_prompt():
    with pytest.raises(ValueError, match="empty"):
        Sequence([], block_size=4)


# ------------------------------------------------------------------ append boundary

@pytest.mark.parametrize("block_size", [1, 2, 3, 16])
def test_block_needed_exactly_when_newest_token_starts_a_block(block_size):
    bm = BlockManager(num_blocks=64, block_size=block_size)
    seq = Sequence([7], block_size=block_size)
    bm.allocate(seq)
    for n in range(2, 3 * block_size + 3):
        seq.append_token(n)
        starts_block = (n - 1) % block_size == 0           # token n is the first of a block
        before = len(seq.block_table)
        assert bm.can_append(seq)
        bm.may_append(seq)
        assert len(seq.block_table) - before == int(starts_block), f"len={n}"
        assert len(seq.block_table) == math.ceil(n / block_size)
        check_invariants(bm, [seq])


def test_block_size_one_needs_a_block_for_every_token():
    # The seed's rule `len(seq) % block_size == 1` never fires when block_size == 1: a manager
    # built on it hands out no block on append and says can_append on a full pool.
    bm = BlockManager(num_blocks=5, block_size=1)
    seq = Sequence([1], block_size=1)
    bm.allocate(seq)
    for t in range(2, 6):
        seq.append_token(t)
        assert bm.can_append(seq)
        bm.may_append(seq)
    assert seq.block_table == [0, 1, 2, 3, 4] and bm.num_free_blocks == 0
    seq.append_token(6)
    assert not bm.can_append(seq)           # token 6 needs a sixth block; none is free
    with pytest.raises(NoFreeBlocksError):
        bm.may_append(seq)


def test_can_append_equality_cases():
    bm = BlockManager(num_blocks=2, block_size=4)
    a = Sequence([1, 2, 3], block_size=4)
    b = Sequence([5, 6, 7, 8], block_size=4)
    bm.allocate(a)
    bm.allocate(b)
    assert bm.num_free_blocks == 0
    a.append_token(4)                   # fills block 0: needs no block
    assert bm.can_append(a)             # 0 free >= 0 needed
    b.append_token(9)                   # first token of block 1: needs one
    assert not bm.can_append(b)         # 0 free < 1 needed
    bm.deallocate(a)                    # one block comes back
    assert bm.num_free_blocks == 1
    assert bm.can_append(b)             # 1 free >= 1 needed
    bm.may_append(b)
    assert bm.num_free_blocks == 0 and len(b.block_table) == 2


# ------------------------------------------------------------------ release order

def test_deallocate_releases_in_reverse_order():
    bm = BlockManager(num_blocks=8, block_size=2)
    seq = Sequence(list(range(7)), block_size=2)
    bm.allocate(seq)
    table = list(seq.block_table)
    rest = list(bm.free_block_ids)
    bm.deallocate(seq)
    assert list(bm.free_block_ids) == rest + table[::-1]
    # The next allocation takes the oldest free blocks first; the freed prefix comes last.
    other = Sequence(list(range(100, 116)), block_size=2)
    bm.allocate(other)
    assert other.block_table == rest + table[::-1]


def test_shared_block_is_freed_only_by_its_last_holder():
    bm = BlockManager(num_blocks=8, block_size=2)
    a = Sequence([1, 2, 3, 4, 5], block_size=2)
    admit(bm, a)
    b = Sequence([1, 2, 3, 4, 9], block_size=2)
    assert bm.can_allocate(b) == 2
    admit(bm, b)
    assert [bm.blocks[i].ref_count for i in a.block_table[:2]] == [2, 2]
    bm.deallocate(a)
    assert a.block_table == [] and all(bm.blocks[i].ref_count == 1 for i in b.block_table)
    check_invariants(bm, [b])


# ------------------------------------------------------------------ prefix caching

def test_freed_block_keeps_hash_and_is_revived_by_a_hit():
    bm = BlockManager(num_blocks=6, block_size=4)
    a = Sequence(list(range(10)), block_size=4)
    admit(bm, a)
    first, second = a.block_table[:2]
    h0 = bm.blocks[first].hash
    bm.deallocate(a)
    assert bm.blocks[first].ref_count == 0 and bm.blocks[first].hash == h0
    assert bm.hash_to_block_id[h0] == first
    b = Sequence(list(range(8)) + [50, 51, 52], block_size=4)
    assert bm.can_allocate(b) == 2
    bm.allocate(b, 2)
    assert b.block_table[:2] == [first, second]
    assert b.num_cached_tokens == 8
    assert first not in list(bm.free_block_ids) and bm.blocks[first].ref_count == 1
    check_invariants(bm, [b])


def test_hit_block_is_not_handed_out_twice_by_the_same_allocation():
    # Arrange for the cached block to sit at the head of the free queue, exactly where the
    # allocation's fresh block would be popped from.
    bm = BlockManager(num_blocks=3, block_size=2)
    a = Sequence([1, 2, 3], block_size=2)
    admit(bm, a)                                  # a: [0, 1], block 0 cached
    bm.deallocate(a)                              # free: 2 1 0
    x, y = Sequence([9], block_size=2), Sequence([8], block_size=2)
    bm.allocate(x)
    bm.allocate(y)                                # free: 0
    bm.deallocate(x)                              # free: 0 2
    assert list(bm.free_block_ids) == [0, 2]
    b = Sequence([1, 2, 7], block_size=2)
    assert bm.can_allocate(b) == 1
    bm.allocate(b, 1)
    assert b.block_table == [0, 2]
    check_invariants(bm, [b, y])


def test_stale_index_entry_is_dropped_when_block_gets_new_content():
    bm = BlockManager(num_blocks=2, block_size=2)
    a = Sequence([1, 2, 3], block_size=2)
    admit(bm, a)
    h = bm.blocks[a.block_table[0]].hash
    bm.deallocate(a)
    assert h in bm.hash_to_block_id
    b = Sequence([8, 9, 10, 11], block_size=2)   # no hit: takes both blocks for new content
    assert bm.can_allocate(b) == 0
    bm.allocate(b)
    assert h not in bm.hash_to_block_id
    # Without the drop, a request with a's prefix would "hit" a block that now holds b's tokens.
    c = Sequence([1, 2, 5], block_size=2)
    assert bm.can_allocate(c) == -1   # no hit, and no free block either
    check_invariants(bm, [b])


def test_stale_guard_keeps_an_entry_that_points_at_another_block():
    # Two sequences with the same prefix admitted in one step both compute the block; the
    # later registration wins the index. Reusing the older block must not drop that entry.
    bm = BlockManager(num_blocks=4, block_size=2)
    a = Sequence([1, 2, 3], block_size=2)
    b = Sequence([1, 2, 4], block_size=2)
    for s in (a, b):
        assert bm.can_allocate(s) == 0
        bm.allocate(s, 0)
    for s in (a, b):
        compute_all(bm, s)
    h = bm.blocks[a.block_table[0]].hash
    assert bm.blocks[b.block_table[0]].hash == h
    assert bm.hash_to_block_id[h] == b.block_table[0]
    bm.deallocate(a)                          # a's copy goes to the free queue
    c = Sequence([9, 9, 9], block_size=2)     # fresh blocks, starting with a's old ones
    bm.allocate(c)
    assert a.block_table == [] and bm.hash_to_block_id[h] == b.block_table[0]
    d = Sequence([1, 2, 7], block_size=2)
    bm.deallocate(c)
    assert bm.can_allocate(d) == 1
    check_invariants(bm, [b])


def test_forced_hash_collision_falls_back_to_a_fresh_block(monkeypatch):
    bm = BlockManager(num_blocks=6, block_size=2)
    monkeypatch.setattr(bm, "compute_hash", lambda token_ids, prefix=-1: 42)
    a = Sequence([1, 2, 3], block_size=2)
    admit(bm, a)
    assert bm.hash_to_block_id == {42: a.block_table[0]}
    b = Sequence([5, 6, 7], block_size=2)   # same (forced) hash, other tokens
    assert bm.can_allocate(b) == 0
    bm.allocate(b, 0)
    assert b.block_table[0] != a.block_table[0] and b.num_cached_tokens == 0
    check_invariants(bm, [a, b])


def test_same_block_content_at_another_position_does_not_match():
    bm = BlockManager(num_blocks=8, block_size=2)
    a = Sequence([1, 2, 1, 2, 3], block_size=2)
    admit(bm, a)
    assert bm.blocks[a.block_table[0]].hash != bm.blocks[a.block_table[1]].hash
    b = Sequence([5, 6, 1, 2, 3], block_size=2)   # block 1 equals a's block 1, prefix differs
    assert bm.can_allocate(b) == 0


@pytest.mark.parametrize("block_size", [1, 2, 4])
def test_last_block_of_a_prompt_is_never_a_hit(block_size):
    bm = BlockManager(num_blocks=32, block_size=block_size)
    prompt = list(range(3 * block_size))        # exactly three full blocks
    a = Sequence(prompt, block_size=block_size)
    admit(bm, a)
    b = Sequence(prompt, block_size=block_size)
    assert bm.can_allocate(b) == 2               # the block with the last token is recomputed
    bm.allocate(b, 2)
    assert b.num_cached_tokens == 2 * block_size < b.num_tokens


def test_blocks_count_as_hits_only_after_hash_blocks():
    bm = BlockManager(num_blocks=8, block_size=2)
    a = Sequence([1, 2, 3, 4, 5], block_size=2)
    bm.allocate(a)
    b = Sequence([1, 2, 3, 4, 6], block_size=2)
    assert bm.can_allocate(b) == 0               # a's K/V are not computed yet
    a.num_cached_tokens = 2                      # a chunk covered the first block only
    bm.hash_blocks(a)
    assert bm.can_allocate(b) == 1
    a.num_cached_tokens = 5
    bm.hash_blocks(a)
    assert bm.can_allocate(b) == 2


def test_decoded_blocks_are_registered_and_reused():
    bm = BlockManager(num_blocks=8, block_size=2)
    a = Sequence([1, 2, 3], block_size=2)
    admit(bm, a)
    for t in (4, 5, 6):
        a.append_token(t)
        bm.may_append(a)
        compute_all(bm, a)
    bm.deallocate(a)
    follow_up = Sequence([1, 2, 3, 4, 5, 6, 7], block_size=2)   # next turn contains the answer
    assert bm.can_allocate(follow_up) == 3


def test_prefix_caching_disabled_gives_no_hits():
    bm = BlockManager(num_blocks=8, block_size=2, enable_prefix_caching=False)
    a = Sequence([1, 2, 3, 4, 5], block_size=2)
    admit(bm, a)
    assert bm.hash_to_block_id == {}
    assert bm.can_allocate(Sequence([1, 2, 3, 4, 5], block_size=2)) == 0


def test_compute_hash_is_xxhash64_chained_on_the_parent_hash():
    # An independent statement of the contract: xxhash64 over the parent's hash (8 bytes,
    # little endian) followed by the token ids as int64.
    import struct

    import xxhash
    parent = compute_hash([9, 9])
    assert parent == xxhash.xxh64(struct.pack("<2q", 9, 9)).intdigest()
    assert compute_hash([1, 2], parent) == xxhash.xxh64(struct.pack("<Q2q", parent, 1, 2)).intdigest()
    assert compute_hash([1, 2, 3]) == compute_hash([1, 2, 3])
    assert compute_hash([1, 2, 3]) != compute_hash([1, 2, 4])
    parent = compute_hash([9, 9])
    assert compute_hash([1, 2], parent) != compute_hash([1, 2])
    assert compute_hash([1, 2], parent) != compute_hash([1, 2], compute_hash([9, 8]))


# ------------------------------------------------------------------ misuse

def _prepared():
    bm = BlockManager(num_blocks=4, block_size=2)
    a = Sequence([1, 2, 3], block_size=2)
    admit(bm, a)
    return bm, a


def _unchanged(bm, seqs, call, exc, match):
    before = state(bm, seqs)
    with pytest.raises(exc, match=match):
        call()
    assert state(bm, seqs) == before


@pytest.mark.parametrize("num_blocks,block_size", [(0, 4), (4, 0), (-1, 4), (4, -2), (2.0, 4)])
def test_rejects_bad_sizes(num_blocks, block_size):
    with pytest.raises(ValueError, match="num_blocks|block_size"):
        BlockManager(num_blocks, block_size)


def test_allocate_twice_raises_and_changes_nothing():
    bm, a = _prepared()
    _unchanged(bm, [a], lambda: bm.allocate(a), ValueError, "already has blocks")


def test_deallocate_without_blocks_raises_and_changes_nothing():
    bm, a = _prepared()
    b = Sequence([5], block_size=2)
    _unchanged(bm, [a, b], lambda: bm.deallocate(b), ValueError, "holds no blocks")


def test_allocate_without_room_raises_and_changes_nothing():
    bm, a = _prepared()
    big = Sequence(list(range(100, 106)), block_size=2)    # 3 blocks, 2 free
    assert bm.can_allocate(big) == -1
    _unchanged(bm, [a, big], lambda: bm.allocate(big), NoFreeBlocksError, "needs 3 free blocks")


def test_allocate_rejects_more_cached_blocks_than_the_cache_holds():
    bm, a = _prepared()
    b = Sequence([1, 2, 9, 9, 9], block_size=2)
    assert bm.can_allocate(b) == 1
    _unchanged(bm, [a, b], lambda: bm.allocate(b, 2), ValueError, "num_cached_blocks")


def test_may_append_without_room_raises_and_changes_nothing():
    bm = BlockManager(num_blocks=2, block_size=2)
    a = Sequence([1, 2, 3, 4], block_size=2)
    bm.allocate(a)
    a.append_token(5)
    _unchanged(bm, [a], lambda: bm.may_append(a), NoFreeBlocksError, "needs 1 free block")


def test_may_append_before_allocate_raises():
    bm = BlockManager(num_blocks=2, block_size=2)
    a = Sequence([1], block_size=2)
    _unchanged(bm, [a], lambda: bm.may_append(a), ValueError, "allocate it first")


def test_block_size_mismatch_raises_and_changes_nothing():
    bm = BlockManager(num_blocks=4, block_size=2)
    a = Sequence([1, 2, 3], block_size=4)
    _unchanged(bm, [a], lambda: bm.allocate(a), ValueError, "block_size 4")


def test_deallocating_a_table_this_manager_did_not_hand_out_raises_and_changes_nothing():
    bm, a = _prepared()
    copy = Sequence([1, 2, 3], block_size=2)
    copy.block_table = list(a.block_table)
    bm.deallocate(a)
    _unchanged(bm, [a, copy], lambda: bm.deallocate(copy), ValueError, "not allocated by this BlockManager")
    other = BlockManager(num_blocks=4, block_size=4)
    b = Sequence([1, 2, 3], block_size=2)
    bm.allocate(b)
    _unchanged(other, [b], lambda: other.deallocate(b), ValueError, "block_size 2")
