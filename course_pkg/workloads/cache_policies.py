"""Block caches for trace replay, one small class per eviction policy (chapter 11).

Every policy sees the same calls from ``replay``: ``admit(block_ids)`` gives a request a block for
each of its ``block_ids`` (reusing the cached ones) and returns ``(hits, handle)``, or None when
the request does not fit now (nothing changed); ``release(handle)`` drops the request's hold;
``peek(block_ids)`` says how many blocks a request would hit now, changing nothing.

A request hits a leading run of its blocks, and never its last block (the one with the prompt's
last token: as in vLLM, at least one token is computed). The policies differ only in which
unheld cached block they give up when a new block needs room:

* ``vllm``     -- the package's ``BlockManager`` itself (one trace block = one KV block,
                  ``block_size=1``, linked free queue): the free block freed longest ago, a
                  request's blocks released last block first (chapter 03);
* ``forward``  -- the same with chapter 03's foil, which releases first block first;
* ``lru``      -- an exact LRU over cached blocks, each stamped when a request reads it (in
                  reading order, first block first). It knows nothing of prefixes;
* ``radix``    -- a radix tree of prefixes, SGLang's eviction: least recently used *leaf*;
* ``belady``   -- the same tree, evicting the leaf whose next use lies farthest ahead (offline:
                  it is given the whole future). A heuristic, not the optimum: ``optimum.py``
                  finds better choices on small traces;
* ``infinite`` -- never evicts: the bound every policy stays under.

The block-level policies (``lru``, ``radix``, ``belady``, ``infinite``) keep one copy of a block:
a request whose last block is already cached computes it again (it is not a hit) and keeps the
cached copy. The ``BlockManager`` stores such a block a second time, as vLLM does.
"""
from __future__ import annotations

import heapq
from bisect import bisect_right
from collections.abc import Hashable, Sequence as SequenceOf

from course_pkg.block_manager import BlockManager
from course_pkg.foils import ForwardReleaseBlockManager
from course_pkg.radix_tree import RadixCache, RadixNode
from course_pkg.sequence import Sequence
from course_pkg.validation import check_positive_int


def leading_run(block_ids: SequenceOf[int], cached) -> int:
    """How many of a request's candidates (all its blocks but the last) lead the request in
    ``cached`` -- a set or dict of block ids -- before the first one that is not."""
    hits = 0
    for block_id in block_ids[:-1]:
        if block_id not in cached:
            break
        hits += 1
    return hits


class CachePolicy:
    """The interface ``replay`` drives. ``offline`` policies are given the future first (``prepare``)."""

    name = ""
    offline = False

    def __init__(self, num_blocks: int):
        self.num_blocks = check_positive_int("num_blocks", num_blocks)

    def prepare(self, future: list[tuple[int, ...]]) -> None:
        """The block ids of every request, in the order they will be admitted (offline policies only)."""

    def admit(self, block_ids: SequenceOf[int]):
        raise NotImplementedError

    def release(self, handle) -> None:
        raise NotImplementedError

    def peek(self, block_ids: SequenceOf[int]) -> int:
        raise NotImplementedError

    def stranded(self, block_ids: SequenceOf[int]) -> int:
        """Candidate blocks of this request that are cached now but cannot be hit: they lie
        behind the first miss (an ancestor was evicted before them)."""
        raise NotImplementedError


class VllmPolicy(CachePolicy):
    """The package's ``BlockManager``: a trace id becomes a one-token block, so its chained hash,
    its index, its exact check and its free queue decide every hit."""

    name = "vllm"
    manager_class = BlockManager

    def __init__(self, num_blocks: int):
        super().__init__(num_blocks)
        self.block_manager = self.manager_class(num_blocks, 1, free_queue="linked")

    def make_sequence(self, block_ids) -> Sequence:
        """The request as a sequence of one-token blocks: token i is block i's id."""
        return Sequence(list(block_ids), block_size=1)

    def admit(self, block_ids):
        bm = self.block_manager
        seq = self.make_sequence(block_ids)
        hits = bm.can_allocate(seq)
        if hits == -1:
            return None
        bm.allocate(seq, hits)
        seq.num_cached_tokens = seq.num_tokens     # the prefill ran: every block is computed
        bm.hash_blocks(seq)
        return hits, seq

    def release(self, seq: Sequence) -> None:
        self.block_manager.deallocate(seq)

    def peek(self, block_ids) -> int:
        hit_block_ids, _ = self.block_manager._match_prefix(Sequence(list(block_ids), block_size=1))
        return len(hit_block_ids)

    def stranded(self, block_ids) -> int:
        bm, h, count = self.block_manager, -1, 0
        first_miss = self.peek(block_ids)
        for i, block_id in enumerate(block_ids[:-1]):
            h = bm.compute_hash([block_id], h)     # the chain continues past a miss
            count += i > first_miss and h in bm.hash_to_block_id
        return count


class ForwardPolicy(VllmPolicy):
    """Chapter 03's foil: release first block first, so a request's prefix is overwritten first."""

    name = "forward"
    manager_class = ForwardReleaseBlockManager


class InfinitePolicy(CachePolicy):
    """Every block ever computed stays cached: no policy can hit more (a request hits a leading
    run of blocks, and every cache holds a subset of what this one holds)."""

    name = "infinite"

    def __init__(self, num_blocks: int = 1):
        super().__init__(num_blocks)
        self.seen: set[int] = set()

    def admit(self, block_ids):
        hits = self.peek(block_ids)
        self.seen.update(block_ids)
        return hits, None

    def release(self, handle) -> None:
        pass

    def peek(self, block_ids) -> int:
        return leading_run(block_ids, self.seen)

    def stranded(self, block_ids) -> int:
        return 0    # nothing is ever evicted, so no block loses its ancestors


class LruPolicy(CachePolicy):
    """An exact LRU over cached blocks, each stamped when a request reads it, first block first.

    It evicts the unheld block read longest ago -- with the request's blocks read in order, a
    request's *first* block -- whatever depends on it: a prefix block evicted before its children
    leaves them cached and useless (a lookup stops at the first miss).
    """

    name = "lru"

    def __init__(self, num_blocks: int):
        super().__init__(num_blocks)
        self.ref_count: dict[int, int] = {}     # cached block -> holders
        self.stamp: dict[int, int] = {}         # cached block -> when it was last read
        self.clock = 0
        self.num_evictable = 0
        self._heap: list[tuple[int, int]] = []  # (stamp, block) of unheld blocks; checked when popped

    def peek(self, block_ids) -> int:
        return leading_run(block_ids, self.ref_count)

    def stranded(self, block_ids) -> int:
        first_miss = self.peek(block_ids)
        return sum(1 for b in block_ids[first_miss + 1:-1] if b in self.ref_count)

    def admit(self, block_ids):
        ids = list(dict.fromkeys(block_ids))    # a block read twice is held once
        missing = [b for b in ids if b not in self.ref_count]
        unheld_reused = sum(1 for b in ids if self.ref_count.get(b) == 0)
        free = self.num_blocks - len(self.ref_count)
        if len(missing) > free + self.num_evictable - unheld_reused:
            return None
        hits = self.peek(block_ids)
        for b in ids:                           # hold first: eviction must not take them
            count = self.ref_count.get(b)
            if count == 0:
                self.num_evictable -= 1
            if count is not None:
                self.ref_count[b] = count + 1
        self._evict(len(missing) - free)
        for b in missing:
            self.ref_count[b] = 1
        for b in ids:                           # read in order: the first block is the oldest
            self.clock += 1
            self.stamp[b] = self.clock
        return hits, ids

    def release(self, ids: list[int]) -> None:
        for b in ids:
            self.ref_count[b] -= 1
            if self.ref_count[b] == 0:
                self.num_evictable += 1
                heapq.heappush(self._heap, (self.stamp[b], b))

    def _evict(self, num: int) -> None:
        while num > 0:
            stamp, b = heapq.heappop(self._heap)
            if self.ref_count.get(b) != 0 or self.stamp[b] != stamp:
                continue                        # held again, or read again, since it was pushed
            del self.ref_count[b], self.stamp[b]
            self.num_evictable -= 1
            num -= 1


class RadixPolicy(CachePolicy):
    """SGLang's radix cache (``course_pkg.radix_tree``): a request holds its path in the tree."""

    name = "radix"
    cache_class = RadixCache

    def __init__(self, num_blocks: int):
        super().__init__(num_blocks)
        self.cache = self.cache_class(num_blocks)

    def peek(self, block_ids) -> int:
        return min(len(self.cache.match_prefix(block_ids, touch=False)), len(block_ids) - 1)

    def stranded(self, block_ids) -> int:
        return 0    # a node is reached only through its parent, and only leaves are evicted

    def admit(self, block_ids):
        cache = self.cache
        path = cache.match_prefix(block_ids, touch=False)
        unheld_on_path = sum(1 for node in path if node.ref_count == 0)
        if len(block_ids) - len(path) > cache.num_free + cache.evictable - unheld_on_path:
            return None
        cache.tick()
        nodes = cache.insert(block_ids)         # marks the path used, evicts leaves for the rest
        cache.lock(nodes)
        return min(len(path), len(block_ids) - 1), nodes

    def release(self, nodes: list[RadixNode]) -> None:
        self.cache.unlock(nodes)


class BeladyCache(RadixCache):
    """A radix tree that evicts the leaf whose next use lies farthest ahead (never used: first)."""

    def __init__(self, num_blocks: int):
        super().__init__(num_blocks)
        self.uses: dict[Hashable, list[int]] = {}   # block -> times at which a request can hit it

    def next_use(self, key: Hashable) -> float:
        times = self.uses.get(key, ())
        i = bisect_right(times, self.clock)
        return times[i] if i < len(times) else float("inf")

    def eviction_key(self, node: RadixNode):
        return -self.next_use(node.key)


class BeladyPolicy(RadixPolicy):
    """Belady's MIN on the prefix tree: evict the unheld leaf needed farthest in the future.

    MIN is provably optimal for a cache of independent pages of one size, one page per access.
    Here a block is worth something only while its whole prefix stays cached, and a request needs
    all its blocks at once and holds them while it runs, so that proof does not carry over:
    ``belady`` is a heuristic, and not the optimum. A "use" is a chance to hit (a block as one of
    a request's candidates); a block that comes back as a request's *last* block is computed
    again whatever the cache holds, so keeping it can be worth nothing -- the exhaustive search
    of ``optimum.optimal_hit_blocks`` finds traces where giving it up instead wins (chapter 11).
    ``infinite`` is the bound.
    """

    name = "belady"
    offline = True
    cache_class = BeladyCache

    def prepare(self, future):
        uses: dict[int, list[int]] = {}
        for t, block_ids in enumerate(future, 1):   # request t is admitted at clock t (see admit)
            for b in block_ids[:-1]:
                uses.setdefault(b, []).append(t)
        self.cache.uses = uses


POLICIES: dict[str, type[CachePolicy]] = {cls.name: cls for cls in (
    VllmPolicy, ForwardPolicy, LruPolicy, RadixPolicy, BeladyPolicy, InfinitePolicy)}
