"""The CPU block pool: where a preempted sequence's KV blocks wait when they are swapped out (ch. 09).

Preemption by *recompute* throws a victim's K/V away and computes them again on readmission.
Preemption by *swap* (vLLM v0's ``preemption_mode="swap"``, sized by ``num_cpu_blocks``) copies
them to host memory instead and copies them back later: a transfer of ``2 x layers x tokens x
kv_heads x head_dim`` values each way, against a forward pass over every token of the sequence.

This is the second allocator that swapping needs. Like the BlockManager it hands out block
*numbers* only; the ModelRunner owns the host tensor they index (pinned memory on CUDA, so
the copies run at full bus speed). Each swapped-out sequence keeps here its CPU block table
and how many of its tokens those blocks hold; nothing else about it changes while it waits.
"""
from __future__ import annotations

from collections import deque

from course_pkg.validation import check_int


class CpuBlockPool:
    """Fixed-size blocks in host memory: a FIFO free queue and one block table per swapped sequence."""

    def __init__(self, num_blocks: int):
        check_int("num_cpu_blocks", num_blocks, minimum=1)
        self.num_blocks = num_blocks
        self.free_block_ids: deque[int] = deque(range(num_blocks))
        # seq_id -> (CPU block ids in logical order, tokens whose K/V they hold)
        self.swapped: dict[int, tuple[list[int], int]] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    @property
    def usage(self) -> float:
        """Fraction of CPU blocks holding a swapped sequence's K/V (vLLM v0's ``cpu_cache_usage_perc``)."""
        return 1 - len(self.free_block_ids) / self.num_blocks

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self.swapped

    def can_swap_out(self, num_blocks: int) -> bool:
        return num_blocks <= len(self.free_block_ids)

    def swap_out(self, seq_id: int, num_blocks: int, num_computed_tokens: int) -> list[int]:
        """Take ``num_blocks`` CPU blocks for ``seq_id``; returns them in logical order."""
        if seq_id in self.swapped:
            raise ValueError(f"sequence {seq_id} is already swapped out")
        if num_blocks > len(self.free_block_ids):
            raise ValueError(f"sequence {seq_id} needs {num_blocks} CPU blocks, "
                             f"{len(self.free_block_ids)} are free")
        block_ids = [self.free_block_ids.popleft() for _ in range(num_blocks)]
        self.swapped[seq_id] = (block_ids, num_computed_tokens)
        return list(block_ids)

    def block_table(self, seq_id: int) -> list[int]:
        return list(self.swapped[seq_id][0])

    def num_computed_tokens(self, seq_id: int) -> int:
        return self.swapped[seq_id][1]

    def release(self, seq_id: int) -> None:
        """Return ``seq_id``'s CPU blocks to the tail of the free queue (swapped in, aborted, or
        turned into a recomputation)."""
        entry = self.swapped.pop(seq_id)
        self.free_block_ids.extend(entry[0])

    def describe(self) -> str:
        """Deterministic text: each swapped sequence's CPU blocks, then the free queue."""
        rows = [f"seq {sid}: cpu blocks {ids} ({n} tokens)" for sid, (ids, n) in sorted(self.swapped.items())]
        rows.append(f"free: {list(self.free_block_ids)}")
        return "\n".join(rows)
