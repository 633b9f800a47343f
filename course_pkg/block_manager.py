"""The BlockManager: which physical blocks are free, who holds the rest (chapters 02-04).

It manages block *numbers*, never tensors: the ModelRunner owns the KV cache and reads
each sequence's ``block_table`` to find where a token's K/V live. Four structures hold
all of the state:

* ``blocks``            -- every block's metadata, indexed by block id;
* ``free_block_ids``    -- free blocks in FIFO order: allocate from the head, release to
                           the tail, so the head is the block freed longest ago;
* ``used_block_ids``    -- blocks with ``ref_count > 0``;
* ``hash_to_block_id``  -- prefix-cache index: chained content hash -> block id.

Invariants (tested after every call): free and used partition all blocks; a block is in
the free queue at most once; the sum of ref counts equals the number of block-table
entries of live sequences; every index entry points at a block that carries that hash.

The free queue is a ``deque`` by default (chapters 02-03). ``free_queue="linked"`` swaps in
the doubly linked ``FreeBlockQueue`` (chapter 03), which removes a revived block from the
middle in O(1) and hands out the very same block ids.

Statistics, named as vLLM names them: ``prefix_cache_stats`` counts prefix-cache
``queries`` and ``hits`` in tokens, per admitted request, with the hit rate over all
requests and over the most recent ones; ``kv_cache_usage`` is the fraction of blocks in use.
"""
from __future__ import annotations

from array import array
from collections import deque

import xxhash

from course_pkg.block import Block
from course_pkg.free_block_queue import FreeBlockQueue
from course_pkg.sequence import Sequence

FREE_QUEUES = ("deque", "linked")


class NoFreeBlocksError(RuntimeError):
    """The pool has too few free blocks for the request (ask ``can_allocate``/``can_append`` first)."""


def compute_hash(token_ids: list[int], prefix: int = -1) -> int:
    """xxhash64 of a block's token ids, chained on the parent block's hash.

    Chaining makes the key "this content *after that prefix*": the same tokens at another
    position, or after another prefix, get another hash.
    """
    h = xxhash.xxh64()
    if prefix != -1:
        h.update(prefix.to_bytes(8, "little"))
    h.update(array("q", token_ids).tobytes())
    return h.intdigest()


class PrefixCacheStats:
    """Prefix-cache lookups counted in tokens, as vLLM v1 counts them.

    Each admitted request adds its ``queries`` (all its tokens at admission) and its
    ``hits`` (the tokens found in the cache). A request that was preempted and is admitted
    again is counted apart, in ``preempted_requests``, ``preempted_queries`` and
    ``preempted_hits``: its re-lookup mostly finds the blocks it freed a moment before, so
    counting it in would make the cache look better the more the scheduler preempts.
    ``hit_rate`` (hits / queries over every first admission so far) and ``recent_hit_rate``
    (over the last ``max_recent_requests`` first admissions: vLLM's ``CachingMetrics``
    window, 1000 by default, which follows a changing workload where the all-time rate lags
    behind) leave the preempted lookups out, as vLLM's exported hit rate does.
    """

    def __init__(self, max_recent_requests: int = 1000):
        if not isinstance(max_recent_requests, int) or max_recent_requests < 1:
            raise ValueError(f"max_recent_requests must be an integer >= 1, got {max_recent_requests!r}")
        self.max_recent_requests = max_recent_requests
        self.requests = 0
        self.queries = 0
        self.hits = 0
        self.preempted_requests = 0
        self.preempted_queries = 0
        self.preempted_hits = 0
        self.recent: deque[tuple[int, int]] = deque(maxlen=max_recent_requests)  # (queries, hits)
        self._recent_queries = 0
        self._recent_hits = 0

    def record(self, queries: int, hits: int, preempted: bool = False) -> None:
        """Count one admission that asked for ``queries`` tokens and found ``hits`` of them.

        ``preempted``: the request was preempted before (this is a readmission); it is
        counted in the ``preempted_*`` fields only.
        """
        if preempted:
            self.preempted_requests += 1
            self.preempted_queries += queries
            self.preempted_hits += hits
            return
        if len(self.recent) == self.max_recent_requests:
            old_queries, old_hits = self.recent[0]  # about to fall out of the window
            self._recent_queries -= old_queries
            self._recent_hits -= old_hits
        self.recent.append((queries, hits))
        self._recent_queries += queries
        self._recent_hits += hits
        self.requests += 1
        self.queries += queries
        self.hits += hits

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0

    @property
    def recent_hit_rate(self) -> float:
        return self._recent_hits / self._recent_queries if self._recent_queries else 0.0

    def __repr__(self) -> str:
        return (f"PrefixCacheStats(requests={self.requests}, queries={self.queries}, "
                f"hits={self.hits}, hit_rate={self.hit_rate:.3f}, recent_hit_rate={self.recent_hit_rate:.3f}, "
                f"preempted_requests={self.preempted_requests}, preempted_queries={self.preempted_queries}, "
                f"preempted_hits={self.preempted_hits})")


class BlockManager:
    """Hands out fixed-size KV blocks to sequences, with prefix caching by content hash."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 free_queue: str = "deque", max_recent_requests: int = 1000):
        for name, value in (("num_blocks", num_blocks), ("block_size", block_size)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if free_queue not in FREE_QUEUES:
            raise ValueError(f"free_queue must be one of {FREE_QUEUES}, got {free_queue!r}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.free_queue = free_queue
        self.blocks: list[Block] = [Block(i) for i in range(num_blocks)]
        # Both kinds offer popleft / append / remove / len / iteration head -> tail.
        self.free_block_ids: deque[int] | FreeBlockQueue = (
            deque(range(num_blocks)) if free_queue == "deque" else FreeBlockQueue(num_blocks))
        self.used_block_ids: set[int] = set()
        self.hash_to_block_id: dict[int, int] = {}
        self.prefix_cache_stats = PrefixCacheStats(max_recent_requests)

    # The hash function is reachable from the manager, as in Nano-vLLM.
    compute_hash = staticmethod(compute_hash)

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    @property
    def kv_cache_usage(self) -> float:
        """Fraction of blocks held by sequences (vLLM's ``kv_cache_usage``); free-but-cached
        blocks count as free."""
        return len(self.used_block_ids) / len(self.blocks)

    # ---------------------------------------------------------------- internals

    def _check_block_size(self, seq: Sequence) -> None:
        if seq.block_size != self.block_size:
            raise ValueError(f"sequence {seq.seq_id} uses block_size {seq.block_size}, "
                             f"this BlockManager uses {self.block_size}")

    def _match_prefix(self, seq: Sequence) -> tuple[list[int], list[int]]:
        """Leading blocks of ``seq`` found in the cache: (block ids, their chained hashes).

        Only full blocks are candidates, and never the block holding the prompt's last
        token: at least one token must be computed to produce the next token's logits.
        A hash hit counts only if the block still holds the same tokens (a collision, or a
        block whose content changed, falls back to a fresh block).
        """
        block_ids: list[int] = []
        hashes: list[int] = []
        if not self.enable_prefix_caching:
            return block_ids, hashes
        h = -1
        for i in range((seq.num_tokens - 1) // self.block_size):
            token_ids = seq.block(i)
            h = self.compute_hash(token_ids, h)
            block_id = self.hash_to_block_id.get(h, -1)
            if block_id == -1 or self.blocks[block_id].token_ids != token_ids:
                break
            block_ids.append(block_id)
            hashes.append(h)
        return block_ids, hashes

    def _num_new_blocks(self, seq: Sequence, hit_block_ids: list[int]) -> int:
        """Free blocks an allocation takes: fresh blocks plus cache hits revived from the free queue."""
        revived = sum(1 for b in hit_block_ids if self.blocks[b].ref_count == 0)
        return seq.num_blocks - len(hit_block_ids) + revived

    def _allocate_block(self) -> Block:
        """Take the block at the head of the free queue for new content."""
        block = self.blocks[self.free_block_ids.popleft()]
        self._maybe_evict_cached_block(block)
        block.reset()
        self.used_block_ids.add(block.block_id)
        return block

    def _maybe_evict_cached_block(self, block: Block) -> None:
        """Drop the index entry of a free block about to get new content (the stale-entry guard).

        Only if the index still points here: a newer block may have taken over the same hash,
        and that entry is still good.
        """
        if block.hash != -1 and self.hash_to_block_id.get(block.hash) == block.block_id:
            del self.hash_to_block_id[block.hash]

    def _deallocate_block(self, block: Block) -> None:
        # Hash and tokens stay: a freed block remains a cache entry until it is reused.
        self.used_block_ids.remove(block.block_id)
        self.free_block_ids.append(block.block_id)

    # ---------------------------------------------------------------- public calls

    def can_allocate(self, seq: Sequence) -> int:
        """-1 if the sequence does not fit, else how many leading blocks come from the cache."""
        self._check_block_size(seq)
        hit_block_ids, _ = self._match_prefix(seq)
        if self._num_new_blocks(seq, hit_block_ids) > len(self.free_block_ids):
            return -1
        return len(hit_block_ids)

    def allocate(self, seq: Sequence, num_cached_blocks: int = 0) -> None:
        """Give ``seq`` a block table for all its tokens, reusing ``num_cached_blocks`` cached blocks.

        ``num_cached_blocks`` is what ``can_allocate`` returned (or fewer -- but fewer hits
        mean more fresh blocks, which may not fit: then ``NoFreeBlocksError`` is raised and
        nothing changes). New blocks are not registered in the index here: their K/V are not
        computed yet (see ``hash_blocks``). The request's prefix-cache query and hits are
        counted in ``prefix_cache_stats`` (also when caching is off, with zero hits, so that
        runs with and without caching compare).
        """
        self._check_block_size(seq)
        if seq.block_table:
            raise ValueError(f"sequence {seq.seq_id} already has blocks {seq.block_table}; "
                             "deallocate it before allocating again")
        hit_block_ids, hashes = self._match_prefix(seq)
        if not 0 <= num_cached_blocks <= len(hit_block_ids):
            raise ValueError(f"num_cached_blocks={num_cached_blocks} but only {len(hit_block_ids)} "
                             f"leading blocks of sequence {seq.seq_id} are in the cache")
        hit_block_ids = hit_block_ids[:num_cached_blocks]
        needed = self._num_new_blocks(seq, hit_block_ids)
        if needed > len(self.free_block_ids):
            raise NoFreeBlocksError(f"sequence {seq.seq_id} needs {needed} free blocks, "
                                    f"{len(self.free_block_ids)} are free")
        # Cached blocks first: a free one is taken out of the free queue before any fresh
        # block is popped, so the same allocation can never hand it out twice.
        for block_id in hit_block_ids:
            block = self.blocks[block_id]
            if block.ref_count == 0:  # free but still cached: revive it
                self.free_block_ids.remove(block_id)
                self.used_block_ids.add(block_id)
            block.ref_count += 1
            seq.block_table.append(block_id)
        for _ in range(seq.num_blocks - num_cached_blocks):
            seq.block_table.append(self._allocate_block().block_id)
        seq.block_hashes = hashes[:num_cached_blocks]
        seq.num_cached_tokens = num_cached_blocks * self.block_size
        self.prefix_cache_stats.record(seq.num_tokens, seq.num_cached_tokens, preempted=seq.num_preemptions > 0)

    def can_append(self, seq: Sequence) -> bool:
        """Can ``seq`` get the blocks its newest token needs? (True when it needs none.)"""
        return len(self.free_block_ids) >= self._blocks_to_append(seq)

    def _blocks_to_append(self, seq: Sequence) -> int:
        # A block is needed exactly when the newest token is the first of a new block. For a
        # table kept in sync that is (len(seq) - 1) % block_size == 0; counting the table
        # against num_blocks says the same and holds for every block_size >= 1.
        self._check_block_size(seq)
        if not seq.block_table:
            raise ValueError(f"sequence {seq.seq_id} has no blocks; allocate it first")
        return seq.num_blocks - len(seq.block_table)

    def may_append(self, seq: Sequence) -> None:
        """Add a block to ``seq``'s table if its newest token starts a new block."""
        needed = self._blocks_to_append(seq)
        if needed > len(self.free_block_ids):
            raise NoFreeBlocksError(f"sequence {seq.seq_id} needs {needed} free block(s), "
                                    f"{len(self.free_block_ids)} are free")
        for _ in range(needed):
            seq.block_table.append(self._allocate_block().block_id)

    def deallocate(self, seq: Sequence) -> None:
        """Release ``seq``'s blocks, last block first.

        Reversed order puts the sequence's tail blocks into the free queue first and its
        prefix blocks last, so the prefix -- the part most likely shared by the next
        request -- is the last to be overwritten: the free queue acts as an LRU.
        """
        self._check_block_size(seq)
        if not seq.block_table:
            raise ValueError(f"sequence {seq.seq_id} holds no blocks; nothing to deallocate")
        if any(self.blocks[block_id].ref_count < 1 for block_id in seq.block_table):
            raise ValueError(f"sequence {seq.seq_id}'s block table {seq.block_table} holds a free "
                             "block: it was not allocated by this BlockManager, or was already released")
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self._deallocate_block(block)
        seq.block_table.clear()
        seq.block_hashes.clear()
        seq.num_cached_tokens = 0

    def hash_blocks(self, seq: Sequence) -> None:
        """Register the blocks of ``seq`` that became full and computed since the last call.

        Called after each step, once ``seq.num_cached_tokens`` counts the tokens whose K/V
        that step wrote. Registering at allocation instead would let another sequence "hit"
        a block whose K/V do not exist yet.
        """
        if not self.enable_prefix_caching:
            return
        self._check_block_size(seq)
        num_full = min(seq.num_cached_tokens // self.block_size, len(seq.block_table))
        h = seq.block_hashes[-1] if seq.block_hashes else -1
        for i in range(len(seq.block_hashes), num_full):
            token_ids = seq.block(i)
            h = self.compute_hash(token_ids, h)
            block = self.blocks[seq.block_table[i]]
            block.update(h, token_ids)
            self.hash_to_block_id[h] = block.block_id
            seq.block_hashes.append(h)
