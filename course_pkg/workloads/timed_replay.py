"""Replay a trace in time: each request holds its blocks from admission until it would finish
(chapter 11).

``replay`` (``replay.py``) lets a fixed number of requests hold blocks and finishes them in
arrival order; time does not pass. Here it does. A request arrives at its trace timestamp
(divided by ``speedup``: 2 means twice the traffic in the same time), waits in a first come,
first served queue, and is admitted when the pool has room for all the blocks it will ever hold
and fewer than ``max_num_seqs`` requests run. It then holds them until it finishes:

    duration = (prompt tokens not hit) / prefill_speed  +  output_length / decode_speed

A stated model of speed, not a simulation of a GPU: every request runs at the same speed however
many run beside it, and no request is preempted -- each reserves its final length when it is
admitted (vLLM allocates while decoding and preempts when the pool runs out; chapter 09).

Blocks: a request's candidates are its prompt blocks but the last, as in ``replay``. Its other
blocks are its own: the last prompt block is filled up by the answer (unless the prompt ends on
a block boundary: then that block is shared like the others), and the answer's further blocks
are new. They are cached on release, as vLLM caches full decode blocks, so they compete for the
pool -- but no later request asks for them: the trace's ids for a later turn's copy of an answer
are not the ones this replay made up (the traces do not say which blocks an answer fills).

The head of the queue waits until it fits (no request overtakes it), so requests are admitted in
arrival order and the offline ``belady`` policy knows the future order.
"""
from __future__ import annotations

import heapq
import itertools
import time
from collections import Counter, deque
from dataclasses import dataclass

from course_pkg.validation import check_positive_int
from course_pkg.workloads.replay import ReplayResult, block_ids_of, make_policy
from course_pkg.workloads.traces import MOONCAKE_BLOCK_SIZE, TraceRequest

PREFILL_SPEED = 10_000.0   # tokens per second that a request's prefill computes
DECODE_SPEED = 20.0        # tokens per second that a request decodes (50 ms per output token)


@dataclass(frozen=True)
class TimedReplayResult(ReplayResult):
    speedup: float = 1.0
    mean_running: float = 0.0       # requests holding blocks, averaged over the replay's time
    max_running: int = 0
    mean_wait_s: float = 0.0        # from arrival to admission, averaged over the requests
    max_wait_s: float = 0.0
    hits_on_held: int = 0           # hit blocks that a running request held at the time

    def __str__(self) -> str:
        return (f"policy {self.policy}, pool {self.num_blocks:,} blocks, speed-up x{self.speedup:g}: "
                f"{self.num_requests:,} requests ({self.skipped} skipped), hit {self.hit_ratio:.2%}; "
                f"{self.mean_running:.1f} running on average (most {self.max_running}), "
                f"{self.hits_on_held / max(self.hit_blocks, 1):.0%} of the hits on blocks running requests held; wait {self.mean_wait_s:.2f} s on average "
                f"(longest {self.max_wait_s:.1f} s)")


def request_blocks(trace: list[TraceRequest], block_size: int = MOONCAKE_BLOCK_SIZE) -> list[tuple[tuple, tuple]]:
    """Per request, ``(prompt_ids, held_ids)``: the trace's prompt block ids, and every block the
    request holds until it finishes -- its candidates, then blocks of its own (new ids nobody
    shares) for the last prompt block, unless the prompt ends on a block boundary, and the rest
    of the answer."""
    prompts = block_ids_of(trace)
    fresh = itertools.count(1 + max((max(ids) for ids in prompts if ids), default=-1))
    blocks = []
    for r, ids in zip(trace, prompts):
        total = -(-(r.input_length + r.output_length) // block_size)
        shared = len(ids) if r.input_length % block_size == 0 else len(ids) - 1
        blocks.append((ids, ids[:shared] + tuple(itertools.islice(fresh, max(total - shared, 0)))))
    return blocks


def replay_timed(trace: list[TraceRequest], policy, num_blocks: int, *, speedup: float = 1.0,
                 prefill_speed: float = PREFILL_SPEED, decode_speed: float = DECODE_SPEED,
                 max_num_seqs: int | None = None) -> TimedReplayResult:
    """Replay ``trace`` in time through ``policy`` on a pool of ``num_blocks`` blocks; see the
    module docstring for the model. A request that needs more blocks than the pool is skipped."""
    check_positive_int("num_blocks", num_blocks)
    for name, value in (("speedup", speedup), ("prefill_speed", prefill_speed), ("decode_speed", decode_speed)):
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0 or value == float("inf"):
            raise ValueError(f"{name} must be a positive finite number, got {value!r}")
    if max_num_seqs is not None:
        check_positive_int("max_num_seqs", max_num_seqs)
    if any(r.input_length == 0 for r in trace):
        raise ValueError("a request with no prompt blocks (input_length 0) cannot be replayed")
    cache = make_policy(policy, num_blocks)
    blocks = request_blocks(trace)
    fits = [i for i, (_, held) in enumerate(blocks) if len(held) <= num_blocks]
    t0 = min((r.timestamp_ms for r in trace), default=0.0)
    arrival = {i: (trace[i].timestamp_ms - t0) / 1000 / speedup for i in fits}
    arrivals = deque(sorted(fits, key=lambda i: (arrival[i], i)))
    if cache.offline:
        cache.prepare([blocks[i][0] for i in arrivals])   # first come, first served: admitted in this order

    hits: list[int | None] = [None] * len(trace)
    waits: list[float] = []
    running: list[tuple[float, int, object]] = []     # a heap of (finish time, trace index, handle)
    waiting: deque = deque()
    admitted: list[int] = []
    held_by_running: Counter = Counter()              # block id -> running requests holding it
    now = area_running = 0.0
    max_running = hits_on_held = 0
    start = time.perf_counter()

    def advance(to: float) -> None:
        nonlocal now, area_running
        area_running += len(running) * (to - now)
        now = to

    while arrivals or waiting or running:
        next_arrival = arrival[arrivals[0]] if arrivals else float("inf")
        if running and running[0][0] <= next_arrival:       # a finish first, at equal times
            advance(running[0][0])
            _, i, handle = heapq.heappop(running)
            cache.release(handle)
            held_by_running.subtract(blocks[i][1])
        elif arrivals:
            advance(next_arrival)
            waiting.append(arrivals.popleft())
        else:   # cannot happen: the head of the queue fits an empty pool (larger requests were skipped)
            raise RuntimeError(f"request {waiting[0]} does not fit an empty pool of {num_blocks} blocks")
        while waiting and (max_num_seqs is None or len(running) < max_num_seqs):
            i = waiting[0]
            prompt, held = blocks[i]
            got = cache.admit(held)
            if got is None:
                break                                       # the head waits for room; nobody overtakes it
            waiting.popleft()
            hit, handle = got
            hits[i] = min(hit, len(prompt) - 1)
            hits_on_held += sum(held_by_running[b] > 0 for b in prompt[:hits[i]])
            held_by_running.update(held)
            computed = trace[i].input_length - hits[i] * MOONCAKE_BLOCK_SIZE
            duration = computed / prefill_speed + trace[i].output_length / decode_speed
            heapq.heappush(running, (now + duration, i, handle))
            max_running = max(max_running, len(running))
            waits.append(now - arrival[i])
            admitted.append(i)
    seconds = time.perf_counter() - start
    return TimedReplayResult(
        policy=cache.name or type(cache).__name__, num_blocks=num_blocks, concurrency=max_running,
        num_requests=len(fits), hit_blocks=sum(hits[i] for i in fits),
        full_blocks=sum(len(blocks[i][0]) - 1 for i in fits), skipped=len(trace) - len(fits),
        hits=tuple(hits), admission_order=tuple(admitted), max_overtaken=0, seconds=seconds,
        speedup=speedup, mean_running=area_running / now if now else 0.0, max_running=max_running,
        mean_wait_s=sum(waits) / len(waits) if waits else 0.0, max_wait_s=max(waits, default=0.0),
        hits_on_held=hits_on_held)
