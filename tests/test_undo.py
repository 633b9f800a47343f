"""The undo log on its own (ARCHITECTURE.md, "The undo log").

* The primitives: each change, undone, gives back exactly the value before, for lists, deques,
  dicts and attributes, in any interleaving (a property test against copies made beforehand).
* The block manager: any sequence of its calls inside ``BlockManager.transaction()``, broken
  off by an exception at any point, leaves every structure as it was -- ref counts, the free
  queue's order (deque and linked), the used set, the prefix index, the exact prefix ids, the
  owners, the statistics and every sequence's block table.
* Once ``kv_written`` is set, the blocks the transaction took from the free queue lose their
  cache entries instead.
"""
from __future__ import annotations

import copy
from collections import deque

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from course_pkg import BlockManager, Sequence
from course_pkg.undo import UndoLog
from tests.helpers import check_invariants


class Boom(Exception):
    pass


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["append", "appendleft", "remove", "insert", "setitem", "delitem",
                                           "setattr", "add", "save"]),
                          st.integers(0, 5), st.integers(0, 99)), max_size=30))
def test_every_primitive_undone_gives_back_the_value_before(ops):
    class Box:
        pass

    box = Box()
    box.items, box.queue, box.table, box.counter, box.name = [1, 2, 3], deque([4, 5]), {"a": 1}, 0, "x"
    before = copy.deepcopy(vars(box))
    log = UndoLog()
    for op, i, v in ops:
        if op == "append":
            log.append(box.items, v)
        elif op == "appendleft":
            log.appendleft(box.queue, v)
        elif op == "remove" and v in box.items:
            log.remove(box.items, v)
        elif op == "remove" and box.items:
            log.remove(box.items, box.items[i % len(box.items)])
        elif op == "insert":
            log.insert(box.items, i % (len(box.items) + 1), v)
        elif op == "setitem":
            log.setitem(box.table, "abcdef"[i], v)
        elif op == "delitem" and box.table:
            log.delitem(box.table, sorted(box.table)[i % len(box.table)])
        elif op == "setattr":
            log.setattr(box, "name", str(v))
        elif op == "add":
            log.add(box, "counter", v)
        elif op == "save":
            log.save(box, "items", "counter")
            box.items.append(v)
            box.counter += v
    log.rollback()
    assert vars(box) == before and len(log) == 0


def full_state(bm: BlockManager, seqs) -> tuple:
    stats = bm.prefix_cache_stats
    return (
        tuple((b.block_id, b.ref_count, b.hash, tuple(b.token_ids), b.prefix_id, b.parent_prefix_id, b.cache_salt)
              for b in bm.blocks),
        tuple(bm.free_block_ids), frozenset(bm.used_block_ids), tuple(sorted(bm.hash_to_block_id.items())),
        tuple(sorted(bm._prefix_ids.items(), key=repr)), bm._next_prefix_id, tuple(sorted(bm._holders)),
        (stats.requests, stats.queries, stats.hits, stats.preempted_requests, tuple(stats.recent)),
        tuple((s.seq_id, tuple(s.block_table), tuple(s.block_hashes), s.num_cached_tokens) for s in seqs),
    )


OPS = st.lists(st.tuples(st.sampled_from(["allocate", "deallocate", "fork", "hash", "append"]),
                         st.integers(0, 7), st.integers(1, 9)), min_size=1, max_size=25)


def apply(bm: BlockManager, seqs: list[Sequence], op: str, i: int, v: int) -> None:
    """One block-manager call chosen by (op, i, v); calls that do not apply are skipped."""
    held = [s for s in seqs if s.block_table]
    if op == "allocate":
        prompt = ([1, 2, 3, 4, 5, 6] * 3)[: 2 + i * 2] + [v]   # shared prefixes: hits and revivals
        seq = Sequence(prompt, block_size=bm.block_size)
        n = bm.can_allocate(seq)
        if n >= 0:
            bm.allocate(seq, n)
            seqs.append(seq)
    elif op == "deallocate" and held:
        bm.deallocate(held[i % len(held)])
    elif op == "fork" and held:
        parent = held[i % len(held)]
        child = parent.fork(1)
        bm.fork(parent, child)
        seqs.append(child)
    elif op == "hash" and held:
        seq = held[i % len(held)]
        bm.hash_blocks(seq, seq.num_tokens - (v % 2))
    elif op == "append" and held:
        seq = held[i % len(held)]
        log = bm.undo_log
        if log is not None:   # the scheduler's part of an append: the token itself
            log.record(lambda s=seq, n=seq.num_tokens: s.restore_progress(s.num_cached_tokens, 0, n,
                                                                            s.cumulative_logprob))
        seq.append_token(v)
        if bm.can_append(seq):
            bm.may_append(seq)
        else:                 # no block for it: the token is taken back (a scheduler would preempt)
            seq.restore_progress(seq.num_cached_tokens, 0, seq.num_tokens - 1, seq.cumulative_logprob)


@settings(max_examples=150, deadline=None)
@given(warm=OPS, ops=OPS, fail_at=st.integers(0, 25), queue=st.sampled_from(["deque", "linked"]))
def test_a_transaction_broken_off_anywhere_leaves_the_manager_as_it_was(warm, ops, fail_at, queue):
    bm = BlockManager(14, 2, free_queue=queue)
    seqs: list[Sequence] = []
    for op in warm:                       # some history: held, shared, registered and freed blocks
        apply(bm, seqs, *op)
    before = full_state(bm, seqs)
    known = list(seqs)
    with pytest.raises(Boom):
        with bm.transaction():
            for k, op in enumerate(ops):
                if k == fail_at % len(ops):
                    raise Boom
                apply(bm, seqs, *op)
    assert full_state(bm, known) == before
    assert bm.undo_log is None
    check_invariants(bm, [s for s in known if s.block_table])


@settings(max_examples=60, deadline=None)
@given(warm=OPS, ops=OPS)
def test_after_kv_was_written_the_blocks_taken_lose_their_cache_entries(warm, ops):
    bm = BlockManager(14, 2, free_queue="linked")
    seqs: list[Sequence] = []
    for op in warm:
        apply(bm, seqs, *op)
    known = list(seqs)
    cached_free = {b.block_id for b in bm.blocks if b.ref_count == 0 and b.hash != -1}
    with pytest.raises(Boom):
        with bm.transaction() as log:
            log.kv_written = True
            for op in ops:
                apply(bm, seqs, *op)
            taken = set(log.new_blocks)
            raise Boom
    for b in bm.blocks:
        if b.block_id in taken:
            assert b.hash == -1 and b.block_id not in bm.hash_to_block_id.values()
        elif b.block_id in cached_free:
            assert b.hash != -1, "a cached block the transaction never took keeps its entry"
    check_invariants(bm, [s for s in known if s.block_table])
