"""A physical KV-cache block: the unit the BlockManager hands out (chapter 01).

A block is a fixed-size slot in the KV cache that holds the keys and values of
``block_size`` tokens. This object is only its *bookkeeping*: the KV tensors live elsewhere,
and whoever owns them finds a block's memory by its ``block_id``.
"""
from __future__ import annotations


class Block:
    """Metadata of one physical block.

    ``ref_count`` tells the block's state: 0 = free, 1 = held by one sequence,
    >1 = shared by several sequences (a common prefix). ``hash`` is the content
    fingerprint under which the block is registered for prefix caching (-1 = not
    registered); ``token_ids`` are the tokens it holds, kept to confirm a hash hit.
    ``prefix_id`` names, exactly, the whole token prefix that ends with this block, and
    ``parent_prefix_id`` the prefix before it (-1: none; chapter 04 explains why the hash
    alone is not trusted). ``cache_salt`` is the salt of the request whose *first* block this
    is (``None``: no salt, or not a first block; chapter 12): requests with different salts
    never share a block.
    """

    __slots__ = ("block_id", "ref_count", "hash", "token_ids", "prefix_id", "parent_prefix_id", "cache_salt")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.hash = -1
        self.token_ids: list[int] = []
        self.prefix_id = -1
        self.parent_prefix_id = -1
        self.cache_salt: str | None = None

    def update(self, hash: int, token_ids: list[int], prefix_id: int = -1, parent_prefix_id: int = -1,
               cache_salt: str | None = None) -> None:
        """Register the block's content: its chained hash, its tokens, its exact prefix.

        The block keeps the list it is given (no copy): hand it a list of its own, as the
        slice ``seq.block(i)`` is.
        """
        self.hash = hash
        self.token_ids = token_ids
        self.prefix_id = prefix_id
        self.parent_prefix_id = parent_prefix_id
        self.cache_salt = cache_salt

    def reset(self) -> None:
        """Prepare the block for new content.

        ``ref_count`` becomes 1, not 0: the only caller hands the block to a sequence at
        once, so the block is never observed "allocated but unowned".
        """
        self.ref_count = 1
        self.hash = -1
        self.token_ids = []
        self.prefix_id = -1
        self.parent_prefix_id = -1
        self.cache_salt = None

    @property
    def is_free(self) -> bool:
        return self.ref_count == 0

    @property
    def is_shared(self) -> bool:
        return self.ref_count > 1

    def __repr__(self) -> str:
        return (f"Block(block_id={self.block_id}, ref_count={self.ref_count}, "
                f"hash={self.hash}, token_ids={self.token_ids})")
