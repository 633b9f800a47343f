"""A correct solution of lab `cache_salt`, written from the chapter's explanation, not from the package's code.

Grade it like a student's file: ``python -m course_pkg.labs cache_salt tests/lab_solutions/cache_salt.py``.
It hashes the salt with BLAKE2b (the package uses xxhash): any stable 64-bit hash of the salt will do.
"""
import hashlib

from course_pkg import BlockManager


class StudentSaltBlockManager(BlockManager):
    @staticmethod
    def salt_hash(cache_salt):
        if cache_salt is None:
            return -1                                  # no salt: the chain of chapter 04
        digest = hashlib.blake2b(cache_salt.encode("utf-8"), digest_size=8, person=b"salt").digest()
        return int.from_bytes(digest, "little")        # 8 bytes: always in [0, 2**64)

    def _confirms_hit(self, block, token_ids, parent_prefix_id, cache_salt=None):
        same_tokens = list(block.token_ids) == list(token_ids)
        same_prefix = block.parent_prefix_id == parent_prefix_id
        same_salt = block.cache_salt == cache_salt     # None == None for every block after the first
        return same_tokens and same_prefix and same_salt
