"""Replay a trace through a device pool with a second tier behind it (chapter 15).

Chapter 11's ``replay`` with one change: an ``OffloadingManager`` (``course_pkg.offload``) keeps
copies of blocks. Each request, in trace order, at most ``concurrency`` holding blocks:

1. the device pool (a ``cache_policies`` policy) gives it its leading hits, as in ``replay``;
2. the tier is looked up for the candidates after them (``lookup``): its leading run there is
   loaded (``prepare_load`` / ``complete_load``) -- hits that cost a copy, not a prefill -- and
   is protected from eviction while the step's stores make room;
3. the tier is told the request used all its candidates (``touch``);
4. ``store="compute"``: every block the request computed is stored in the tier
   (``prepare_store`` / ``complete_store``) -- *store on compute*, as vLLM's offloading connector
   stores a block once it is full, so the tier holds copies of blocks the device pool may still
   hold. ``store="evict"`` (the ``vllm`` policy only): a block goes to the tier when the device
   pool gives it up -- a cached block handed out for new content -- just before it is
   overwritten, so the tier holds what the pool has forgotten and nothing else.

The device pool sees exactly the calls it sees in ``replay`` (a block loaded from the tier is,
for it, a block computed), so its hits are ``replay``'s; the tier can only add to them. With a
tier that stores on compute and never evicts, every candidate seen before is a hit somewhere: the
infinite bound.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from course_pkg.block_manager import BlockManager
from course_pkg.offload import OffloadingManager
from course_pkg.offload.manager import OffloadStats
from course_pkg.validation import check_choice, check_positive_int
from course_pkg.workloads.cache_policies import VllmPolicy
from course_pkg.workloads.replay import block_ids_of, make_policy
from course_pkg.workloads.traces import TraceRequest

STORES = ("compute", "evict")


class EvictionNotingBlockManager(BlockManager):
    """A device pool that notes the trace id of every cached block it gives up (``evicted``),
    for the tier of ``store="evict"``: the stale-entry guard's one-line hook is where a cached
    block is handed out for new content."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.evicted: list[int] = []

    def _maybe_evict_cached_block(self, block) -> None:
        cached = len(self.hash_to_block_id)
        super()._maybe_evict_cached_block(block)
        if len(self.hash_to_block_id) < cached:   # the guard dropped its entry: the pool forgot it
            self.evicted.append(block.token_ids[0])   # (one-token blocks: the token is the trace id)


class EvictionNotingVllmPolicy(VllmPolicy):
    manager_class = EvictionNotingBlockManager


@dataclass(frozen=True)
class TierReplayResult:
    policy: str
    store: str                 # "compute" or "evict"
    num_blocks: int            # device pool
    tier_blocks: int
    concurrency: int
    num_requests: int          # replayed (those larger than the device pool are skipped)
    device_hits: int           # candidate blocks hit in the device pool
    tier_hits: int             # candidate blocks loaded from the tier
    full_blocks: int           # candidates: every request's blocks but its last
    tier_stats: OffloadStats
    hits: tuple                # per trace request: (device hits, tier hits), None if skipped
    seconds: float

    @property
    def hit_ratio(self) -> float:
        """Device and tier hits over candidates."""
        return (self.device_hits + self.tier_hits) / self.full_blocks if self.full_blocks else 0.0

    @property
    def device_hit_ratio(self) -> float:
        return self.device_hits / self.full_blocks if self.full_blocks else 0.0

    def __str__(self) -> str:
        return (f"policy {self.policy}, pool {self.num_blocks:,} + tier {self.tier_blocks:,} blocks: "
                f"{self.num_requests:,} requests, hit {self.hit_ratio:.2%} "
                f"(device {self.device_hit_ratio:.2%}, tier {self.tier_hits / max(self.full_blocks, 1):.2%}); "
                f"tier stored {self.tier_stats.stored:,}, evicted {self.tier_stats.evicted:,}")


def replay_with_tier(trace: list[TraceRequest], policy, num_blocks: int, tier: OffloadingManager,
                     concurrency: int = 16, *, store: str = "compute") -> TierReplayResult:
    """Replay ``trace`` through ``policy`` on ``num_blocks`` device blocks with ``tier`` behind
    it (a fresh manager: it is changed), storing on ``store`` ("compute" or "evict"); see the
    module docstring."""
    check_positive_int("num_blocks", num_blocks)
    check_positive_int("concurrency", concurrency)
    check_choice("store", store, STORES)
    if store == "evict":
        if policy != "vllm":
            raise ValueError(f"store='evict' replays the 'vllm' policy (the BlockManager), not {policy!r}")
        policy = EvictionNotingVllmPolicy
    cache = make_policy(policy, num_blocks)
    if cache.offline:
        raise ValueError(f"{cache.name!r} needs the future; replay_with_tier runs online policies")
    all_ids = block_ids_of(trace)
    if any(len(ids) == 0 for ids in all_ids):
        raise ValueError("a request with no prompt blocks (input_length 0) cannot be replayed")
    fits = [i for i, ids in enumerate(all_ids) if len(ids) <= num_blocks]
    hits: list[tuple[int, int] | None] = [None] * len(trace)
    holding: deque = deque()
    start = time.perf_counter()
    for i in fits:
        ids = list(all_ids[i])
        if len(holding) == concurrency:
            cache.release(holding.popleft())
        while (got := cache.admit(ids)) is None:
            cache.release(holding.popleft())
        device_hits, handle = got
        holding.append(handle)
        candidates = ids[:-1]
        from_tier = tier.lookup(candidates[device_hits:])
        loaded = candidates[device_hits:device_hits + from_tier]
        tier.prepare_load(loaded)   # (protected from eviction until loaded, as vLLM looks up first)
        if store == "evict" and cache.block_manager.evicted:   # copied out before they are overwritten
            _store(tier, cache.block_manager.evicted)
            cache.block_manager.evicted.clear()
        tier.complete_load(loaded)
        tier.touch(candidates)
        if store == "compute":
            _store(tier, ids[device_hits + from_tier:])
        hits[i] = (device_hits, from_tier)
    seconds = time.perf_counter() - start
    while holding:
        cache.release(holding.popleft())
    return TierReplayResult(
        policy=cache.name or type(cache).__name__, store=store, num_blocks=num_blocks, tier_blocks=tier.num_blocks,
        concurrency=concurrency, num_requests=len(fits), device_hits=sum(hits[i][0] for i in fits),
        tier_hits=sum(hits[i][1] for i in fits), full_blocks=sum(len(all_ids[i]) - 1 for i in fits),
        tier_stats=tier.stats, hits=tuple(hits), seconds=seconds)


def _store(tier: OffloadingManager, block_ids: list[int]) -> None:
    out = tier.prepare_store(block_ids)   # (None: every block it could give up is in use -- not stored)
    if out is not None:
        tier.complete_store(out.block_hashes_to_store)


@dataclass(frozen=True)
class PolicyGrade:
    """``grade_tier_policy``'s verdict: the contract checks, and the replay against LRU's."""

    problems: tuple[str, ...]    # broken rules of the contract (empty: none)
    hit_ratio: float             # the policy's, on the replay
    lru_hit_ratio: float         # LRU's, on the same replay

    @property
    def passed(self) -> bool:
        return not self.problems and self.hit_ratio > self.lru_hit_ratio

    def __str__(self) -> str:
        lines = [f"contract: {'kept' if not self.problems else 'BROKEN'}"] + [f"  - {p}" for p in self.problems]
        lines.append(f"replay: hit ratio {self.hit_ratio:.2%} against LRU's {self.lru_hit_ratio:.2%} "
                     f"({'better' if self.hit_ratio > self.lru_hit_ratio else 'not better'})")
        return "\n".join(lines)


def grade_tier_policy(manager_class, trace: list[TraceRequest], num_blocks: int = 2000, tier_blocks: int = 8000,
                      *, scripts: int = 300, seed: int = 0) -> PolicyGrade:
    """Grade a tier policy of your own (chapter 15): ``manager_class(n)`` is an ``OffloadingManager``.

    First the contract, on ``scripts`` random call sequences of tiers of 1 to 6 blocks (seeded):
    ``prepare_store`` evicts only ready blocks that no load holds, exactly as many as it needs,
    and returns None -- changing nothing -- only when fewer than that may be evicted; free and
    held slots always partition the tier. Then the replay: the trace through a device pool of
    ``num_blocks`` and the tier at ``tier_blocks``, against LRU's tier of the same size. It
    passes when the contract holds and it hits more than LRU."""
    import random

    rng = random.Random(seed)
    problems: list[str] = []
    for _ in range(scripts):
        c = rng.randint(1, 6)
        m = manager_class(c)
        loading: list[list[int]] = []
        for _ in range(rng.randint(1, 40)):
            op = rng.choice(["lookup", "touch", "store", "store_fail", "load", "done"])
            hashes = [rng.randint(0, 11) for _ in range(rng.randint(1, 5))]
            try:
                _one_call(m, op, hashes, loading, problems)
            except Exception as e:   # noqa: BLE001 -- a broken policy may break the tier's own calls
                problems.append(f"{op}({hashes}) raised {type(e).__name__}: {e}")
            slots = [m._find(h).block_id for h in range(12) if h in m]
            if sorted(slots + list(m.free_block_ids)) != list(range(c)):
                problems.append(f"after {op}({hashes}): the slots held {sorted(slots)} and free "
                                f"{sorted(m.free_block_ids)} do not partition the tier")
            if problems:
                break
        if problems:
            break
    lru = replay_with_tier(trace, "vllm", num_blocks, _lru(tier_blocks))
    mine = replay_with_tier(trace, "vllm", num_blocks, manager_class(tier_blocks))
    return PolicyGrade(tuple(problems[:5]), mine.hit_ratio, lru.hit_ratio)


def _one_call(m, op: str, hashes: list[int], loading: list[list[int]], problems: list[str]) -> None:
    """One call of ``grade_tier_policy``'s scripts, with the contract's checks."""
    if op == "lookup":
        m.lookup(hashes)
    elif op == "touch":
        m.touch(hashes)
    elif op in ("store", "store_fail"):
        new = list(dict.fromkeys(h for h in hashes if h not in m))
        need = len(new) - (m.num_blocks - len(m))
        held = {h: b for h in range(12) if h in m for b in [m._find(h)]}
        evictable = {h for h, b in held.items() if b.is_ready and b.ref_cnt == 0}
        out = m.prepare_store(hashes)
        if out is None:
            if need <= len(evictable):
                problems.append(f"prepare_store({hashes}) returned None with {len(evictable)} evictable "
                                f"blocks for {need} needed")
        else:
            if not set(out.block_hashes_evicted) <= evictable:
                problems.append(f"prepare_store({hashes}) evicted {out.block_hashes_evicted}, not all of "
                                f"them ready and free of loads")
            if len(out.block_hashes_evicted) != max(need, 0):
                problems.append(f"prepare_store({hashes}) evicted {len(out.block_hashes_evicted)} blocks "
                                f"to make room for {need}")
            m.complete_store(hashes, success=op == "store")
    elif op == "load":
        n = m.lookup(hashes)
        if n:
            m.prepare_load(hashes[:n])
            loading.append(hashes[:n])
    elif loading:
        m.complete_load(loading.pop(0))


def _lru(n: int):
    from course_pkg.offload import LRUOffloadingManager

    return LRUOffloadingManager(n)
