"""The BlockManager: which physical blocks are free, who holds the rest (chapters 02-04).

It manages block *numbers*, never tensors: whoever owns the KV cache reads each
sequence's ``block_table`` to find where a token's K/V live. Four structures hold the state:

* ``blocks``            -- every block's metadata, indexed by block id;
* ``free_block_ids``    -- free blocks in FIFO order: allocate from the head, release to
                           the tail, so the head is the block freed longest ago;
* ``used_block_ids``    -- blocks with ``ref_count > 0``;
* ``hash_to_block_id``  -- prefix-cache index: chained content hash -> block id.

Invariants (tested after every call): free and used partition all blocks; a block is in
the free queue at most once; the sum of ref counts equals the number of block-table
entries of live sequences; every index entry points at a block that carries that hash.

Two guards sit beside the four structures and change no decision of a correct program:
``_holders`` (the sequences this manager allocated, so ``deallocate`` can refuse any other)
and ``_prefix_ids`` (exact names for the token prefixes that registered blocks end, so a
prefix-cache hit never rests on the hash being free of collisions; see ``_match_prefix``).

The free queue is a ``deque`` by default (chapters 02-03). ``free_queue="linked"`` swaps in
the doubly linked ``FreeBlockQueue`` (chapter 03), which removes a revived block from the
middle in O(1) and hands out the very same block ids. The deque is a teaching default: the
engine always passes ``EngineConfig.free_queue`` ("linked").

Statistics, named as vLLM names them: ``prefix_cache_stats`` counts prefix-cache
``queries`` and ``hits`` in tokens, per first admission (a readmission after preemption is
counted apart), with the hit rate over all requests and over the most recent ones;
``kv_cache_usage`` is the fraction of blocks in use.
"""
from __future__ import annotations

import functools
import struct
from collections import deque
import xxhash

from course_pkg.block import Block
from course_pkg.free_block_queue import FreeBlockQueue
from course_pkg.sequence import Sequence
from course_pkg.validation import check_bool, check_choice, check_positive_int, is_int

FREE_QUEUES = ("deque", "linked")


def _free(n: int) -> str:
    return f"{n} {'is' if n == 1 else 'are'} free"


class NoFreeBlocksError(RuntimeError):
    """The pool has too few free blocks for the request (ask ``can_allocate``/``can_append`` first)."""


def compute_hash(token_ids: list[int], prefix: int = -1) -> int:
    """xxhash64 of a block's token ids, chained on the parent block's hash.

    Chaining makes the key "this content *after that prefix*": the same tokens at another
    position, or after another prefix, get another hash. The bytes hashed are the parent's
    hash (8 bytes, little-endian; none for a first block), then each token id in 8 bytes,
    little-endian -- the bytes Nano-vLLM hashes too (numpy's int64), packed here in one call.
    """
    if prefix == -1:   # a first block: its tokens only
        data = _uint64s(len(token_ids)).pack(*token_ids)
    else:              # the parent's hash first, as one more 8-byte integer
        data = _uint64s(len(token_ids) + 1).pack(prefix, *token_ids)
    return xxhash.xxh64_intdigest(data)


@functools.lru_cache(maxsize=64)
def _uint64s(n: int) -> struct.Struct:
    """Packs ``n`` integers in ``[0, 2**64)`` as 8 little-endian bytes each (one packer per length:
    a block size, and a block size plus the parent's hash)."""
    return struct.Struct(f"<{n}Q")


def salt_hash(cache_salt: str | None) -> int:
    """Where a request's hash chain starts: -1 (no parent) without a salt, else a hash of the salt.

    The first block's hash is chained on it as on a parent's hash, so a ``cache_salt`` enters
    the hash of the first block only and every later block inherits it through the chain --
    as vLLM mixes the salt into the first block's hash (chapter 12).
    """
    return -1 if cache_salt is None else xxhash.xxh64(b"cache_salt:" + cache_salt.encode()).intdigest()


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
        check_positive_int("max_recent_requests", max_recent_requests)
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
            dropped = self.recent[0]  # about to fall out of the window
            self._recent_queries -= dropped[0]
            self._recent_hits -= dropped[1]
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
        check_positive_int("num_blocks", num_blocks)
        check_positive_int("block_size", block_size)
        check_bool("enable_prefix_caching", enable_prefix_caching)
        check_choice("free_queue", free_queue, FREE_QUEUES)
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks: list[Block] = [Block(i) for i in range(num_blocks)]
        # Both kinds offer popleft / append / remove / len / iteration head -> tail.
        self.free_block_ids: deque[int] | FreeBlockQueue = (
            deque(range(num_blocks)) if free_queue == "deque" else FreeBlockQueue(num_blocks))
        self.used_block_ids: set[int] = set()
        self.hash_to_block_id: dict[int, int] = {}
        self.prefix_cache_stats = PrefixCacheStats(max_recent_requests)
        # The guards (see the module docstring): seq_id -> the Sequence object that holds
        # blocks; chained hash -> (prefix id, (parent prefix id, tokens, salt)), the exact
        # prefix that hash names here (see ``_prefix_id_for``).
        self._holders: dict[int, Sequence] = {}
        self._prefix_ids: dict[int, tuple[int, tuple[int, list[int], str | None]]] = {}
        self._next_prefix_id = 0
        self._prefix_sweep_at = 2 * num_blocks + 4096   # see _sweep_prefix_ids

    # The hash function is reachable from the manager, as in Nano-vLLM; so is where a
    # request's chain starts (chapter 12), so that a subclass can change either.
    compute_hash = staticmethod(compute_hash)
    salt_hash = staticmethod(salt_hash)

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
        The hash only *finds* a candidate; ``_confirms_hit`` decides. A collision -- another
        prefix with the same chained hash -- falls back to a fresh block.
        """
        block_ids: list[int] = []
        hashes: list[int] = []
        if not self.enable_prefix_caching:
            return block_ids, hashes
        h = self.salt_hash(seq.cache_salt)   # -1 without a salt
        parent_prefix_id = -1
        for i in range((seq.num_tokens - 1) // self.block_size):
            token_ids = seq.block(i)
            salt = seq.cache_salt if i == 0 else None   # a first block carries its salt
            h = self.compute_hash(token_ids, h)
            block_id = self.hash_to_block_id.get(h, -1)
            if block_id == -1 or not self._confirms_hit(self.blocks[block_id], token_ids, parent_prefix_id, salt):
                break
            block_ids.append(block_id)
            hashes.append(h)
            parent_prefix_id = self.blocks[block_id].prefix_id
        return block_ids, hashes

    def _confirms_hit(self, block: Block, token_ids: list[int], parent_prefix_id: int,
                      cache_salt: str | None = None) -> bool:
        """Does ``block`` hold these tokens right after the prefix matched so far?

        Comparing the block's own tokens is not enough: two different prefixes can end in the
        same block of tokens, and if their chained hashes collide the block's K/V belong to
        the other prefix. The parent's prefix id closes that gap: ids are exact (see
        ``_prefix_id_for``), so equal ids mean the very same tokens from position 0 on. A
        first block must also carry the request's salt (chapter 12), compared exactly too.
        """
        return (block.token_ids == token_ids and block.parent_prefix_id == parent_prefix_id
                and block.cache_salt == cache_salt)

    def _prefix_id_for(self, h: int, parent_prefix_id: int, token_ids: list[int],
                       cache_salt: str | None = None) -> int:
        """The exact id of "prefix ``parent_prefix_id`` followed by ``token_ids``", for a block
        whose chained hash is ``h``.

        ``_prefix_ids`` maps a chained hash to the prefix it names here, written out in full:
        ``(prefix id, (parent prefix id, tokens, salt))``. The hash only finds the entry; the id
        is shared only when the whole name is equal, so unlike ``hash_to_block_id`` this cannot
        mistake one prefix for another. A second prefix under the same hash -- a collision --
        gets an id of its own and no entry: no other block can share that id, which may cost a
        hit, never give a wrong one. Ids are never reused, and an entry outlives the blocks that
        carried its prefix (it still names that prefix exactly): ``_sweep_prefix_ids`` drops the
        entries no block needs once they pile up. A first block's name holds its request's salt
        (``None`` for all other blocks).
        """
        name = (parent_prefix_id, token_ids, cache_salt)
        entry = self._prefix_ids.get(h)
        if entry is not None and entry[1] == name:
            return entry[0]   # this very prefix has an id already
        prefix_id = self._take_prefix_id()
        if entry is None:     # else a collision: the id stays this block's own
            if len(self._prefix_ids) > self._prefix_sweep_at:
                self._sweep_prefix_ids()   # (before the new entry: its block does not carry it yet)
            self._prefix_ids[h] = (prefix_id, name)
        return prefix_id

    def _take_prefix_id(self) -> int:
        prefix_id = self._next_prefix_id
        self._next_prefix_id = prefix_id + 1
        return prefix_id

    def _sweep_prefix_ids(self) -> None:
        """Keep only the entries of prefixes that a block carries: the others only take memory.

        Run once the dictionary holds more than ``_prefix_sweep_at`` entries: twice the blocks,
        plus 4096 so that a small pool is not swept every few requests. Afterwards it holds at
        most one per block, so a sweep -- O(blocks) -- comes at most once per pool's worth of
        registrations: amortised O(1) each. An entry swept while a cached block still names it
        as its parent leaves that block unreachable: a miss, never a wrong hit.
        """
        entries, none = self._prefix_ids, (None,)
        self._prefix_ids = {b.hash: entries[b.hash] for b in self.blocks if entries.get(b.hash, none)[0] == b.prefix_id}

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

    def forget_overwritten(self, written: dict[int, int]) -> list[Sequence]:
        """K/V were overwritten behind the bookkeeping's back (a step that wrote them was undone):
        ``written`` maps a block id to the first offset written in it.

        A registered block among them loses its prefix-cache entry, so no later request hits
        what is no longer there; returns the sequences whose *computed* tokens lie in a written
        slot (they must be computed again). A sequence's own slots past its computed tokens are
        not its K/V yet: writing them harms nobody.
        """
        damaged = []
        for seq in self._holders.values():
            for i, block_id in enumerate(seq.block_table):
                first = written.get(block_id)
                if first is not None and seq.num_cached_tokens > i * self.block_size + first:
                    damaged.append(seq)
                    break
        for block_id in written:
            block = self.blocks[block_id]
            if block.hash != -1:
                self._maybe_evict_cached_block(block)
                block.update(-1, [], -1, -1)
        return damaged

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

    def _revive_block(self, block: Block) -> None:
        """A prefix hit on a free block still cached: take it out of the free queue, wherever it is."""
        self.free_block_ids.remove(block.block_id)
        self.used_block_ids.add(block.block_id)

    def _record_admission(self, seq: Sequence) -> None:
        """Count the prefix-cache query and hits of ``seq``'s admission."""
        self.prefix_cache_stats.record(seq.num_tokens, seq.num_cached_tokens, preempted=seq.num_preemptions > 0)

    def _check_holder(self, seq: Sequence) -> None:
        """Refuse a sequence that does not hold blocks of this manager right now."""
        self._check_block_size(seq)
        if not seq.block_table:
            raise ValueError(f"sequence {seq.seq_id} holds no blocks; allocate it first")
        if self._holders.get(seq.seq_id) is not seq:
            raise ValueError(f"sequence {seq.seq_id} was not allocated by this BlockManager, or was "
                             f"already released (a copy of a sequence is not the sequence)")

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
        nothing changes; -1, "does not fit", raises it too). New blocks are not registered in
        the index here: their K/V are not computed yet (see ``hash_blocks``). The request's
        prefix-cache query and hits are counted in ``prefix_cache_stats`` (also when caching is
        off, with zero hits, so that runs with and without caching compare).
        """
        self._check_block_size(seq)
        if seq.block_table or seq.seq_id in self._holders:
            raise ValueError(f"sequence {seq.seq_id} already has blocks {seq.block_table}; "
                             "deallocate it before allocating again")
        if num_cached_blocks == -1:
            raise NoFreeBlocksError(f"sequence {seq.seq_id} does not fit: it needs {seq.num_blocks} blocks "
                                    f"(fewer with cache hits), {len(self.free_block_ids)} of "
                                    f"{self.num_blocks} are free (can_allocate returned -1)")
        hit_block_ids, hashes = self._match_prefix(seq)
        if not is_int(num_cached_blocks) or not 0 <= num_cached_blocks <= len(hit_block_ids):
            raise ValueError(f"num_cached_blocks={num_cached_blocks!r} but only {len(hit_block_ids)} "
                             f"leading blocks of sequence {seq.seq_id} are in the cache")
        hit_block_ids = hit_block_ids[:num_cached_blocks]
        needed = self._num_new_blocks(seq, hit_block_ids)
        if needed > len(self.free_block_ids):
            raise NoFreeBlocksError(f"sequence {seq.seq_id} needs {needed} free blocks, "
                                    f"{_free(len(self.free_block_ids))}")
        self._holders[seq.seq_id] = seq
        # Cached blocks first: a free one is taken out of the free queue before any fresh
        # block is popped, so the same allocation can never hand it out twice.
        for block_id in hit_block_ids:
            block = self.blocks[block_id]
            if block.ref_count == 0:  # free but still cached: revive it
                self._revive_block(block)
            block.ref_count += 1
            seq.block_table.append(block_id)
        for _ in range(seq.num_blocks - num_cached_blocks):
            seq.block_table.append(self._allocate_block().block_id)
        seq.block_hashes[:] = hashes[:num_cached_blocks]
        seq.num_cached_tokens = num_cached_blocks * self.block_size
        self._record_admission(seq)

    def can_append(self, seq: Sequence) -> bool:
        """Can ``seq`` get the blocks its newest token needs? (True when it needs none.)"""
        return len(self.free_block_ids) >= self._blocks_to_append(seq)

    def _blocks_to_append(self, seq: Sequence) -> int:
        # A block is needed exactly when the newest token is the first of a new block. For a
        # table kept in sync that is (len(seq) - 1) % block_size == 0; counting the table
        # against num_blocks says the same and holds for every block_size >= 1.
        self._check_holder(seq)
        return seq.num_blocks - len(seq.block_table) + self._needs_copy_on_write(seq)

    def _needs_copy_on_write(self, seq: Sequence) -> bool:
        """Does the newest token land in a last block that other sequences share? (Only forks
        share a block that is not full: a prefix-cache hit is always a full block.)"""
        return len(seq.block_table) == seq.num_blocks and self.blocks[seq.block_table[-1]].ref_count > 1

    def may_append(self, seq: Sequence) -> list[tuple[int, int]]:
        """Give ``seq``'s newest token a place: a new block if it starts one, or -- copy-on-write
        -- a private copy of a shared last block. Returns the copies to make, ``(src, dst)``
        block ids (vLLM's ``blocks_to_copy``), for whoever owns the K/V tensors: the new block
        must receive the shared one's K/V before this step writes into it.
        """
        needed = self._blocks_to_append(seq)
        if needed > len(self.free_block_ids):
            raise NoFreeBlocksError(f"sequence {seq.seq_id} needs {needed} free block(s), "
                                    f"{_free(len(self.free_block_ids))}")
        if self._needs_copy_on_write(seq):
            shared = self.blocks[seq.block_table[-1]]
            copy = self._allocate_block()
            shared.ref_count -= 1           # still >= 1: the other sharers keep it
            seq.block_table[-1] = copy.block_id
            return [(shared.block_id, copy.block_id)]
        for _ in range(needed):
            seq.block_table.append(self._allocate_block().block_id)
        return []

    # ---------------------------------------------------------------- speculative decoding (chapter 14)

    def allocate_lookahead_slots(self, seq: Sequence, num_lookahead_tokens: int) -> int:
        """Slots for up to ``num_lookahead_tokens`` draft tokens after ``seq``'s newest token
        (positions ``num_tokens .. num_tokens + n - 1``; vLLM's ``num_lookahead_tokens``).

        Call it once the newest token has its place (``may_append``). Blocks come from the free
        queue only, as many as there are: returns the slots ``seq`` has now -- all of them, or
        fewer when the pool ran short (a draft without a slot is not proposed). The new blocks
        are not registered: their K/V are drafts. ``free_lookahead_slots`` gives back those left
        empty after verification.
        """
        self._check_holder(seq)
        if not is_int(num_lookahead_tokens) or num_lookahead_tokens < 0:
            raise ValueError(f"num_lookahead_tokens must be an integer >= 0, got {num_lookahead_tokens!r}")
        if len(seq.block_table) < seq.num_blocks:
            raise ValueError(f"sequence {seq.seq_id}: its newest token has no slot yet; call may_append first")
        bs = self.block_size
        needed = -(-(seq.num_tokens + num_lookahead_tokens) // bs) - len(seq.block_table)
        needed = min(max(needed, 0), len(self.free_block_ids))
        for _ in range(needed):
            seq.block_table.append(self._allocate_block().block_id)
        return min(num_lookahead_tokens, len(seq.block_table) * bs - seq.num_tokens)

    def free_lookahead_slots(self, seq: Sequence) -> list[int]:
        """After verification, the rollback of rejected drafts: give back every block past the
        last *computed* token of ``seq`` (``num_cached_tokens``); returns their ids.

        Such a block holds no verified K/V -- only drafts that were rejected, slots no draft
        used, or the slot of the newest token, which is computed next step -- so the table is
        left exactly as a step without speculation leaves it. The blocks go back to the *head*
        of the free queue, where ``allocate_lookahead_slots`` took them from, so the queue's order
        is as before (the next step's ``may_append`` takes the first one again) -- but a cached
        prefix such a block held while free lost its index entry when it was taken, as with any
        allocation: speculation evicts from the head of the LRU. They were never registered. A
        block that keeps an accepted token stays; its rejected slots are simply overwritten by
        the next step (``num_cached_tokens`` does not count them).
        """
        self._check_holder(seq)
        keep = self._num_verified_blocks(seq)
        extra = seq.block_table[keep:]
        if not extra:
            return []
        for block_id in reversed(extra):   # the last taken goes back first: the head ends as before
            block = self.blocks[block_id]
            if block.ref_count != 1 or block.hash != -1:
                raise RuntimeError(f"lookahead block {block_id} of sequence {seq.seq_id} is shared or "
                                   f"registered (ref_count {block.ref_count}, hash {block.hash})")
            block.ref_count = 0
            self._release_to_head(block)
        del seq.block_table[keep:]
        return extra

    def _num_verified_blocks(self, seq: Sequence) -> int:
        """The blocks the rollback keeps: those holding positions ``0 .. num_cached_tokens - 1``."""
        return -(-seq.num_cached_tokens // self.block_size)

    def _release_to_head(self, block: Block) -> None:
        self.used_block_ids.remove(block.block_id)
        self.free_block_ids.appendleft(block.block_id)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Let ``child`` share every block of ``parent`` -- the partly filled last one too.

        ``child`` is a fresh copy of ``parent`` (``Sequence.fork``): same tokens, no blocks. Each
        block's ref count rises by one; no block is copied now. A copy is made only when one
        of the sharers writes into a shared block that is not full (``may_append``).
        """
        self._check_holder(parent)
        self._check_block_size(child)
        if child.block_table or child.seq_id in self._holders:
            raise ValueError(f"sequence {child.seq_id} already has blocks; a fork target must have none")
        if child.token_ids != parent.token_ids or child.num_cached_tokens != parent.num_cached_tokens:
            raise ValueError(f"sequence {child.seq_id} is not a copy of sequence {parent.seq_id} "
                             "(tokens or cached tokens differ); make it with parent.fork(index)")
        self._holders[child.seq_id] = child
        for block_id in parent.block_table:
            block = self.blocks[block_id]
            block.ref_count += 1
        child.block_table[:] = parent.block_table
        child.block_hashes[:] = parent.block_hashes

    def deallocate(self, seq: Sequence) -> None:
        """Release ``seq``'s blocks, last block first.

        Reversed order puts the sequence's tail blocks into the free queue first and its
        prefix blocks last, so the prefix -- the part most likely shared by the next
        request -- is the last to be overwritten: the free queue acts as an LRU.
        """
        self._check_holder(seq)
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self._deallocate_block(block)
        del self._holders[seq.seq_id]
        seq.block_table.clear()
        seq.block_hashes.clear()
        seq.num_cached_tokens = 0

    def hash_blocks(self, seq: Sequence, num_computed_tokens: int | None = None) -> None:
        """Register the blocks of ``seq`` that became full and computed since the last call.

        Called after each step, once ``seq.num_cached_tokens`` counts the tokens whose K/V
        that step wrote. Registering at allocation instead would let another sequence "hit"
        a block whose K/V do not exist yet. Incremental: a call that was missed is made up by
        the next one.

        ``num_computed_tokens`` (default ``seq.num_cached_tokens``): a scheduler that offers
        same-step prefix hits (chapter 09) passes the tokens computed once the step it is
        scheduling has run. That is safe because in one forward pass every layer stores the
        step's K/V before it attends: a later sequence of the same batch may read a block that
        an earlier one fills in that pass.
        """
        if not self.enable_prefix_caching:
            return
        self._check_holder(seq)
        name = "num_computed_tokens" if num_computed_tokens is not None else "seq.num_cached_tokens"
        if num_computed_tokens is None:
            num_computed_tokens = seq.num_cached_tokens
        if not is_int(num_computed_tokens) or not 0 <= num_computed_tokens <= seq.num_tokens:
            raise ValueError(f"{name}={num_computed_tokens!r}: sequence {seq.seq_id} has "
                             f"{seq.num_tokens} tokens, so between 0 and {seq.num_tokens} can be computed")
        num_full = min(num_computed_tokens // self.block_size, len(seq.block_table))
        h = seq.block_hashes[-1] if seq.block_hashes else self.salt_hash(seq.cache_salt)
        for i in range(len(seq.block_hashes), num_full):
            token_ids = seq.block(i)
            salt = seq.cache_salt if i == 0 else None   # a first block carries its salt
            h = self.compute_hash(token_ids, h)
            block = self.blocks[seq.block_table[i]]
            if block.hash == h:   # shared with a fork that registered it already
                seq.block_hashes.append(h)
                continue
            parent_prefix_id = self.blocks[seq.block_table[i - 1]].prefix_id if i else -1
            block.update(h, token_ids, self._prefix_id_for(h, parent_prefix_id, token_ids, salt), parent_prefix_id, salt)
            self.hash_to_block_id[h] = block.block_id
            seq.block_hashes.append(h)

    # ---------------------------------------------------------------- swapping (chapter 09)

    def computed_blocks(self, seq: Sequence) -> list[int]:
        """The blocks of ``seq`` that hold computed K/V, in logical order: what a swap copies."""
        return seq.block_table[:-(-seq.num_cached_tokens // self.block_size)]

    def can_swap_in(self, seq: Sequence, num_computed_tokens: int = 0) -> bool:
        """Are there free blocks for every token of a swapped-out ``seq``? (``num_computed_tokens``,
        the tokens its CPU copy holds, matters only to a hybrid model's manager, chapter 16.)"""
        self._check_block_size(seq)
        return seq.num_blocks <= len(self.free_block_ids)

    def allocate_for_swap_in(self, seq: Sequence, num_computed_tokens: int = 0) -> None:
        """Give a swapped-out ``seq`` a fresh block for every token; no prefix-cache lookup.

        Its K/V come back from the CPU pool, copied into these blocks before the step runs, so
        this is not an admission: no prefix-cache query is counted. The blocks are registered
        by ``hash_blocks`` after the step, as for any computed tokens.
        """
        self._check_block_size(seq)
        if seq.block_table or seq.seq_id in self._holders:
            raise ValueError(f"sequence {seq.seq_id} already has blocks {seq.block_table}")
        if seq.num_blocks > len(self.free_block_ids):
            raise NoFreeBlocksError(f"sequence {seq.seq_id} needs {seq.num_blocks} free blocks to swap in, "
                                    f"{len(self.free_block_ids)} are free")
        self._holders[seq.seq_id] = seq
        for _ in range(seq.num_blocks):
            seq.block_table.append(self._allocate_block().block_id)
        seq.block_hashes.clear()
