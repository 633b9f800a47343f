"""Chapter 16 grader: a sliding-window group's blocks, ``SlidingWindowManager``.

``impl`` is a subclass of ``SlidingWindowManager`` with the three methods the lab asks for. Every
scenario builds a package ``HybridBlockManager`` -- the pool and group 0's manager -- and gives it
``impl`` as the manager of each further group, so the calls that use the three methods (admission's
window hit, the blocks given back after each step) are the package's own.

The expectations of the by-hand scenarios are computed from the contract, not taken from the
package: a query at position ``p`` of a group of window ``w`` reads positions ``p - w + 1 .. p``,
so once ``c`` tokens are computed no query reads a block wholly before position ``c - w + 1``; a
hit of ``L`` blocks needs the blocks holding positions ``L * bs - w + 1 .. L * bs - 1`` cached, not
the ones before. The lockstep scenarios serve random requests through two real Schedulers -- one
over ``impl``, one over the package's managers -- and compare every decision after every call;
on the one over ``impl`` a fake model writes into each slot a step computes *what* belongs there
(the group and the token prefix ending at that position) and checks, before each query, that
every position it reads holds exactly that.
"""
from __future__ import annotations

import random

from course_pkg.hybrid_block_manager import NULL_BLOCK, HybridBlockManager
from course_pkg.labs.lab import Grading
from course_pkg.sampling_params import SamplingParams
from course_pkg.scheduler import Scheduler
from course_pkg.sequence import Sequence

N = NULL_BLOCK


def _manager(impl, num_blocks: int, block_size: int, windows: tuple, free_queue: str = "linked") -> HybridBlockManager:
    """A HybridBlockManager whose groups after the first are ``impl`` instances (None: the package's)."""
    bm = HybridBlockManager(num_blocks, block_size, windows, free_queue=free_queue)
    if impl is not None:
        bm.groups = [impl(bm, g + 1, w) for g, w in enumerate(windows)]
    return bm


def _free(bm) -> list[int]:
    return list(bm.free_block_ids)


# ---------------------------------------------------------------- (a) first_needed_block

#: (window, block size, tokens computed, the first block a query at that position or later reads)
FIRST_NEEDED = [
    (8, 4, 0, 0), (8, 4, 7, 0), (8, 4, 8, 0), (8, 4, 11, 1), (8, 4, 12, 1), (8, 4, 15, 2), (8, 4, 24, 4),
    (8, 4, 100, 23),
    (5, 2, 4, 0), (5, 2, 5, 0), (5, 2, 6, 1), (5, 2, 9, 2), (5, 2, 10, 3),
    (1, 1, 0, 0), (1, 1, 1, 1), (1, 1, 13, 13), (1, 4, 3, 0), (1, 4, 4, 1), (1, 4, 9, 2),
    (4, 1, 3, 0), (4, 1, 4, 1), (4, 1, 10, 7),
    (6, 4, 6, 0), (6, 4, 9, 1), (6, 4, 13, 2),
    (None, 4, 0, 0), (None, 4, 1000, 0), (None, 1, 57, 0),
]


def _grade_first_needed(impl, g: Grading) -> None:
    with g.scenario("first_needed_block by hand: windows 1, 4, 5, 6, 8 and None, block sizes 1, 2, 4"):
        for w, bs, n, want in FIRST_NEEDED:
            bm = _manager(impl, 4, bs, (w,))
            got = bm.groups[0].first_needed_block(n)
            reads = "every position (a full-attention group)" if w is None else \
                f"positions {max(0, n - w + 1)} .. {n}"
            g.equal(got, want, f"first_needed_block({n}) with window {w}, block size {bs} (a query at {n} reads "
                               f"{reads}; later queries read later positions)")


# ---------------------------------------------------------------- (b) remove_skipped_blocks

def _grade_remove_skipped(impl, g: Grading) -> None:
    with g.scenario("remove_skipped_blocks by hand: window 8, block size 4, newest first to the free queue's tail"):
        bm = _manager(impl, 16, 4, (8, None))
        seq = Sequence(list(range(3, 23)), block_size=4)              # 20 tokens: 5 blocks per group
        bm.allocate(seq, 0)
        local, full2 = seq.group_block_tables
        g.equal((seq.block_table, local, full2, _free(bm)),
                ([0, 1, 2, 3, 4], [5, 6, 7, 8, 9], [10, 11, 12, 13, 14], [15]),
                "the tables and free queue after allocate")
        loc, other = bm.groups
        g.equal(loc.remove_skipped_blocks(seq), [], "remove_skipped_blocks with nothing computed")
        seq.num_cached_tokens = 8
        loc.hash_blocks(seq, 8)
        g.equal(loc.remove_skipped_blocks(seq), [], "remove_skipped_blocks with 8 computed (a query at 8 reads 1 .. 8: "
                                                    "block 0 still)")
        seq.num_cached_tokens = 12
        loc.hash_blocks(seq, 12)                                       # local blocks 0 .. 2 registered
        hashes = [bm.blocks[b].hash for b in (5, 6, 7)]
        g.equal(loc.remove_skipped_blocks(seq), [5], "remove_skipped_blocks with 12 computed (a query at 12 reads "
                                                     "5 .. 12: block 0 left the window)")
        g.equal(seq.group_block_tables[0], [N, 6, 7, 8, 9], "the local table: NULL_BLOCK where block 0 was")
        g.equal((_free(bm), bm.blocks[5].ref_count), ([15, 5], 0), "(free queue, ref count of block 5): at the tail")
        g.check(bm.blocks[5].hash == hashes[0] != -1 and bm.hash_to_block_id.get(hashes[0]) == 5,
                "block 5 went back still registered (its hash and index entry kept: a later request may hit it)")
        g.equal(loc.remove_skipped_blocks(seq), [], "remove_skipped_blocks again with nothing new computed")
        seq.num_cached_tokens = 19
        loc.hash_blocks(seq, 19)
        g.equal(loc.remove_skipped_blocks(seq), [7, 6], "remove_skipped_blocks with 19 computed (a query at 19 reads "
                                                        "12 .. 19: blocks 1 and 2 left; newest first)")
        g.equal(seq.group_block_tables[0], [N, N, N, 8, 9], "the local table after 19 computed")
        g.equal(_free(bm), [15, 5, 7, 6], "the free queue: block 2's 7, then block 1's 6, at the tail -- the older "
                                          "block given back last, so it is evicted last")
        g.equal(other.remove_skipped_blocks(seq), [], "a full-attention group (window None) gives nothing back")
        g.equal((seq.block_table, seq.group_block_tables[1]), ([0, 1, 2, 3, 4], [10, 11, 12, 13, 14]),
                "the other groups' tables")
        g.equal(sorted(bm.used_block_ids), [0, 1, 2, 3, 4, 8, 9, 10, 11, 12, 13, 14], "the used blocks")
    with g.scenario("remove_skipped_blocks by hand: window 1, block size 1, five blocks at once"):
        bm = _manager(impl, 12, 1, (1,))
        seq = Sequence([5, 6, 7, 8, 9, 10], block_size=1)
        bm.allocate(seq, 0)
        g.equal(seq.group_block_tables[0], [6, 7, 8, 9, 10, 11], "the local table after allocate")
        seq.num_cached_tokens = 5
        g.equal(bm.groups[0].remove_skipped_blocks(seq), [10, 9, 8, 7, 6],
                "remove_skipped_blocks with 5 computed (a query at 5 reads position 5 only), newest first")
        g.equal((seq.group_block_tables[0], _free(bm)), ([N, N, N, N, N, 11], [10, 9, 8, 7, 6]),
                "(local table, free queue)")
        seq.num_cached_tokens = 6
        g.equal(bm.groups[0].remove_skipped_blocks(seq), [11], "remove_skipped_blocks with all 6 computed (the next "
                                                               "query, at 6, reads only itself: block 5 goes too)")
        g.equal((seq.group_block_tables[0], _free(bm)), ([N] * 6, [10, 9, 8, 7, 6, 11]), "(local table, free queue)")
    with g.scenario("remove_skipped_blocks by hand: a block a fork shares loses one reference only"):
        bm = _manager(impl, 16, 4, (8,))
        a = Sequence(list(range(3, 23)), block_size=4)
        bm.allocate(a, 0)                                              # full 0 .. 4, local 5 .. 9
        a.num_cached_tokens = 8
        bm.hash_blocks(a)
        b = a.fork(1)
        bm.fork(a, b)
        g.equal((b.group_block_tables[0], [bm.blocks[i].ref_count for i in (5, 6)]), ([5, 6, 7, 8, 9], [2, 2]),
                "the fork shares the local blocks")
        a.num_cached_tokens = 12
        bm.groups[0].hash_blocks(a, 12)
        g.equal(bm.groups[0].remove_skipped_blocks(a), [5], "remove_skipped_blocks of the parent with 12 computed")
        g.equal((a.group_block_tables[0], b.group_block_tables[0], bm.blocks[5].ref_count, 5 in _free(bm)),
                ([N, 6, 7, 8, 9], [5, 6, 7, 8, 9], 1, False),
                "(parent's table, fork's table, ref count of 5, 5 free): the fork still reads block 5")
        b.num_cached_tokens = 12
        bm.groups[0].hash_blocks(b, 12)
        g.equal(bm.groups[0].remove_skipped_blocks(b), [5], "remove_skipped_blocks of the fork with 12 computed")
        g.equal((b.group_block_tables[0], bm.blocks[5].ref_count, _free(bm)[-1:]), ([N, 6, 7, 8, 9], 0, [5]),
                "(fork's table, ref count of 5, tail of the free queue): the last reference gone, block 5 is free")


# ---------------------------------------------------------------- (c) longest_hit

#: (window, block size, num_blocks, cached, ids, the hit, why). 0 stands for "an id is known".
LONGEST_HIT = [
    (8, 4, 6, [3, 4, 5, 6, 7, 8], [0] * 6, 6, "everything cached"),
    (8, 4, 6, [N, N, N, N, 7, 8], [0] * 6, 6,
     "blocks 0-3 evicted: a query at 24 reads 17 .. 23, blocks 4 and 5 only -- the hit is on the right"),
    (8, 4, 6, [N, 2, 3, N, 5, 6], [0] * 6, 6, "holes before the window do not matter"),
    (8, 4, 6, [1, 2, N, 4, 5, N], [0] * 6, 5,
     "block 5 missing: the largest hit is 5 blocks (a query at 20 reads 13 .. 19, blocks 3 and 4)"),
    (8, 4, 6, [N, N, N, N, 7, N], [0] * 6, 0, "no point has its whole window cached"),
    (8, 4, 3, [1, 2, 3, 4, 5], [0] * 5, 3, "at most num_blocks"),
    (8, 4, 0, [1, 2, 3], [0] * 3, 0, "num_blocks 0"),
    (8, 4, 2, [N, 2, 3], [0] * 3, 0, "a query at 8 reads 1 .. 7: block 0 is needed"),
    (5, 2, 5, [N, N, N, 4, 5], [0] * 5, 5, "window 5, block size 2: a query at 10 reads 6 .. 9, blocks 3 and 4"),
    (5, 2, 5, [N, 2, 3, N, 5], [0] * 5, 3, "window 5, block size 2: 5 and 4 need block 3; a query at 6 reads 2 .. 5"),
    (1, 4, 3, [N, N, N], [0, 0, None], 2,
     "window 1: a query at L * 4 reads only itself, so a hit needs only its prefix to be known (ids), no block"),
    (1, 4, 3, [N, N, N], [None, None, None], 0, "window 1 with no prefix known"),
    (None, 4, 4, [1, 2, N, 4], [0] * 4, 2, "a full-attention group (window None): the leading run"),
    (None, 4, 4, [1, 2, 3, 4], [0, 0, 0, None], 3, "window None, the last id unknown"),
]


def _grade_longest_hit(impl, g: Grading) -> None:
    with g.scenario("longest_hit by hand: searched from the right, the window's blocks only"):
        for w, bs, num_blocks, cached, ids, want, why in LONGEST_HIT:
            bm = _manager(impl, 4, bs, (w,))
            seq = Sequence(list(range(1, 1 + bs * len(cached) + 1)), block_size=bs)
            ids = [None if i is None else 1000 + k for k, i in enumerate(ids)]
            before = (list(cached), list(ids))
            got = bm.groups[0].longest_hit(seq, num_blocks, cached, ids)
            g.equal(got, want, f"longest_hit(seq, {num_blocks}, cached={cached}, ids={ids}) with window {w}, "
                               f"block size {bs} ({why})")
            g.equal((cached, ids), before, "longest_hit changes neither cached nor ids")


# ---------------------------------------------------------------- (d) a window hit end to end

def _grade_window_hit(impl, g: Grading) -> None:
    with g.scenario("a window hit end to end: the early blocks evicted, the window at the end still cached"):
        bm = _manager(impl, 64, 4, (8,))
        prompt = list(range(3, 35))                                    # 32 tokens: 8 blocks
        first = Sequence(prompt, block_size=4)
        bm.allocate(first, bm.can_allocate(first))
        local = list(first.group_block_tables[0])
        first.num_cached_tokens = 32
        bm.hash_blocks(first)
        g.equal(first.group_block_tables[0], [N] * 6 + local[6:], "the local table once 32 tokens are computed "
                                                                  "(a query at 32 reads 25 .. 31: blocks 6 and 7)")
        bm.deallocate(first)
        bm.forget_overwritten({b: 0 for b in local[:4]})               # blocks 0-3 evicted; 4 and 5 still cached
        again = Sequence(prompt + [99], block_size=4)
        g.equal(bm.can_allocate(again), 8, "can_allocate(the same prompt + 1 token): the window of a query at 32 "
                                           "is blocks 6 and 7, both cached -- 8 blocks hit")
        bm.allocate(again, 8)
        g.equal((again.num_cached_tokens, again.group_block_tables[0][:8]), (32, [N] * 6 + local[6:]),
                "(num_cached_tokens, the first 8 local entries): the window's blocks reused, NULL_BLOCK before")
        bm.deallocate(again)
        bm.forget_overwritten({local[7]: 0})                           # the window's last block evicted
        g.equal(bm.can_allocate(Sequence(prompt + [99], block_size=4)), 7,
                "can_allocate once local block 7 is evicted too: a hit of 8 needs it, a hit of 7 (a query at 28 "
                "reads 21 .. 27) needs blocks 5 and 6, both cached")
        bm.forget_overwritten({local[5]: 0})
        g.equal(bm.can_allocate(Sequence(prompt + [99], block_size=4)), 0,
                "can_allocate once local blocks 5 and 7 are evicted: no point of the prompt has its window cached")
        g.equal(bm.num_free_blocks, 64, "every block is free at the end")


# ---------------------------------------------------------------- (e) lockstep through real Schedulers

#: (windows, block size, pool, token budget, free queue, requests, seed)
LOCKSTEP = [
    ((8,), 4, 40, 16, "linked", 10, 16),
    ((5, None), 2, 70, 64, "deque", 10, 17),
    ((1,), 1, 120, 5, "linked", 8, 18),
    ((4, 6, 9), 4, 80, 16, "linked", 10, 19),
    ((13,), 2, 60, 64, "linked", 10, 20),
]


def _queues(sched: Scheduler) -> tuple:
    """Every live sequence of the scheduler, by value, in queue order."""
    def seq_state(s):
        return (s.status.name, s.num_tokens, s.num_cached_tokens, tuple(s.block_table),
                tuple(tuple(t) for t in s.group_block_tables))
    return (tuple(seq_state(s) for s in sched.running), tuple(seq_state(s) for s in sched.waiting))


def _pool_state(bm: HybridBlockManager) -> tuple:
    return tuple(bm.free_block_ids), tuple(b.ref_count for b in bm.blocks)


def _hit_counts(bm: HybridBlockManager) -> tuple:
    st = bm.prefix_cache_stats
    return st.requests, st.queries, st.hits, st.preempted_requests, st.preempted_queries, st.preempted_hits


def _batch(out) -> list[tuple]:
    return [(s.num_tokens, c, n, k) for s, c, n, k in
            zip(out.seqs, out.num_computed_tokens, out.num_scheduled_tokens, out.num_samples)]


def _requests(rng: random.Random, block_size: int, count: int) -> list[tuple[list[int], SamplingParams]]:
    base = [rng.randrange(5) for _ in range(6 * block_size + 4)]
    out = []
    for _ in range(count):
        shared = base[:rng.randrange(1, len(base))]
        prompt = shared + [rng.randrange(5) for _ in range(rng.randrange(1, 3 * block_size))]
        out.append((prompt, SamplingParams(max_tokens=rng.randrange(1, 20), ignore_eos=True, n=rng.choice([1, 1, 2]))))
    return out


def _check_reads(g: Grading, out, windows: tuple, block_size: int, kv: dict, step: int) -> int:
    """The fake model: store each scheduled position's (group, prefix), then check every read."""
    reads = 0
    for src, dst in out.blocks_to_copy:                                # copy-on-write, before the step writes
        for o in range(block_size):
            if (src, o) in kv:
                kv[(dst, o)] = kv[(src, o)]
    for seq, start, num in zip(out.seqs, out.num_computed_tokens, out.num_scheduled_tokens):
        tables = [seq.block_table, *seq.group_block_tables]
        for grp, (table, w) in enumerate(zip(tables, windows)):
            for pos in range(start, start + num):
                block = table[pos // block_size] if pos // block_size < len(table) else N
                if block == N:
                    g.fail(f"step {step}: group {grp} has no block for position {pos} of the sequence it computes "
                           f"(table {table})")
                kv[(block, pos % block_size)] = (grp, tuple(seq.token_ids[:pos + 1]))
            for pos in range(start, start + num):
                for q in range(0 if w is None else max(0, pos - w + 1), pos + 1):
                    block = table[q // block_size]
                    if block == N:
                        g.fail(f"step {step}: a query at {pos} of group {grp} (window {w}) reads position {q}, "
                               f"whose block was given back (table {table})")
                    if kv.get((block, q % block_size)) != (grp, tuple(seq.token_ids[:q + 1])):
                        g.fail(f"step {step}: a query at {pos} of group {grp} (window {w}) reads position {q} in "
                               f"block {block}, which holds another position's K/V")
                    reads += 1
    return reads


def _grade_lockstep(impl, g: Grading) -> None:
    totals = dict(passed=0, steps=0, reads=0, hits=0, preemptions=0)
    for windows, bs, num_blocks, budget, queue, count, seed in LOCKSTEP:
        name = (f"random requests through two Schedulers in lockstep, windows {windows}, block size {bs}, "
                f"{num_blocks} blocks ({queue} queue)")
        with g.scenario(name):
            rng = random.Random(seed)
            requests = _requests(rng, bs, count)
            pair = []
            for groups in (impl, None):
                bm = _manager(groups, num_blocks, bs, windows, queue)
                sched = Scheduler(num_blocks, bs, block_manager=bm, max_num_batched_tokens=budget, max_num_seqs=8,
                                  transactional=False)
                pair.append((sched, bm))
            (mine, my_bm), (ref, ref_bm) = pair
            for prompt, params in requests:
                refused = []
                for sched in (mine, ref):
                    try:
                        sched.add(Sequence(list(prompt), params, block_size=bs))
                        refused.append(False)
                    except ValueError:                                 # it could never fit in this pool
                        refused.append(True)
                g.equal(refused[0], refused[1], f"a request of {len(prompt)} tokens refused up front")
            all_windows = (None, *windows)
            kv: dict = {}
            reads = steps = 0
            while not ref.is_finished():
                steps += 1
                if steps > 2000:
                    g.fail("the package's scheduler did not finish in 2000 steps")
                got, want = mine.schedule(), ref.schedule()
                g.equal(_hit_counts(my_bm), _hit_counts(ref_bm), f"step {steps}: the admissions' prefix-cache hits "
                        "(prefix_cache_stats: requests, queries, hits, and the same for readmissions)")
                g.equal(_batch(got), _batch(want), f"step {steps}: the batch (tokens, computed, scheduled, samples)")
                g.equal((got.blocks_to_copy, len(got.preempted)), (want.blocks_to_copy, len(want.preempted)),
                        f"step {steps}: (copy-on-write copies, preemptions)")
                g.equal(_queues(mine), _queues(ref), f"step {steps}: after schedule, each sequence in running and "
                                                     "waiting (status, tokens, computed, block table, group tables)")
                g.equal(_pool_state(my_bm), _pool_state(ref_bm),
                        f"step {steps}: after schedule, (free queue, ref counts)")
                reads += _check_reads(g, got, all_windows, bs, kv, steps)
                tokens = [[rng.randrange(5) for _ in range(k)] for k in want.num_samples]
                mine.update_from_output(got, tokens)
                ref.update_from_output(want, tokens)
                g.equal(_queues(mine), _queues(ref), f"step {steps}: after update_from_output (blocks given back), "
                                                     "each sequence in running and waiting")
                g.equal(_pool_state(my_bm), _pool_state(ref_bm),
                        f"step {steps}: after update_from_output, (free queue, ref counts)")
            g.check(mine.is_finished(), f"the scheduler over your managers has requests left after step {steps}")
            g.equal(my_bm.num_free_blocks, num_blocks, "free blocks once every request finished")
            st = my_bm.prefix_cache_stats
            for key, value in (("passed", 1), ("steps", steps), ("reads", reads), ("hits", st.hits + st.preempted_hits),
                               ("preemptions", ref.stats.num_preemptions)):
                totals[key] += value
    if totals["passed"]:
        g.note(f"lockstep: {totals['passed']} of {len(LOCKSTEP)} configurations in step with the package, "
               f"{totals['steps']} steps, {totals['reads']:,} reads of the fake K/V checked, {totals['hits']} tokens "
               f"hit in the prefix cache, {totals['preemptions']} preemptions")


def grade_sliding_window(impl, g: Grading) -> None:
    _grade_first_needed(impl, g)
    _grade_remove_skipped(impl, g)
    _grade_longest_hit(impl, g)
    _grade_window_hit(impl, g)
    _grade_lockstep(impl, g)
