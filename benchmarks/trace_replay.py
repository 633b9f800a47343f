"""Per-request cost of the prefix cache on a real trace: the BlockManager, the radix tree, Nano-vLLM.

    .venv/bin/python benchmarks/trace_replay.py                       # pools 500 .. 100,000 blocks
    .venv/bin/python benchmarks/trace_replay.py --pools 500 30000 --requests 1000
    .venv/bin/python benchmarks/trace_replay.py --block-size 512      # Mooncake's own block size
    .venv/bin/python benchmarks/trace_replay.py --profile --pools 500 30000   # where the time goes

The Mooncake trace (``data/``) is replayed as chapter 11 replays it -- requests in trace order, at
most 16 holding blocks, the oldest released first or when a new request needs room -- by three
caches, each at the same pool sizes:

* ``BlockManager`` -- the package's, with its default ``deque`` free queue and with the linked
  one (chapter 03), on real token ids: each trace block becomes one KV block of ``--block-size``
  tokens (16 by default, vLLM's block size; 512 is Mooncake's own) that only its hash id
  produces, so chained hashing, the exact check and the token validation all do their real
  work. Per request: build the ``Sequence``, ``can_allocate``, ``allocate``, ``hash_blocks``,
  and later ``deallocate``;
* ``NanoVllm``     -- Nano-vLLM's ``BlockManager`` and ``Sequence``, re-implemented below with
  its data structures, its calls and its asserts (Python runs them): a ``deque`` whose
  ``remove`` scans, numpy-built hash input, a token-list check, registration at allocation,
  no exact check, no validation -- on the same tokens and the same calls;
* ``radix``        -- the package's ``RadixCache`` policy over the trace's block ids.

Only the cache's own work is timed (the token lists are built outside the clock), with the
garbage collector off, and each figure is the fastest of ``--repeats`` runs (the machine's load
only ever adds time). The figures vary with the machine and its load; the ratios printed side
by side, from one run, are what to read. The hit ratios are printed too: the caches must agree
on what they find for the timing to compare like with like.
"""
from __future__ import annotations

import argparse
import gc
import sys
import time
from collections import deque
from copy import copy
from itertools import count
from pathlib import Path

import numpy as np
import xxhash

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from course_pkg.block_manager import BlockManager  # noqa: E402
from course_pkg.sequence import Sequence  # noqa: E402
from course_pkg.workloads.cache_policies import RadixPolicy  # noqa: E402
from course_pkg.workloads.traces import MOONCAKE_TRACE, load_mooncake  # noqa: E402

CONCURRENCY = 16


# ------------------------------------------------------------------ Nano-vLLM's algorithm, as a foil

class NanoSamplingParams:
    def __init__(self, temperature: float = 1.0, max_tokens: int = 64, ignore_eos: bool = False):
        self.temperature = temperature
        self.max_tokens = max_tokens
        self.ignore_eos = ignore_eos


class NanoBlock:
    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.hash = -1
        self.token_ids: list[int] = []

    def update(self, h: int, token_ids: list[int]) -> None:
        self.hash = h
        self.token_ids = token_ids

    def reset(self) -> None:
        self.ref_count = 1
        self.hash = -1
        self.token_ids = []


class NanoSequence:
    counter = count()

    def __init__(self, token_ids: list[int], block_size: int, sampling_params=NanoSamplingParams()):
        self.seq_id = next(NanoSequence.counter)
        self.token_ids = copy(token_ids)   # Nano-vLLM copies the prompt, and checks nothing
        self.last_token = token_ids[-1]
        self.num_tokens = len(self.token_ids)
        self.num_prompt_tokens = len(token_ids)
        self.num_cached_tokens = 0
        self.block_table: list[int] = []
        self.block_size = block_size       # (a class attribute in Nano-vLLM)
        self.temperature = sampling_params.temperature
        self.max_tokens = sampling_params.max_tokens
        self.ignore_eos = sampling_params.ignore_eos

    @property
    def num_blocks(self) -> int:
        return (self.num_tokens + self.block_size - 1) // self.block_size

    def block(self, i: int) -> list[int]:
        assert 0 <= i < self.num_blocks
        return self.token_ids[i * self.block_size:(i + 1) * self.block_size]


class NanoBlockManager:
    """Nano-vLLM's ``engine/block_manager.py``: its decisions, data structures and asserts, for timing."""

    def __init__(self, num_blocks: int, block_size: int):
        self.block_size = block_size
        self.blocks = [NanoBlock(i) for i in range(num_blocks)]
        self.hash_to_block_id: dict[int, int] = {}
        self.free_block_ids: deque[int] = deque(range(num_blocks))
        self.used_block_ids: set[int] = set()

    @classmethod
    def compute_hash(cls, token_ids: list[int], prefix: int = -1) -> int:
        h = xxhash.xxh64()
        if prefix != -1:
            h.update(prefix.to_bytes(8, "little"))
        h.update(np.array(token_ids).tobytes())
        return h.intdigest()

    def _allocate_block(self, block_id: int) -> NanoBlock:
        block = self.blocks[block_id]
        assert block.ref_count == 0
        block.reset()
        self.free_block_ids.remove(block_id)     # O(n) for a block in the middle of the queue
        self.used_block_ids.add(block_id)
        return self.blocks[block_id]

    def _deallocate_block(self, block_id: int) -> None:
        assert self.blocks[block_id].ref_count == 0
        self.used_block_ids.remove(block_id)
        self.free_block_ids.append(block_id)

    def can_allocate(self, seq: NanoSequence) -> bool:
        return len(self.free_block_ids) >= seq.num_blocks

    def allocate(self, seq: NanoSequence) -> None:
        assert not seq.block_table
        h = -1
        cache_miss = False
        for i in range(seq.num_blocks):
            token_ids = seq.block(i)
            h = self.compute_hash(token_ids, h) if len(token_ids) == self.block_size else -1
            block_id = self.hash_to_block_id.get(h, -1)
            if block_id == -1 or self.blocks[block_id].token_ids != token_ids:
                cache_miss = True
            if cache_miss:
                block_id = self.free_block_ids[0]
                block = self._allocate_block(block_id)
            else:
                seq.num_cached_tokens += self.block_size
                if block_id in self.used_block_ids:
                    block = self.blocks[block_id]
                    block.ref_count += 1
                else:
                    block = self._allocate_block(block_id)
            if h != -1:
                block.update(h, token_ids)
                self.hash_to_block_id[h] = block_id
            seq.block_table.append(block_id)

    def deallocate(self, seq: NanoSequence) -> None:
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self._deallocate_block(block_id)
        seq.num_cached_tokens = 0
        seq.block_table.clear()


# ------------------------------------------------------------------ the three replays

def tokens_of(hash_ids, input_length: int, block_size: int) -> list[int]:
    """``block_size`` tokens per trace block, all equal to its hash id (so equal ids, equal
    blocks); the last block is cut to the share of 512 tokens the trace's last block fills."""
    last = input_length - 512 * (len(hash_ids) - 1)          # 1..512 tokens in the trace's last block
    tokens: list[int] = []
    for h in hash_ids:
        tokens += [h] * block_size
    return tokens[:len(tokens) - block_size + max(1, -(-last * block_size // 512))]


def timed_replay(trace, num_blocks: int, block_size: int, make_request, admit, release) -> tuple[float, int, int]:
    """(seconds, hit blocks, candidate blocks) of one cache on the trace, as chapter 11 replays it.

    ``make_request(tokens, hash_ids)`` builds what ``admit`` takes; ``admit(request)`` returns
    the blocks hit, or None when the request does not fit now; ``release(request)`` frees it.
    Only these three calls are timed."""
    holding: deque = deque()
    seconds, hits, candidates = 0.0, 0, 0
    for r in trace:
        if r.num_blocks > num_blocks:
            continue
        tokens = tokens_of(r.hash_ids, r.input_length, block_size)
        t0 = time.perf_counter()
        request = make_request(tokens, r.hash_ids)
        if len(holding) == CONCURRENCY:
            release(holding.popleft())
        while (hit := admit(request)) is None:
            release(holding.popleft())
        holding.append(request)
        seconds += time.perf_counter() - t0
        hits += hit
        candidates += r.num_blocks - 1
    return seconds, hits, candidates


CALLS = ("Sequence", "can_allocate", "allocate", "hash_blocks", "deallocate")


def replay_block_manager(trace, num_blocks: int, block_size: int, free_queue: str,
                         wrap=lambda name, fn: fn) -> tuple[float, int, int]:
    """The BlockManager's replay; ``wrap(name, fn)`` may wrap each call of ``CALLS`` (to time it apart)."""
    bm = BlockManager(num_blocks, block_size, free_queue=free_queue)
    make = wrap("Sequence", lambda tokens, _: Sequence(tokens, block_size=block_size))
    can_allocate, allocate, hash_blocks, deallocate = (wrap(name, getattr(bm, name)) for name in CALLS[1:])

    def admit(seq: Sequence) -> int | None:
        cached = can_allocate(seq)
        if cached == -1:
            return None
        allocate(seq, cached)
        seq.num_cached_tokens = seq.num_tokens      # the prefill ran
        hash_blocks(seq)
        return cached

    return timed_replay(trace, num_blocks, block_size, make, admit, deallocate)


def profile_block_manager(trace, num_blocks: int, block_size: int, free_queue: str) -> dict[str, float]:
    """Seconds the BlockManager's replay spends in each call of its per-request path, each call
    timed apart (the clock itself adds a little to each)."""
    spent = dict.fromkeys(CALLS, 0.0)

    def timed(name, fn):
        def call(*args):
            t0 = time.perf_counter()
            result = fn(*args)
            spent[name] += time.perf_counter() - t0
            return result
        return call

    replay_block_manager(trace, num_blocks, block_size, free_queue, wrap=timed)
    return spent


def replay_nano(trace, num_blocks: int, block_size: int) -> tuple[float, int, int]:
    bm = NanoBlockManager(num_blocks, block_size)

    def admit(seq: NanoSequence) -> int | None:
        if not bm.can_allocate(seq):
            return None
        bm.allocate(seq)
        return seq.num_cached_tokens // block_size

    return timed_replay(trace, num_blocks, block_size, lambda tokens, _: NanoSequence(tokens, block_size),
                        admit, bm.deallocate)


def replay_radix(trace, num_blocks: int, block_size: int) -> tuple[float, int, int]:
    policy = RadixPolicy(num_blocks)

    def admit(request: list) -> int | None:       # request: [hash ids, the nodes it holds]
        got = policy.admit(request[0])
        if got is None:
            return None
        hits, request[1] = got
        return hits

    return timed_replay(trace, num_blocks, block_size, lambda _, hash_ids: [hash_ids, None], admit,
                        lambda request: policy.release(request[1]))


def print_profile(trace, args) -> None:
    print(f"Mooncake trace, first {len(trace):,} requests, {args.block_size} tokens per block: the BlockManager's "
          f"microseconds per request, per call (best of {args.repeats})")
    print(f"{'pool':>8} {'queue':>7} " + " ".join(f"{name:>12}" for name in CALLS) + f" {'total':>8}")
    gc.disable()
    try:
        for pool in args.pools:
            n = sum(1 for r in trace if r.num_blocks <= pool)
            for free_queue in ("deque", "linked"):
                runs = []
                for _ in range(args.repeats):
                    gc.collect()
                    runs.append(profile_block_manager(trace, pool, args.block_size, free_queue))
                best = min(runs, key=lambda spent: sum(spent.values()))
                print(f"{pool:>8,} {free_queue:>7} " + " ".join(f"{best[name] / n * 1e6:>12.1f}" for name in CALLS)
                      + f" {sum(best.values()) / n * 1e6:>8.1f}")
    finally:
        gc.enable()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pools", type=int, nargs="+",
                        default=[500, 1000, 2000, 4000, 8000, 16000, 30000, 60000, 100000])
    parser.add_argument("--requests", type=int, default=2000, help="the first N requests of the trace")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per trace block (Mooncake's: 512)")
    parser.add_argument("--repeats", type=int, default=3, help="runs per cache and pool; the fastest counts")
    parser.add_argument("--profile", action="store_true",
                        help="instead: where the BlockManager's time goes, per call of its per-request path")
    args = parser.parse_args()
    trace = load_mooncake(MOONCAKE_TRACE, limit=args.requests)
    if args.profile:
        print_profile(trace, args)
        return
    print(f"Mooncake trace, first {len(trace):,} requests, {args.block_size} tokens per block, "
          f"concurrency {CONCURRENCY}; microseconds per request (cache work only, best of {args.repeats})")
    print(f"{'pool':>8} {'BM deque':>9} {'BM linked':>9} {'NanoVllm':>9} {'radix':>7}   "
          f"{'Nano/deque':>10} {'Nano/linked':>11}   hit ratio BM / Nano / radix")
    gc.disable()
    try:
        for pool in args.pools:
            rows = {}
            for name, run in (("deque", lambda: replay_block_manager(trace, pool, args.block_size, "deque")),
                              ("linked", lambda: replay_block_manager(trace, pool, args.block_size, "linked")),
                              ("nano", lambda: replay_nano(trace, pool, args.block_size)),
                              ("radix", lambda: replay_radix(trace, pool, args.block_size))):
                runs = []
                for _ in range(args.repeats):
                    gc.collect()
                    runs.append(run())
                seconds, hits, candidates = min(runs)
                assert len({r[1:] for r in runs}) == 1, "a replay must find the same hits every time"
                n = sum(1 for r in trace if r.num_blocks <= pool)
                rows[name] = (seconds / n * 1e6, hits / candidates)
            deq, lin, nano, radix = rows["deque"], rows["linked"], rows["nano"], rows["radix"]
            print(f"{pool:>8,} {deq[0]:>9.1f} {lin[0]:>9.1f} {nano[0]:>9.1f} {radix[0]:>7.1f}   "
                  f"{nano[0] / deq[0]:>9.2f}x {nano[0] / lin[0]:>10.2f}x   "
                  f"{lin[1]:.3f} / {nano[1]:.3f} / {radix[1]:.3f}")
            assert deq[1] == lin[1], "the two free queues must hand out the same hits"
    finally:
        gc.enable()
    print("Nano/deque, Nano/linked: Nano-vLLM's time over the BlockManager's (above 1: the BlockManager is faster).")


if __name__ == "__main__":
    main()
