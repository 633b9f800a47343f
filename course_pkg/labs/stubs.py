"""The starting points of the labs: the package's classes with the taught bodies left out.

Copy a stub into a notebook cell (or a file), replace each ``...`` with code, and grade it:
``LABS["append"].grade(StudentAppendBlockManager)`` or, from a shell,
``python -m course_pkg.labs append my_file.py``. Everything not shown here is inherited from
the package, so a stub exercises exactly the method bodies its chapter teaches.

The prefix-caching stubs override two private steps of ``BlockManager`` (``_match_prefix`` and
``_maybe_evict_cached_block``) and point to two more (``_confirms_hit``, ``_prefix_id_for``): they
are the seams the package itself is built around; see ``course_pkg.labs.hooks``.
"""
from __future__ import annotations

from course_pkg.block import Block
from course_pkg.block_manager import BlockManager
from course_pkg.hybrid_block_manager import SlidingWindowManager
from course_pkg.offload.manager import ARCOffloadingManager
from course_pkg.radix_tree import RadixCache, RadixNode
from course_pkg.scheduler import Scheduler, StepPlan
from course_pkg.sequence import Sequence
from course_pkg.swap import CpuBlockPool


# ---------------------------------------------------------------- chapter 01

class StudentBlock(Block):
    """Lab ``block_reset``: prepare a block for new content."""

    def reset(self) -> None:
        """Called when the BlockManager hands this block to a sequence for new content.

        Set ``ref_count``, ``hash``, ``token_ids`` -- and every other field of the block's
        content (see ``Block.__init__``) -- to what a block that one sequence now holds, with
        no registered content, must have.
        """
        ...


class StudentSequence(Sequence):
    """Lab ``logical_blocks``: split a sequence's tokens into logical blocks of ``block_size``."""

    @property
    def num_blocks(self) -> int:
        """Logical blocks needed for all ``self.num_tokens`` tokens."""
        ...

    @property
    def last_block_num_tokens(self) -> int:
        """Tokens in the last logical block (1 .. block_size)."""
        ...

    def block(self, i: int) -> list[int]:
        """Token ids of logical block ``i``; IndexError if there is no such block."""
        ...


# ---------------------------------------------------------------- chapter 02

class StudentAppendBlockManager(BlockManager):
    """Lab ``append``: give a decoding sequence a new block exactly when it needs one."""

    def can_append(self, seq: Sequence) -> bool:
        """Can ``seq`` get the block its newest token needs? True when it needs none.

        ``seq`` already holds ``seq.block_table``; its newest token is ``seq[-1]``.
        """
        ...

    def may_append(self, seq: Sequence) -> list[tuple[int, int]]:
        """Append a fresh block (``self._allocate_block()``) to ``seq.block_table`` if the newest
        token starts a new block; raise (changing nothing) if none is free. Every block size >= 1.
        Return ``[]``: the block copies copy-on-write asks for (chapter 08) -- none here."""
        ...


class StudentAllocateBlockManager(BlockManager):
    """Lab ``allocate``: admit a sequence, and release it."""

    def allocate(self, seq: Sequence, num_cached_blocks: int = 0) -> None:
        """Give ``seq`` one block per logical block.

        The first ``num_cached_blocks`` come from the cache (``self._match_prefix(seq)`` returns
        their ids and hashes; a free one is revived: taken out of the free queue), the rest are
        fresh (``self._allocate_block()``). Set ``seq.block_hashes`` to the reused blocks'
        hashes and ``seq.num_cached_tokens``; record the query in ``self.prefix_cache_stats``
        (``record(tokens queried, tokens hit, preempted=...)``: a readmission after preemption,
        ``seq.num_preemptions > 0``, is counted apart). Raise, changing nothing, on misuse (the
        sequence already has blocks, too few free blocks -- a revived block takes a free one too).
        """
        ...

    def deallocate(self, seq: Sequence) -> None:
        """Release ``seq``'s blocks (ref counts; a block that reaches 0 goes to the free queue's
        tail, keeping its hash), clear its table; raise, changing nothing, if it holds none."""
        ...


# ---------------------------------------------------------------- chapter 03

class StudentReleaseBlockManager(BlockManager):
    """Lab ``release_order``: release a sequence's blocks in the order that makes the free queue an LRU."""

    def deallocate(self, seq: Sequence) -> None:
        """Release ``seq``'s blocks so that its prefix blocks are overwritten last."""
        ...


class StudentFreeBlockQueue:
    """Lab ``free_queue``: the free block ids in FIFO order, with O(1) ``remove``.

    Ids are ``0 .. num_blocks - 1``; at the start every id is in the queue, ascending.
    ``popleft``, ``append`` and ``remove`` must all take constant time, however long the queue.
    """

    def __init__(self, num_blocks: int):
        ...

    def __len__(self) -> int:
        ...

    def __iter__(self):
        """Block ids from the head (allocated next) to the tail (freed most recently)."""
        ...

    def popleft(self) -> int:
        """Remove and return the head; IndexError when empty."""
        ...

    def append(self, block_id: int) -> None:
        """Put ``block_id`` at the tail; ValueError if it is already queued or not a block id."""
        ...

    def remove(self, block_id: int) -> None:
        """Take ``block_id`` out wherever it is; ValueError if it is not in the queue."""
        ...


# ---------------------------------------------------------------- chapter 04

class StudentPrefixBlockManager(BlockManager):
    """Lab ``prefix_caching``: find a sequence's cached prefix, and register computed blocks."""

    def _match_prefix(self, seq: Sequence) -> tuple[list[int], list[int]]:
        """The leading blocks of ``seq`` found in the cache: ``(block ids, their chained hashes)``.

        Walk the full blocks with ``self.compute_hash(token_ids, parent_hash)`` and
        ``self.hash_to_block_id``; a hit counts only if it can be trusted: the hash only finds
        a candidate, ``self._confirms_hit(block, token_ids, parent_prefix_id)`` decides (the
        parent's exact prefix id is the previous hit block's ``prefix_id``, -1 at the start).
        """
        ...

    def hash_blocks(self, seq: Sequence) -> None:
        """Register the blocks of ``seq`` that became full and computed since the last call
        (``seq.num_cached_tokens`` counts the computed tokens; ``seq.block_hashes`` the
        blocks registered so far): ``block.update(hash, token_ids, prefix_id, parent_prefix_id)``
        with ``prefix_id = self._prefix_id_for(hash, parent_prefix_id, token_ids)``, and the index."""
        ...


class StudentGuardBlockManager(BlockManager):
    """Lab ``stale_entry_guard``: keep the index honest when a cached block gets new content."""

    def _maybe_evict_cached_block(self, block: Block) -> None:
        """``block`` is free and about to be reset for new content: fix the index."""
        ...


# ---------------------------------------------------------------- chapter 08

class StudentForkBlockManager(BlockManager):
    """Lab ``fork_cow``: share a sequence's blocks with a fork, copy a shared block on write."""

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Let ``child`` (a fresh copy made by ``parent.fork(index)``) share every block of
        ``parent``, the partly filled last one too; raise, changing nothing, if ``parent`` holds
        no blocks or ``child`` is not a blockless copy of it (same tokens, same
        ``num_cached_tokens``, no blocks)."""
        ...

    def may_append(self, seq: Sequence) -> list[tuple[int, int]]:
        """Give ``seq``'s newest token a place: a fresh block (``self._allocate_block()``) if it
        starts one, or -- copy-on-write -- a private copy of a last block other sequences share.
        Return the copies to make, ``[(src, dst)]`` block ids, for whoever owns the K/V; raise,
        changing nothing, if no block is free. (``can_append`` counts the copy too.)"""
        ...


# ---------------------------------------------------------------- chapter 06

class StudentScheduler(Scheduler):
    """Lab ``scheduler``: the decode half of each step -- continuous batching and preemption.

    The package's ``_schedule_prompts`` and ``PrefillFirst`` policy call these; the grader runs
    your scheduler in lockstep with the package's.
    """

    def _schedule_decodes(self, plan: StepPlan) -> int:
        """One token for each running sequence, oldest first (at most ``max_num_batched_tokens``
        of them); return how many were scheduled. A sequence that cannot get the block its new
        token needs (``block_manager.can_append``) preempts ``self._choose_victim(seq)`` until it
        can, or preempts itself when it is the victim. Give each scheduled one its place with
        ``block_manager.may_append`` (add the copies it returns to ``plan.blocks_to_copy``) and
        schedule it with ``self._schedule_tokens(plan, seq, 1, decode=True)``."""
        ...

    def preempt(self, seq: Sequence, plan: StepPlan) -> None:
        """Free running ``seq``'s blocks (``self._release_victim(seq, plan)`` asks the preemption
        policy and returns its new status), take it out of ``running`` and put it first in ``waiting``; count it in
        ``seq.num_preemptions`` and ``self.stats.num_preemptions``; list it in ``plan.preempted``.
        (Plain changes are enough: the step's journal records them by itself, chapter 06.)"""
        ...


class StudentMixedScheduler(Scheduler):
    """Lab ``mixed``: the prompt half of each step, as the mixed policy uses it -- every running
    sequence has decoded already, prompt chunks fill what is left of the token budget (the
    grader builds it with ``scheduling="mixed"``)."""

    def _schedule_prompts(self, plan: StepPlan, budget: int) -> int:
        """Prompt tokens of waiting sequences, up to ``budget`` in all, first come first served,
        a partly prefilled prompt (status RUNNING, still in ``waiting``) first; return the tokens
        scheduled. Admit a new one with ``self._admit(seq, plan)`` (it needs a seat:
        ``len(self.running) + seq.num_samples <= max_num_seqs``), schedule it with
        ``self._schedule_tokens(plan, seq, n, decode=False)``, chunk what does not fit, move a
        prompt that completes from ``waiting`` to ``running``, and add the tokens to
        ``self.stats.prefill_kv_computed_tokens``."""
        ...


# ---------------------------------------------------------------- chapter 07

def student_kv_block_bytes(block_size: int, num_layers: int, num_kv_heads: int, head_dim: int,
                           dtype_bytes: int) -> int:
    """Lab ``kv_block_bytes``: bytes of KV cache one block takes, over all layers."""
    ...


def student_internal_fragmentation(num_tokens: list[int], block_size: int) -> int:
    """Lab ``fragmentation``: token slots allocated but empty when each sequence holds
    ``num_tokens[i]`` tokens in blocks of ``block_size``."""
    ...


# ---------------------------------------------------------------- chapter 09

class StudentCpuBlockPool(CpuBlockPool):
    """Lab ``cpu_pool``: the second allocator that preemption by swapping needs."""

    def can_swap_out(self, num_blocks: int) -> bool:
        """Are ``num_blocks`` CPU blocks free?"""
        ...

    def swap_out(self, seq_id: int, num_blocks: int, num_computed_tokens: int) -> list[int]:
        """Take ``num_blocks`` blocks from the head of ``self.free_block_ids`` for ``seq_id`` and
        record them, with ``num_computed_tokens``, in ``self.swapped[seq_id]`` (a tuple: block
        ids in logical order, tokens). Return the block ids. Raise ``ValueError`` -- and change
        nothing -- if ``seq_id`` is swapped out already or too few blocks are free."""
        ...

    def release(self, seq_id: int) -> None:
        """Forget ``seq_id`` and return its blocks to the free queue (any order will do: CPU
        blocks hold no cache, so which free block the next swap-out gets does not matter)."""
        ...


# ---------------------------------------------------------------- chapter 11

class StudentRadixCache(RadixCache):
    """Lab ``radix_cache``: SGLang's cache of prefixes as a tree, evicting LRU leaves.

    Kept from the package: ``root`` (a ``RadixNode`` with no key), ``clock`` and ``tick()``,
    ``lock`` / ``unlock`` (a holder's ``ref_count`` on each node of its path; they keep
    ``evictable`` right), ``nodes()`` and ``eviction_key(node)`` (smallest first:
    ``node.last_access``). A node has ``key``, ``parent``, ``children`` (key -> node),
    ``ref_count``, ``last_access`` and ``depth``. Keep ``num_cached`` (nodes in the tree) and
    ``evictable`` (nodes with ``ref_count == 0``) right in what you write.
    """

    def match_prefix(self, keys, *, touch: bool = True) -> list[RadixNode]:
        """The nodes of the longest cached prefix of ``keys``, root's child first. With ``touch``,
        set each one's ``last_access`` to ``self.clock``."""
        ...

    def insert(self, keys) -> list[RadixNode]:
        """Cache the whole path ``keys`` and return its nodes (new ones get ``last_access =
        self.clock``). If the pool (``num_blocks``) is too full, evict first -- never a node of
        this path; raise ``MemoryError`` and change nothing if eviction cannot make room."""
        ...

    def evict(self, num: int) -> int:
        """Remove up to ``num`` nodes, one at a time: each time the unheld *leaf* (no children,
        ``ref_count == 0``) with the smallest ``eviction_key``. Return how many were removed."""
        ...


# ---------------------------------------------------------------- chapter 12

class StudentSaltBlockManager(BlockManager):
    """Lab ``cache_salt``: a request's salt starts its hash chain, and every hit checks it.

    Kept from the package: ``_match_prefix`` and ``hash_blocks``, which start a request's chain
    at ``self.salt_hash(seq.cache_salt)`` and chain each block on the one before (chapter 04);
    a registered first block keeps its request's salt in ``block.cache_salt`` (later blocks keep
    ``None``: they inherit the salt through the chain).
    """

    @staticmethod
    def salt_hash(cache_salt: str | None) -> int:
        """Where the hash chain of a request with ``cache_salt`` starts. ``-1`` (no parent) without
        a salt, so that unsalted hashes stay chapter 04's. For a salt: a hash of it, an int in
        ``[0, 2**64)`` (it is packed as 8 unsigned bytes, like a parent's hash), different for
        different salts and the same in every process -- use ``xxhash`` or ``hashlib``, not
        Python's ``hash``, which is randomised per process."""
        ...

    def _confirms_hit(self, block: Block, token_ids: list[int], parent_prefix_id: int,
                      cache_salt: str | None = None) -> bool:
        """The exact check behind a hash hit: does ``block`` hold ``token_ids`` right after the prefix
        whose id is ``parent_prefix_id``, for a request with salt ``cache_salt``? (``_match_prefix``
        passes the request's salt for its first block, ``None`` for later ones; a block has
        ``token_ids``, ``parent_prefix_id`` and ``cache_salt``.) A hash only finds a candidate."""
        ...


# ---------------------------------------------------------------- chapter 14

class StudentRollbackBlockManager(BlockManager):
    """Lab ``rollback``: after a speculative step's verification, give back what holds no verified token."""

    def free_lookahead_slots(self, seq: Sequence) -> list[int]:
        """Give back every block of ``seq.block_table`` past those that hold a verified token;
        return their ids in table order.

        When this is called, verification is done: ``seq``'s accepted tokens are appended and
        ``seq.num_cached_tokens`` counts the tokens whose K/V are verified (the rejected drafts'
        slots are not counted). Keep exactly the blocks that hold positions ``0 ..
        num_cached_tokens - 1``. The blocks past them were taken for lookahead from the head of
        the free queue; put each back at the head so that the queue ends as it was before they
        were taken (use ``self._release_to_head(block)`` after setting its ``ref_count`` to 0).
        Register nothing. (Plain changes are enough: the step's journal records them by
        itself, chapter 06.)
        """
        ...


# ---------------------------------------------------------------- chapter 15

class StudentARCOffloadingManager(ARCOffloadingManager):
    """Lab ``arc_tier``: the tier's lookup and ARC's two decisions -- what a use teaches it, what
    it gives up.

    Kept from the package: the four lists ``t1``, ``t2`` (hash -> ``TierBlock``, least recently
    used first) and the ghosts ``b1``, ``b2`` (hash -> None), the target size ``p`` of ``t1``,
    ``num_blocks`` (ARC's ``c``), ``_find(h)`` (the ``TierBlock`` of a hash in ``t1`` or ``t2``, or
    None), ``_add`` / ``_drop`` (a block stored enters ``t1`` -- or ``t2`` if its ghost was
    touched -- and an evicted one leaves its hash in ``b1`` or ``b2``; the ghosts are trimmed to
    ARC's bounds there), ``prepare_store`` (which calls your ``_eviction_order``) and the other
    calls. A ``TierBlock`` has ``block_id`` (its slot), ``ref_cnt`` (loads in flight; -1 while
    being stored) and ``is_ready`` (``ref_cnt >= 0``). The lists are ``LinkedDict``s:
    ``OrderedDict``'s calls (``move_to_end``, ``pop``, ``d[h] = v`` adds at the end, iteration
    oldest first).
    """

    def lookup(self, block_hashes) -> int:
        """How many *leading* blocks of ``block_hashes`` the tier holds ready to load (stop at the
        first that is missing or still being stored). Count every hash asked about in
        ``self.stats.queried`` and the leading run in ``self.stats.hits``."""
        ...

    def touch(self, block_hashes) -> None:
        """A request used these blocks; visit them last to first (so the first ends most recent).
        A ready block in ``t1`` was asked for again: it moves to the end of ``t2`` (one still being
        stored only moves to the end of ``t1``); one in ``t2`` moves to its end. A hash in ``b1``
        (a block evicted from ``t1`` too soon) raises ``p`` by ``max(1, len(b2) // len(b1))``, at
        most to ``num_blocks``; one in ``b2`` lowers it by ``max(1, len(b1) // len(b2))``, at least to
        0; either ghost moves to the end of its list."""
        ...

    def _eviction_order(self, n: int, incoming) -> list[int] | None:
        """The ``n`` hashes to evict (``[]`` if ``n <= 0``), changing nothing; None if fewer than
        ``n`` may go. Only a ready block that no load holds (``ref_cnt == 0``) may go, least
        recently used first within each list; take from ``t1`` while the ``t1`` that is left is
        larger than ``p`` (or when ``t2`` has no block left that may go), else from ``t2``."""
        ...


# ---------------------------------------------------------------- chapter 16

class StudentSlidingWindowManager(SlidingWindowManager):
    """Lab ``sliding_window``: a sliding-window group's blocks -- give back what left the window,
    hit on what the window reads.

    A query at position ``p`` of a group of window ``w`` (``self.sliding_window``; None for a
    full-attention group other than the first) reads positions ``p - w + 1 .. p`` only.

    Kept from the package: ``self.pool`` (the ``HybridBlockManager`` whose ``blocks``, free queue
    and ``used_block_ids`` every group draws on), ``self.block_size``, ``self.table(seq)`` (this
    group's block table of ``seq``, a list in ``seq.group_block_tables``; an entry is a block id,
    or ``NULL_BLOCK`` -- from ``course_pkg.hybrid_block_manager``, -1 -- where a block was given
    back), ``self._release(block_id)`` (drops one reference to a block; at 0 the block goes to the
    tail of the free queue, keeping its hash: still a cache entry), ``cached_blocks`` (the lookup
    that computes the ``cached`` and ``ids`` lists ``longest_hit`` is given) and every other call;
    ``HybridBlockManager`` calls yours in ``can_allocate``, ``allocate``, ``hash_blocks`` and ``fork``.
    """

    def first_needed_block(self, num_computed_tokens: int) -> int:
        """The index of the first block that a query at position ``num_computed_tokens``, or at
        any later position, still reads: the block holding position ``num_computed_tokens - w + 1``
        (block 0 while that is below 0). 0 for a full-attention group (``sliding_window`` None)."""
        ...

    def remove_skipped_blocks(self, seq: Sequence) -> list[int]:
        """Give back every block of this group's table of ``seq`` that no future query reads:
        the entries before ``first_needed_block(seq.num_cached_tokens)`` (within the table) that
        still hold a block. Release each with ``self._release(block_id)`` -- a block a fork
        shares only loses this reference -- newest (highest index) first, so that the older
        block reaches the free queue's tail last, and set its entry to ``NULL_BLOCK``. Return
        their ids in that order (newest first); ``[]`` when there is nothing to give back.
        (Entries before an entry that is ``NULL_BLOCK`` are ``NULL_BLOCK`` already.)"""
        ...

    def longest_hit(self, seq: Sequence, num_blocks: int, cached: list[int], ids: list) -> int:
        """How many leading blocks of ``seq``, at most ``num_blocks``, this group can count as
        computed. ``cached[i]`` is the cached block holding this group's block ``i`` of ``seq``
        (``NULL_BLOCK``: none), ``ids[i]`` the exact id of the prefix ending at block ``i`` (None:
        never computed). A hit of ``L`` blocks means computing resumes at position
        ``L * block_size``; it needs ``ids[L - 1]`` known and the blocks that query reads --
        ``cached[first_needed_block(L * block_size):L]`` -- all cached (not the ones before).
        Return the largest such ``L``, or 0: search from the right, since blocks before the window
        may be missing while the window is cached. Change neither list."""
        ...
