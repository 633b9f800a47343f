"""One pool, a manager per KV cache group: the blocks of a hybrid model (chapter 16).

A model that mixes full-attention and sliding-window layers (Gemma 2/3, gpt-oss, Ministral; a
Qwen3 with ``layer_types``) keeps its cache in *groups* (``kv_cache_spec.get_kv_cache_config``):
the layers of one group share a block table, and a block id belongs to one group at a time. All
groups draw on **one** pool -- one free queue, one LRU order, one prefix-cache index -- as vLLM's
hybrid KV cache manager does with its ``BlockPool`` and one ``SingleTypeKVCacheManager`` per
group. The course splits the work so that nothing of chapters 02-04 changes:

* ``HybridBlockManager`` *is* the BlockManager of chapters 02-04: the pool, and the manager of
  group 0 (full attention, the table in ``seq.block_table``). It adds one
  ``SlidingWindowManager`` per further group and asks all of them in each decision, so a
  request fits only when every group has room.
* ``SlidingWindowManager`` keeps its group's table in ``seq.group_block_tables[g - 1]``, taking
  and giving blocks through the pool's own calls (``_allocate_block``, ``_deallocate_block``,
  ``_revive_block``). Two things differ from full attention:

  - **blocks leave the window.** A query at position ``p`` reads positions ``p - w + 1 .. p``
    only, so once ``c`` tokens are computed no future query reads a block wholly before
    position ``c - w + 1``: ``remove_skipped_blocks`` gives such blocks back (to the free
    queue's tail, still cached) and marks their entries ``NULL_BLOCK``. A sequence decoding
    then holds at most ``cdiv(w - 1, block_size) + 1`` blocks of the group, whatever its length.
  - **a prefix hit needs only the window.** Computing from position ``L`` needs the K/V of
    positions ``L - w + 1 .. L - 1``: a hit of ``L`` tokens needs the blocks covering those,
    not the ones before. ``longest_hit`` searches from the right: the largest ``L`` (up to what
    the other groups found) whose window blocks are all cached.

A group's blocks are registered under a hash chain of their own (the group id enters the chain
like one more parent, and the first block's name carries it), so a block of one group never
answers another group's lookup: its K/V are other layers'.

With ``sliding_window=None`` a ``SlidingWindowManager`` keeps a full-attention group other than
the first (vLLM's grouping can split the full layers into several groups): its window is the
whole sequence, so nothing leaves it and a hit needs every block.
"""
from __future__ import annotations

from course_pkg.block_manager import BlockManager, NoFreeBlocksError, _free
from course_pkg.kv_cache_spec import cdiv
from course_pkg.sequence import Sequence
from course_pkg.validation import check_positive_int, is_int

NULL_BLOCK = -1   # a table entry whose block left the window (vLLM's null block)


class SlidingWindowManager:
    """The blocks of one KV cache group of ``sliding_window`` (or full, with None) on ``pool``."""

    def __init__(self, pool: BlockManager, group_id: int, sliding_window: int | None):
        if sliding_window is not None:
            check_positive_int("sliding_window", sliding_window)
        self.pool = pool
        self.group_id = group_id
        self.sliding_window = sliding_window
        self.block_size = pool.block_size
        # seq_id -> (blocks registered, the last one's chained hash, its prefix id): where the
        # group's hash chain stands, since blocks that left the window are no longer in the table.
        self.chains: dict[int, tuple[int, int, int]] = {}

    def table(self, seq: Sequence) -> list[int]:
        return seq.group_block_tables[self.group_id - 1]

    def first_needed_block(self, num_computed_tokens: int) -> int:
        """The first block a query at position ``num_computed_tokens`` or later still reads."""
        if self.sliding_window is None:
            return 0
        return max(0, num_computed_tokens - self.sliding_window + 1) // self.block_size

    # ------------------------------------------------------------ the prefix cache

    def _chain_start(self, seq: Sequence) -> int:
        """Where the group's hash chain starts: the request's salt, then the group id."""
        return self.pool.compute_hash([self.group_id], self.pool.salt_hash(seq.cache_salt))

    def _first_block_salt(self, seq: Sequence) -> tuple:
        """What a first block's exact name carries here: the salt and the group."""
        return (seq.cache_salt, self.group_id)

    def cached_blocks(self, seq: Sequence, num_blocks: int) -> tuple[list[int], list[int], list[int]]:
        """For the first ``num_blocks`` blocks of ``seq``: their chained hashes, their exact prefix
        ids (None once no name is known) and the cached block holding each (NULL_BLOCK: none).

        The ids are read off the pool's names (``_prefix_ids``), which outlive the blocks: a hit
        at block ``i`` is confirmed exactly -- the block carries the id of this very prefix --
        even when the blocks before it were evicted long ago.
        """
        pool = self.pool
        hashes, ids, cached = [], [], []
        h, parent_id = self._chain_start(seq), -1
        for i in range(num_blocks):
            token_ids = seq.block(i)
            h = pool.compute_hash(token_ids, h)
            prefix_id = None
            if parent_id is not None:
                entry = pool._prefix_ids.get(h)
                name = (parent_id, token_ids, self._first_block_salt(seq) if i == 0 else None)
                if entry is not None and entry[1] == name:
                    prefix_id = entry[0]
            block_id = pool.hash_to_block_id.get(h, NULL_BLOCK)
            if prefix_id is None or block_id == NULL_BLOCK or pool.blocks[block_id].prefix_id != prefix_id:
                block_id = NULL_BLOCK
            hashes.append(h)
            ids.append(prefix_id)
            cached.append(block_id)
            parent_id = prefix_id
        return hashes, ids, cached

    def longest_hit(self, seq: Sequence, num_blocks: int, cached: list[int], ids: list) -> int:
        """The most leading blocks, at most ``num_blocks``, this group can count as computed:
        the largest ``L`` whose window blocks (those before block ``L`` that a query at position
        ``L * block_size`` reads) are all cached -- searched from the right."""
        for hit in range(num_blocks, 0, -1):
            first = self.first_needed_block(hit * self.block_size)
            if ids[hit - 1] is not None and all(b != NULL_BLOCK for b in cached[first:hit]):
                return hit
        return 0

    def num_new_blocks(self, seq: Sequence, hit: int, cached: list[int]) -> int:
        """Free blocks ``allocate`` takes: fresh blocks after the hit, plus hits revived."""
        first = self.first_needed_block(hit * self.block_size)
        revived = sum(1 for b in cached[first:hit] if self.pool.blocks[b].ref_count == 0)
        return seq.num_blocks - hit + revived

    def take_hits(self, seq: Sequence, hit: int, hashes: list[int], ids: list, cached: list[int]) -> None:
        """Start ``seq``'s table with its ``hit`` cached blocks: NULL_BLOCK before the window."""
        table = self.table(seq)
        first = self.first_needed_block(hit * self.block_size)
        table.extend([NULL_BLOCK] * first)
        for block_id in cached[first:hit]:
            block = self.pool.blocks[block_id]
            if block.ref_count == 0:   # free but still cached: revive it
                self.pool._revive_block(block)
            block.ref_count += 1
            table.append(block_id)
        self.chains[seq.seq_id] = (hit, hashes[hit - 1], ids[hit - 1]) if hit else (0, self._chain_start(seq), -1)

    def computed_blocks(self, seq: Sequence) -> list[int]:
        """This group's blocks of ``seq`` holding computed K/V that a query still reads: what a
        swap copies (the blocks before them have left the window)."""
        num_computed = seq.num_cached_tokens
        return self.table(seq)[self.first_needed_block(num_computed):cdiv(num_computed, self.block_size)]

    def allocate_for_swap_in(self, seq: Sequence, num_computed_tokens: int) -> None:
        """A swapped-out ``seq`` comes back with ``num_computed_tokens`` computed: NULL_BLOCK
        before its window, fresh blocks from there on; its place in the hash chain is found again
        from the pool's exact names (none found: this group registers no more of its blocks)."""
        first = self.first_needed_block(num_computed_tokens)
        table = self.table(seq)
        table.extend([NULL_BLOCK] * first)
        for _ in range(seq.num_blocks - first):
            table.append(self.pool._allocate_block().block_id)
        if first == 0:
            self.chains[seq.seq_id] = (0, self._chain_start(seq), -1)
        else:
            hashes, ids, _ = self.cached_blocks(seq, first)
            self.chains[seq.seq_id] = (first, hashes[-1], ids[-1])

    def allocate_new(self, seq: Sequence) -> None:
        """Fresh blocks for the rest of ``seq``'s tokens."""
        table = self.table(seq)
        for _ in range(seq.num_blocks - len(table)):
            table.append(self.pool._allocate_block().block_id)

    # ------------------------------------------------------------ decoding

    def blocks_to_append(self, seq: Sequence) -> int:
        table = self.table(seq)
        return seq.num_blocks - len(table) + self._needs_copy_on_write(seq)

    def _needs_copy_on_write(self, seq: Sequence) -> bool:
        table = self.table(seq)
        return len(table) == seq.num_blocks and self.pool.blocks[table[-1]].ref_count > 1

    def may_append(self, seq: Sequence) -> list[tuple[int, int]]:
        """The newest token's place in this group: a new block, or a private copy of a shared one."""
        table = self.table(seq)
        if self._needs_copy_on_write(seq):
            shared = self.pool.blocks[table[-1]]
            copy = self.pool._allocate_block()
            shared.ref_count -= 1
            table[-1] = copy.block_id
            return [(shared.block_id, copy.block_id)]
        for _ in range(seq.num_blocks - len(table)):
            table.append(self.pool._allocate_block().block_id)
        return []

    def remove_skipped_blocks(self, seq: Sequence) -> list[int]:
        """Give back every block no future query of ``seq`` reads (all its positions are before
        the window of the next token to compute); returns their ids, newest first. Each goes to
        the free queue's tail like any freed block -- still cached if it was registered."""
        table = self.table(seq)
        freed = []
        i = min(self.first_needed_block(seq.num_cached_tokens), len(table)) - 1
        while i >= 0 and table[i] != NULL_BLOCK:   # (the entries before are NULL already)
            self._release(table[i])
            freed.append(table[i])
            table[i] = NULL_BLOCK
            i -= 1
        return freed

    def _release(self, block_id: int) -> None:
        block = self.pool.blocks[block_id]
        block.ref_count -= 1
        if block.ref_count == 0:
            self.pool._deallocate_block(block)

    def hash_blocks(self, seq: Sequence, num_computed_tokens: int) -> None:
        """Register this group's blocks that became full and computed (see BlockManager.hash_blocks)."""
        pool, table = self.pool, self.table(seq)
        done, h, parent_id = self.chains[seq.seq_id]
        if parent_id is None:   # swapped in without a known name for its prefix: a hit lost, never a wrong one
            return
        num_full = min(num_computed_tokens // self.block_size, len(table))
        for i in range(done, num_full):
            token_ids = seq.block(i)
            salt = self._first_block_salt(seq) if i == 0 else None
            h = pool.compute_hash(token_ids, h)
            if table[i] == NULL_BLOCK:
                raise RuntimeError(f"sequence {seq.seq_id}: block {i} of group {self.group_id} left the window "
                                   "before it was registered")
            block = pool.blocks[table[i]]
            if block.hash != h:   # (else shared with a fork that registered it already)
                block.update(h, token_ids, pool._prefix_id_for(h, parent_id, token_ids, salt), parent_id, salt)
                pool.hash_to_block_id[h] = block.block_id
            parent_id = block.prefix_id
        if num_full > done:
            self.chains[seq.seq_id] = (num_full, h, parent_id)

    # ------------------------------------------------------------ speculative decoding

    def allocate_lookahead_slots(self, seq: Sequence, num_lookahead_tokens: int) -> None:
        table = self.table(seq)
        for _ in range(cdiv(seq.num_tokens + num_lookahead_tokens, self.block_size) - len(table)):
            table.append(self.pool._allocate_block().block_id)

    def lookahead_blocks_needed(self, seq: Sequence, num_lookahead_tokens: int) -> int:
        return max(0, cdiv(seq.num_tokens + num_lookahead_tokens, self.block_size) - len(self.table(seq)))

    def free_lookahead_slots(self, seq: Sequence) -> None:
        table = self.table(seq)
        keep = cdiv(seq.num_cached_tokens, self.block_size)
        for block_id in reversed(table[keep:]):   # back to the head, last taken first
            block = self.pool.blocks[block_id]
            block.ref_count = 0
            self.pool._release_to_head(block)
        del table[keep:]

    # ------------------------------------------------------------ forks and release

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """``child`` shares every block of ``parent`` in this group, and its place in the chain."""
        table = list(self.table(parent))
        for block_id in table:
            if block_id != NULL_BLOCK:
                self.pool.blocks[block_id].ref_count += 1
        child.group_block_tables.append(table)
        self.chains[child.seq_id] = self.chains[parent.seq_id]

    def deallocate(self, seq: Sequence) -> None:
        """Release the group's blocks of ``seq``, last block first (the LRU order of chapter 03)."""
        for block_id in reversed(self.table(seq)):
            if block_id != NULL_BLOCK:
                self._release(block_id)
        del self.chains[seq.seq_id]

    def damaged(self, seq: Sequence, written: dict[int, int]) -> bool:
        """Does ``written`` (block id -> first offset) overwrite a computed token of ``seq`` here?"""
        for i, block_id in enumerate(self.table(seq)):
            first = written.get(block_id)
            if block_id != NULL_BLOCK and first is not None and seq.num_cached_tokens > i * self.block_size + first:
                return True
        return False


class HybridBlockManager(BlockManager):
    """The BlockManager of group 0 and the pool, plus a ``SlidingWindowManager`` per other group.

    ``sliding_windows``: the window of every group after the first, in group order (None: a
    full-attention group). Each public call does what the BlockManager does for group 0 and
    the same for every other group, after checking that the pool has room for all of them --
    so a call that cannot be served raises before it changes anything.
    """

    def __init__(self, num_blocks: int, block_size: int, sliding_windows: tuple[int | None, ...],
                 enable_prefix_caching: bool = True, free_queue: str = "deque", max_recent_requests: int = 1000):
        super().__init__(num_blocks, block_size, enable_prefix_caching, free_queue, max_recent_requests)
        if not sliding_windows:
            raise ValueError("a HybridBlockManager needs at least one group after the first; "
                             "use a BlockManager for a model whose layers are all full attention")
        self.groups = [SlidingWindowManager(self, g + 1, w) for g, w in enumerate(sliding_windows)]

    def group_blocks_needed(self, full_group_blocks: int) -> int:
        """Blocks the other groups may hold at once for a request that holds ``full_group_blocks``
        in group 0 at most (see ``Scheduler.max_blocks_needed``): as many per group. A local
        group's table is the full one with blocks given back, so it never holds more -- and it
        holds as many at admission: a prompt, or a request readmitted after a preemption, is
        allocated whole in every group, and gives back what left its windows only once computed."""
        return len(self.groups) * full_group_blocks

    # ------------------------------------------------------------ admission

    def _match_all(self, seq: Sequence) -> tuple[int, list[int], list]:
        """The hit every group agrees on, in blocks, with the groups' lookups. vLLM's coordinator
        does the same: the full group's leading run bounds it; each other group may cut it back
        (its window at the end must be cached), which may cut another group's: repeat until
        no group cuts."""
        full_ids, _ = self._match_prefix(seq)
        hit = len(full_ids)
        lookups = [g.cached_blocks(seq, hit) for g in self.groups] if self.enable_prefix_caching else []
        changed = bool(lookups)
        while changed:
            changed = False
            for group, (_, ids, cached) in zip(self.groups, lookups):
                cut = group.longest_hit(seq, hit, cached, ids)
                if cut < hit:
                    hit, changed = cut, True
        return hit, full_ids, lookups

    def _num_new_blocks_all(self, seq: Sequence, hit: int, full_ids: list[int], lookups) -> int:
        needed = self._num_new_blocks(seq, full_ids[:hit])
        if lookups:
            needed += sum(g.num_new_blocks(seq, hit, cached) for g, (_, _, cached) in zip(self.groups, lookups))
        else:
            needed += len(self.groups) * seq.num_blocks
        return needed

    def can_allocate(self, seq: Sequence) -> int:
        self._check_block_size(seq)
        hit, full_ids, lookups = self._match_all(seq)
        if self._num_new_blocks_all(seq, hit, full_ids, lookups) > len(self.free_block_ids):
            return -1
        return hit

    def allocate(self, seq: Sequence, num_cached_blocks: int = 0) -> None:
        """``BlockManager.allocate`` for every group: the hits of all groups are taken first (a
        free cached block leaves the free queue before any fresh block is popped), then the
        fresh blocks. ``num_cached_blocks``: what ``can_allocate`` returned, or fewer."""
        self._check_block_size(seq)
        if seq.block_table or seq.seq_id in self._holders:
            raise ValueError(f"sequence {seq.seq_id} already has blocks {seq.block_table}; "
                             "deallocate it before allocating again")
        if num_cached_blocks == -1:
            raise NoFreeBlocksError(f"sequence {seq.seq_id} does not fit (can_allocate returned -1)")
        hit, full_ids, lookups = self._match_all(seq)
        if not is_int(num_cached_blocks) or not 0 <= num_cached_blocks <= hit:
            raise ValueError(f"num_cached_blocks={num_cached_blocks!r} but only {hit} leading blocks of "
                             f"sequence {seq.seq_id} are in the cache of every group")
        hit = num_cached_blocks
        for group, (_, ids, cached) in zip(self.groups, lookups):   # (a smaller hit may need fewer blocks)
            hit_ok = group.longest_hit(seq, hit, cached, ids)
            if hit_ok < hit:
                raise ValueError(f"num_cached_blocks={hit}: group {group.group_id} has no cached window there")
        needed = self._num_new_blocks_all(seq, hit, full_ids, lookups)
        if needed > len(self.free_block_ids):
            raise NoFreeBlocksError(f"sequence {seq.seq_id} needs {needed} free blocks over "
                                    f"{1 + len(self.groups)} KV cache groups, {_free(len(self.free_block_ids))}")
        seq.group_block_tables[:] = [[] for _ in self.groups]
        for group, lookup in zip(self.groups, lookups or [None] * len(self.groups)):
            if lookup is None:
                group.take_hits(seq, 0, [], [], [])
            else:
                group.take_hits(seq, hit, *lookup)
        super().allocate(seq, hit)
        for group in self.groups:
            group.allocate_new(seq)

    # ------------------------------------------------------------ decoding

    def _blocks_to_append_all(self, seq: Sequence) -> int:
        return self._blocks_to_append(seq) + sum(g.blocks_to_append(seq) for g in self.groups)

    def can_append(self, seq: Sequence) -> bool:
        return len(self.free_block_ids) >= self._blocks_to_append_all(seq)

    def may_append(self, seq: Sequence) -> list[tuple[int, int]]:
        needed = self._blocks_to_append_all(seq)
        if needed > len(self.free_block_ids):
            raise NoFreeBlocksError(f"sequence {seq.seq_id} needs {needed} free block(s) over "
                                    f"{1 + len(self.groups)} KV cache groups, {_free(len(self.free_block_ids))}")
        copies = super().may_append(seq)
        for group in self.groups:
            copies += group.may_append(seq)
        return copies

    def hash_blocks(self, seq: Sequence, num_computed_tokens: int | None = None) -> None:
        """Register every group's new full blocks, then give back the blocks that left a window
        (by the tokens computed *now*, ``seq.num_cached_tokens``: a step being scheduled may
        still read blocks that its own tokens will push out)."""
        super().hash_blocks(seq, num_computed_tokens)
        if self.enable_prefix_caching:
            n = seq.num_cached_tokens if num_computed_tokens is None else num_computed_tokens
            for group in self.groups:
                group.hash_blocks(seq, n)
        for group in self.groups:
            group.remove_skipped_blocks(seq)

    # ------------------------------------------------------------ speculative decoding

    def allocate_lookahead_slots(self, seq: Sequence, num_lookahead_tokens: int) -> int:
        """Slots for the drafts in every group: as many drafts as the pool has blocks for in all."""
        self._check_holder(seq)
        if not is_int(num_lookahead_tokens) or num_lookahead_tokens < 0:
            raise ValueError(f"num_lookahead_tokens must be an integer >= 0, got {num_lookahead_tokens!r}")
        n = num_lookahead_tokens
        while n > 0 and self._lookahead_needed(seq, n) > len(self.free_block_ids):
            n -= 1
        granted = super().allocate_lookahead_slots(seq, n)
        for group in self.groups:
            group.allocate_lookahead_slots(seq, granted)
        return granted

    def _lookahead_needed(self, seq: Sequence, n: int) -> int:
        full = max(0, cdiv(seq.num_tokens + n, self.block_size) - len(seq.block_table))
        return full + sum(g.lookahead_blocks_needed(seq, n) for g in self.groups)

    def free_lookahead_slots(self, seq: Sequence) -> list[int]:
        self._check_holder(seq)
        for group in reversed(self.groups):   # the last taken go back to the head first
            group.free_lookahead_slots(seq)
        return super().free_lookahead_slots(seq)

    # ------------------------------------------------------------ forks, release, faults

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Share every group's blocks, then let ``child`` give back at once what its windows no
        longer read (registering first what the parent has not registered yet: a fork is made
        while the step's results are recorded, before the parent's ``hash_blocks``)."""
        super().fork(parent, child)
        for group in self.groups:
            group.fork(parent, child)
        self.hash_blocks(child)

    def deallocate(self, seq: Sequence) -> None:
        """Release every group's blocks: the other groups' first, then group 0's -- so the
        full-attention prefix, the part a later request can hit, is the last to be evicted."""
        self._check_holder(seq)
        for group in reversed(self.groups):
            group.deallocate(seq)
        seq.group_block_tables.clear()
        super().deallocate(seq)

    def forget_overwritten(self, written: dict[int, int]) -> list[Sequence]:
        damaged = [s for s in self._holders.values() if any(g.damaged(s, written) for g in self.groups)]
        for seq in super().forget_overwritten(written):
            if seq not in damaged:
                damaged.append(seq)
        return damaged

    # ------------------------------------------------------------ swapping (chapter 09)

    def computed_blocks(self, seq: Sequence) -> list[int]:
        """Every group's blocks holding computed K/V that a query still reads, group by group."""
        return super().computed_blocks(seq) + [b for group in self.groups for b in group.computed_blocks(seq)]

    def _swap_in_blocks(self, seq: Sequence, num_computed_tokens: int) -> int:
        return seq.num_blocks + sum(seq.num_blocks - g.first_needed_block(num_computed_tokens) for g in self.groups)

    def can_swap_in(self, seq: Sequence, num_computed_tokens: int = 0) -> bool:
        self._check_block_size(seq)
        return self._swap_in_blocks(seq, num_computed_tokens) <= len(self.free_block_ids)

    def allocate_for_swap_in(self, seq: Sequence, num_computed_tokens: int = 0) -> None:
        """Every group's blocks for a swapped-out ``seq``: all of group 0's, and each local group's
        from its window on (the K/V before it were not copied out)."""
        needed = self._swap_in_blocks(seq, num_computed_tokens)
        if needed > len(self.free_block_ids):
            raise NoFreeBlocksError(f"sequence {seq.seq_id} needs {needed} free blocks over {1 + len(self.groups)} "
                                    f"KV cache groups to swap in, {_free(len(self.free_block_ids))}")
        super().allocate_for_swap_in(seq, num_computed_tokens)
        seq.group_block_tables[:] = [[] for _ in self.groups]
        for group in self.groups:
            group.allocate_for_swap_in(seq, num_computed_tokens)
