"""Chapter 11 grader: the radix-tree cache (match, insert, evict least recently used leaves)."""
from __future__ import annotations

import random

from course_pkg.labs.lab import Grading
from course_pkg.radix_tree import RadixCache


def _paths(cache) -> dict[tuple, tuple[int, int]]:
    """Every cached prefix (keys from the root) -> (ref_count, last_access)."""
    out, stack = {}, [((), cache.root)]
    while stack:
        prefix, node = stack.pop()
        for key, child in node.children.items():
            out[prefix + (key,)] = (child.ref_count, child.last_access)
            stack.append((prefix + (key,), child))
    return out


def _state(cache) -> tuple:
    return _paths(cache), cache.num_cached, cache.evictable


def _keys(nodes) -> list:
    return [n.key for n in nodes]


def grade_radix_cache(impl, g: Grading) -> None:
    with g.scenario("match_prefix and insert by hand"):
        c = impl(8)
        g.equal(_keys(c.match_prefix(["a"])), [], "match_prefix on an empty tree")
        c.tick()
        p = c.insert(["a", "b", "c"])
        g.equal(_keys(p), ["a", "b", "c"], "insert(a, b, c) returns the path")
        g.equal((c.num_cached, c.evictable), (3, 3), "(num_cached, evictable) after the first insert")
        c.tick()
        q = c.insert(["a", "b", "d"])
        g.check(q[0] is p[0] and q[1] is p[1], "insert(a, b, d) must reuse the nodes of a and b, not copy them")
        g.equal(c.num_cached, 4, "num_cached after insert(a, b, d): only d is new")
        g.equal(_paths(c), {("a",): (0, 2), ("a", "b"): (0, 2), ("a", "b", "c"): (0, 1), ("a", "b", "d"): (0, 2)},
                "cached prefixes -> (ref_count, last_access) after two inserts at clocks 1 and 2")
        c.tick()
        g.equal(_keys(c.match_prefix(["a", "b", "x", "c"])), ["a", "b"], "match_prefix(a, b, x, c)")
        g.equal((p[0].last_access, p[1].last_access, p[2].last_access), (3, 3, 1),
                "last_access of a, b, c after match_prefix(a, b, x, c) at clock 3")
        c.tick()
        c.match_prefix(["a", "b", "c"], touch=False)
        g.equal((p[0].last_access, p[2].last_access), (3, 1), "match_prefix(..., touch=False) changes no last_access")
        g.equal(_keys(c.insert(["a", "b", "c"])), ["a", "b", "c"], "insert of a cached path")
        g.equal(c.num_cached, 4, "num_cached after inserting a cached path again")
    with g.scenario("evict: the least recently used leaf, never an inner node or a held one"):
        c = impl(5)
        c.tick()
        c.insert(["a", "b", "c"])
        c.tick()
        d = c.insert(["a", "d"])
        c.lock(d)
        c.tick()
        c.match_prefix(["a", "b"])
        g.equal(c.evict(1), 1, "evict(1) with an evictable leaf")
        g.equal(sorted(_paths(c)), [("a",), ("a", "b"), ("a", "d")],
                "after evict(1): the leaf c (used at 1) goes; d is held, a and b have children")
        g.equal(c.evict(5), 1, "evict(5): only b can go (a holds the held d)")
        g.equal(sorted(_paths(c)), [("a",), ("a", "d")], "after evict(5)")
        g.equal((c.num_cached, c.evictable), (2, 0), "(num_cached, evictable)")
        c.unlock(d)
        g.equal(c.evict(0), 0, "evict(0)")
        g.equal(c.evict(5), 2, "evict(5) once nothing is held: d, then a")
        g.equal((_paths(c), c.num_cached, c.evictable), ({}, 0, 0), "the tree is empty")
    with g.scenario("evict after the holder of a path left: still leaves only"):
        c = impl(4)
        c.tick()
        p = c.insert(["a", "b", "c"])
        c.lock(p)
        c.unlock(p)                            # a, b and c are unheld now; only c is a leaf
        c.tick()
        c.insert(["d"])
        g.equal(c.evict(1), 1, "evict(1)")
        g.equal(set(_paths(c)), {("a",), ("a", "b"), ("d",)}, "after evict(1): c (used at 1) goes, not a or b")
        g.equal((c.num_cached, c.evictable), (3, 3), "(num_cached, evictable)")
    with g.scenario("LRU among leaves of different branches"):
        c = impl(6)
        for keys in (["x", 1], ["x", 2], ["x", 3], ["y"]):
            c.tick()
            c.insert(keys)
        c.tick()
        c.match_prefix(["x", 1])               # 1 used again: now 2 is the oldest leaf
        g.equal(c.evict(2), 2, "evict(2)")
        g.equal(set(_paths(c)), {("x",), ("x", 1), ("y",)},
                "after evict(2): leaves 2 (clock 2) and 3 (clock 3) go; 1 was used at clock 5, y at 4")
    with g.scenario("insert evicts to make room, and refuses what cannot fit"):
        c = impl(3)
        c.tick()
        held = c.insert([1, 2])
        c.lock(held)
        c.tick()
        c.insert([3])
        c.tick()
        path = c.insert([1, 2, 4])
        g.equal(_keys(path), [1, 2, 4], "insert(1, 2, 4) into a full pool")
        g.equal(sorted(_paths(c)), [(1,), (1, 2), (1, 2, 4)], "cached after insert(1, 2, 4): 3 was evicted")
        c.lock(path)
        before = _state(c)
        try:
            c.insert([5])
        except MemoryError:
            pass
        else:
            g.fail("insert(5) with every block held should raise MemoryError")
        g.equal(_state(c), before, "(paths, num_cached, evictable) after the refused insert")
        c.unlock(path)
        c.unlock(held)
        c.tick()
        g.equal(_keys(c.insert([1, 2, 6])), [1, 2, 6], "insert(1, 2, 6): 4 is the only leaf to evict")
        g.equal(sorted(_paths(c)), [(1,), (1, 2), (1, 2, 6)], "cached after insert(1, 2, 6)")
    with g.scenario("800 random calls in lockstep with the package's RadixCache"):
        rng = random.Random(11)
        mine, ref = impl(12), RadixCache(12)
        held: list[tuple[list, list]] = []
        for step in range(800):
            op = rng.random()
            keys = [rng.randrange(3) for _ in range(rng.randint(1, 5))]
            if op < 0.45:
                mine.tick()
                ref.tick()
                want_error = got_error = False
                try:
                    r = ref.insert(keys)
                except MemoryError:
                    want_error = True
                try:
                    m = mine.insert(keys)
                except MemoryError:
                    got_error = True
                g.equal(got_error, want_error, f"step {step}: insert({keys}) raised MemoryError")
                if not want_error and rng.random() < 0.5:
                    mine.lock(m)
                    ref.lock(r)
                    held.append((m, r))
            elif op < 0.65 and held:
                m, r = held.pop(rng.randrange(len(held)))
                mine.unlock(m)
                ref.unlock(r)
            elif op < 0.85:
                mine.tick()
                ref.tick()
                g.equal(_keys(mine.match_prefix(keys)), _keys(ref.match_prefix(keys)), f"step {step}: match_prefix({keys})")
            else:
                n = rng.randint(0, 4)
                g.equal(mine.evict(n), ref.evict(n), f"step {step}: evict({n})")
            g.equal(len(_paths(mine)), mine.num_cached,
                    f"step {step}: nodes reachable from the root vs num_cached (an evicted inner node cuts off its subtree)")
            g.equal(_state(mine), _state(ref), f"step {step}: (paths with ref_count and last_access, num_cached, evictable)")
    with g.scenario("the Mooncake trace replayed with your cache: the package's hits, request by request"):
        from course_pkg.workloads.cache_policies import RadixPolicy
        from course_pkg.workloads.replay import replay
        from course_pkg.workloads.traces import MOONCAKE_TRACE, load_mooncake

        trace = load_mooncake(MOONCAKE_TRACE, limit=600)
        yours = type("YourRadixPolicy", (RadixPolicy,), {"name": "yours", "cache_class": impl})
        for pool in (400, 3000):
            got, want = replay(trace, yours, pool), replay(trace, "radix", pool)
            first = next((i for i, (a, b) in enumerate(zip(got.hits, want.hits)) if a != b), None)
            g.check(first is None, f"pool {pool}: request {first} hits {got.hits[first] if first is not None else ''} "
                                   f"blocks with your cache, {want.hits[first] if first is not None else ''} with the package's")
