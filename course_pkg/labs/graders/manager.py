"""Chapter 02, 03 and 08 graders: ``can_append``/``may_append``, ``allocate``/``deallocate``, the
release order; ``fork`` and copy-on-write.

Each scenario drives the manager under test and the package's in lockstep (``Lockstep``):
same calls, same results, same state after every call, invariants checked each time. The
``expect`` lines are computed by hand from the contract.
"""
from __future__ import annotations

from course_pkg.block_manager import BlockManager
from course_pkg.labs.lab import Grading
from course_pkg.labs.lockstep import Lockstep, Named, random_trace
from course_pkg.labs.graders.serving import make_manager, serve
from course_pkg.workloads import shared_prefix_workload


def _decode(lock: Lockstep, name: str, tokens) -> None:
    """Decode ``tokens`` one at a time: ask, append the block if needed, compute, register."""
    for t in tokens:
        lock.append_token(name, t)
        lock.call("can_append", name)
        lock.call("may_append", name)
        lock.computed(name)


def grade_append(impl, g: Grading) -> None:
    for bs in (1, 2, 7, 16):
        with g.scenario(f"decode 2 blocks and a token past a full prompt, block size {bs}"):
            lock = Lockstep(g, impl, 8, bs)
            lock.seq("A", list(range(1, bs + 1)))      # exactly one full block
            lock.call("allocate", "A")
            lock.computed("A")
            _decode(lock, "A", range(100, 100 + 2 * bs + 1))
            lock.expect("block table of A", (0, 1, 2, 3),
                        f"{3 * bs + 1} tokens in blocks of {bs} need 4 blocks, taken from the head")
    with g.scenario("the equality case: exactly as many free blocks as needed (block size 4, pool 3)"):
        lock = Lockstep(g, impl, 3, 4)
        lock.seq("A", list(range(1, 9)))               # 2 full blocks, 1 free
        lock.call("allocate", "A")
        lock.computed("A")
        lock.append_token("A", 9)                      # starts block 3 of 3: 1 needed, 1 free
        g.equal(lock.call("can_append", "A"), True, "can_append with 1 free block for the 1 needed")
        lock.call("may_append", "A")
        lock.expect("block table of A", (0, 1, 2), "the one free block, 2, is appended")
        lock.computed("A")
        for t in (10, 11, 12):                         # fill block 2: no block needed, none free
            lock.append_token("A", t)
            g.equal(lock.call("can_append", "A"), True,
                    f"can_append for token {t}, which needs no block (0 free, 0 needed)")
            lock.call("may_append", "A")
            lock.computed("A")
    with g.scenario("a full pool: the next block cannot be had (block size 2, pool 2)"):
        lock = Lockstep(g, impl, 2, 2)
        lock.seq("A", [1, 2, 3, 4])
        lock.call("allocate", "A")
        lock.computed("A")
        lock.append_token("A", 5)
        g.equal(lock.call("can_append", "A"), False, "can_append with 0 free blocks for 1 needed")
        lock.call("may_append", "A", expect_raise=True)
    with g.scenario("two sequences interleaved (block size 3, pool 8)"):
        lock = Lockstep(g, impl, 8, 3)
        lock.seq("A", [1, 2, 3, 4])
        lock.seq("B", [5, 6])
        lock.call("allocate", "A")
        lock.call("allocate", "B")
        lock.computed("A")
        lock.computed("B")
        for t in range(7):
            _decode(lock, "A", [10 + t])
            _decode(lock, "B", [20 + t])
        # New blocks at B's 4th, A's 7th, B's 7th and A's 10th token: 3, 4, 5, 6.
        lock.expect("block table of A", (0, 1, 4, 6), "A's 11 tokens: 0, 1, then 4 (7th token) and 6 (10th)")
        lock.expect("block table of B", (2, 3, 5), "B's 9 tokens: 2, then 3 (4th token) and 5 (7th)")
    for seed, bs in ((1, 1), (2, 7)):
        with g.scenario(f"200 random calls in lockstep (seed {seed}, block size {bs}, pool 12)"):
            random_trace(Lockstep(g, impl, 12, bs), seed, 200)


def grade_allocate(impl, g: Grading) -> None:
    for bs in (1, 4, 7):
        with g.scenario(f"admit two, release both, block size {bs}"):
            lock = Lockstep(g, impl, 8, bs, enable_prefix_caching=False)
            lock.seq("A", list(range(1, 2 * bs + 2)))       # 2 blocks and a token: 3 blocks
            lock.seq("B", list(range(50, 50 + bs + 1)))     # 2 blocks
            lock.call("can_allocate", "A")
            lock.call("allocate", "A", 0)
            lock.expect("block table of A", (0, 1, 2), "three blocks from the head of the free queue")
            lock.call("allocate", "B", 0)
            lock.expect("block table of B", (3, 4), "the next two")
            lock.call("deallocate", "A")
            lock.expect("free queue (head first)", (5, 6, 7, 2, 1, 0),
                        "A's blocks go to the tail, last block first")
            lock.call("deallocate", "B")
            lock.expect("free queue (head first)", (5, 6, 7, 2, 1, 0, 4, 3), "then B's, last block first")
    with g.scenario("a full pool refuses, changing nothing (block size 4, pool 4)"):
        lock = Lockstep(g, impl, 4, 4, enable_prefix_caching=False)
        lock.seq("A", list(range(1, 12)))                   # 3 blocks
        lock.seq("B", [20, 21, 22, 23, 24])                 # 2 blocks, 1 free
        lock.call("allocate", "A", 0)
        g.equal(lock.call("can_allocate", "B"), -1, "can_allocate(B) with 1 free block for 2")
        lock.call("allocate", "B", 0, expect_raise=True)
        lock.seq("C", [30, 31, 32])                         # 1 block: fits exactly
        lock.call("allocate", "C", 0)
        lock.expect("free queue (head first)", (), "the pool is full")
    with g.scenario("misuse is refused and changes nothing (block size 2, pool 6)"):
        lock = Lockstep(g, impl, 6, 2, enable_prefix_caching=False)
        lock.seq("A", [1, 2, 3])
        lock.seq("B", [4, 5])
        lock.call("allocate", "A", 0)
        lock.call("allocate", "A", 0, expect_raise=True)    # already has blocks
        lock.call("deallocate", "B", expect_raise=True)     # holds none
        lock.call("deallocate", "A")
        lock.call("deallocate", "A", expect_raise=True)     # released already
    with g.scenario("a shared prefix: hits, ref counts, revival (block size 4, pool 8)"):
        lock = Lockstep(g, impl, 8, 4)
        lock.seq("A", list(range(1, 11)))                   # 10 tokens: 2 full blocks + 2
        lock.call("allocate", "A", 0)
        lock.computed("A")
        lock.seq("B", list(range(1, 9)) + [90, 91, 92])     # A's 2 full blocks + 3
        g.equal(lock.call("can_allocate", "B"), 2, "can_allocate(B): A's two full blocks are cached")
        lock.call("allocate", "B", 2)
        lock.expect("ref counts", (2, 2, 1, 1, 0, 0, 0, 0), "blocks 0 and 1 are shared by A and B")
        lock.call("deallocate", "A")
        lock.expect("ref counts", (1, 1, 0, 1, 0, 0, 0, 0), "B still holds the shared blocks")
        lock.call("deallocate", "B")
        lock.seq("C", list(range(1, 9)) + [70])
        g.equal(lock.call("can_allocate", "C"), 2, "can_allocate(C): the freed blocks 0, 1 are still cached")
        lock.call("allocate", "C", 2)                       # revived from the middle of the free queue
        lock.expect("block table of C", (0, 1, 4), "blocks 0 and 1 revived, then the head of the queue")
        lock.seq("D", list(range(1, 9)) + [71])
        lock.call("allocate", "D", 1)                       # fewer hits than available: allowed
        lock.call("deallocate", "C")
        lock.call("deallocate", "D")
    with g.scenario("revived blocks count against the room: a hit that does not fit is refused (block size 2, pool 4)"):
        lock = Lockstep(g, impl, 4, 2)
        lock.seq("A", [1, 2, 3, 4, 5])                      # blocks 0 = [1, 2], 1 = [3, 4], 2 = [5]
        lock.call("allocate", "A", 0)
        lock.computed("A")
        lock.call("deallocate", "A")                        # free: 3, 2, 1, 0; blocks 0 and 1 still cached
        lock.seq("Y", [9, 9, 9])
        lock.call("allocate", "Y", 0)                       # takes 3 and 2: free 1, 0, both cached
        lock.seq("B", [1, 2, 3, 4, 7])                      # 2 hits (both free) + 1 fresh = 3 free blocks, 2 free
        g.equal(lock.call("can_allocate", "B"), -1, "can_allocate(B): its two hits are free blocks, so "
                                                    "reviving them takes 2 of the 2 free blocks, and the fresh one has none")
        lock.call("allocate", "B", 2, expect_raise=True)
        lock.expect("free queue (head first)", (1, 0), "the refused allocate revived nothing")
        lock.call("deallocate", "Y")
        lock.call("allocate", "B", lock.call("can_allocate", "B"))
        lock.expect("block table of B", (0, 1, 2), "the two revived hits, then the head of the free queue, "
                                                   "2 (Y released its blocks 3, 2 last block first)")
    with g.scenario("prefix_cache_stats: first admissions and readmissions counted apart (block size 4, pool 8)"):
        lock = Lockstep(g, impl, 8, 4)
        lock.seq("A", list(range(1, 11)))                   # 10 tokens, nothing cached
        lock.call("allocate", "A", 0)
        _expect_stats(lock, (1, 10, 0, 0, 0, 0), "after admitting A: 1 request, 10 tokens queried, 0 hits")
        lock.computed("A")
        lock.seq("B", list(range(1, 9)) + [90, 91, 92])     # A's 2 full blocks + 3 tokens
        lock.call("allocate", "B", 2)
        _expect_stats(lock, (2, 21, 8, 0, 0, 0), "after admitting B: +11 tokens queried, +8 hits")
        lock.call("deallocate", "B")                        # B is preempted ...
        for seq in (lock.ref_seqs["B"], lock.my_seqs["B"]):
            seq.num_preemptions = 1
        lock.call("allocate", "B", 2)                       # ... and readmitted: counted apart
        _expect_stats(lock, (2, 21, 8, 1, 11, 8), "after B's readmission: the preempted_* counters only")
        lock.seq("C", [50, 51, 52])
        lock.call("allocate", "C", 0)
        _expect_stats(lock, (3, 24, 8, 1, 11, 8), "after admitting C: +3 tokens queried, no hit")
    with g.scenario("prefix_cache_stats with prefix caching off: queries counted, no hits (block size 2, pool 6)"):
        lock = Lockstep(g, impl, 6, 2, enable_prefix_caching=False)
        for name in ("A", "B"):
            lock.seq(name, [1, 2, 3, 4, 5])
            lock.call("allocate", name, 0)
            lock.computed(name)
        _expect_stats(lock, (2, 10, 0, 0, 0, 0), "two requests of 5 tokens, caching off")
    for seed, bs, caching in ((3, 3, True), (4, 1, False)):
        with g.scenario(f"200 random calls in lockstep (seed {seed}, block size {bs}, pool 10, "
                        f"prefix caching {'on' if caching else 'off'})"):
            lock = Lockstep(g, impl, 10, bs, enable_prefix_caching=caching)
            random_trace(lock, seed, 200)
            g.equal(_stats(lock.mine), _stats(lock.ref), f"prefix_cache_stats {_STATS_FIELDS} after the trace")


_STATS_FIELDS = "(requests, queries, hits, preempted_requests, preempted_queries, preempted_hits)"


def _stats(bm) -> tuple[int, ...]:
    s = bm.prefix_cache_stats
    return (s.requests, s.queries, s.hits, s.preempted_requests, s.preempted_queries, s.preempted_hits)


def _expect_stats(lock: Lockstep, expected: tuple[int, ...], why: str) -> None:
    """``prefix_cache_stats`` as computed by hand (checked on the reference too)."""
    if _stats(lock.ref) != expected:
        raise AssertionError(f"the reference's prefix_cache_stats {_stats(lock.ref)} break the lab's "
                             f"expectation {expected} ({why}): the lab needs updating")
    lock.g.equal(_stats(lock.mine), expected, f"prefix_cache_stats {_STATS_FIELDS} {why}")


def grade_release_order(impl, g: Grading) -> None:
    with g.scenario("release order, block size 4 (pool 6)"):
        lock = Lockstep(g, impl, 6, 4)
        lock.seq("A", list(range(1, 13)))                   # 3 full blocks: 0, 1, 2
        lock.call("allocate", "A", 0)
        lock.computed("A")
        lock.call("deallocate", "A")
        lock.expect("free queue (head first)", (3, 4, 5, 2, 1, 0),
                    "the last block is released first, so the prefix block 0 is reused last")
        lock.expect("ref counts", (0, 0, 0, 0, 0, 0), "everything is free")
    with g.scenario("the prefix survives new requests (block size 2, pool 6)"):
        lock = Lockstep(g, impl, 6, 2)
        lock.seq("A", [1, 2, 3, 4, 5, 6, 7])                # blocks 0..3, 3 full
        lock.call("allocate", "A", 0)
        lock.computed("A")
        lock.call("deallocate", "A")
        lock.seq("X", [50, 51, 52, 53, 54])                 # 3 blocks
        lock.call("allocate", "X", 0)
        lock.expect("block table of X", (4, 5, 3), "the never-used blocks 4, 5, then A's last block 3")
        lock.seq("B", [1, 2, 3, 4, 99])                     # A's first two blocks survive
        g.equal(lock.call("can_allocate", "B"), 2, "can_allocate(B): A's prefix blocks 0 and 1 are still cached")
        lock.call("allocate", "B", 2)
        lock.call("deallocate", "X")
        lock.call("deallocate", "B")
    with g.scenario("shared blocks are released by their last holder (block size 2, pool 6)"):
        lock = Lockstep(g, impl, 6, 2)
        lock.seq("A", [1, 2, 3, 4, 5])
        lock.call("allocate", "A", 0)
        lock.computed("A")
        lock.seq("B", [1, 2, 3, 4, 8])
        lock.call("allocate", "B", 2)
        lock.call("deallocate", "A")
        lock.expect("free queue (head first)", (4, 5, 2), "only A's own last block is freed")
        lock.call("deallocate", "B")
        lock.expect("free queue (head first)", (4, 5, 2, 3, 1, 0), "B's own block, then the shared ones, last first")
    with g.scenario("200 random calls in lockstep (seed 5, block size 2, pool 10)"):
        random_trace(Lockstep(g, impl, 10, 2), 5, 200)
    with g.scenario("hit rate under memory pressure (shared prompts, the real Scheduler)"):
        requests = shared_prefix_workload(60, num_prefixes=4, prefix_len=48, suffix_len=(4, 12),
                                          output_len=(2, 8), seed=3)
        rates = {}
        for label, cls in (("reference", BlockManager), ("yours", impl)):
            result = serve(make_manager(cls, 40, 8), requests, max_num_batched_tokens=256)
            rates[label] = result.prefix_cache_hit_rate
        g.note(f"prefix-cache hit rate with your release order: {rates['yours']:.3f} "
               f"(reference: {rates['reference']:.3f})")
        g.equal(round(rates["yours"], 6), round(rates["reference"], 6),
                "prefix-cache hit rate on 60 requests sharing 4 prompts, 40 blocks of 8")


def _append(lock: Lockstep, name: str, token: int, copies, why: str) -> None:
    """Decode one token of ``name``; ``may_append`` must return ``copies`` (hand-computed)."""
    lock.append_token(name, token)
    lock.call("can_append", name)
    got = lock.call("may_append", name, compare_result=True)
    lock.g.equal(got, copies, f"may_append({name}) ({why})")
    lock.computed(name)


def grade_fork_cow(impl, g: Grading) -> None:
    with g.scenario("a fork shares every block; the first write into the shared last block copies it (block size 4)"):
        lock = Lockstep(g, impl, 8, 4)
        lock.seq("A", [1, 2, 3, 4, 5, 6])                  # blocks 0 (full), 1 (2 of 4)
        lock.call("allocate", "A", 0)
        lock.computed("A")
        lock.fork("A", "B")
        lock.expect("block table of B", (0, 1), "B shares both of A's blocks")
        lock.expect("ref counts", (2, 2, 0, 0, 0, 0, 0, 0), "each shared block is held twice")
        _append(lock, "B", 100, [(1, 2)], "B writes into the shared block 1: it gets a copy, block 2")
        lock.expect("block table of B", (0, 2), "B's last block is its private copy")
        _append(lock, "A", 200, [], "block 1 is A's alone now: written in place")
        lock.expect("ref counts", (2, 1, 1, 0, 0, 0, 0, 0), "block 0 still shared")
        lock.call("deallocate", "A")
        lock.call("deallocate", "B")
    with g.scenario("a full shared last block: the new token starts a new block, nothing is copied (block size 4)"):
        lock = Lockstep(g, impl, 8, 4)
        lock.seq("A", list(range(1, 9)))
        lock.call("allocate", "A", 0)
        lock.computed("A")
        lock.fork("A", "B")
        _append(lock, "B", 100, [], "the 9th token starts block 2 of B")
        lock.expect("block table of B", (0, 1, 2), "a fresh block after the two shared ones")
    with g.scenario("block size 1: every block is full, so a fork never copies"):
        lock = Lockstep(g, impl, 8, 1)
        lock.seq("A", [1, 2, 3])
        lock.call("allocate", "A", 0)
        lock.computed("A")
        lock.fork("A", "B")
        _append(lock, "B", 100, [], "a new block of one token")
        _append(lock, "A", 200, [], "a new block of one token")
    with g.scenario("no free block for the copy: refused, nothing changes (block size 4, pool 2)"):
        lock = Lockstep(g, impl, 2, 4)
        lock.seq("A", [1, 2, 3, 4, 5, 6])
        lock.call("allocate", "A", 0)
        lock.computed("A")
        lock.fork("A", "B")
        lock.append_token("B", 100)
        g.equal(lock.call("can_append", "B"), False, "can_append(B): the copy needs a block, none is free")
        lock.call("may_append", "B", expect_raise=True)
    with g.scenario("a fork of a fork, the parent released first (block size 7)"):
        lock = Lockstep(g, impl, 6, 7)
        lock.seq("A", list(range(1, 11)))                  # blocks 0 (full), 1 (3 of 7)
        lock.call("allocate", "A", 0)
        lock.computed("A")
        lock.fork("A", "B")
        lock.fork("B", "C")
        lock.expect("ref counts", (3, 3, 0, 0, 0, 0), "three holders")
        lock.call("deallocate", "A")
        _append(lock, "C", 100, [(1, 2)], "C writes into block 1, which B still holds")
        _append(lock, "B", 200, [], "block 1 is B's alone now")
        lock.call("deallocate", "B")
        lock.call("deallocate", "C")
    with g.scenario("misuse is refused and changes nothing (block size 4)"):
        lock = Lockstep(g, impl, 8, 4)
        lock.seq("A", [1, 2, 3, 4, 5])
        lock.seq("X", [9, 9, 9])
        lock.fork("X", "Y", expect_raise=True)             # X holds no blocks
        lock.call("allocate", "A", 0)
        lock.computed("A")
        lock.call("allocate", "X", 0)
        lock.call("fork", "A", Named("X"), expect_raise=True)   # X is not a blockless copy of A
        lock.seq("Z", [1, 2, 3, 4, 6])                          # blockless, but other tokens than A's
        lock.call("fork", "A", Named("Z"), expect_raise=True)
        lock.seq("W", [1, 2, 3, 4, 5])                          # A's tokens, but none of them computed
        lock.call("fork", "A", Named("W"), expect_raise=True)
    for seed, bs in ((13, 3), (14, 7)):
        with g.scenario(f"200 random calls with forks in lockstep (seed {seed}, block size {bs}, pool 14)"):
            random_trace(Lockstep(g, impl, 14, bs), seed, 200, forks=True)
