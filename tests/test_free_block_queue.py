"""The linked free block queue against a deque: same order, same errors, same BlockManager.

Two levels: the queue alone against ``collections.deque`` under random operations, then two
BlockManagers -- one per queue kind -- driven by the same random trace of admissions,
decode steps, hashing, releases and preemptions: every block id, ref count, hash, index
entry and the free order must match after every step.
"""
from __future__ import annotations

from collections import deque

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from course_pkg import BlockManager, NoFreeBlocksError, Sequence
from course_pkg.free_block_queue import FreeBlockQueue
from tests.helpers import admit, check_invariants, compute_all, state


# ------------------------------------------------------------------ the queue alone

def test_starts_with_all_ids_in_order_like_deque_range():
    q = FreeBlockQueue(5)
    assert list(q) == [0, 1, 2, 3, 4] and len(q) == 5
    assert list(FreeBlockQueue(0)) == [] and len(FreeBlockQueue(0)) == 0
    assert list(FreeBlockQueue(1)) == [0]
    assert list(FreeBlockQueue(4, [2, 0])) == [2, 0]


def test_remove_from_head_middle_and_tail():
    q = FreeBlockQueue(5)
    q.remove(2)
    q.remove(0)
    q.remove(4)
    assert list(q) == [1, 3] and len(q) == 2
    assert 2 not in q and 1 in q
    q.append(2)
    assert list(q) == [1, 3, 2]
    assert q.popleft() == 1 and list(q) == [3, 2]


def test_misuse_raises_and_leaves_the_queue_unchanged():
    q = FreeBlockQueue(3, [2, 0])
    with pytest.raises(ValueError, match="already in the free queue"):
        q.append(0)
    with pytest.raises(ValueError, match="not in the free queue"):
        q.remove(1)
    with pytest.raises(ValueError, match="not in 0..2"):
        q.append(3)
    with pytest.raises(ValueError, match="not in 0..2"):
        q.remove(-1)
    assert list(q) == [2, 0] and len(q) == 2
    q.popleft(), q.popleft()
    with pytest.raises(IndexError, match="empty"):
        q.popleft()
    assert list(q) == [] and len(q) == 0
    with pytest.raises(ValueError):
        FreeBlockQueue(-1)


@settings(max_examples=200, deadline=None)
@given(n=st.integers(1, 12), ops=st.lists(st.tuples(st.sampled_from(["pop", "append", "remove"]),
                                                    st.integers(0, 11)), max_size=80))
def test_matches_deque_under_random_operations(n, ops):
    q, d = FreeBlockQueue(n), deque(range(n))
    for op, x in ops:
        b = x % n
        if op == "pop" and d:
            assert q.popleft() == d.popleft()
        elif op == "append" and b not in d:
            q.append(b)
            d.append(b)
        elif op == "remove" and b in d:
            q.remove(b)
            d.remove(b)
        assert list(q) == list(d)
        assert len(q) == len(d)
        assert all((i in q) == (i in d) for i in range(n))


# ------------------------------------------------------------------ two BlockManagers, one trace

# Prompts share a few prefixes so that hits, sharing and revivals of free blocks all happen.
PREFIXES = [[1, 2, 3, 4, 5, 6], [1, 2, 3, 9, 9, 9], [7, 7, 7, 7], []]

op = st.one_of(
    st.tuples(st.just("admit"), st.integers(0, len(PREFIXES) - 1), st.lists(st.integers(0, 3), max_size=6)),
    st.tuples(st.just("step"), st.integers(0, 50), st.integers(0, 3)),
    st.tuples(st.just("finish"), st.integers(0, 50), st.just(0)),
)


@settings(max_examples=150, deadline=None)
@given(num_blocks=st.integers(1, 10), block_size=st.integers(1, 3), trace=st.lists(op, max_size=40))
def test_linked_queue_gives_the_same_block_ids_as_the_deque(num_blocks, block_size, trace):
    managers = [BlockManager(num_blocks, block_size, free_queue=kind) for kind in ("deque", "linked")]
    live: list[list[Sequence]] = [[], []]  # the same requests, one Sequence per manager
    for kind, a, b in trace:
        for bm, seqs in zip(managers, live):
            if kind == "admit":
                seq = Sequence(PREFIXES[a] + b or [0], block_size=block_size)
                if bm.can_allocate(seq) == -1:
                    continue
                seqs.append(admit(bm, seq))   # with its prefill step: full blocks become cache entries
            elif kind == "step" and seqs:  # one decode token for one live sequence
                seq = seqs[a % len(seqs)]
                seq.append_token(b)
                if bm.can_append(seq):
                    bm.may_append(seq)
                    compute_all(bm, seq)
                else:  # preempt it: release everything, as the scheduler would
                    with pytest.raises(NoFreeBlocksError):
                        bm.may_append(seq)
                    bm.deallocate(seq)
                    seqs.remove(seq)
            elif kind == "finish" and seqs:
                bm.deallocate(seqs.pop(a % len(seqs)))
        assert state(managers[0], live[0]) == state(managers[1], live[1])
    for bm, seqs in zip(managers, live):
        for seq in seqs:
            bm.deallocate(seq)
    assert state(managers[0]) == state(managers[1])
    check_invariants(managers[1], [])                 # the whole pool is free again


def test_free_queue_choice_is_validated():
    with pytest.raises(ValueError, match="free_queue"):
        BlockManager(4, 2, free_queue="heap")
    assert isinstance(BlockManager(4, 2).free_block_ids, deque)
    assert isinstance(BlockManager(4, 2, free_queue="linked").free_block_ids, FreeBlockQueue)
