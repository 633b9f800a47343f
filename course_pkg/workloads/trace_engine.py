"""The engine on a slice of a Mooncake trace (chapter 15): prompts made of the trace's blocks,
served with a fixed number of requests in flight.

The block-level replays (chapters 11, 15) count hits; this runs the real engine, so the K/V are
computed, cached, stored in a tier and loaded back, and what the caches save shows up as prefill
not computed and as time to first token. A Mooncake request names its prompt by *hash ids*, one
per 512-token block, equal ids meaning equal content after an equal prefix. ``prompts_from_trace``
turns each id into ``tokens_per_block`` tokens (one fixed random draw per id, so requests share
leading tokens exactly where they share leading ids): the trace's sharing, scaled down to a model
a CPU runs.
"""
from __future__ import annotations

import random
import time
from collections import deque
from dataclasses import dataclass

from course_pkg.validation import check_positive_int
from course_pkg.workloads.traces import MOONCAKE_BLOCK_SIZE, TraceRequest


def prompts_from_trace(trace: list[TraceRequest], tokens_per_block: int, vocab_size: int,
                       seed: int = 0) -> list[list[int]]:
    """One prompt per request: ``tokens_per_block`` tokens per hash id (ids 3 .. vocab_size - 1,
    the same for the same hash id in every request); the last block keeps the share of
    ``tokens_per_block`` that the request's last 512-token block had of 512 (at least 1)."""
    check_positive_int("tokens_per_block", tokens_per_block)
    rng = random.Random(seed)
    blocks: dict[int, list[int]] = {}
    prompts = []
    for request in trace:
        if not request.hash_ids:
            raise ValueError("a request without hash ids (an Azure trace?) has no content to rebuild")
        tokens = []
        for h in request.hash_ids:
            if h not in blocks:
                blocks[h] = [rng.randrange(3, vocab_size) for _ in range(tokens_per_block)]
            tokens += blocks[h]
        last = request.input_length - MOONCAKE_BLOCK_SIZE * (len(request.hash_ids) - 1)
        keep = max(1, min(tokens_per_block, round(last / MOONCAKE_BLOCK_SIZE * tokens_per_block)))
        prompts.append(tokens[:len(tokens) - tokens_per_block + keep])
    return prompts


@dataclass(frozen=True)
class ServedRequest:
    """One request as the engine served it: prompt tokens, those it did not compute (found in the
    device pool or loaded from a tier: ``RequestOutput.num_cached_tokens``), time to first token,
    the tokens it generated."""

    prompt_tokens: int
    cached_tokens: int
    ttft: float
    token_ids: tuple[int, ...] = ()


def serve_trace(llm, prompts: list[list[int]], max_tokens: int, concurrency: int) -> tuple[list[ServedRequest], float]:
    """Serve ``prompts`` in order, greedy, ``max_tokens`` each, at most ``concurrency`` in flight
    (the next one is added when one finishes: a closed loop, as the replays hold ``concurrency``
    requests). Returns each request's numbers, in order, and the wall-clock seconds."""
    from course_pkg import SamplingParams

    check_positive_int("concurrency", concurrency)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    pending = deque(enumerate(prompts))
    ids: dict[int, int] = {}
    served: dict[int, ServedRequest] = {}
    start = time.perf_counter()
    while pending or llm.has_unfinished_requests():
        while pending and len(ids) - len(served) < concurrency:
            i, prompt = pending.popleft()
            ids[llm.add_request(prompt, params)] = i
        for out in llm.step():
            served[ids[out.request_id]] = ServedRequest(len(out.prompt_token_ids), out.num_cached_tokens,
                                                        out.metrics.time_to_first_token,
                                                        tuple(out.outputs[0].token_ids))
    return [served[i] for i in range(len(prompts))], time.perf_counter() - start
