"""Microseconds per BlockManager call, from 1k to 1M blocks, deque vs linked free queue.

    .venv/bin/python benchmarks/block_manager_ops.py            # 1k, 10k, 100k, 1M blocks
    .venv/bin/python benchmarks/block_manager_ops.py --sizes 1000 10000 --repeats 2

What it does, for each pool size and each free-queue kind ("deque", "linked"):

1. Fill the cache: admit requests until the pool is full, register their full blocks
   (``hash_blocks``), release them all. Every block is now free and most are still cached
   -- the state of a busy server's pool. Each request's first block is a distinct "root"
   that a later request can hit.
2. Time three traces of ``--requests`` requests each (block size 16):
   * ``miss``     -- distinct 40-token prompts, no prefix hit; then 24 decode tokens each
                     (``may_append`` per token) and release;
   * ``hit``      -- a 64-token prompt shared with a live request (4 blocks with
                     ref_count > 0) plus a distinct suffix: hits that revive nothing;
   * ``revival``  -- each prompt is a cached root block plus one token: the hit revives a
                     block that is free, from a random place in the free queue. This is
                     where ``deque.remove`` scans (O(n)) and the linked queue unlinks (O(1));
   * ``hot``      -- revivals of 16 popular roots, again and again: after its first revival
                     a root is released to the tail, so the deque scans nearly the whole
                     queue each time, while the roots' metadata stays in the CPU cache.

Each figure is the median over all calls of ``--repeats`` runs of a trace, with the
garbage collector off while timing (it would otherwise add pauses that grow with the heap,
not with the bookkeeping). Figures vary with the machine and its load; the ratios between
columns of one run are what to read. The last lines check the target of chapter 03: with
the linked queue, a revival's ``allocate`` costs within 1.5x at 1M blocks of what it costs
at 1k. It is checked on both revival traces, next to the growth of ``can_allocate``, which
never touches the free queue: that growth is what the memory hierarchy alone adds at that
size (a random block's metadata, index entry and links are rarely in the CPU cache when the
pool holds a million blocks), whatever the queue.
"""
from __future__ import annotations

import argparse
import gc
import random
import statistics
import time
from collections import deque

from course_pkg.block_manager import BlockManager
from course_pkg.free_block_queue import FreeBlockQueue
from course_pkg.sequence import Sequence

BLOCK_SIZE = 16
CHAIN_BLOCKS = 3          # full blocks per filling request (+1 partial block)
PROMPT_MISS = 40          # tokens: 2 full blocks + 8
DECODE_TOKENS = 24        # 40 + 24 = 64 tokens: one new block during decode
SHARED_PREFIX = 64        # tokens: 4 full blocks shared with a live request
OPS = ("can_allocate", "allocate", "may_append", "hash_blocks", "deallocate")


def root_tokens(c: int) -> list[int]:
    """A block's worth of tokens that differs for every c (small ints: cheap to store)."""
    return [c & 255, (c >> 8) & 255, (c >> 16) & 255, (c >> 24) & 255] + [7] * (BLOCK_SIZE - 4)


def fill_cache(bm: BlockManager) -> list[tuple[list[int], int]]:
    """Fill the pool with registered chains and release them; return (root tokens, root hash)."""
    per_request = CHAIN_BLOCKS + 1
    seqs, roots = [], []
    tail = [1] * (BLOCK_SIZE * (CHAIN_BLOCKS - 1)) + [2]
    for c in range(bm.num_blocks // per_request):
        root = root_tokens(c)
        seq = Sequence(root + tail, block_size=BLOCK_SIZE)
        bm.allocate(seq, 0)
        seq.num_cached_tokens = CHAIN_BLOCKS * BLOCK_SIZE
        bm.hash_blocks(seq)
        seqs.append(seq)
        roots.append((root, seq.block_hashes[0]))
    for seq in seqs:
        bm.deallocate(seq)
    return roots


class Timer:
    """Collects the duration of every call, per operation name.

    Each call is timed on its own (two ``perf_counter`` reads, well under a microsecond), so
    that the untimed work between calls -- appending a decoded token, advancing
    ``num_cached_tokens`` -- stays out of the figures. The report takes the median: on a
    shared machine a few calls are interrupted by other processes, and the median ignores them.
    """

    def __init__(self):
        self.seconds: dict[str, list[float]] = {op: [] for op in OPS}

    def call(self, op: str, fn, *args):
        t0 = time.perf_counter()
        out = fn(*args)
        self.seconds[op].append(time.perf_counter() - t0)
        return out


def admit_all(bm: BlockManager, seqs: list[Sequence], t: Timer) -> None:
    """Admit each request as the scheduler does, then run its prefill and register its blocks."""
    for seq in seqs:
        cached = t.call("can_allocate", bm.can_allocate, seq)
        assert cached >= 0, "benchmark bug: a request does not fit"
        t.call("allocate", bm.allocate, seq, cached)
        seq.num_cached_tokens = seq.num_tokens  # the prefill step computed every prompt token
        t.call("hash_blocks", bm.hash_blocks, seq)


def trace_miss(bm: BlockManager, rng: random.Random, n_req: int, _roots, t: Timer) -> None:
    seqs = [Sequence([rng.randrange(1 << 30) for _ in range(PROMPT_MISS)], block_size=BLOCK_SIZE)
            for _ in range(n_req)]
    admit_all(bm, seqs, t)
    for step in range(DECODE_TOKENS):
        for seq in seqs:
            seq.append_token(step)
        for seq in seqs:
            t.call("may_append", bm.may_append, seq)
            seq.num_cached_tokens = seq.num_tokens
    for seq in seqs:
        t.call("deallocate", bm.deallocate, seq)


def trace_hit(bm: BlockManager, rng: random.Random, n_req: int, _roots, t: Timer) -> None:
    system = [rng.randrange(1 << 30) for _ in range(SHARED_PREFIX)]
    holder = Sequence(system + [0], block_size=BLOCK_SIZE)
    bm.allocate(holder, bm.can_allocate(holder))
    holder.num_cached_tokens = holder.num_tokens
    bm.hash_blocks(holder)
    seqs = [Sequence(system + [rng.randrange(1 << 30) for _ in range(8)], block_size=BLOCK_SIZE)
            for _ in range(n_req)]
    admit_all(bm, seqs, t)
    assert all(s.num_cached_tokens == s.num_tokens for s in seqs)
    assert bm.prefix_cache_stats.hits >= SHARED_PREFIX * n_req
    for seq in seqs:
        t.call("deallocate", bm.deallocate, seq)
    bm.deallocate(holder)


def trace_revival(bm: BlockManager, rng: random.Random, n_req: int, roots, t: Timer) -> None:
    chosen = []
    for i in rng.sample(range(len(roots)), len(roots)):
        tokens, h = roots[i]
        block_id = bm.hash_to_block_id.get(h)
        if block_id is not None and bm.blocks[block_id].ref_count == 0:
            chosen.append(tokens)
            if len(chosen) == n_req:
                break
    seqs = [Sequence(tokens + [3], block_size=BLOCK_SIZE) for tokens in chosen]
    admit_all(bm, seqs, t)
    assert all(s.block_hashes for s in seqs), "benchmark bug: a root was not a hit"
    for seq in seqs:
        t.call("deallocate", bm.deallocate, seq)


def trace_revival_hot(bm: BlockManager, rng: random.Random, n_req: int, roots, t: Timer) -> None:
    """Revivals of a few popular prefixes: the same HOT_ROOTS roots again and again.

    After its first revival a popular root sits near the tail of the free queue (released
    last), so ``deque.remove`` scans almost the whole queue for it; its metadata stays in
    the CPU cache, which isolates the cost of the queue from the cost of cold memory.
    """
    hot = [tokens for tokens, h in roots[len(roots) // 2:len(roots) // 2 + HOT_ROOTS]]
    seqs = [Sequence(hot[i % HOT_ROOTS] + [3], block_size=BLOCK_SIZE) for i in range(n_req)]
    for seq in seqs:  # one at a time: each request revives its root and releases it again
        admit_all(bm, [seq], t)
        assert seq.block_hashes, "benchmark bug: a hot root was not a hit"
        t.call("deallocate", bm.deallocate, seq)


HOT_ROOTS = 16

# Revival first: the other traces overwrite cached blocks at the head of the queue.
TRACES = {"revival": trace_revival, "hot": trace_revival_hot, "miss": trace_miss, "hit": trace_hit}


def measure(num_blocks: int, kind: str, n_req: int, repeats: int, seed: int = 0) -> dict:
    """{trace: {op: median microseconds per call}} for one pool size and free-queue kind."""
    rng = random.Random(seed)
    bm = BlockManager(num_blocks, BLOCK_SIZE, free_queue=kind)
    roots = fill_cache(bm)
    gc.collect()
    gc.freeze()  # the filled pool is long-lived: keep it out of every later collection
    results = {}
    gc.disable()
    try:
        for name, trace in TRACES.items():
            t = Timer()
            for _ in range(repeats):
                trace(bm, rng, n_req, roots, t)
            results[name] = {op: 1e6 * statistics.median(sec) for op, sec in t.seconds.items() if sec}
    finally:
        gc.enable()
        gc.unfreeze()
    assert len(bm.free_block_ids) == num_blocks and not bm.used_block_ids
    return results


def queue_alone(num_blocks: int, kind: str, calls: int, seed: int = 0) -> dict[str, float]:
    """Median microseconds of the free queue's own operations, with every block free.

    ``remove`` takes a random block out (what a revival does), ``popleft`` takes the head
    (what a fresh allocation does); each is followed, untimed, by ``append`` to put the
    block back at the tail, as a release would.
    """
    rng = random.Random(seed)
    q = deque(range(num_blocks)) if kind == "deque" else FreeBlockQueue(num_blocks)
    times: dict[str, list[float]] = {"remove": [], "popleft": [], "append": []}
    for _ in range(calls):
        b = rng.randrange(num_blocks)
        t0 = time.perf_counter()
        q.remove(b)
        t1 = time.perf_counter()
        q.append(b)
        t2 = time.perf_counter()
        head = q.popleft()
        t3 = time.perf_counter()
        q.append(head)
        times["remove"].append(t1 - t0)
        times["append"].append(t2 - t1)
        times["popleft"].append(t3 - t2)
    return {op: 1e6 * statistics.median(v) for op, v in times.items()}


def fmt(x: float | None) -> str:
    return "-" if x is None else (f"{x:8.2f}" if x < 1000 else f"{x:8.0f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[1_000, 10_000, 100_000, 1_000_000])
    ap.add_argument("--requests", type=int, default=100, help="requests per trace and repeat")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    if min(args.sizes) < args.requests * 5:
        ap.error("each pool needs at least 5 blocks per request (--requests)")

    start = time.perf_counter()
    table = {}
    for n in args.sizes:
        for kind in ("deque", "linked"):
            table[n, kind] = measure(n, kind, args.requests, args.repeats)

    print(f"microseconds per call (median over {args.repeats} runs, {args.requests} requests per trace, "
          f"block_size {BLOCK_SIZE})")
    head = f"{'blocks':>9} {'queue':>6} {'trace':>8} " + " ".join(f"{op:>12}" for op in OPS)
    print(head)
    print("-" * len(head))
    for n in args.sizes:
        for kind in ("deque", "linked"):
            for name in TRACES:
                row = table[n, kind][name]
                print(f"{n:>9,} {kind:>6} {name:>8} " + " ".join(f"{fmt(row.get(op)):>12}" for op in OPS))
        print()

    print("revival traces, allocate (us/call): deque vs linked, side by side")
    print(f"{'blocks':>9} {'trace':>8} {'deque':>10} {'linked':>10} {'deque/linked':>13}")
    for n in args.sizes:
        for trace in ("revival", "hot"):
            d = table[n, "deque"][trace]["allocate"]
            li = table[n, "linked"][trace]["allocate"]
            print(f"{n:>9,} {trace:>8} {d:10.2f} {li:10.2f} {d / li:13.1f}")
    print()
    print("the free queue alone, every block free (us/call, median)")
    print(f"{'blocks':>9} {'queue':>6} {'remove':>10} {'popleft':>10} {'append':>10}")
    for n in args.sizes:
        for kind in ("deque", "linked"):
            r = queue_alone(n, kind, calls=50 if kind == "deque" and n > 100_000 else 500)
            print(f"{n:>9,} {kind:>6} {fmt(r['remove']):>10} {fmt(r['popleft']):>10} {fmt(r['append']):>10}")
    print()
    lo, hi = min(args.sizes), max(args.sizes)
    print(f"growth from {lo:,} to {hi:,} blocks (cost at {hi:,} / cost at {lo:,}):")
    growth = {}
    for kind, trace, op, note in (
            ("deque", "revival", "allocate", "deque.remove scans the queue"),
            ("deque", "hot", "allocate", "deque.remove scans the queue"),
            ("linked", "revival", "allocate", "the O(1) queue, random cold blocks"),
            ("linked", "revival", "can_allocate", "same lookups, never touches the free queue"),
            ("linked", "hot", "allocate", "the O(1) queue, popular blocks"),
            ("deque", "miss", "allocate", "popleft only, no revival")):
        growth[kind, trace, op] = table[hi, kind][trace][op] / table[lo, kind][trace][op]
        print(f"  {kind:>6} {trace:>8} {op:<13} {growth[kind, trace, op]:8.2f}x   ({note})")
    print("target, linked revival allocate flat within 1.5x:")
    for trace, what in (("hot", "popular prefixes"), ("revival", "uniformly random cached blocks")):
        ratio = growth["linked", trace, "allocate"]
        print(f"  {what:<31} {'met' if ratio <= 1.5 else 'NOT met'} ({ratio:.2f}x)")
    print(f"total time {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
