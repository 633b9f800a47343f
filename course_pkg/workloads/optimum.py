"""The best any eviction could do on a small trace, by exhaustive search (chapter 11).

``replay`` fixes everything but one decision: when a request needs room, *which* unheld cached
blocks to give up. This module tries every choice. It replays the trace in the model of the
block-level policies of ``cache_policies`` (``lru``, ``radix``, ``belady``, ``infinite``): one
copy of each block; a request hits the leading run of its blocks that is cached, never its last
block; it holds all its blocks while it runs; at most ``concurrency`` requests hold blocks, the
one admitted longest ago finishes first, or earlier when a new request does not fit. At each
admission that must evict ``m`` blocks, every set of ``m`` unheld cached blocks is tried, inner
blocks of a prefix included, and the largest total of hit blocks wins. States met twice are
solved once (memoised on the request's position, the cached set and who holds what).

The search grows fast with the pool and the number of distinct blocks: it is meant for traces
of about ten requests and pools of a few blocks, which is where it shows that ``belady`` (the
farthest next use among unheld leaves) is a heuristic here, not the optimum.
"""
from __future__ import annotations

from functools import lru_cache
from itertools import combinations

from course_pkg.validation import check_positive_int
from course_pkg.workloads.cache_policies import leading_run
from course_pkg.workloads.replay import block_ids_of
from course_pkg.workloads.traces import TraceRequest

#: States the search may visit before it gives up (a trace too large for an exhaustive search).
MAX_STATES = 2_000_000


def optimal_hit_blocks(trace: list[TraceRequest], num_blocks: int, concurrency: int = 1) -> int:
    """The most blocks any eviction choice hits on ``trace`` (requests larger than the pool are
    skipped, as ``replay`` skips them). Raises ``ValueError`` past ``MAX_STATES`` states."""
    check_positive_int("num_blocks", num_blocks)
    check_positive_int("concurrency", concurrency)
    requests = [tuple(ids) for ids in block_ids_of(trace) if len(ids) <= num_blocks]
    visited = 0

    @lru_cache(maxsize=None)
    def best(i: int, cached: frozenset, holding: tuple) -> int:
        nonlocal visited
        visited += 1
        if visited > MAX_STATES:
            raise ValueError(f"the search passed {MAX_STATES:,} states: the trace is too large for it")
        if i == len(requests):
            return 0
        ids = requests[i]
        wanted = set(ids)
        holding = holding[1:] if len(holding) == concurrency else holding
        while True:
            held = {b for request in holding for b in request} | wanted
            evictable = sorted(cached - held)
            missing = len(wanted - cached)
            free = num_blocks - len(cached)
            if missing <= free + len(evictable):
                break
            holding = holding[1:]      # the oldest request finishes early to make room
        hits = leading_run(ids, cached)
        rest = (*holding, ids)
        if missing <= free:
            return hits + best(i + 1, cached | wanted, rest)
        return hits + max(best(i + 1, (cached - set(gone)) | wanted, rest)
                          for gone in combinations(evictable, missing - free))

    return best(0, frozenset(), ())
