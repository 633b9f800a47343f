"""Known-wrong BlockManagers: the course's foils (chapters 03, 04), never to be used for real.

Each foil changes one decision of the real ``BlockManager`` and keeps everything else, so an
experiment that serves the same workload with both measures exactly that decision:

* ``ForwardReleaseBlockManager`` -- ``deallocate`` releases first block first (chapter 03);
* ``UnguardedBlockManager``      -- no stale-entry guard when a cached block is reused (chapter 04);
* ``TokenCheckBlockManager``     -- a hash hit is confirmed by the block's own tokens only, as in
                                    Nano-vLLM, so a hash collision can hand out another prefix's
                                    K/V (chapter 04).
"""
from __future__ import annotations

from course_pkg.block import Block
from course_pkg.block_manager import BlockManager
from course_pkg.sequence import Sequence


class ForwardReleaseBlockManager(BlockManager):
    """A BlockManager whose ``deallocate`` releases blocks first to last (chapter 03's foil).

    Everything else is the real BlockManager. The parent walks the block table backwards,
    so handing it the table reversed makes the walk go forwards: the prefix reaches the
    free queue first and is overwritten first.
    """

    def deallocate(self, seq: Sequence) -> None:
        seq.block_table.reverse()  # empty table: a no-op, and the parent raises as usual
        super().deallocate(seq)


class UnguardedBlockManager(BlockManager):
    """A BlockManager without the stale-entry guard (chapter 04's foil -- never use it).

    When it hands out a free block for new content it leaves the block's old index entry
    in place. The block may later hold the same tokens after another prefix; the stale
    entry then finds it, and only the exact check (``_confirms_hit``: the parent's prefix
    id) refuses the wrong hit. The index keeps growing with entries for content that no
    longer exists.
    """

    def _maybe_evict_cached_block(self, block: Block) -> None:
        pass  # the real one deletes the block's index entry here


class TokenCheckBlockManager(BlockManager):
    """A BlockManager that confirms a hash hit by the block's own tokens only (chapter 04's foil).

    That is Nano-vLLM's check. It is right as long as the chained hash never collides: two
    prefixes that end in the same block of tokens are then told apart by their hashes alone.
    """

    def _confirms_hit(self, block: Block, token_ids: list[int], parent_prefix_id: int,
                      cache_salt: str | None = None) -> bool:
        return block.token_ids == token_ids  # the real one also compares the parent's prefix id


def make_block_manager(num_blocks: int, block_size: int, *, release: str = "reversed",
                       **kwargs) -> BlockManager:
    """A BlockManager that releases in ``release`` order: "reversed" (the real one) or "forward"."""
    if release == "reversed":
        return BlockManager(num_blocks, block_size, **kwargs)
    if release == "forward":
        return ForwardReleaseBlockManager(num_blocks, block_size, **kwargs)
    raise ValueError(f"release must be 'reversed' or 'forward', got {release!r}")
