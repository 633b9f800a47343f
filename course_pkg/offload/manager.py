"""The tier's bookkeeping: which block hashes it holds, where, and which one it gives up next.

A device pool forgets a cached block as soon as it needs the block for something else
(chapters 03-04, 11). A *tier* behind it -- host memory, then disk -- keeps such blocks longer: a
request whose prefix the device pool has forgotten may still find it there and load it back,
a copy over the bus instead of a prefill. vLLM v1's offloading connector splits this in two,
as the course's engine splits the BlockManager from the ModelRunner: on the scheduler's side an
``OffloadingManager`` keeps block *hashes* and slot numbers only (this module, torch-free), and
the workers move the bytes. Its six calls, with vLLM's names and meanings:

* ``lookup(hashes)`` -- how many *leading* blocks of a request the tier holds, ready to load;
* ``prepare_load(hashes)`` -- where they are; each is protected from eviction until
* ``complete_load(hashes)`` -- the copy to the device is done;
* ``touch(hashes)`` -- the request used these blocks (recency, and ARC's learning);
* ``prepare_store(hashes)`` -- room for the blocks not held yet, evicting others if needed;
  returns what to copy where, and what was evicted -- or None if it cannot make room (every
  block it could give up is being loaded or stored), and then nothing has changed;
* ``complete_store(hashes, success)`` -- the copy to the tier is done: the blocks become
  loadable (or, on failure, are dropped again).

A block in the tier is ``ready`` once its store completed, and ``ref_cnt`` counts the loads in
flight; only a ready block that no load holds can be evicted. The subclasses differ only in
which such block goes first: ``LRUOffloadingManager`` the least recently used,
``ARCOffloadingManager`` the choice of Megiddo and Modha's *adaptive replacement cache* (FAST'03),
which keeps blocks seen once apart from blocks seen again and learns how much room each side
deserves. ``FilterReusedOffloadingManager`` wraps either and stores only blocks that requests
have asked for ``store_threshold`` times (vLLM's reuse-frequency gate): a block nobody comes
back for is not worth the copy.
"""
from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterable
from dataclasses import dataclass
from itertools import chain, islice

from course_pkg.offload.linked_dict import LinkedDict
from course_pkg.validation import check_int, check_positive_int


@dataclass(frozen=True)
class LoadStoreSpec:
    """Where blocks are in the tier: one slot per block hash, in the order of the hashes."""

    medium: str
    block_ids: tuple[int, ...]


@dataclass(frozen=True)
class PrepareStoreOutput:
    """What ``prepare_store`` decided: the hashes to copy into the tier (those it did not hold
    yet), their slots, and the hashes it evicted to make room."""

    block_hashes_to_store: list[int]
    store_spec: LoadStoreSpec
    block_hashes_evicted: list[int]


@dataclass
class OffloadStats:
    """Counters since the tier was made, in blocks."""

    queried: int = 0      # blocks ``lookup`` was asked about
    hits: int = 0         # of those, found ready (the leading run only)
    loaded: int = 0       # blocks ``prepare_load`` handed out
    stored: int = 0       # blocks whose store completed
    evicted: int = 0      # blocks given up to make room


@dataclass(slots=True)
class TierBlock:
    """One block the tier holds: its slot, and the loads in flight (-1 while being stored)."""

    block_id: int
    ref_cnt: int = -1

    @property
    def is_ready(self) -> bool:
        return self.ref_cnt >= 0


class OffloadingManager:
    """The tier's common part: slots, lookups, loads and stores. A subclass keeps the blocks in
    its own order (``_find``, ``_add``, ``_drop``) and says which ones to give up first
    (``_eviction_order``)."""

    def __init__(self, num_blocks: int, medium: str = "CPU"):
        self.num_blocks = check_positive_int("num_blocks", num_blocks)
        self.medium = medium
        self.free_block_ids: deque[int] = deque(range(num_blocks))
        self.stats = OffloadStats()

    # ---------------------------------------------------------------- the calls

    def lookup(self, block_hashes: Iterable[int]) -> int:
        """How many leading blocks of ``block_hashes`` the tier holds ready to load."""
        block_hashes = list(block_hashes)
        hits = 0
        for h in block_hashes:
            block = self._find(h)
            if block is None or not block.is_ready:
                break
            hits += 1
        self.stats.queried += len(block_hashes)
        self.stats.hits += hits
        return hits

    def prepare_load(self, block_hashes: Iterable[int]) -> LoadStoreSpec:
        """The slots of ``block_hashes`` (all ready, as ``lookup`` found them), each protected
        from eviction until ``complete_load``. Raises (changing nothing) if one is not ready."""
        blocks = [self._ready_block(h) for h in block_hashes]
        for block in blocks:
            block.ref_cnt += 1
        self.stats.loaded += len(blocks)
        return LoadStoreSpec(self.medium, tuple(b.block_id for b in blocks))

    def complete_load(self, block_hashes: Iterable[int]) -> None:
        """The loads of ``block_hashes`` are done: they may be evicted again."""
        counts = Counter(block_hashes)
        for h, n in counts.items():
            if self._ready_block(h).ref_cnt < n:
                raise ValueError(f"block {h:#x} is not being loaded (or not {n} times)")
        for h, n in counts.items():
            self._find(h).ref_cnt -= n

    def touch(self, block_hashes: Iterable[int]) -> None:
        """A request used these blocks (the whole prefix it asked for, held here or not)."""

    def prepare_store(self, block_hashes: Iterable[int]) -> PrepareStoreOutput | None:
        """Make room for the blocks of ``block_hashes`` that the tier does not hold yet and give
        them slots (not loadable until ``complete_store``). Returns None, changing nothing, when
        too few blocks can be evicted."""
        to_store = list(dict.fromkeys(h for h in block_hashes if self._find(h) is None))   # (each once, in order)
        victims = self._eviction_order(len(to_store) - len(self.free_block_ids), to_store)
        if victims is None:
            return None
        for h in victims:
            self.free_block_ids.append(self._find(h).block_id)
            self._drop(h, evicted=True)
        self.stats.evicted += len(victims)
        slots = []
        for h in to_store:
            block = TierBlock(self.free_block_ids.popleft())
            self._add(h, block)
            slots.append(block.block_id)
        return PrepareStoreOutput(to_store, LoadStoreSpec(self.medium, tuple(slots)), victims)

    def remove(self, block_hash: int) -> bool:
        """Forget a ready block that no load holds -- its copy was found bad (the disk tier's
        checksum) -- without a ghost: it was lost, not evicted. Returns whether it was removed."""
        block = self._find(block_hash)
        if block is None or block.ref_cnt != 0:
            return False
        self._drop(block_hash, evicted=False)
        self.free_block_ids.append(block.block_id)
        return True

    def complete_store(self, block_hashes: Iterable[int], success: bool = True) -> None:
        """The copies into the tier are done: the blocks become loadable; if they failed
        (``success=False``), the blocks still being stored are dropped and their slots freed."""
        for h in block_hashes:
            block = self._find(h)
            if block is None or block.is_ready:
                continue   # stored earlier (or never asked for): nothing to complete
            if success:
                block.ref_cnt = 0
                self.stats.stored += 1
            else:
                self._drop(h, evicted=False)
                self.free_block_ids.append(block.block_id)

    # ---------------------------------------------------------------- what a policy decides

    def __len__(self) -> int:
        return self.num_blocks - len(self.free_block_ids)

    def __contains__(self, block_hash: int) -> bool:
        return self._find(block_hash) is not None

    def _ready_block(self, h: int) -> TierBlock:
        block = self._find(h)
        if block is None or not block.is_ready:
            raise ValueError(f"block {h:#x} is not in the tier ready to load")
        return block

    def _find(self, h: int) -> TierBlock | None:
        raise NotImplementedError

    def _add(self, h: int, block: TierBlock) -> None:
        raise NotImplementedError

    def _drop(self, h: int, evicted: bool) -> None:
        raise NotImplementedError

    def _eviction_order(self, n: int, incoming: list[int]) -> list[int] | None:
        """The ``n`` hashes to evict for ``incoming`` (none if ``n <= 0``), without changing
        anything; None if fewer than ``n`` blocks may be evicted."""
        raise NotImplementedError

    @staticmethod
    def _evictable(blocks: LinkedDict):
        """The hashes of ``blocks`` that may be evicted (ready, no load in flight), least
        recently used first: an iterator, so that finding a few costs no pass over all."""
        return (h for h, b in blocks.items() if b.ref_cnt == 0)


class LRUOffloadingManager(OffloadingManager):
    """Evicts the least recently used block. ``touch`` makes a request's blocks the most recent,
    its *first* block last -- so, as with chapter 03's reversed release, a prefix's head outlives
    its tail."""

    def __init__(self, num_blocks: int, medium: str = "CPU"):
        super().__init__(num_blocks, medium)
        self.blocks: LinkedDict[int, TierBlock] = LinkedDict()   # least recently used first

    def touch(self, block_hashes: Iterable[int]) -> None:
        for h in reversed(list(block_hashes)):
            if h in self.blocks:
                self.blocks.move_to_end(h)

    def _find(self, h):
        return self.blocks.get(h)

    def _add(self, h, block):
        self.blocks[h] = block

    def _drop(self, h, evicted):
        del self.blocks[h]

    def _eviction_order(self, n, incoming):
        if n <= 0:
            return []
        victims = list(islice(self._evictable(self.blocks), n))
        return victims if len(victims) == n else None


class SLRUOffloadingManager(LRUOffloadingManager):
    """Segmented LRU: a block asked for again after it was stored (a ``touch`` once it is ready)
    is *protected*; to make room the tier gives up unprotected blocks first, least recently used
    first, and protected ones only when no unprotected block may go. It is ARC's split into T1
    and T2 without ARC's learning -- the target size of T1 fixed at 0 -- and the chapter's
    exercise (``segmented_victims`` is the same decision, on plain lists)."""

    def __init__(self, num_blocks: int, medium: str = "CPU"):
        super().__init__(num_blocks, medium)
        self.protected: set[int] = set()

    def touch(self, block_hashes: Iterable[int]) -> None:
        block_hashes = list(block_hashes)
        for h in block_hashes:
            block = self.blocks.get(h)
            if block is not None and block.is_ready:
                self.protected.add(h)
        super().touch(block_hashes)

    def _drop(self, h, evicted):
        super()._drop(h, evicted)
        self.protected.discard(h)

    def _eviction_order(self, n, incoming):
        if n <= 0:
            return []
        evictable = self._evictable(self.blocks)
        first = (h for h in evictable if h not in self.protected)
        then = (h for h in self._evictable(self.blocks) if h in self.protected)
        victims = list(islice(chain(first, then), n))
        return victims if len(victims) == n else None


def segmented_victims(order: list[int], in_use: set[int], protected: set[int], n: int) -> list[int] | None:
    """SLRU's choice on plain lists: the ``n`` hashes to evict from ``order`` (least recently used
    first), never one ``in_use`` (being loaded or stored), unprotected ones first; None if fewer
    than ``n`` may go."""
    free = [h for h in order if h not in in_use]
    victims = ([h for h in free if h not in protected] + [h for h in free if h in protected])[:max(n, 0)]
    return victims if len(victims) == max(n, 0) else None


class ARCOffloadingManager(OffloadingManager):
    """Megiddo and Modha's adaptive replacement cache over the tier's ``c`` blocks.

    ``t1`` holds blocks asked for once since they entered, ``t2`` blocks asked for again (a
    ``touch`` of a ready block in ``t1`` promotes it). ``b1`` and ``b2`` are *ghosts*: the hashes
    of blocks evicted from ``t1`` and ``t2``, without their data. A ``touch`` that finds a ghost
    says the tier guessed wrong: a ghost of ``b1`` (a block seen once, evicted too soon) raises
    the target size ``p`` of ``t1``, a ghost of ``b2`` lowers it, each by the ratio of the
    ghost lists' sizes (at least 1); a block stored again after its ghost was touched enters
    ``t2``. To make room, ``t1`` gives up its least recently used block while it is larger than
    ``p`` (or when ``t2`` has none to give), else ``t2`` does; the ghosts are trimmed so that
    ``t1`` and ``b1`` together, and all four lists together, stay within ``c`` and ``2c``.
    """

    def __init__(self, num_blocks: int, medium: str = "CPU"):
        super().__init__(num_blocks, medium)
        self.t1: LinkedDict[int, TierBlock] = LinkedDict()
        self.t2: LinkedDict[int, TierBlock] = LinkedDict()
        self.b1: LinkedDict[int, None] = LinkedDict()
        self.b2: LinkedDict[int, None] = LinkedDict()
        self.p = 0   # the target size of t1 (ARC's p)

    def touch(self, block_hashes: Iterable[int]) -> None:
        c = self.num_blocks
        for h in reversed(list(block_hashes)):   # (the first block ends most recent)
            if h in self.t1:
                if self.t1[h].is_ready:       # asked for again: frequent
                    self.t2[h] = self.t1.pop(h)
                else:                         # being stored: this is still its first use
                    self.t1.move_to_end(h)
            elif h in self.t2:
                self.t2.move_to_end(h)
            elif h in self.b1:
                self.p = min(c, self.p + max(1, len(self.b2) // len(self.b1)))
                self.b1.move_to_end(h)
            elif h in self.b2:
                self.p = max(0, self.p - max(1, len(self.b1) // len(self.b2)))
                self.b2.move_to_end(h)

    def _find(self, h):
        return self.t1.get(h) or self.t2.get(h)

    def _add(self, h, block):
        if h in self.b1 or h in self.b2:   # a ghost comes back: it has been asked for before
            self.b1.pop(h, None)
            self.b2.pop(h, None)
            self.t2[h] = block
        else:
            self.t1[h] = block
        c = self.num_blocks
        while len(self.t1) + len(self.b1) > c and self.b1:
            self.b1.popitem(last=False)
        while len(self.t1) + len(self.t2) + len(self.b1) + len(self.b2) > 2 * c and self.b2:
            self.b2.popitem(last=False)

    def _drop(self, h, evicted):
        if h in self.t1:
            del self.t1[h]
            if evicted:
                self.b1[h] = None
        else:
            del self.t2[h]
            if evicted:
                self.b2[h] = None

    def _eviction_order(self, n, incoming):
        if n <= 0:
            return []
        from_t1, from_t2 = self._evictable(self.t1), self._evictable(self.t2)
        next1, next2 = next(from_t1, None), next(from_t2, None)
        size_t1 = len(self.t1)
        victims = []
        while len(victims) < n:
            if next1 is not None and (size_t1 > self.p or next2 is None):
                victims.append(next1)
                size_t1 -= 1
                next1 = next(from_t1, None)
            elif next2 is not None:
                victims.append(next2)
                next2 = next(from_t2, None)
            else:
                return None
        return victims


class FilterReusedOffloadingManager:
    """A tier that stores a block only once requests have asked for it ``store_threshold``
    times (vLLM's reuse-frequency gate): ``lookup`` counts each hash it is asked about (in an
    LRU table of at most ``max_tracker_size`` hashes), ``prepare_store`` passes on only the
    hashes counted often enough; every other call goes to ``backing`` unchanged."""

    def __init__(self, backing: OffloadingManager, store_threshold: int = 2, max_tracker_size: int = 64_000):
        self.backing = backing
        self.store_threshold = check_int("store_threshold", store_threshold, minimum=1)
        self.max_tracker_size = check_positive_int("max_tracker_size", max_tracker_size)
        self.counts: LinkedDict[int, int] = LinkedDict()

    def lookup(self, block_hashes: Iterable[int]) -> int:
        block_hashes = list(block_hashes)
        for h in block_hashes:
            self.counts[h] = self.counts.pop(h, 0) + 1   # (re-inserted: now the most recent)
            if len(self.counts) > self.max_tracker_size:
                self.counts.popitem(last=False)
        return self.backing.lookup(block_hashes)

    def prepare_store(self, block_hashes: Iterable[int]) -> PrepareStoreOutput | None:
        return self.backing.prepare_store([h for h in block_hashes if self.counts.get(h, 0) >= self.store_threshold])

    def __getattr__(self, name):   # prepare_load, complete_load, touch, complete_store, stats, ...
        return getattr(self.backing, name)

    def __len__(self) -> int:
        return len(self.backing)

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self.backing
