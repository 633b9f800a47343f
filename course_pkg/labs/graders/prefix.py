"""Chapter 04 graders: prefix matching and ``hash_blocks``; the stale-entry guard.

The scenarios are the contract's rules and the bugs Nano-vLLM fixed: a hit only on computed
blocks; never the prompt's last block; a hash hit confirmed by tokens (collisions are forced
by replacing ``compute_hash``); hashes chained on the parent; the index never pointing at a
block whose content changed; two sequences with the same prompt in one step.
"""
from __future__ import annotations

from course_pkg.block_manager import BlockManager
from course_pkg.labs.lab import Grading
from course_pkg.labs.lockstep import Lockstep, random_trace
from course_pkg.labs.graders.serving import make_manager
from course_pkg.labs.graders.serving import serve as _serve
from course_pkg.workloads import multi_turn_workload, shared_prefix_workload


def grade_prefix_caching(impl, g: Grading) -> None:
    with g.scenario("a shared prefix is found (block size 4)"):
        lock = Lockstep(g, impl, 10, 4)
        lock.seq("A", list(range(1, 11)))               # 2 full blocks + 2 tokens
        lock.call("allocate", "A", 0)
        lock.computed("A")
        lock.expect("hash index (block ids)", (0, 1), "A's two full blocks are registered, the partial one not")
        lock.seq("B", list(range(1, 9)) + [90, 91, 92])
        g.equal(lock.call("can_allocate", "B"), 2, "can_allocate(B), which starts with A's two full blocks")
        lock.call("allocate", "B", 2)
        lock.expect("block table of B", (0, 1, 3), "A's blocks 0, 1 shared, then a fresh block")
        lock.expect("num_cached_tokens of B", 8, "two cached blocks of 4")
    with g.scenario("only computed blocks are hits (block size 4)"):
        lock = Lockstep(g, impl, 10, 4)
        lock.seq("A", list(range(1, 11)))
        lock.seq("B", list(range(1, 11)))
        lock.call("allocate", "A", 0)                   # admitted, K/V not computed yet
        g.equal(lock.call("can_allocate", "B"), 0, "can_allocate(B) while A's K/V are not computed")
        lock.call("allocate", "B", 0)
        lock.computed("A", 5)                           # a chunk: 5 tokens computed
        lock.expect("hash index (block ids)", (0,), "after 5 computed tokens only block 0 is full and computed")
        lock.computed("A")
        lock.computed("B")
        lock.seq("C", list(range(1, 12)))
        g.equal(lock.call("can_allocate", "C"), 2, "can_allocate(C) once A and B are computed")
    with g.scenario("the prompt's last block is never a hit (block size 4)"):
        lock = Lockstep(g, impl, 10, 4)
        lock.seq("A", list(range(1, 13)))               # 3 full blocks
        lock.call("allocate", "A", 0)
        lock.computed("A")
        lock.seq("B", list(range(1, 13)))               # the same 12 tokens
        g.equal(lock.call("can_allocate", "B"), 2, "can_allocate(B) for a prompt that is all in the cache: "
                                                   "its last block must be computed")
        lock.seq("C", list(range(1, 9)))
        g.equal(lock.call("can_allocate", "C"), 1, "can_allocate(C), an 8-token prompt = A's first two blocks")
    with g.scenario("hashes chain on the prefix: the same tokens after another prefix miss (block size 4)"):
        lock = Lockstep(g, impl, 10, 4)
        lock.seq("A", [1, 2, 3, 4, 5, 6, 7, 8, 9])
        lock.call("allocate", "A", 0)
        lock.computed("A")
        lock.seq("B", [5, 6, 7, 8, 1, 2, 3, 4, 9])      # A's blocks, swapped
        g.equal(lock.call("can_allocate", "B"), 0, "can_allocate(B), whose first block is A's second")
    with g.scenario("a forced hash collision falls back to a fresh block (block size 4)"):
        lock = Lockstep(g, impl, 10, 4)
        with lock.patched_hash(lambda token_ids, prefix=-1: 42):
            lock.seq("A", list(range(1, 10)))
            lock.call("allocate", "A", 0)
            lock.computed("A")
            lock.seq("B", [70, 71, 72, 73, 74, 75, 76, 77, 78])
            g.equal(lock.call("can_allocate", "B"), 0, "can_allocate(B) when every hash is 42: the index "
                                                       "entry holds other tokens")
            lock.call("allocate", "B", 0)
            lock.seq("C", list(range(1, 10)))           # A's tokens: 42 -> block 1, which holds 5..8
            g.equal(lock.call("can_allocate", "C"), 0, "can_allocate(C): its first block's hash points at a "
                                                       "block holding other tokens")
    with g.scenario("a forced collision on the same tokens after another prefix: the parent decides (block size 4)"):
        lock = Lockstep(g, impl, 12, 4)
        real_hash = lock.ref.compute_hash
        # Every block after the first hashes to 7: the index keeps one entry for all of them.
        with lock.patched_hash(lambda token_ids, prefix=-1: 7 if prefix != -1 else real_hash(token_ids)):
            lock.seq("C", [10, 11, 12, 13, 20, 21, 22, 23, 0])
            lock.call("allocate", "C", 0)
            lock.computed("C")
            lock.seq("A", [1, 2, 3, 4, 5, 6, 7, 8, 9])
            lock.call("allocate", "A", 0)
            lock.computed("A")                           # the entry 7 now points at A's [5, 6, 7, 8]
            lock.seq("B", [10, 11, 12, 13, 5, 6, 7, 8, 0])
            g.equal(lock.call("can_allocate", "B"), 1, "can_allocate(B): [10..13] is C's block, but the "
                                                       "[5, 6, 7, 8] found under hash 7 follows A's prefix")
    for bs in (1, 7):
        with g.scenario(f"block size {bs}"):
            lock = Lockstep(g, impl, 12, bs)
            n = 3 * bs
            lock.seq("A", list(range(1, n + 1)))
            lock.call("allocate", "A", 0)
            lock.computed("A")
            lock.expect("hash index (block ids)", (0, 1, 2), f"A's {n} tokens fill 3 blocks of {bs}")
            lock.seq("B", list(range(1, 2 * bs + 1)) + [99])
            g.equal(lock.call("can_allocate", "B"), 2, "can_allocate(B), which shares A's first two blocks")
            lock.call("allocate", "B", 2)
            lock.computed("B")
            lock.seq("C", list(range(1, n + 1)))
            g.equal(lock.call("can_allocate", "C"), 2, "can_allocate(C), A's prompt again: the last block is computed")
    with g.scenario("decoded blocks are registered for the next turn (block size 2)"):
        lock = Lockstep(g, impl, 10, 2)
        lock.seq("A", [1, 2, 3])
        lock.call("allocate", "A", 0)
        lock.computed("A")
        for t in (4, 5, 6):                             # decode: blocks [3, 4] and [5, 6] fill up
            lock.append_token("A", t)
            lock.call("may_append", "A")
            lock.computed("A")
        lock.expect("hash index (block ids)", (0, 1, 2), "A's 6 tokens fill 3 blocks, decoded ones included")
        lock.call("deallocate", "A")
        lock.seq("B", [1, 2, 3, 4, 5, 6, 7, 8])         # the next turn: history + a new message
        g.equal(lock.call("can_allocate", "B"), 3, "can_allocate(B): the previous turn's 3 blocks")
        lock.call("allocate", "B", 3)
    for seed, bs in ((6, 1), (7, 7)):
        with g.scenario(f"200 random calls in lockstep (seed {seed}, block size {bs}, pool 12)"):
            random_trace(Lockstep(g, impl, 12, bs), seed, 200)
    with g.scenario("200 random calls with a weak hash: many collisions (seed 8, block size 2, pool 12)"):
        lock = Lockstep(g, impl, 12, 2)
        with lock.patched_hash(lambda token_ids, prefix=-1: (sum(token_ids) + max(prefix, 0)) % 5):
            random_trace(lock, 8, 200)
    with g.scenario("prefill tokens saved on a shared system prompt (24 requests, the real Scheduler)"):
        requests = shared_prefix_workload(24, num_prefixes=1, prefix_len=64, suffix_len=(4, 12),
                                          output_len=(2, 6), seed=1)
        baseline = _serve(BlockManager(200, 8, enable_prefix_caching=False), requests).num_computed_tokens
        reference = baseline - _serve(BlockManager(200, 8), requests).num_computed_tokens
        yours = baseline - _serve(make_manager(impl, 200, 8), requests).num_computed_tokens
        g.note(f"shared 64-token system prompt, 24 requests: your cache saves {yours} of {baseline} "
               f"prefill tokens (the reference saves {reference})")
        g.equal(yours, reference, "prefill tokens saved (the reference's saving, no more: a larger one is a wrong hit)")


def grade_stale_entry_guard(impl, g: Grading) -> None:
    with g.scenario("a stale entry after its block is reused (block size 2, pool 4)"):
        lock = Lockstep(g, impl, 4, 2)
        lock.seq("A", [1, 2, 3, 4, 9])                  # blocks 0 = [1, 2], 1 = [3, 4], 2 = [9]
        lock.call("allocate", "A", 0)
        lock.computed("A")
        lock.call("deallocate", "A")                    # free: 3, 2, 1, 0 -- 0 and 1 still cached
        lock.seq("F", [5, 6, 7, 8, 3, 4])               # takes 3, 2, 1: block 1 gets [3, 4] after [5..8]
        lock.call("allocate", "F", 0)
        lock.expect("hash index (block ids)", (0,), "block 1 got new content, so A's entry for it is gone; "
                                                    "block 0 still holds [1, 2]")
        lock.computed("F")
        lock.call("deallocate", "F")
        lock.seq("B", [1, 2, 3, 4, 7])
        g.equal(lock.call("can_allocate", "B"), 1, "can_allocate(B): [1, 2] is cached, but [3, 4] after "
                                                   "[1, 2] is not (block 1 holds it after [5..8])")
        lock.call("allocate", "B", 1)
    # Two sequences with one prefix admitted in one step hold duplicate blocks; one of them holds
    # the index entries (the newer ones). Reusing the other's blocks must keep those entries,
    # whichever sequence registered first (lower or higher block ids) and whether the holder is
    # still running or already freed (its blocks free, their content still cached).
    for first in ("A", "B"):
        for holder_state in ("running", "freed"):
            name = (f"same-prefix sequences in one step keep the newer entry ({first} computed first, "
                    f"its holder {holder_state}; block size 2, pool 6)")
            with g.scenario(name):
                lock = Lockstep(g, impl, 6, 2)
                lock.seq("A", [1, 2, 3, 4, 5])
                lock.seq("B", [1, 2, 3, 4, 5])
                lock.call("allocate", "A", 0)               # both admitted in the same step:
                lock.call("allocate", "B", 0)               # B cannot hit A's uncomputed blocks
                lock.computed(first)
                lock.computed("B" if first == "A" else "A")  # duplicate blocks: one holds the entry
                indexed = set(lock.ref.hash_to_block_id.values())
                holder = "B" if indexed <= set(lock.ref_seqs["B"].block_table) else "A"
                other = "A" if holder == "B" else "B"
                entries = tuple(sorted(lock.ref_seqs[holder].block_table[:2]))
                lock.call("deallocate", other)              # its blocks carry the hashes but no entry
                if holder_state == "freed":
                    lock.call("deallocate", holder)         # freed after: the other's blocks go first
                lock.seq("X", [60, 61, 62, 63, 64])         # reuses exactly the other's three blocks
                lock.call("allocate", "X", 0)
                lock.expect("hash index (block ids)", entries,
                            f"the entries point at {holder}'s blocks, which did not change")
                lock.call("deallocate", "X")
                lock.seq("C", [1, 2, 3, 4, 6])
                g.equal(lock.call("can_allocate", "C"), 2, f"can_allocate(C): {holder}'s two blocks are cached")
                lock.call("allocate", "C", 2)
    for seed, bs in ((9, 2), (10, 1)):
        with g.scenario(f"200 random calls in lockstep (seed {seed}, block size {bs}, pool 8)"):
            random_trace(Lockstep(g, impl, 8, bs), seed, 200)
    with g.scenario("multi-turn chats under memory pressure: the same hits (the real Scheduler)"):
        requests = multi_turn_workload(6, 3, system_len=16, user_len=(4, 10), output_len=(4, 10), seed=2)
        ref, mine = _serve(BlockManager(24, 4), requests), _serve(make_manager(impl, 24, 4), requests)
        g.equal((mine.prefix_cache_hits, mine.num_computed_tokens), (ref.prefix_cache_hits, ref.num_computed_tokens),
                "(prefix-cache hit tokens, computed tokens) on 6 three-turn chats in 24 blocks of 4")
