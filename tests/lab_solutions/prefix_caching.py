"""A correct solution of lab `prefix_caching`, written from the chapter's explanation, not from the package's code.

Grade it like a student's file: ``python -m course_pkg.labs prefix_caching tests/lab_solutions/prefix_caching.py``.
"""
from __future__ import annotations

from course_pkg.block_manager import BlockManager


class ScratchPrefixBlockManager(BlockManager):
    """The lookup and the registration written as one loop each, with the package's exact-prefix helpers."""

    def _match_prefix(self, seq):
        ids, hashes, h, parent = [], [], -1, -1
        if not self.enable_prefix_caching:
            return ids, hashes
        for i in range((len(seq) - 1) // self.block_size):
            tokens = seq.block(i)
            h = self.compute_hash(tokens, h)
            b = self.hash_to_block_id.get(h)
            if b is None or not self._confirms_hit(self.blocks[b], tokens, parent):
                break
            ids.append(b)
            hashes.append(h)
            parent = self.blocks[b].prefix_id
        return ids, hashes

    def hash_blocks(self, seq):
        if not self.enable_prefix_caching:
            return
        full = min(seq.num_cached_tokens // self.block_size, len(seq.block_table))
        while len(seq.block_hashes) < full:
            i = len(seq.block_hashes)
            tokens = seq.block(i)
            h = self.compute_hash(tokens, seq.block_hashes[-1] if i else -1)
            parent = self.blocks[seq.block_table[i - 1]].prefix_id if i else -1
            block = self.blocks[seq.block_table[i]]
            block.update(h, tokens, self._prefix_id_for(h, parent, tokens), parent)
            self.hash_to_block_id[h] = block.block_id
            seq.block_hashes.append(h)


StudentPrefixBlockManager = ScratchPrefixBlockManager
