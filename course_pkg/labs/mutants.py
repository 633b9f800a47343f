"""Known-wrong implementations the labs' graders must reject (never use them).

Each mutant is one classic mistake -- the ones the course's chapters warn about and the bugs
Nano-vLLM fixed -- with everything else left as the package has it, so a grader that accepts a
mutant has a blind spot exactly there. ``tests/test_labs.py`` checks that every one is rejected.
The kernel mutants live in ``course_pkg.labs.kernel_labs`` (they need Triton), the
tensor-parallel ones in ``course_pkg.labs.parallel_labs`` (they need torch).

The mutants of ``_match_prefix``, ``_confirms_hit``, ``_maybe_evict_cached_block``,
``_schedule_decode`` and the direct uses of ``_allocate_block`` depend on private steps of the
package; they are listed in ``course_pkg.labs.hooks``.
"""
from __future__ import annotations

from collections import deque

from course_pkg.block import Block
from course_pkg.block_manager import BlockManager, NoFreeBlocksError, PrefixCacheStats
from course_pkg.free_block_queue import FreeBlockQueue
from course_pkg.hybrid_block_manager import NULL_BLOCK, SlidingWindowManager
from course_pkg.offload.manager import ARCOffloadingManager
from course_pkg.policies import AdmissionPolicy
from course_pkg.radix_tree import RadixCache, RadixNode
from course_pkg.scheduler import Scheduler
from course_pkg.sequence import Sequence, SequenceStatus
from course_pkg.swap import CpuBlockPool


# ---------------------------------------------------------------- chapter 01: Block.reset

class ResetToZeroBlock(Block):
    """``reset`` sets ref_count 0: the block looks free while a sequence holds it."""

    def reset(self) -> None:
        self.ref_count = 0
        self.hash = -1
        self.token_ids = []


class ResetKeepsHashBlock(Block):
    """``reset`` forgets the hash: new content carries the old content's fingerprint."""

    def reset(self) -> None:
        self.ref_count = 1
        self.token_ids = []


class ResetKeepsTokensBlock(Block):
    """``reset`` leaves the token ids: the block's new holder starts with the old content's tokens."""

    def reset(self) -> None:
        self.ref_count = 1
        self.hash = -1


# ---------------------------------------------------------------- chapter 01: logical blocks

class FloorPlusOneSequence(Sequence):
    """``num_blocks = n // block_size + 1``: one block too many when the last block is full."""

    @property
    def num_blocks(self) -> int:
        return self.num_tokens // self.block_size + 1


class ModuloLastBlockSequence(Sequence):
    """``last_block_num_tokens = n % block_size``: 0 instead of block_size for a full last block."""

    @property
    def last_block_num_tokens(self) -> int:
        return self.num_tokens % self.block_size


class NegativeBlockSequence(Sequence):
    """``block(i)`` checks only ``i < num_blocks``: ``block(-1)`` slices ``token_ids[-bs:0]`` and
    returns ``[]`` instead of raising."""

    def block(self, i: int) -> list[int]:
        if i >= self.num_blocks:
            raise IndexError(f"logical block {i} out of range")
        return self.token_ids[i * self.block_size:(i + 1) * self.block_size]


# ---------------------------------------------------------------- chapter 02: append

class ModuloOneBlockManager(BlockManager):
    """The seed's one-liner ``len(seq) % block_size == 1``: never true for block size 1."""

    def can_append(self, seq: Sequence) -> bool:
        return len(self.free_block_ids) >= (len(seq) % self.block_size == 1)

    def may_append(self, seq: Sequence) -> None:
        if len(seq) % self.block_size == 1:
            if not self.free_block_ids:
                raise NoFreeBlocksError("no free block")
            seq.block_table.append(self._allocate_block().block_id)


class StrictCanAppendBlockManager(BlockManager):
    """``can_append`` with ``>``: refuses when exactly as many blocks are free as needed."""

    def can_append(self, seq: Sequence) -> bool:
        needed = seq.num_blocks - len(seq.block_table)
        return len(self.free_block_ids) > needed


# ---------------------------------------------------------------- chapter 02: allocate / deallocate

class NoRoomCheckBlockManager(BlockManager):
    """``allocate`` takes fresh blocks one by one without checking room first: on a full pool
    it fails half-way and leaves the sequence holding blocks."""

    def allocate(self, seq: Sequence, num_cached_blocks: int = 0) -> None:
        if num_cached_blocks:
            return super().allocate(seq, num_cached_blocks)
        if seq.block_table:
            raise ValueError(f"sequence {seq.seq_id} already has blocks")
        for _ in range(seq.num_blocks):
            seq.block_table.append(self._allocate_block().block_id)
        seq.num_cached_tokens = 0
        self.prefix_cache_stats.record(seq.num_tokens, 0)


class UncountedAllocateBlockManager(BlockManager):
    """``allocate`` right in every block, but it never records the request in
    ``prefix_cache_stats``: the hit rate the engine reports stays 0."""

    def allocate(self, seq: Sequence, num_cached_blocks: int = 0) -> None:
        stats, self.prefix_cache_stats = self.prefix_cache_stats, PrefixCacheStats()
        try:
            super().allocate(seq, num_cached_blocks)
        finally:
            self.prefix_cache_stats = stats      # the bug: the new request is not counted


class ReadmissionCountedBlockManager(BlockManager):
    """Counts a readmission after preemption as a first admission: its re-lookup finds the
    blocks it freed a moment before, so the more the scheduler preempts, the better the cache
    looks."""

    def allocate(self, seq: Sequence, num_cached_blocks: int = 0) -> None:
        preemptions, seq.num_preemptions = seq.num_preemptions, 0     # the bug: forgets it was preempted
        try:
            super().allocate(seq, num_cached_blocks)
        finally:
            seq.num_preemptions = preemptions


class RevivalUncheckedBlockManager(BlockManager):
    """The room check counts fresh blocks only, not the cached blocks revived from the free
    queue: when those revivals use up the free blocks, the fresh ones are not there, and
    ``allocate`` fails half-way (``IndexError`` from an empty queue) with the state changed."""

    def allocate(self, seq: Sequence, num_cached_blocks: int = 0) -> None:
        # The bug, in this call only (``can_allocate`` still counts right).
        self._num_new_blocks = lambda seq, hit_block_ids: seq.num_blocks - len(hit_block_ids)
        try:
            super().allocate(seq, num_cached_blocks)
        finally:
            del self._num_new_blocks


class FreesSharedBlocksBlockManager(BlockManager):
    """``deallocate`` frees every block of the table, even one another sequence still holds."""

    def deallocate(self, seq: Sequence) -> None:
        if not seq.block_table:
            raise ValueError(f"sequence {seq.seq_id} holds no blocks")
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            if block.ref_count > 0:
                block.ref_count = 0
                self.used_block_ids.discard(block_id)
                self.free_block_ids.append(block_id)
        seq.block_table.clear()
        seq.block_hashes.clear()
        seq.num_cached_tokens = 0


class KeepsTableBlockManager(BlockManager):
    """``deallocate`` releases the blocks but leaves them in the sequence's block table."""

    def deallocate(self, seq: Sequence) -> None:
        table = list(seq.block_table)
        super().deallocate(seq)
        seq.block_table.extend(table)


# ---------------------------------------------------------------- chapter 03: release order

class ReleaseToHeadBlockManager(BlockManager):
    """Released blocks go to the *head* of the free queue: the most recently freed block is
    overwritten first (a stack), so a just-finished prefix is the first to go."""

    def deallocate(self, seq: Sequence) -> None:
        if not seq.block_table:
            raise ValueError(f"sequence {seq.seq_id} holds no blocks")
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.used_block_ids.remove(block_id)
                self.free_block_ids.appendleft(block_id)
        seq.block_table.clear()
        seq.block_hashes.clear()
        seq.num_cached_tokens = 0


# ---------------------------------------------------------------- chapter 03: the free queue

class DequeFreeBlockQueue:
    """Right answers, wrong cost: ``remove`` is ``deque.remove``, a scan from the head (O(n))."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self._queue = deque(range(num_blocks))
        self._members = set(range(num_blocks))

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self):
        return iter(self._queue)

    def popleft(self) -> int:
        block_id = self._queue.popleft()
        self._members.discard(block_id)
        return block_id

    def append(self, block_id: int) -> None:
        if not 0 <= block_id < self.num_blocks or block_id in self._members:
            raise ValueError(f"cannot append block {block_id}")
        self._queue.append(block_id)
        self._members.add(block_id)

    def remove(self, block_id: int) -> None:
        self._queue.remove(block_id)      # ValueError if absent
        self._members.discard(block_id)


class ForgetfulLinkFreeBlockQueue:
    """A linked list whose ``remove`` relinks only forwards: the next block's ``prev`` still
    points at the removed one, so a later removal or append corrupts the order."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.head, self.tail = -2, -3
        ids = [self.head, *range(num_blocks), self.tail]
        self.next = {a: b for a, b in zip(ids, ids[1:])}
        self.prev = {b: a for a, b in zip(ids, ids[1:])}
        self.members = set(range(num_blocks))

    def __len__(self) -> int:
        return len(self.members)

    def __iter__(self):
        b = self.next[self.head]
        seen = 0
        while b != self.tail and seen <= self.num_blocks:
            yield b
            b = self.next[b]
            seen += 1

    def popleft(self) -> int:
        if not self.members:
            raise IndexError("pop from an empty queue")
        b = self.next[self.head]
        self.remove(b)
        return b

    def append(self, block_id: int) -> None:
        if not 0 <= block_id < self.num_blocks or block_id in self.members:
            raise ValueError(f"cannot append block {block_id}")
        last = self.prev[self.tail]
        self.next[last] = block_id
        self.prev[block_id] = last
        self.next[block_id] = self.tail
        self.prev[self.tail] = block_id
        self.members.add(block_id)

    def remove(self, block_id: int) -> None:
        if block_id not in self.members:
            raise ValueError(f"block {block_id} is not in the queue")
        self.next[self.prev[block_id]] = self.next[block_id]   # the bug: prev of next not updated
        self.members.remove(block_id)


class ListPopFreeBlockQueue:
    """``remove`` in O(1) by lazy deletion -- the entry stays in a list, marked dead -- but
    ``popleft`` is ``list.pop(0)``, which shifts every later entry: O(n) per call."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self._entries = [(b, b) for b in range(num_blocks)]    # (block id, entry number)
        self._live = {b: b for b in range(num_blocks)}          # queued block -> its live entry
        self._counter = num_blocks

    def __len__(self) -> int:
        return len(self._live)

    def __iter__(self):
        return (b for b, entry in self._entries if self._live.get(b) == entry)

    def popleft(self) -> int:
        while self._entries:
            b, entry = self._entries.pop(0)                     # the bug: O(n)
            if self._live.get(b) == entry:
                del self._live[b]
                return b
        raise IndexError("pop from an empty queue")

    def append(self, block_id: int) -> None:
        if not 0 <= block_id < self.num_blocks or block_id in self._live:
            raise ValueError(f"cannot append block {block_id}")
        self._live[block_id] = self._counter
        self._entries.append((block_id, self._counter))
        self._counter += 1

    def remove(self, block_id: int) -> None:
        if block_id not in self._live:
            raise ValueError(f"block {block_id} is not in the queue")
        del self._live[block_id]                                # its entry dies where it is


class ScanningAppendFreeBlockQueue(FreeBlockQueue):
    """The package's linked queue, but ``append`` checks that the block is not queued yet by
    walking the queue: O(n) per call."""

    def append(self, block_id: int) -> None:
        if block_id in list(self):                              # the bug: a walk of the whole queue
            raise ValueError(f"block {block_id} is already in the free queue")
        super().append(block_id)


# ---------------------------------------------------------------- chapter 04: prefix caching

class RegisterAtAllocationBlockManager(BlockManager):
    """Registers a new sequence's full blocks as soon as they are allocated, before their K/V
    are computed: a second sequence in the same step "hits" blocks that hold nothing yet."""

    def allocate(self, seq: Sequence, num_cached_blocks: int = 0) -> None:
        super().allocate(seq, num_cached_blocks)
        computed = seq.num_cached_tokens
        seq.num_cached_tokens = seq.num_tokens    # the bug: as if the K/V were there already
        self.hash_blocks(seq)
        seq.num_cached_tokens = computed


class NoTokenCheckBlockManager(BlockManager):
    """Trusts the hash alone: a collision hands out a block holding other tokens."""

    def _confirms_hit(self, block: Block, token_ids: list[int], parent_prefix_id: int,
                      cache_salt: str | None = None) -> bool:
        return True


class LastBlockHitBlockManager(BlockManager):
    """Takes the prompt's last block from the cache too: a prompt that is all cached leaves no
    token to compute, so there are no logits to sample the next token from."""

    def _match_prefix(self, seq: Sequence) -> tuple[list[int], list[int]]:
        block_ids, hashes, h, parent_prefix_id = [], [], -1, -1
        if not self.enable_prefix_caching:
            return block_ids, hashes
        for i in range(seq.num_tokens // self.block_size):     # the bug: (num_tokens - 1) // block_size
            token_ids = seq.block(i)
            h = self.compute_hash(token_ids, h)
            block_id = self.hash_to_block_id.get(h, -1)
            if block_id == -1 or not self._confirms_hit(self.blocks[block_id], token_ids, parent_prefix_id):
                break
            block_ids.append(block_id)
            hashes.append(h)
            parent_prefix_id = self.blocks[block_id].prefix_id
        return block_ids, hashes


class UnchainedHashBlockManager(BlockManager):
    """Hashes each block's tokens alone, without the parent's hash: the same tokens after
    another prefix (or at another position) hit, though their K/V differ."""

    @staticmethod
    def compute_hash(token_ids: list[int], prefix: int = -1) -> int:
        from course_pkg.block_manager import compute_hash
        return compute_hash(token_ids)


class UncomputedBlocksRegisteredBlockManager(BlockManager):
    """``hash_blocks`` counts the sequence's tokens, not its computed ones: after a prompt chunk
    it registers full blocks whose K/V the next chunk has yet to write."""

    def hash_blocks(self, seq: Sequence, num_computed_tokens: int | None = None) -> None:
        super().hash_blocks(seq, seq.num_tokens)           # the bug: seq.num_cached_tokens


class PartialBlockRegisteredBlockManager(BlockManager):
    """``hash_blocks`` registers the partly filled last block too (rounding the computed tokens
    up to whole blocks): its hash names tokens that are not all there, and the next token
    changes its content under the index entry."""

    def hash_blocks(self, seq: Sequence, num_computed_tokens: int | None = None) -> None:
        computed = seq.num_cached_tokens if num_computed_tokens is None else num_computed_tokens
        rounded_up = -(-computed // self.block_size) * self.block_size      # the bug
        super().hash_blocks(seq, rounded_up)


class InvertedGuardBlockManager(BlockManager):
    """The stale-entry guard's condition turned around: it drops the entry only when the index
    points at *another* block (a still-valid entry) and keeps the stale one."""

    def _maybe_evict_cached_block(self, block: Block) -> None:
        if block.hash != -1 and self.hash_to_block_id.get(block.hash, block.block_id) != block.block_id:
            del self.hash_to_block_id[block.hash]


class NewerIdEvictingBlockManager(BlockManager):
    """The guard compares block ids by order instead of identity: it drops the entry when the
    index points at this block *or a higher-numbered one*, so a newer entry held by a block with
    a larger id is lost."""

    def _maybe_evict_cached_block(self, block: Block) -> None:
        target = self.hash_to_block_id.get(block.hash) if block.hash != -1 else None
        if target is not None and target >= block.block_id:                # the bug: >= for ==
            del self.hash_to_block_id[block.hash]


class UnconditionalEvictBlockManager(BlockManager):
    """The stale-entry guard without its condition: drops the index entry of the block's hash
    even when the index points at *another* block with that hash (a still-valid entry)."""

    def _maybe_evict_cached_block(self, block: Block) -> None:
        if block.hash != -1:
            self.hash_to_block_id.pop(block.hash, None)


# ---------------------------------------------------------------- chapter 08: fork, copy-on-write

class ForkWithoutRefCountsBlockManager(BlockManager):
    """``fork`` copies the block table but raises no ref count: the first holder to finish
    frees blocks the other still reads."""

    def fork(self, parent: Sequence, child: Sequence) -> None:
        if not parent.block_table or child.block_table:
            raise ValueError("fork needs a parent with blocks and a child without")
        child.block_table = list(parent.block_table)
        child.block_hashes = list(parent.block_hashes)


class ForkWithoutCopyCheckBlockManager(BlockManager):
    """``fork`` checks that the child holds no blocks but not that it is a copy of the parent:
    a sequence with other tokens (or other computed tokens) then shares blocks whose K/V
    belong to another text."""

    def fork(self, parent: Sequence, child: Sequence) -> None:
        # The bug: no comparison of tokens and computed tokens. (``keep_private_guards`` keeps
        # the package's holder record in step, as for a student's fork.)
        if not parent.block_table or child.block_table:
            raise ValueError("fork needs a parent with blocks and a child without")
        for block_id in parent.block_table:
            self.blocks[block_id].ref_count += 1
        child.block_table = list(parent.block_table)
        child.block_hashes = list(parent.block_hashes)


class ForkWithoutHashesBlockManager(BlockManager):
    """``fork`` shares the blocks and raises their ref counts but leaves the child's
    ``block_hashes`` empty: the child's next full block is then hashed as if it began the
    sequence, and registers under a hash no other sequence's prefix can match."""

    def fork(self, parent: Sequence, child: Sequence) -> None:
        super().fork(parent, child)
        child.block_hashes = []                            # the bug


class NoCopyOnWriteBlockManager(BlockManager):
    """Never copies: a fork's new token is written into the last block its siblings still read."""

    def _needs_copy_on_write(self, seq: Sequence) -> bool:
        return False


class CopyExclusiveBlockManager(BlockManager):
    """Copies a partly filled last block on every write, shared or not: a wasted block and a
    wasted copy per decode step."""

    def _needs_copy_on_write(self, seq: Sequence) -> bool:
        return len(seq.block_table) == seq.num_blocks


class SilentCopyBlockManager(BlockManager):
    """Makes the private block but does not say so: the K/V owner never copies the shared
    block's K/V into it, so the fork reads garbage."""

    def may_append(self, seq: Sequence) -> list[tuple[int, int]]:
        super().may_append(seq)
        return []


# ---------------------------------------------------------------- chapter 06: the scheduler

class SameStepIgnoredMixedScheduler(Scheduler):
    """Schedules prompt tokens as if ``same_step_prefix_hits`` were off: blocks a prompt fills in
    this step are not registered when scheduled, so a later prompt of the same step that shares
    them hits nothing and computes them again."""

    def _schedule_prompts(self, plan, budget: int) -> int:
        setting, self.same_step_prefix_hits = self.same_step_prefix_hits, False    # the bug
        try:
            return super()._schedule_prompts(plan, budget)
        finally:
            self.same_step_prefix_hits = setting


class UncountedPreemptScheduler(Scheduler):
    """``preempt`` does everything but count: ``stats.num_preemptions`` stays 0, so the metrics
    (and chapter 03's sweeps) report no preemption however many there were."""

    def preempt(self, seq: Sequence, plan) -> None:
        preemptions = self.stats.num_preemptions
        super().preempt(seq, plan)
        self.stats.num_preemptions = preemptions          # the bug


class PreemptOldestScheduler(Scheduler):
    """Preempts the *oldest* sequence not yet scheduled in this step -- the one closest to
    finishing of those that wait for a token -- instead of the most recently admitted one."""

    def _choose_victim(self, seq: Sequence) -> Sequence:
        at = self.running.index(seq) + 1
        return self.running[at] if at < len(self.running) else seq   # the bug


class PreemptToTailScheduler(Scheduler):
    """Sends a preempted sequence to the *back* of ``waiting``: it loses its turn to every
    request that arrived after it."""

    def preempt(self, seq: Sequence, plan) -> None:
        super().preempt(seq, plan)
        self.waiting.remove(seq)
        self.waiting.append(seq)


class _DecodeFirst(AdmissionPolicy):
    name = "decode_first (a mutant)"

    def schedule(self, step) -> None:
        if step.schedule_decodes():   # (nothing runs: it schedules none)
            return
        step.schedule_prompts(step.token_budget)


class DecodeFirstScheduler(Scheduler):
    """Runs a decode step whenever anything is running; new requests wait for a step in which
    nothing decodes (no continuous batching of arrivals)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.admission = _DecodeFirst()


class _PromptsFirst(AdmissionPolicy):
    name = "mixed, prompts first (a mutant)"

    def schedule(self, step) -> None:
        if not step.schedule_prompts(step.token_budget):   # the bug: decodes wait
            step.schedule_decodes()


class PromptsFirstMixedScheduler(Scheduler):
    """Gives waiting prompts the whole budget first and decodes only what is left: a long
    prompt stalls every running sequence again, as in the prefill-first policy."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.admission = _PromptsFirst()


class _BudgetIgnored(AdmissionPolicy):
    name = "mixed, budget not shared (a mutant)"

    def schedule(self, step) -> None:
        step.schedule_decodes()
        step.schedule_prompts(step.token_budget)   # the bug: no "- decodes"


class BudgetIgnoredMixedScheduler(Scheduler):
    """Fills the prompt chunks with the whole budget although the decodes already used part
    of it: steps hold more tokens than ``max_num_batched_tokens``."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.admission = _BudgetIgnored()


class WholePromptsOnlyMixedScheduler(Scheduler):
    """Admits a prompt only when all of it fits in the rest of the budget: no chunking, so a
    prompt longer than the budget never starts."""

    def _schedule_prompts(self, plan, budget: int) -> int:
        head = next(iter(sorted(self.waiting, key=lambda s: s.status != SequenceStatus.RUNNING)), None)
        if head is None or head.num_tokens - head.num_cached_tokens > budget:
            return 0
        return super()._schedule_prompts(plan, budget)


# ---------------------------------------------------------------- chapter 07: arithmetic

def kv_block_bytes_float(block_size: int, num_layers: int, num_kv_heads: int, head_dim: int,
                         dtype_bytes: int) -> float:
    """The right number as a float (``/`` where ``*`` would do): ``torch.empty`` and a byte budget
    need an int."""
    return 2 * num_layers * block_size * num_kv_heads * head_dim * dtype_bytes / 1


def kv_block_bytes_keys_only(block_size: int, num_layers: int, num_kv_heads: int, head_dim: int,
                             dtype_bytes: int) -> int:
    """Counts the keys and forgets the values."""
    return block_size * num_layers * num_kv_heads * head_dim * dtype_bytes


def kv_block_bytes_one_layer(block_size: int, num_layers: int, num_kv_heads: int, head_dim: int,
                             dtype_bytes: int) -> int:
    """Counts K and V of one layer only."""
    return 2 * block_size * num_kv_heads * head_dim * dtype_bytes


def kv_block_bytes_two_byte_dtype(block_size: int, num_layers: int, num_kv_heads: int, head_dim: int,
                                  dtype_bytes: int) -> int:
    """Assumes 2 bytes per value (bfloat16) whatever ``dtype_bytes`` says."""
    return 2 * num_layers * block_size * num_kv_heads * head_dim * 2


def fragmentation_allocated_slots(num_tokens: list[int], block_size: int) -> int:
    """Counts every allocated slot (``ceil(n / bs) * bs``), not the empty ones."""
    return sum(-(-n // block_size) * block_size for n in num_tokens)


def fragmentation_modulo(num_tokens: list[int], block_size: int) -> int:
    """``block_size - n % block_size`` per sequence: a full last block counted as empty."""
    return sum(block_size - n % block_size for n in num_tokens)


def fragmentation_one_block_at_least(num_tokens: list[int], block_size: int) -> int:
    """Gives every sequence at least one block: a sequence with no tokens yet counts
    ``block_size`` empty slots, though it holds no block at all."""
    return sum(max(1, -(-n // block_size)) * block_size - n for n in num_tokens)


# ---------------------------------------------------------------- chapter 09: the CPU block pool

class StrictCanSwapOutCpuBlockPool(CpuBlockPool):
    """``can_swap_out`` with ``<``: refuses when exactly as many CPU blocks are free as needed, so
    the scheduler recomputes a sequence it could have swapped."""

    def can_swap_out(self, num_blocks: int) -> bool:
        return num_blocks < len(self.free_block_ids)


class PeekingSwapOutCpuBlockPool(CpuBlockPool):
    """``swap_out`` reads the ids at the head of the free queue but leaves them there: the next
    swap-out gets the same blocks and overwrites the K/V of the first."""

    def swap_out(self, seq_id: int, num_blocks: int, num_computed_tokens: int) -> list[int]:
        if seq_id in self.swapped or num_blocks > len(self.free_block_ids):
            raise ValueError(f"sequence {seq_id} cannot be swapped out")
        block_ids = list(self.free_block_ids)[:num_blocks]      # the bug: not taken out
        self.swapped[seq_id] = (block_ids, num_computed_tokens)
        return block_ids


class NoRoomCheckCpuBlockPool(CpuBlockPool):
    """Takes blocks without checking there are enough: a refused swap-out has already taken some."""

    def swap_out(self, seq_id: int, num_blocks: int, num_computed_tokens: int) -> list[int]:
        block_ids = []
        for _ in range(num_blocks):
            if not self.free_block_ids:
                raise ValueError(f"sequence {seq_id}: no free CPU block left")
            block_ids.append(self.free_block_ids.popleft())
        self.swapped[seq_id] = (block_ids, num_computed_tokens)
        return block_ids


class ReleaseKeepsEntryCpuBlockPool(CpuBlockPool):
    """Frees the blocks but keeps the sequence's entry: it still looks swapped out, and its
    stale block table points at blocks another sequence may take."""

    def release(self, seq_id: int) -> None:
        self.free_block_ids.extend(self.swapped[seq_id][0])


# ---------------------------------------------------------------- chapter 11: the radix cache

class InnerEvictingRadixCache(RadixCache):
    """Counts an unheld node with children as evictable: its whole subtree is cut off with it."""

    def _is_evictable_leaf(self, node: RadixNode) -> bool:
        return node.parent is not None and node.ref_count == 0


class HeldEvictingRadixCache(RadixCache):
    """Evicts leaves that a running request still holds."""

    def _is_evictable_leaf(self, node: RadixNode) -> bool:
        return node.parent is not None and not node.children


class NoTouchRadixCache(RadixCache):
    """A lookup does not mark the path it matched as used: a hot prefix ages like a cold one."""

    def match_prefix(self, keys, *, touch: bool = True) -> list[RadixNode]:
        return super().match_prefix(keys, touch=False)


# ---------------------------------------------------------------- chapter 12: the cache salt

class NoSaltBlockManager(BlockManager):
    """Every chain starts at -1: the salt is left out of the hash (only the exact check separates salts)."""

    @staticmethod
    def salt_hash(cache_salt):
        return -1


class BuiltinHashSaltBlockManager(BlockManager):
    """Python's ``hash``: negative for about half the salts, and another value in every process."""

    @staticmethod
    def salt_hash(cache_salt):
        return -1 if cache_salt is None else hash(cache_salt)


class OneStartSaltBlockManager(BlockManager):
    """A salted request's chain starts at one value whatever its salt."""

    @staticmethod
    def salt_hash(cache_salt):
        return -1 if cache_salt is None else 0


class UncheckedSaltBlockManager(BlockManager):
    """The exact check compares tokens and parent, not the salt: a hash collision crosses salts."""

    def _confirms_hit(self, block, token_ids, parent_prefix_id, cache_salt=None):
        return block.token_ids == token_ids and block.parent_prefix_id == parent_prefix_id


class SaltOnlyIfGivenBlockManager(BlockManager):
    """The salt is checked only when the request has one: an unsalted request may hit a salted block."""

    def _confirms_hit(self, block, token_ids, parent_prefix_id, cache_salt=None):
        return (block.token_ids == token_ids and block.parent_prefix_id == parent_prefix_id
                and (cache_salt is None or block.cache_salt == cache_salt))


# ---------------------------------------------------------------- chapter 14: the rollback

class FloorKeepRollbackBlockManager(BlockManager):
    """Keeps only the blocks *full* of verified tokens: frees a block still holding accepted ones."""

    def _num_verified_blocks(self, seq: Sequence) -> int:
        return seq.num_cached_tokens // self.block_size


class RegistersRejectedRollbackBlockManager(BlockManager):
    """Rolls back, then registers every full block up to the newest token -- whose slot holds a
    rejected draft's K/V, now a prefix-cache entry under the accepted tokens' hash."""

    def free_lookahead_slots(self, seq: Sequence) -> list[int]:
        freed = BlockManager.free_lookahead_slots(self, seq)
        self.hash_blocks(seq, seq.num_tokens)
        return freed


class LastBlockOnlyRollbackBlockManager(BlockManager):
    """Gives back only the last lookahead block: an earlier one left without a verified token stays held."""

    def _num_verified_blocks(self, seq: Sequence) -> int:
        return max(super()._num_verified_blocks(seq), len(seq.block_table) - 1)


class TailReleaseRollbackBlockManager(BlockManager):
    """Gives the blocks back to the *tail* of the free queue, behind cached prefixes it then evicts sooner."""

    def _release_to_head(self, block: Block) -> None:
        self._deallocate_block(block)   # (the tail, as a finished request's blocks go)


# ---------------------------------------------------------------- chapter 15: the tier's ARC

class NoGhostsARC(ARCOffloadingManager):
    """A touch ignores the ghost lists: ``p`` never moves, ARC never learns (an LRU split in two)."""

    def touch(self, block_hashes) -> None:
        for h in reversed(list(block_hashes)):
            if h in self.t1:
                if self.t1[h].is_ready:
                    self.t2[h] = self.t1.pop(h)
                else:
                    self.t1.move_to_end(h)
            elif h in self.t2:
                self.t2.move_to_end(h)


class EvictsLoadingARC(ARCOffloadingManager):
    """Gives up any block of a list, one being loaded or stored included."""

    def _eviction_order(self, n, incoming):
        if n <= 0:
            return []
        victims = []
        t1, t2 = list(self.t1), list(self.t2)
        size_t1 = len(t1)
        while len(victims) < n and (t1 or t2):
            if t1 and (size_t1 > self.p or not t2):
                victims.append(t1.pop(0))
                size_t1 -= 1
            else:
                victims.append(t2.pop(0))
        return victims if len(victims) == n else None


class LookupPastMissARC(ARCOffloadingManager):
    """``lookup`` counts every ready block asked about, not the leading run: a hole in the middle
    of a prefix is loaded over."""

    def lookup(self, block_hashes) -> int:
        block_hashes = list(block_hashes)
        hits = sum(1 for h in block_hashes if self._find(h) is not None and self._find(h).is_ready)
        self.stats.queried += len(block_hashes)
        self.stats.hits += hits
        return hits


# ---------------------------------------------------------------- chapter 16: a sliding window's blocks

class EarlyFreeSlidingWindowManager(SlidingWindowManager):
    """Rounds the window's first position *up* to a block: the block holding position ``n - w + 1``
    is given back while a query still reads it (one block too far, unless that position starts a block)."""

    def first_needed_block(self, num_computed_tokens: int) -> int:
        if self.sliding_window is None:
            return 0
        return -(-max(0, num_computed_tokens - self.sliding_window + 1) // self.block_size)


class WideWindowSlidingWindowManager(SlidingWindowManager):
    """Counts ``w + 1`` positions as the window (``n - w`` instead of ``n - w + 1``): a block that
    left the window is kept, and a hit asks for one that is not needed."""

    def first_needed_block(self, num_computed_tokens: int) -> int:
        if self.sliding_window is None:
            return 0
        return max(0, num_computed_tokens - self.sliding_window) // self.block_size


class NeverFreesSlidingWindowManager(SlidingWindowManager):
    """Gives nothing back: a local group holds every block, as a full-attention group does."""

    def remove_skipped_blocks(self, seq: Sequence) -> list[int]:
        return []


class OldestFirstSlidingWindowManager(SlidingWindowManager):
    """Gives the blocks back oldest first: the older block reaches the free queue's tail first, so
    it is evicted before the newer ones (and the ids come back in the wrong order)."""

    def remove_skipped_blocks(self, seq: Sequence) -> list[int]:
        table = self.table(seq)
        freed = []
        for i in range(min(self.first_needed_block(seq.num_cached_tokens), len(table))):
            if table[i] != NULL_BLOCK:
                self._release(table[i])
                freed.append(table[i])
                table[i] = NULL_BLOCK
        return freed


class LeftSearchSlidingWindowManager(SlidingWindowManager):
    """Counts the leading run of cached blocks, stopping at the first miss -- a full-attention
    group's rule: a window still cached at the end of a prompt whose early blocks were evicted is missed."""

    def longest_hit(self, seq: Sequence, num_blocks: int, cached: list[int], ids: list) -> int:
        hit = 0
        while hit < num_blocks and cached[hit] != NULL_BLOCK and ids[hit] is not None:
            hit += 1
        return hit
