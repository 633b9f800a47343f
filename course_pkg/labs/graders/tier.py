"""Chapter 15 grader: the tier's lookup and ARC's two decisions (touch, eviction order)."""
from __future__ import annotations

import random

from course_pkg.labs.lab import Grading
from course_pkg.offload.manager import ARCOffloadingManager


def _state(m) -> tuple:
    """Everything a call may change, by value: the four lists in order, p, free slots, counters."""
    blocks = lambda d: [(h, b.block_id, b.ref_cnt) for h, b in d.items()]   # noqa: E731
    return (blocks(m.t1), blocks(m.t2), list(m.b1), list(m.b2), m.p, list(m.free_block_ids),
            (m.stats.queried, m.stats.hits, m.stats.loaded, m.stats.stored, m.stats.evicted))


def _stored(m, hashes, ready=True):
    out = m.prepare_store(hashes)
    if out is not None and ready:
        m.complete_store(hashes)
    return out


def grade_arc_tier(impl, g: Grading) -> None:
    with g.scenario("lookup: the leading run of ready blocks"):
        m = impl(6)
        _stored(m, [1, 2, 3])
        _stored(m, [4], ready=False)                       # being stored: not loadable yet
        g.equal(m.lookup([1, 2, 3]), 3, "lookup([1, 2, 3]) with all three ready")
        g.equal(m.lookup([1, 9, 3]), 1, "lookup([1, 9, 3]): 9 is missing, so 3 cannot be loaded after it")
        g.equal(m.lookup([4, 1]), 0, "lookup([4, 1]): 4 is still being stored")
        g.equal(m.lookup([]), 0, "lookup([])")
        g.equal((m.stats.queried, m.stats.hits), (8, 4), "(stats.queried, stats.hits) after those four lookups")
    with g.scenario("touch: a second use moves a block to T2, last to first"):
        m = impl(6)
        _stored(m, [1, 2, 3])
        _stored(m, [4], ready=False)
        m.touch([2, 4])
        g.equal((list(m.t1), list(m.t2)), ([1, 3, 4], [2]), "(t1, t2) after touch([2, 4]): 2 was ready, 4 is not")
        m.touch([3, 1])
        g.equal(list(m.t2), [2, 1, 3], "t2 after touch([3, 1]): visited last to first, so 3 then 1 -- 1 ends most recent")
        m.touch([2])
        g.equal(list(m.t2), [1, 3, 2], "t2 after touch([2]): moved to the end")
    with g.scenario("eviction: T1 while it is larger than p, never a block in use"):
        m = impl(4)
        _stored(m, [1, 2])
        m.touch([1])                                       # t1 = [2], t2 = [1]
        _stored(m, [3, 4])                                 # t1 = [2, 3, 4]
        m.prepare_load([2])                                # 2 is being loaded: it may not go
        g.equal(m._eviction_order(0, []), [], "_eviction_order(0)")
        g.equal(m._eviction_order(2, []), [3, 4], "_eviction_order(2) with p = 0: t1's oldest that may go, 2 is loading")
        g.equal(m._eviction_order(3, []), [3, 4, 1], "_eviction_order(3): t1 runs out of blocks that may go, then t2")
        g.equal(m._eviction_order(4, []), None, "_eviction_order(4): only three blocks may go")
        g.equal(_state(m)[:2], ([(2, 1, 1), (3, 2, 0), (4, 3, 0)], [(1, 0, 0)]),
                "_eviction_order changes nothing: (hash, slot, ref_cnt) in t1 and t2")
        m.p = 2
        g.equal(m._eviction_order(2, []), [3, 1], "_eviction_order(2) with p = 2: t1 (3 blocks) above p gives 3, "
                                                  "then at 2 blocks it is not above p and t2 gives 1")
        m.complete_load([2])
        out = m.prepare_store([5, 6])
        g.equal(out.block_hashes_evicted if out else None, [2, 1],
                "prepare_store([5, 6]) with p = 2, once 2 is loaded: t1's oldest (2), then -- t1 down to p -- t2's (1)")
    with g.scenario("ghosts: a use of an evicted block moves p"):
        m = impl(2)
        _stored(m, [1, 2])
        m.touch([2])                                       # t1 = [1], t2 = [2]
        _stored(m, [3])                                    # t1 (1 block) is above p = 0: 1 goes, b1 = [1]
        g.equal((list(m.t1), list(m.t2), list(m.b1)), ([3], [2], [1]), "(t1, t2, b1) after storing 3 in a tier of 2")
        m.touch([1])
        g.equal(m.p, 1, "p after touching the ghost 1 (b1 had 1, b2 none: p rises by 1)")
        m.touch([3])                                       # t1 = [], t2 = [2, 3]
        _stored(m, [4])                                    # t1 has nothing to give: t2's oldest, 2, goes
        g.equal((list(m.b1), list(m.b2)), ([1], [2]), "(b1, b2) after storing 4")
        m.touch([2])
        g.equal(m.p, 0, "p after touching the ghost 2 in b2 (b1 had 1, b2 1: p falls by 1)")
        m.touch([2, 2])
        g.equal(m.p, 0, "p never falls below 0")
    with g.scenario("800 random calls in lockstep with the package's ARC"):
        rng = random.Random(15)
        for _ in range(40):
            c = rng.randint(1, 6)
            mine, ref = impl(c), ARCOffloadingManager(c)
            loading: list[list[int]] = []
            for call in range(20):
                op = rng.choice(["lookup", "touch", "store", "store_fail", "load", "done"])
                hashes = [rng.randint(0, 11) for _ in range(rng.randint(1, 4))]
                what = f"call {call} ({op} {hashes}) of a tier of {c}"
                if op == "lookup":
                    g.equal(mine.lookup(hashes), ref.lookup(hashes), what)
                elif op == "touch":
                    mine.touch(hashes)
                    ref.touch(hashes)
                elif op in ("store", "store_fail"):
                    got, want = mine.prepare_store(hashes), ref.prepare_store(hashes)
                    g.equal(got and got.block_hashes_evicted, want and want.block_hashes_evicted, what + ": evicted")
                    if want is not None:
                        mine.complete_store(hashes, success=op == "store")
                        ref.complete_store(hashes, success=op == "store")
                elif op == "load":
                    n = ref.lookup(hashes)
                    g.equal(mine.lookup(hashes), n, what)
                    if n:
                        mine.prepare_load(hashes[:n])
                        ref.prepare_load(hashes[:n])
                        loading.append(hashes[:n])
                elif loading:
                    done = loading.pop(0)
                    mine.complete_load(done)
                    ref.complete_load(done)
                g.equal(_state(mine), _state(ref), f"the tier's state after {what}")
    with g.scenario("the Mooncake trace through a pool and your tier: the package's hits, request by request"):
        from course_pkg.workloads.tier_replay import replay_with_tier
        from course_pkg.workloads.traces import MOONCAKE_TRACE, load_trace

        trace = load_trace(MOONCAKE_TRACE, limit=600)
        got = replay_with_tier(trace, "vllm", 500, impl(1500))
        want = replay_with_tier(trace, "vllm", 500, ARCOffloadingManager(1500))
        g.equal(got.hits, want.hits, "(device hits, tier hits) per request")
        g.note(f"tier of 1,500 blocks behind a pool of 500: hit ratio {got.hit_ratio:.2%} "
               f"(the pool alone: {got.device_hit_ratio:.2%})")
