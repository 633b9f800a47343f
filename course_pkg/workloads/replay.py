"""Replay a trace, block by block, through a cache policy; count the hits (chapter 11).

One trace block is one KV block. Requests are admitted in trace order -- or, with a waiting
``window`` of more than one request, in the order a scheduler picks -- and at most
``concurrency`` of them hold their blocks at once: the request admitted longest ago finishes
first, or earlier when a new request needs room. No model runs and time does not pass: what is
measured is which blocks the cache still holds when a request asks for them.

A request can hit only a leading run of its blocks, never the last one (it holds the prompt's
last token, which must be computed), so a request of ``n`` blocks has ``n - 1`` candidates;
``hit_ratio`` is hits over candidates. Only prompt blocks are cached: the traces do not say
which blocks a request's answer fills. A request larger than the whole pool is skipped.

Scheduling (``order``): ``"fcfs"`` admits the oldest waiting request; ``"lpm"`` the one with the
longest cached prefix now (SGLang's longest-prefix-match), the oldest among equals. A request
that later arrivals overtake waits; ``max_wait`` bounds how often: a request overtaken that
many times is admitted next (the oldest such first).
"""
from __future__ import annotations

import argparse
import itertools
import sys
import time
from collections import deque
from dataclasses import dataclass

from course_pkg.validation import check_choice, check_int, check_positive_int
from course_pkg.workloads.cache_policies import POLICIES, CachePolicy
from course_pkg.workloads.traces import TraceRequest, load_trace, summarize

ORDERS = ("fcfs", "lpm")


@dataclass(frozen=True)
class ReplayResult:
    policy: str
    num_blocks: int
    concurrency: int
    num_requests: int          # requests replayed (skipped ones not counted)
    hit_blocks: int
    full_blocks: int           # candidates: every request's blocks but its last
    skipped: int               # requests larger than the pool
    hits: tuple                # per trace request: blocks hit, or None if skipped
    admission_order: tuple     # trace indices in the order they were admitted
    max_overtaken: int         # the most later arrivals admitted before one request
    seconds: float             # wall time of the replay
    stranded_blocks: int | None = None   # cached candidates behind a miss (``stranded=True``)

    @property
    def hit_ratio(self) -> float:
        return self.hit_blocks / self.full_blocks if self.full_blocks else 0.0

    @property
    def us_per_request(self) -> float:
        return self.seconds / self.num_requests * 1e6 if self.num_requests else 0.0

    def __str__(self) -> str:
        return (f"policy {self.policy}, pool {self.num_blocks:,} blocks, concurrency {self.concurrency}: "
                f"{self.num_requests:,} requests ({self.skipped} skipped, larger than the pool), "
                f"hit {self.hit_blocks:,} of {self.full_blocks:,} candidate blocks = {self.hit_ratio:.2%}; "
                f"most overtaken {self.max_overtaken}; {self.us_per_request:.1f} us per request")


def block_ids_of(trace: list[TraceRequest]) -> list[tuple[int, ...]]:
    """Each request's block ids: Mooncake's ``hash_ids``; for a trace without them (Azure) fresh
    ids, one per 512-token block, that no other request shares."""
    fresh = itertools.count(1 + max((max(r.hash_ids, default=-1) for r in trace if r.hash_ids), default=-1))
    return [r.hash_ids if r.hash_ids is not None else tuple(itertools.islice(fresh, r.num_blocks))
            for r in trace]


def make_policy(policy: str | CachePolicy | type, num_blocks: int) -> CachePolicy:
    """A policy by name, a policy class (called with ``num_blocks``), or a fresh policy object."""
    if isinstance(policy, str):
        check_choice("policy", policy, tuple(POLICIES))
        return POLICIES[policy](num_blocks)
    if isinstance(policy, type):
        return policy(num_blocks)
    return policy


def replay(trace: list[TraceRequest], policy, num_blocks: int, concurrency: int = 16, *,
           order: str = "fcfs", window: int = 1, max_wait: int | None = None,
           stranded: bool = False) -> ReplayResult:
    """Replay ``trace`` through ``policy`` (a name of ``POLICIES``, a class or a fresh object) on
    a pool of ``num_blocks`` blocks; see the module docstring for the model.

    ``stranded``: also count, before each admission, the request's cached blocks that it cannot
    hit because an earlier block of its prefix was evicted (``CachePolicy.stranded``)."""
    check_positive_int("num_blocks", num_blocks)
    check_positive_int("concurrency", concurrency)
    check_choice("order", order, ORDERS)
    check_positive_int("window", window)
    if max_wait is not None:
        check_int("max_wait", max_wait, minimum=0)
    cache = make_policy(policy, num_blocks)
    all_ids = block_ids_of(trace)
    if any(len(ids) == 0 for ids in all_ids):
        raise ValueError("a request with no prompt blocks (input_length 0) cannot be replayed")
    fits = [i for i, ids in enumerate(all_ids) if len(ids) <= num_blocks]
    if cache.offline:
        if order != "fcfs" or window != 1:
            raise ValueError(f"{cache.name!r} needs the future in admission order: use order='fcfs', window=1")
        cache.prepare([all_ids[i] for i in fits])
    hits: list[int | None] = [None] * len(trace)
    overtaken = dict.fromkeys(fits, 0)
    holding: deque = deque()          # handles of the requests holding blocks, oldest first
    waiting: list[int] = []           # trace indices, in arrival order
    arrivals = iter(fits)
    admitted: list[int] = []
    num_stranded = 0
    start = time.perf_counter()
    while True:
        while len(waiting) < window and (i := next(arrivals, None)) is not None:
            waiting.append(i)
        if not waiting:
            break
        pick = _pick(cache, waiting, all_ids, overtaken, order, max_wait)
        i = waiting.pop(pick)
        for j in waiting[:pick]:      # those arrived earlier and were passed over
            overtaken[j] += 1
        ids = all_ids[i]
        if stranded:
            num_stranded += cache.stranded(ids)
        if len(holding) == concurrency:
            cache.release(holding.popleft())
        while (got := cache.admit(ids)) is None:
            cache.release(holding.popleft())  # never empty here: an empty pool fits any request that is not skipped
        hits[i], handle = got
        holding.append(handle)
        admitted.append(i)
    seconds = time.perf_counter() - start
    while holding:
        cache.release(holding.popleft())
    return ReplayResult(
        policy=cache.name or type(cache).__name__, num_blocks=num_blocks, concurrency=concurrency,
        num_requests=len(fits), hit_blocks=sum(hits[i] for i in fits),
        full_blocks=sum(len(all_ids[i]) - 1 for i in fits), skipped=len(trace) - len(fits),
        hits=tuple(hits), admission_order=tuple(admitted), max_overtaken=max(overtaken.values(), default=0),
        seconds=seconds, stranded_blocks=num_stranded if stranded else None)


def _pick(cache: CachePolicy, waiting: list[int], all_ids, overtaken, order: str, max_wait: int | None) -> int:
    """Position in ``waiting`` of the request to admit next."""
    if max_wait is not None:
        for pos, i in enumerate(waiting):
            if overtaken[i] >= max_wait:
                return pos            # the oldest starving request goes first
    if order == "fcfs" or len(waiting) == 1:
        return 0
    best, best_hits = 0, -1
    for pos, i in enumerate(waiting):
        h = cache.peek(all_ids[i])
        if h > best_hits:             # strictly more: the oldest wins a tie
            best, best_hits = pos, h
    return best


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m course_pkg.workloads.replay",
                                     description="Describe or replay a Mooncake (.jsonl) or Azure (.csv) trace.")
    sub = parser.add_subparsers(dest="command", required=True)
    p_describe = sub.add_parser("describe", help="lengths and sharing of a trace")
    p_describe.add_argument("trace")
    p_describe.add_argument("--limit", type=int, default=None, help="read the first N requests only")
    p_replay = sub.add_parser("replay", help="replay a trace through a cache policy")
    p_replay.add_argument("trace")
    p_replay.add_argument("--policy", choices=sorted(POLICIES), default="vllm")
    p_replay.add_argument("--pool", type=int, required=True, help="KV blocks in the pool")
    p_replay.add_argument("--concurrency", type=int, default=16, help="requests holding blocks at once")
    p_replay.add_argument("--limit", type=int, default=None, help="replay the first N requests only")
    args = parser.parse_args(argv)
    try:
        trace = load_trace(args.trace, args.limit)
        if args.command == "describe":
            print(summarize(trace))
        else:
            print(replay(trace, args.policy, args.pool, concurrency=args.concurrency))
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
