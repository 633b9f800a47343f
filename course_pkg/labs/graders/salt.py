"""Chapter 12 grader: the cache salt -- where a request's hash chain starts, and the exact check.

The student writes ``salt_hash`` and ``_confirms_hit``. The scenarios: ``salt_hash``'s contract,
checked directly; requests made by hand on the student's manager alone, against values worked
out from the contract (an unsalted chain is chapter 04's, a salted one starts at the salt's
hash; the same salt shares, another salt or none shares nothing); forced collisions -- every
salt's chain starting alike, a salted chain starting where the unsalted one does -- which only
the exact check stops; and random salted calls in lockstep with the package's manager given the
student's ``salt_hash`` (any good hash of the salt will do, so the reference uses the same one
and the two managers' hashes compare).
"""
from __future__ import annotations

from course_pkg.block_manager import BlockManager, compute_hash
from course_pkg.labs.hooks import keep_private_guards
from course_pkg.labs.lab import Grading
from course_pkg.labs.lockstep import Lockstep, random_trace
from course_pkg.sequence import Sequence
from course_pkg.validation import is_int

SALTS = [f"user-{i}" for i in range(40)] + ["a", "b", "é", "東京", "org/team:7", "x" * 1000]


def _serve(bm: BlockManager, tokens: list[int], salt: str | None, block_size: int) -> Sequence:
    """Admit a request with every hit ``can_allocate`` finds and compute its prompt; the
    sequence, still holding its blocks."""
    seq = Sequence(list(tokens), block_size=block_size, cache_salt=salt)
    hits = bm.can_allocate(seq)
    if hits < 0:
        raise AssertionError("the grader's pool is too small: the lab needs updating")
    bm.allocate(seq, hits)
    seq.num_cached_tokens = seq.num_tokens
    bm.hash_blocks(seq)
    return seq


def _hits(bm: BlockManager, tokens: list[int], salt: str | None, block_size: int) -> int:
    return bm.can_allocate(Sequence(list(tokens), block_size=block_size, cache_salt=salt))


def grade_cache_salt(impl, g: Grading) -> None:
    make = keep_private_guards(impl)
    salt_hash = impl.salt_hash
    with g.scenario("salt_hash: -1 without a salt; for each salt a distinct int in [0, 2**64), the same every call"):
        g.equal(salt_hash(None), -1, "salt_hash(None): without a salt the chain starts as in chapter 04")
        values = [salt_hash(s) for s in SALTS]
        for s, v in zip(SALTS, values):
            g.check(v != -1, f"salt_hash({s[:20]!r}) returned -1, where an unsalted chain starts: the salt "
                             "must change the hash of the request's first block")
            g.check(is_int(v) and 0 <= v < 2 ** 64,
                    f"salt_hash({s[:20]!r}) returned {v!r}: a chain start is packed as 8 unsigned bytes, so it "
                    "must be an int in [0, 2**64) (Python's hash() can be negative, and changes between processes)")
        g.equal([salt_hash(s) for s in SALTS], values, "salt_hash of the same salts, called a second time")
        g.check(len(set(values)) == len(values),
                f"{len(SALTS)} distinct salts gave only {len(set(values))} distinct chain starts: requests of "
                "two salts would find each other's blocks by hash, and only the exact check would keep them apart")
    A = list(range(1, 10))                             # 2 full blocks of 4, and a partial one
    with g.scenario("the chains: unsalted as in chapter 04, a salt in the first block's hash only (block size 4)"):
        bm = make(12, 4)
        plain = _serve(bm, A, None, 4)
        h0 = compute_hash(A[:4])
        g.equal(list(plain.block_hashes), [h0, compute_hash(A[4:8], h0)],
                "block_hashes of an unsalted request: compute_hash chained from -1, as in chapter 04")
        g.equal(_hits(bm, A, "a", 4), 0, "can_allocate of the same tokens with salt 'a' after the unsalted request")
        salted = _serve(bm, A, "a", 4)
        s0 = compute_hash(A[:4], salt_hash("a"))
        g.equal(list(salted.block_hashes), [s0, compute_hash(A[4:8], s0)],
                "block_hashes with salt 'a': the first block chained on salt_hash('a'), the second on the first")
    with g.scenario("the same salt shares; another salt, or none, shares nothing (block size 4)"):
        bm = make(16, 4)
        bm.deallocate(_serve(bm, A, "a", 4))
        g.equal(_hits(bm, A + [50, 51], "a", 4), 2, "can_allocate with salt 'a' after a request with salt 'a'")
        g.equal(_hits(bm, A, "b", 4), 0, "can_allocate with salt 'b': not even the first block")
        g.equal(_hits(bm, A, None, 4), 0, "can_allocate without a salt")
        bm.deallocate(_serve(bm, A, None, 4))
        g.equal(_hits(bm, A, None, 4), 2, "can_allocate without a salt after an unsalted request")
        g.equal(_hits(bm, A, "a", 4), 2, "can_allocate with salt 'a' once more (its blocks are still cached)")
    with g.scenario("a forced collision: every salt's chain starts at one value, only the exact check "
                    "keeps the salts apart (block size 4)"):
        bm = make(16, 4)
        one = salt_hash("a")
        bm.salt_hash = lambda salt: -1 if salt is None else one
        bm.deallocate(_serve(bm, A, "a", 4))
        g.equal(_hits(bm, A, "b", 4), 0, "can_allocate with salt 'b', whose chain starts at the same value as "
                                         "salt 'a': the cached blocks belong to salt 'a'")
        g.equal(_hits(bm, A, "a", 4), 2, "can_allocate with salt 'a' (the same salt still shares)")
    for first, second in (("a", None), (None, "a")):
        name = "salted" if first else "unsalted"
        with g.scenario(f"a forced collision: a salted chain starts where the unsalted one does, the {name} "
                        "request first (block size 4)"):
            bm = make(16, 4)
            bm.salt_hash = lambda salt: -1
            bm.deallocate(_serve(bm, A, first, 4))
            g.equal(_hits(bm, A, second, 4), 0,
                    f"can_allocate {'without a salt' if second is None else 'with salt ' + repr(second)} after a "
                    f"request {'without one' if first is None else 'with salt ' + repr(first)}: the first block "
                    "hashes alike, but its salt differs")
            g.equal(_hits(bm, A, first, 4), 2, "can_allocate of the first request's salt again")

    class Reference(BlockManager):
        pass

    Reference.salt_hash = staticmethod(salt_hash)      # the student's chain starts, so hashes compare
    for seed, bs in ((21, 1), (22, 4)):
        with g.scenario(f"200 random calls with salts None, 'a', 'b' in lockstep (seed {seed}, block size {bs}, pool 12)"):
            random_trace(Lockstep(g, impl, 12, bs, reference=Reference), seed, 200, salts=(None, "a", "b"))
    with g.scenario("200 random calls with salts and every salt's chain starting alike (seed 23, block size 2, pool 12)"):
        lock = Lockstep(g, impl, 12, 2, reference=Reference)
        one = salt_hash("a")
        for bm in (lock.ref, lock.mine):
            bm.salt_hash = lambda salt: -1 if salt is None else one
        random_trace(lock, 23, 200, salts=(None, "a", "b"))
