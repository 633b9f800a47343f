"""KV-cache arithmetic for chapter 07: what a block costs, and what paging wastes.

Two small functions the chapter's claims rest on. ``kv_block_bytes`` is what one block of the
cache occupies (the ModelRunner allocates ``num_blocks`` of them at start-up);
``internal_fragmentation`` is the memory paging still wastes: the empty slots of each
sequence's partly filled last block.
"""
from __future__ import annotations


def kv_block_bytes(block_size: int, num_layers: int, num_kv_heads: int, head_dim: int,
                   dtype_bytes: int) -> int:
    """Bytes of one KV block over all layers: a K and a V vector per token, head and layer."""
    return 2 * num_layers * block_size * num_kv_heads * head_dim * dtype_bytes


def internal_fragmentation(num_tokens: list[int], block_size: int) -> int:
    """Token slots allocated but empty when sequence ``i`` holds ``num_tokens[i]`` tokens.

    Each sequence holds ``ceil(n / block_size)`` blocks; only its last block can be partly
    empty, by ``ceil(n / block_size) * block_size - n`` slots (0 when it is full).
    """
    return sum(-(-n // block_size) * block_size - n for n in num_tokens)
