"""A client-side load generator for the server (chapter 13 and ``benchmarks/serving.py``).

Latency as a user sees it is measured at the client: ``run_load`` sends streaming completions
at given arrival times (open loop: a request goes out at its time whether or not earlier ones
have finished, as real users do) and records, per request, the time to the first token and the
gaps between tokens, from the server-sent events as they arrive. Times count from each request's
*planned* arrival, not from the moment the client got round to sending it: a client that falls
behind (one sharing a process or a CPU with the server) must not hide its own lateness. How late
it sent is reported too (``send_lag``): when it grows, the client is part of what is measured.
Arrival patterns:
``poisson_arrivals`` (independent users) and ``scaled_arrivals`` (a trace's own timestamps,
e.g. the Azure trace's, stretched to a mean rate: real traffic is burstier than Poisson).
"""
from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field


def poisson_arrivals(num_requests: int, rate: float, seed: int = 0) -> list[float]:
    """Arrival times (seconds from 0) of a Poisson process of ``rate`` requests per second."""
    rng, t, times = random.Random(seed), 0.0, []
    for _ in range(num_requests):
        t += rng.expovariate(rate)
        times.append(t)
    return times


def scaled_arrivals(timestamps_ms, num_requests: int, rate: float) -> list[float]:
    """The first ``num_requests`` of a trace's timestamps, rescaled to a mean of ``rate`` per second."""
    ts = [t / 1000 for t in list(timestamps_ms)[:num_requests]]
    span = ts[-1] - ts[0]
    if len(ts) < 2 or span <= 0:
        raise ValueError("need at least two distinct timestamps to scale")
    scale = (len(ts) - 1) / rate / span
    return [(t - ts[0]) * scale for t in ts]


@dataclass
class RequestResult:
    """One request as the client saw it."""

    arrival: float                 # planned send time (seconds from the start of the run)
    status: int = 0                # HTTP status (0: no response)
    ttft: float | None = None      # planned arrival -> first token
    send_lag: float | None = None  # planned arrival -> the request actually went out
    itls: list[float] = field(default_factory=list)   # gaps between later tokens
    num_tokens: int = 0
    text: str = ""
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None


@dataclass
class LoadResult:
    rate: float
    results: list[RequestResult]
    duration: float                # first send -> last response done

    @property
    def completed(self) -> list[RequestResult]:
        return [r for r in self.results if r.ok]

    @property
    def throughput(self) -> float:
        """Completed requests per second."""
        return len(self.completed) / self.duration if self.duration > 0 else 0.0

    def ttft(self, q: float) -> float:
        return percentile([r.ttft for r in self.completed if r.ttft is not None], q)

    def itl(self, q: float) -> float:
        return percentile([g for r in self.completed for g in r.itls], q)

    def send_lag(self, q: float) -> float:
        """How late the client sent (every request that went out), the ``q``-th percentile."""
        return percentile([r.send_lag for r in self.results if r.send_lag is not None], q)

    def statuses(self) -> dict[int, int]:
        counts: dict[int, int] = {}
        for r in self.results:
            counts[r.status] = counts.get(r.status, 0) + 1
        return dict(sorted(counts.items()))


def percentile(values, q: float) -> float:
    """The ``q``-th percentile (0-100) by linear interpolation, as numpy's default; nan if empty."""
    values = sorted(values)
    if not values:
        return float("nan")
    k = (len(values) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


async def _one(http, body: dict, result: RequestResult, start: float) -> None:
    planned = start + result.arrival
    await asyncio.sleep(max(0.0, planned - time.perf_counter()))
    last = time.perf_counter()
    result.send_lag = last - planned
    try:
        async with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            result.status = r.status_code
            if r.status_code != 200:
                result.error = json.loads(await r.aread())["error"]["message"]
                return
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    result.error = chunk["error"]["message"]
                    return
                now = time.perf_counter()
                choice = chunk["choices"][0]
                result.text += choice["text"]
                n = len(choice["logprobs"]["tokens"]) if choice.get("logprobs") else (1 if choice["text"] else 0)
                if n and result.ttft is None:
                    result.ttft = now - planned
                elif n:
                    result.itls.append(now - last)
                if n:
                    last = now
                result.num_tokens += n
    except Exception as e:   # a refused connection, a reset: the run goes on, the request failed
        result.error = f"{type(e).__name__}: {e}"


async def run_load(url: str, bodies: list[dict], arrivals: list[float], *, rate: float = float("nan"),
                   timeout: float = 120.0) -> LoadResult:
    """Send ``bodies[i]`` (a completions request; ``stream`` is set) at ``arrivals[i]`` seconds.

    Tokens are counted from ``logprobs`` when the body asks for them (``"logprobs": 0``), else
    one per chunk with text.
    """
    import httpx

    if len(bodies) != len(arrivals):
        raise ValueError(f"{len(bodies)} bodies but {len(arrivals)} arrival times")
    results = [RequestResult(arrival=a) for a in arrivals]
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(base_url=url, timeout=timeout, limits=limits) as http:
        start = time.perf_counter()
        await asyncio.gather(*[_one(http, b, r, start) for b, r in zip(bodies, results)])
        duration = time.perf_counter() - start
    return LoadResult(rate=rate, results=results, duration=duration)
