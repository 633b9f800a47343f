"""Chapter 01 graders: ``Block.reset`` and the logical blocks of a ``Sequence``."""
from __future__ import annotations

from course_pkg.block import Block
from course_pkg.block_manager import BlockManager
from course_pkg.labs.lab import Grading
from course_pkg.labs.lockstep import Lockstep, random_trace


def _manager_with_blocks(block_cls):
    """A BlockManager factory whose pool is made of ``block_cls`` blocks."""
    def make(num_blocks: int, block_size: int, **kwargs) -> BlockManager:
        bm = BlockManager(num_blocks, block_size, **kwargs)
        bm.blocks = [block_cls(i) for i in range(num_blocks)]
        return bm
    return make


def _fields(block) -> dict[str, object]:
    """Every field the package's Block has (its ``__slots__``), by value."""
    return {name: getattr(block, name, "<missing>") for name in Block.__slots__}


def _registered(block_cls, block_id: int):
    """A freed block that is still a cache entry: content registered, every extra field set."""
    b = block_cls(block_id)
    b.update(1234, [7, 8, 9, 10])
    for name in Block.__slots__:
        if name not in ("block_id", "ref_count", "hash", "token_ids"):
            setattr(b, name, 77)       # e.g. the exact prefix ids of chapter 04
    b.ref_count = 0
    return b


def grade_block_reset(block_cls, g: Grading) -> None:
    with g.scenario("reset of a fresh block"):
        b = block_cls(3)
        b.reset()
        g.equal((b.block_id, b.ref_count, b.hash, b.token_ids), (3, 1, -1, []),
                "(block_id, ref_count, hash, token_ids) after reset(): one sequence holds it, nothing registered")
    with g.scenario("reset of a freed block that is still registered"):
        b = _registered(block_cls, 5)
        b.reset()
        g.equal((b.block_id, b.ref_count, b.hash, b.token_ids), (5, 1, -1, []),
                "(block_id, ref_count, hash, token_ids) after reset()")
        reference = _registered(Block, 5)
        reference.reset()
        for name, expected in _fields(reference).items():
            g.equal(_fields(b)[name], expected, f"{name} after reset() (the package's Block.reset clears it)")
    with g.scenario("reused in a BlockManager (block size 2, pool of 3)"):
        lock = Lockstep(g, _manager_with_blocks(block_cls), 3, 2)
        lock.seq("A", [1, 2, 3, 4, 5])
        lock.call("allocate", "A")
        lock.computed("A")
        lock.call("deallocate", "A")
        lock.seq("B", [6, 7, 8])                 # new content: blocks are reset and reused
        lock.call("allocate", "B")
        lock.expect("ref counts", (0, 1, 1), "B holds the two blocks at the head of the free queue: 2, then 1")
        lock.computed("B")
        for token in (9, 10):                    # the 5th token takes block 0, still registered for A
            lock.append_token("B", token)
            lock.call("may_append", "B")
        lock.expect("block table of B", (2, 1, 0), "the free queue's head after B's two blocks")
    with g.scenario("200 random calls in lockstep (seed 11, block size 2, pool 8)"):
        random_trace(Lockstep(g, _manager_with_blocks(block_cls), 8, 2), 11, 200)


def grade_logical_blocks(seq_cls, g: Grading) -> None:
    # (num_tokens, block_size) -> (num_blocks, last_block_num_tokens), by hand.
    cases = [((1, 1), (1, 1)), ((5, 1), (5, 1)), ((1, 16), (1, 1)), ((16, 16), (1, 16)),
             ((17, 16), (2, 1)), ((14, 7), (2, 7)), ((15, 7), (3, 1)), ((13, 7), (2, 6))]
    for (n, bs), (num_blocks, last) in cases:
        with g.scenario(f"{n} token{'s' if n != 1 else ''}, block size {bs}"):
            seq = seq_cls(list(range(100, 100 + n)), block_size=bs)
            g.equal(seq.num_blocks, num_blocks, "num_blocks")
            g.equal(seq.last_block_num_tokens, last, "last_block_num_tokens")
            for i in range(num_blocks):
                expected = list(range(100 + i * bs, 100 + min(n, (i + 1) * bs)))
                g.equal(seq.block(i), expected, f"block({i})")
            for i in (num_blocks, -1):
                try:
                    got = seq.block(i)
                except IndexError:
                    continue
                g.fail(f"block({i}) must raise IndexError: the sequence has blocks 0 .. {num_blocks - 1} "
                       f"(a logical block number is never negative); it returned {got!r}")
    with g.scenario("growing by decode (block size 3)"):
        seq = seq_cls([1, 2, 3, 4, 5, 6], block_size=3)
        expected = [(3, 1), (3, 2), (3, 3), (4, 1)]     # after tokens 7, 8, 9, 10
        for token, want in zip([7, 8, 9, 10], expected):
            seq.append_token(token)
            g.equal((seq.num_blocks, seq.last_block_num_tokens), want,
                    f"(num_blocks, last_block_num_tokens) after appending token {token}")
        g.equal(seq.block(3), [10], "block(3)")
