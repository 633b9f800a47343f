"""The tier's bookkeeping (course_pkg/offload, chapter 15): vLLM's six calls, LRU and ARC, the reuse gate.

The LRU manager runs in lockstep with a reference written here from the contract alone (plain
lists, no OrderedDict, no iterators); ARC keeps the invariants of Megiddo and Modha's paper at
every call and shows the behaviour it exists for: a working set survives a scan that an LRU
does not.
"""
from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from course_pkg.offload import (ARCOffloadingManager, FilterReusedOffloadingManager, LRUOffloadingManager,
                                OffloadingManager)


class ReferenceLRU:
    """The LRU tier as the contract states it, on plain lists."""

    def __init__(self, c: int):
        self.c = c
        self.order: list[int] = []          # least recently used first
        self.ready: dict[int, bool] = {}
        self.loads: dict[int, int] = {}

    def lookup(self, hashes):
        n = 0
        for h in hashes:
            if not self.ready.get(h, False):
                break
            n += 1
        return n

    def touch(self, hashes):
        for h in reversed(hashes):
            if h in self.order:
                self.order.remove(h)
                self.order.append(h)

    def prepare_store(self, hashes):
        new = []
        for h in hashes:
            if h not in self.ready and h not in new:
                new.append(h)
        need = len(new) - (self.c - len(self.order))
        evictable = [h for h in self.order if self.ready[h] and self.loads.get(h, 0) == 0]
        if need > len(evictable):
            return None
        victims = evictable[:max(need, 0)]
        for h in victims:
            self.order.remove(h)
            del self.ready[h]
        for h in new:
            self.order.append(h)
            self.ready[h] = False
        return new, victims

    def complete_store(self, hashes, success):
        for h in hashes:
            if h in self.ready and not self.ready[h]:
                if success:
                    self.ready[h] = True
                else:
                    self.order.remove(h)
                    del self.ready[h]


def check_slots(m: OffloadingManager, holders: dict) -> None:
    """Free slots and held slots partition the tier; no slot is held twice."""
    held = [b.block_id for b in holders.values()]
    assert len(held) == len(set(held)) == len(m)
    assert sorted(held + list(m.free_block_ids)) == list(range(m.num_blocks))


def check_arc(m: ARCOffloadingManager) -> None:
    c = m.num_blocks
    t1, t2, b1, b2 = set(m.t1), set(m.t2), set(m.b1), set(m.b2)
    assert len(t1) + len(t2) <= c and len(t1) + len(b1) <= c
    assert len(t1) + len(t2) + len(b1) + len(b2) <= 2 * c
    assert 0 <= m.p <= c
    assert not (t1 & t2) and not ((t1 | t2) & (b1 | b2)) and not (b1 & b2)
    check_slots(m, {**m.t1, **m.t2})


ops = st.lists(st.tuples(st.sampled_from(["lookup", "touch", "store", "store_fail", "load", "done"]),
                         st.lists(st.integers(0, 11), min_size=1, max_size=5)), max_size=60)


@settings(max_examples=200, deadline=None)
@given(c=st.integers(1, 6), script=ops)
def test_lru_tier_in_lockstep_with_the_reference(c, script):
    m, ref = LRUOffloadingManager(c), ReferenceLRU(c)
    loading: list[list[int]] = []
    for op, hashes in script:
        if op == "lookup":
            assert m.lookup(hashes) == ref.lookup(hashes)
        elif op == "touch":
            m.touch(hashes)
            ref.touch(hashes)
        elif op in ("store", "store_fail"):
            before = (list(m.blocks), list(m.free_block_ids))
            out, want = m.prepare_store(hashes), ref.prepare_store(hashes)
            if want is None:
                assert out is None and (list(m.blocks), list(m.free_block_ids)) == before   # nothing changed
                continue
            assert (out.block_hashes_to_store, out.block_hashes_evicted) == want
            m.complete_store(hashes, success=op == "store")
            ref.complete_store(hashes, success=op == "store")
        elif op == "load":
            n = m.lookup(hashes)
            if n:
                spec = m.prepare_load(hashes[:n])
                assert list(spec.block_ids) == [m.blocks[h].block_id for h in hashes[:n]]
                loading.append(hashes[:n])
                for h in hashes[:n]:
                    ref.loads[h] = ref.loads.get(h, 0) + 1
        elif op == "done" and loading:
            done = loading.pop(0)
            m.complete_load(done)
            for h in done:
                ref.loads[h] -= 1
        assert list(m.blocks) == ref.order
        assert {h: b.is_ready for h, b in m.blocks.items()} == ref.ready
        check_slots(m, m.blocks)


@settings(max_examples=200, deadline=None)
@given(c=st.integers(1, 6), script=ops)
def test_arc_keeps_its_invariants_and_never_evicts_a_block_in_use(c, script):
    m = ARCOffloadingManager(c)
    loading: list[list[int]] = []
    for op, hashes in script:
        if op == "lookup":
            m.lookup(hashes)
        elif op == "touch":
            m.touch(hashes)
        elif op in ("store", "store_fail"):
            in_use = {h for batch in loading for h in batch} | {h for h, b in {**m.t1, **m.t2}.items() if not b.is_ready}
            before = (dict(m.t1), dict(m.t2), dict(m.b1), dict(m.b2), m.p, list(m.free_block_ids))
            out = m.prepare_store(hashes)
            if out is None:
                assert (dict(m.t1), dict(m.t2), dict(m.b1), dict(m.b2), m.p, list(m.free_block_ids)) == before
                continue
            assert not in_use & set(out.block_hashes_evicted)
            assert set(out.block_hashes_to_store) <= set(m.t1) | set(m.t2)
            m.complete_store(hashes, success=op == "store")
        elif op == "load":
            n = m.lookup(hashes)
            if n:
                m.prepare_load(hashes[:n])
                loading.append(hashes[:n])
        elif op == "done" and loading:
            m.complete_load(loading.pop(0))
        check_arc(m)


def run_pattern(manager: OffloadingManager, requests) -> int:
    """Each request: look up its blocks, load what the tier has, touch them all, store the rest;
    returns the blocks found in the tier."""
    hits = 0
    for hashes in requests:
        n = manager.lookup(hashes)
        if n:
            manager.prepare_load(hashes[:n])
            manager.complete_load(hashes[:n])
        manager.touch(hashes)
        out = manager.prepare_store(hashes[n:])
        if out is not None:
            manager.complete_store(out.block_hashes_to_store)
        hits += n
    return hits


def test_arc_keeps_a_working_set_through_a_scan_that_lru_does_not_survive():
    # A working set of 6 blocks used again and again, and between its uses a scan of 12 blocks
    # never seen again, on a tier of 10 blocks: LRU lets the scan push the working set out;
    # ARC keeps it in t2 (seen twice) and lets the scan pass through t1.
    rng = random.Random(0)
    scan = iter(range(1000, 100_000))
    requests = []
    for _ in range(60):
        requests.append([rng.choice(range(6))])
        requests.extend([[next(scan)] for _ in range(2)])
    hot = [r for r in requests if r[0] < 6]

    def hot_hits(manager):
        hits = 0
        for r in requests:
            got = run_pattern(manager, [r])
            hits += got if r[0] < 6 else 0
        return hits

    lru, arc = hot_hits(LRUOffloadingManager(10)), hot_hits(ARCOffloadingManager(10))
    # A hot block misses at most twice in ARC: new (into t1, pushed out by the scan into b1),
    # then as a ghost (touched in b1: p grows, and it is stored again into t2, where it stays).
    assert arc >= len(hot) - 2 * 6
    assert lru <= len(hot) // 2 < arc


def test_arc_learns_recency_from_ghost_hits_in_b1():
    # Two blocks asked for twice (t2), then four seen once on a tier of 4: the first two of
    # those are evicted from t1 into its ghost list b1. Asking for one of them again says "t1
    # was too small": p grows, and the block comes back into t2.
    m = ARCOffloadingManager(4)
    run_pattern(m, [[1, 2], [1, 2], [3], [4], [5], [6]])
    assert list(m.t2) == [2, 1] and list(m.t1) == [5, 6] and list(m.b1) == [3, 4] and m.p == 0
    m.touch([3])
    assert m.p == 1
    out = m.prepare_store([3])
    m.complete_store(out.block_hashes_to_store)
    assert 3 in m.t2 and 3 not in m.b1 and out.block_hashes_evicted == [5]   # t1 (2 blocks) is above p = 1


def test_arc_discards_without_a_ghost_when_blocks_seen_once_fill_the_tier():
    # ARC's case IV(a): with t1 the whole cache, what t1 gives up leaves no ghost (|t1| + |b1| <= c).
    m = ARCOffloadingManager(4)
    run_pattern(m, [[1], [2], [3], [4], [5], [6]])
    assert list(m.t1) == [3, 4, 5, 6] and not m.b1 and not m.t2


def test_prepare_store_holds_no_block_twice_and_refuses_when_everything_is_in_use():
    m = LRUOffloadingManager(2)
    out = m.prepare_store([7, 7, 8])
    assert out.block_hashes_to_store == [7, 8] and len(m) == 2
    assert m.lookup([7, 8]) == 0                     # not loadable before its store completes
    assert m.prepare_store([9]) is None              # both are being stored: nothing to evict
    m.complete_store([7, 8])
    m.prepare_load([7, 8])
    assert m.prepare_store([9]) is None              # both are being loaded
    m.complete_load([7])
    assert m.prepare_store([9]).block_hashes_evicted == [7]
    with pytest.raises(ValueError, match="not being loaded"):
        m.complete_load([8, 8])                      # 8 is being loaded once, not twice
    with pytest.raises(ValueError, match="not in the tier"):
        m.prepare_load([7])


def test_a_failed_store_gives_its_slots_back():
    m = ARCOffloadingManager(3)
    out = m.prepare_store([1, 2])
    m.complete_store(out.block_hashes_to_store, success=False)
    assert len(m) == 0 and sorted(m.free_block_ids) == [0, 1, 2] and 1 not in m


def test_the_reuse_gate_stores_a_block_only_once_it_was_asked_for_enough():
    gate = FilterReusedOffloadingManager(LRUOffloadingManager(8), store_threshold=2)
    gate.lookup([1, 2])
    assert gate.prepare_store([1, 2]).block_hashes_to_store == []
    gate.lookup([1])
    out = gate.prepare_store([1, 2])
    assert out.block_hashes_to_store == [1]
    gate.complete_store([1])
    assert gate.lookup([1, 2]) == 1 and 1 in gate and len(gate) == 1
    small = FilterReusedOffloadingManager(LRUOffloadingManager(8), store_threshold=2, max_tracker_size=2)
    small.lookup([1]); small.lookup([2]); small.lookup([3])   # 1 forgotten: the table holds 2
    small.lookup([1])
    assert small.prepare_store([1]).block_hashes_to_store == []


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_sizes_are_checked(bad):
    with pytest.raises((ValueError, TypeError)):
        LRUOffloadingManager(bad)
    with pytest.raises((ValueError, TypeError)):
        FilterReusedOffloadingManager(LRUOffloadingManager(2), store_threshold=bad if bad != 1.5 else 0)


# ---------------------------------------------------------------- the two-tier replay

from course_pkg.workloads.replay import replay  # noqa: E402
from course_pkg.workloads.tier_replay import replay_with_tier  # noqa: E402
from course_pkg.workloads.traces import TraceRequest  # noqa: E402

# Requests as prefixes of a few conversations: block ids from a small tree, so requests share.
prefix_paths = st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=6), min_size=1, max_size=25)


def trace_of(paths):
    """Each path of branch choices becomes a request whose block ids name its prefix exactly."""
    requests = []
    for i, path in enumerate(paths):
        ids, node = [], 0
        for choice in path:
            node = node * 4 + choice + 1
            ids.append(node)
        requests.append(TraceRequest(float(i), 512 * len(ids), 1, tuple(ids)))
    return requests


@settings(max_examples=150, deadline=None)
@given(paths=prefix_paths, pool=st.integers(1, 8), tier=st.integers(1, 8), concurrency=st.integers(1, 3),
       policy=st.sampled_from(["vllm", "lru", "radix"]), arc=st.booleans())
def test_the_tier_adds_to_the_device_hits_and_never_changes_them(paths, pool, tier, concurrency, policy, arc):
    trace = trace_of(paths)
    manager = (ARCOffloadingManager if arc else LRUOffloadingManager)(tier)
    got = replay_with_tier(trace, policy, pool, manager, concurrency=concurrency)
    alone = replay(trace, policy, pool, concurrency=concurrency)
    assert [h[0] if h else None for h in got.hits] == list(alone.hits)
    bound = replay(trace, "infinite", pool)
    for h, b in zip(got.hits, bound.hits):
        assert (h is None) == (b is None) and (h is None or h[0] + h[1] <= b)


@settings(max_examples=100, deadline=None)
@given(paths=prefix_paths, pool=st.integers(1, 8), policy=st.sampled_from(["vllm", "lru", "radix"]))
def test_a_tier_that_never_evicts_reaches_the_infinite_bound(paths, pool, policy):
    trace = trace_of(paths)
    distinct = len({b for r in trace for b in r.hash_ids})
    got = replay_with_tier(trace, policy, pool, LRUOffloadingManager(distinct))
    bound = replay(trace, "infinite", pool)
    assert [None if h is None else h[0] + h[1] for h in got.hits] == list(bound.hits)
    assert got.tier_stats.evicted == 0


def test_the_reuse_gate_costs_the_first_return_of_a_block():
    # A, then A again, then A a third time, with the device pool too small to keep A between
    # requests (B and C pass through it). Without the gate A is in the tier at its second
    # request; with store_threshold=2 only at its third.
    a, b, c = [1, 2, 3], [7, 8, 9], [4, 5, 6]
    trace = [TraceRequest(float(i), 512 * 3, 1, tuple(ids)) for i, ids in enumerate([a, b, c, a, b, c, a])]
    plain = replay_with_tier(trace, "vllm", 3, LRUOffloadingManager(16), concurrency=1)
    gated = replay_with_tier(trace, "vllm", 3, FilterReusedOffloadingManager(LRUOffloadingManager(16)), concurrency=1)
    assert [h[1] for h in plain.hits] == [0, 0, 0, 2, 2, 2, 2]
    assert [h[1] for h in gated.hits] == [0, 0, 0, 0, 0, 0, 2]


def test_storing_on_evict_keeps_what_the_pool_forgot_where_storing_on_compute_mirrors_it():
    # Pool 3, one request at a time: A, B (which takes A's blocks), A again. A tier of 3 blocks
    # that stores on compute holds B's blocks by then (the same as the pool: a mirror); one that
    # stores on evict holds A's, which B pushed out of the pool.
    trace = [TraceRequest(float(i), 512 * 3, 1, tuple(ids)) for i, ids in enumerate([[1, 2, 3], [4, 5, 6], [1, 2, 3]])]
    on_compute = replay_with_tier(trace, "vllm", 3, LRUOffloadingManager(3), concurrency=1)
    on_evict = replay_with_tier(trace, "vllm", 3, LRUOffloadingManager(3), concurrency=1, store="evict")
    assert [h[1] for h in on_compute.hits] == [0, 0, 0]
    assert [h[1] for h in on_evict.hits] == [0, 0, 2]
    assert on_evict.tier_stats.stored == 3        # A's three blocks, when B took them
    with pytest.raises(ValueError, match="'vllm' policy"):
        replay_with_tier(trace, "radix", 3, LRUOffloadingManager(3), store="evict")


@settings(max_examples=100, deadline=None)
@given(paths=prefix_paths, pool=st.integers(1, 8), tier=st.integers(1, 12), concurrency=st.integers(1, 3))
def test_storing_on_evict_adds_to_the_device_hits_within_the_bound(paths, pool, tier, concurrency):
    trace = trace_of(paths)
    got = replay_with_tier(trace, "vllm", pool, ARCOffloadingManager(tier), concurrency=concurrency, store="evict")
    alone = replay(trace, "vllm", pool, concurrency=concurrency)
    bound = replay(trace, "infinite", pool)
    assert [h[0] if h else None for h in got.hits] == list(alone.hits)
    assert all(h is None or h[0] + h[1] <= b for h, b in zip(got.hits, bound.hits))


# ---------------------------------------------------------------- LinkedDict: OrderedDict's calls, undoable

dict_ops = st.lists(st.tuples(st.sampled_from(["set", "del", "pop", "move", "popfirst", "poplast"]),
                              st.integers(0, 7), st.integers()), max_size=40)


@settings(max_examples=200, deadline=None)
@given(script=dict_ops)
def test_linked_dict_behaves_as_an_ordered_dict(script):
    from collections import OrderedDict

    from course_pkg.offload.linked_dict import LinkedDict

    d, ref = LinkedDict(), OrderedDict()
    for op, key, value in script:
        for target in (d, ref):
            try:
                if op == "set":
                    target[key] = value
                elif op == "del":
                    del target[key]
                elif op == "pop":
                    result = target.pop(key, None)
                elif op == "move":
                    target.move_to_end(key)
                else:
                    result = target.popitem(last=op == "poplast")
                outcome = ("ok", result if op in ("pop", "popfirst", "poplast") else None)
            except KeyError:
                outcome = ("KeyError", None)
            if target is d:
                got = outcome
        assert got == outcome
        assert list(d.items()) == list(ref.items()) and len(d) == len(ref)
        assert all((k in d) == (k in ref) for k in range(8))


@settings(max_examples=100, deadline=None)
@given(start=st.lists(st.integers(0, 7), unique=True, max_size=8), script=dict_ops)
def test_a_journal_rolls_a_linked_dict_back_to_its_order(start, script):
    """Inside a transaction any changes; after the rollback the same items in the same order --
    what an OrderedDict under the journal could not give (it has no way to put a key back in
    place)."""
    from course_pkg.offload.linked_dict import LinkedDict
    from course_pkg.undo import Journal

    journal = Journal(follow=(LinkedDict,))
    d = journal.adopt(LinkedDict((k, -k) for k in start))
    before = list(d.items())
    journal.begin()
    for op, key, value in script:
        try:
            {"set": lambda: d.__setitem__(key, value), "del": lambda: d.__delitem__(key),
             "pop": lambda: d.pop(key, None), "move": lambda: d.move_to_end(key),
             "popfirst": lambda: d.popitem(last=False), "poplast": lambda: d.popitem()}[op]()
        except KeyError:
            pass
    journal.rollback()
    assert list(d.items()) == before and len(d) == len(before)


def test_the_tier_policy_grader_passes_arc_fails_lru_and_flags_a_broken_contract():
    from course_pkg.workloads.tier_replay import grade_tier_policy
    from course_pkg.workloads.traces import MOONCAKE_TRACE, load_trace

    trace = load_trace(MOONCAKE_TRACE, limit=1000)
    arc = grade_tier_policy(ARCOffloadingManager, trace, tier_blocks=4000, scripts=100)
    assert arc.passed and not arc.problems and arc.hit_ratio > arc.lru_hit_ratio
    lru = grade_tier_policy(LRUOffloadingManager, trace, tier_blocks=4000, scripts=100)
    assert not lru.passed and not lru.problems and lru.hit_ratio == lru.lru_hit_ratio

    class EvictsBlocksInUse(LRUOffloadingManager):   # the first n blocks, loaded or being stored or not
        def _eviction_order(self, n, incoming):
            victims = list(self.blocks)[:max(n, 0)]
            return victims if len(victims) == max(n, 0) else None

    broken = grade_tier_policy(EvictsBlocksInUse, trace, tier_blocks=4000, scripts=100)
    assert not broken.passed and "not all of them ready and free of loads" in broken.problems[0]


@settings(max_examples=200, deadline=None)
@given(c=st.integers(1, 6), script=ops)
def test_slru_decides_as_segmented_victims_says_on_plain_lists(c, script):
    from course_pkg.offload import SLRUOffloadingManager
    from course_pkg.offload.manager import segmented_victims

    m = SLRUOffloadingManager(c)
    loading: list[list[int]] = []
    for op, hashes in script:
        if op == "lookup":
            m.lookup(hashes)
        elif op == "touch":
            m.touch(hashes)
        elif op in ("store", "store_fail"):
            in_use = {h for h, b in m.blocks.items() if b.ref_cnt != 0}
            order, protected = list(m.blocks), set(m.protected)
            need = len(dict.fromkeys(h for h in hashes if h not in m)) - len(m.free_block_ids)
            want = segmented_victims(order, in_use, protected, need)
            out = m.prepare_store(hashes)
            assert (out is None) == (want is None)
            if out is not None:
                assert out.block_hashes_evicted == want
                m.complete_store(hashes, success=op == "store")
        elif op == "load":
            n = m.lookup(hashes)
            if n:
                m.prepare_load(hashes[:n])
                loading.append(hashes[:n])
        elif loading:
            m.complete_load(loading.pop(0))
        assert m.protected <= set(m.blocks)
        check_slots(m, m.blocks)
