"""Random admit / append / compute / release / preempt traces against the BlockManager.

After every step: free and used partition the pool, no block is twice in the free queue,
ref counts sum to the block-table entries of live sequences, every index entry points at a
block carrying that hash -- and, checked against a shadow model kept by the test itself,
every prefix-cache hit hands out a block that really holds the K/V of the same prefix,
computed for a request with the same ``cache_salt`` (chapter 12: salts never share).
When everything is released the pool is whole again.
"""
from __future__ import annotations

from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from course_pkg import BlockManager, NoFreeBlocksError, Sequence
from tests.helpers import check_invariants, state

# A few shared prefixes over a tiny alphabet: equal blocks at different positions are common,
# which is what chained hashing must get right.
PREFIXES = [[], [1, 2, 1, 2], [1, 2, 1, 2, 3, 3], [2, 1, 2, 1], [1, 2]]
SALTS = [None, None, "alice", "bob"]     # unsalted requests are the common case


class BlockManagerMachine(RuleBasedStateMachine):
    @initialize(block_size=st.integers(1, 4), num_blocks=st.integers(1, 14),
                caching=st.booleans(), free_queue=st.sampled_from(["deque", "linked"]))
    def setup(self, block_size, num_blocks, caching, free_queue):
        self.bm = BlockManager(num_blocks, block_size, enable_prefix_caching=caching, free_queue=free_queue)
        self.block_size = block_size
        self.live: list[Sequence] = []       # hold blocks
        self.preempted: list[Sequence] = []  # released, waiting to be admitted again
        # Shadow model: (salt, token prefix) whose K/V each physical block holds (None = garbage).
        self.content: dict[int, tuple | None] = {}

    def _prefix_through(self, seq: Sequence, i: int) -> tuple:
        return seq.cache_salt, tuple(seq.token_ids[:(i + 1) * self.block_size])

    def _admit(self, seq: Sequence, take_all: bool, data) -> None:
        n = self.bm.can_allocate(seq)
        if n < 0:
            return
        k = n if take_all else data.draw(st.integers(0, n))
        if k < n:
            # Fewer hits can need more free blocks (a hit on a block in use costs none), so
            # this may not fit: then it must raise and change nothing.
            before = state(self.bm, self.live + [seq])
            try:
                self.bm.allocate(seq, k)
            except NoFreeBlocksError:
                assert state(self.bm, self.live + [seq]) == before
                return
        else:
            self.bm.allocate(seq, k)
        for i, bid in enumerate(seq.block_table):
            if i < k:
                assert self.content.get(bid) == self._prefix_through(seq, i), \
                    "hit on a block with other K/V, or computed under another salt"
            else:
                self.content[bid] = None
        assert seq.num_cached_tokens == k * self.block_size
        self.live.append(seq)

    @rule(prefix=st.sampled_from(PREFIXES), suffix=st.lists(st.integers(1, 3), min_size=0, max_size=6),
          salt=st.sampled_from(SALTS), take_all=st.booleans(), data=st.data())
    def admit(self, prefix, suffix, salt, take_all, data):
        tokens = prefix + suffix or [1]
        self._admit(Sequence(tokens, block_size=self.block_size, cache_salt=salt), take_all, data)

    @precondition(lambda self: self.preempted)
    @rule(i=st.integers(0, 100), data=st.data())
    def readmit(self, i, data):
        seq = self.preempted[i % len(self.preempted)]
        if self.bm.can_allocate(seq) >= 0:
            self.preempted.remove(seq)
            self._admit(seq, True, data)

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 100), token=st.integers(1, 3))
    def append(self, i, token):
        seq = self.live[i % len(self.live)]
        if seq.num_cached_tokens < seq.num_tokens:
            return  # compute the pending tokens first, as a decode step would
        seq.append_token(token)
        if self.bm.can_append(seq):
            before = len(seq.block_table)
            self.bm.may_append(seq)
            for bid in seq.block_table[before:]:
                self.content[bid] = None
        else:
            seq.token_ids.pop(); seq.num_tokens -= 1

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 100), chunk=st.integers(1, 8))
    def compute(self, i, chunk):
        """A step computes up to `chunk` pending tokens; then their full blocks are registered."""
        seq = self.live[i % len(self.live)]
        seq.num_cached_tokens = min(seq.num_tokens, seq.num_cached_tokens + chunk)
        for b in range(seq.num_cached_tokens // self.block_size):
            self.content[seq.block_table[b]] = self._prefix_through(seq, b)
        self.bm.hash_blocks(seq)

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 100))
    def release(self, i):
        self.bm.deallocate(self.live.pop(i % len(self.live)))

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 100))
    def preempt(self, i):
        seq = self.live.pop(i % len(self.live))
        self.bm.deallocate(seq)
        self.preempted.append(seq)

    @invariant()
    def consistent(self):
        check_invariants(self.bm, self.live)
        for seq in self.live:
            # A sequence's registered blocks are exactly its full, computed leading blocks.
            if self.bm.enable_prefix_caching:
                assert len(seq.block_hashes) == seq.num_cached_tokens // self.block_size

    def teardown(self):
        for seq in self.live:
            self.bm.deallocate(seq)
        self.live.clear()
        check_invariants(self.bm, [])   # with no live sequence: every block free, none used


BlockManagerMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=30, deadline=None)
TestBlockManagerStateful = BlockManagerMachine.TestCase
