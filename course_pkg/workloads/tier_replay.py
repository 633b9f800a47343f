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
