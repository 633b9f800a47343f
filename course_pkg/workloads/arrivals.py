"""Requests that arrive over time, and a loop that serves them with a real engine (chapter 09).

``poisson_trace`` draws a seeded trace: exponential gaps between arrivals (a Poisson process of
``rate`` requests per unit of time), random prompts and output lengths. ``serve`` plays it
against an ``LLM``, adding each request when its arrival time has come, on one of two clocks:

* ``clock="steps"``: time is the engine's step counter -- request ``i`` is added before the
  first step numbered ``>= arrival``. Deterministic: the notebook prints and plots it;
* ``clock="wall"``: time is seconds since the start; the loop sleeps while nothing has arrived
  and nothing runs. The benchmark measures with it.

Latencies are taken from the trace's arrival times, not from when the loop added a request, so
a request that arrives during a long step waits that step out in its time to first token, as
it would in a server. ``static=True`` serves as static batching does: requests that arrive
while a batch runs wait until the whole batch has finished, then all join the next one.
"""
from __future__ import annotations

import random
import time
from dataclasses import dataclass, field


@dataclass(frozen=True)
class TimedRequest:
    prompt: list[int]
    max_tokens: int
    arrival: float          # in the unit of the serving clock: seconds or steps


def poisson_trace(num_requests: int, rate: float, *, seed: int = 0, prompt_len=(16, 1024),
                  output_len=(16, 256), vocab_size: int = 4096, integer_arrivals: bool = False
                  ) -> list[TimedRequest]:
    """``num_requests`` requests, ``rate`` per unit of time on average; lengths uniform in the
    inclusive ranges. ``integer_arrivals`` rounds arrival times down (for the step clock)."""
    rng = random.Random(seed)
    t, trace = 0.0, []
    for _ in range(num_requests):
        prompt = [rng.randrange(1, vocab_size) for _ in range(rng.randint(*prompt_len))]
        trace.append(TimedRequest(prompt, rng.randint(*output_len), float(int(t)) if integer_arrivals else t))
        t += rng.expovariate(rate)
    return trace


@dataclass
class ServedRequest:
    """One request of a served trace: its arrival and the times (and steps) of its tokens."""

    request_id: int
    arrival: float
    prompt_len: int
    token_times: list[float]
    token_steps: list[int]

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.arrival

    @property
    def inter_token(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times, self.token_times[1:])]


@dataclass
class ServeResult:
    requests: list[ServedRequest]
    steps: list = field(default_factory=list)      # StepInfo of every step, in order
    elapsed: float = 0.0                            # clock units from the first arrival to the end
    step_seconds: list[float] = field(default_factory=list)   # wall time of every step
    step_clock: list[float] = field(default_factory=list)     # when each step started, on the serving clock

    @property
    def num_output_tokens(self) -> int:
        return sum(len(r.token_times) for r in self.requests)

    @property
    def throughput(self) -> float:
        """Output tokens per clock unit."""
        return self.num_output_tokens / self.elapsed

    def ttfts(self) -> list[float]:
        return [r.ttft for r in self.requests]

    def inter_token(self) -> list[float]:
        return [x for r in self.requests for x in r.inter_token]


def serve(llm, trace: list[TimedRequest], *, clock: str = "steps", static: bool = False) -> ServeResult:
    """Serve ``trace`` (sorted by arrival) with ``llm`` until every request has finished.

    On the step clock each step takes one unit and its tokens count at its end; while nothing
    runs and nothing has arrived, the clock jumps to the next arrival (no empty steps).
    """
    from course_pkg.sampling_params import SamplingParams

    if clock not in ("steps", "wall"):
        raise ValueError(f"clock must be 'steps' or 'wall', got {clock!r}")
    start = time.perf_counter()
    virtual = 0.0                              # the step clock
    step_start: dict[int, float] = {}          # engine step number -> its start on the step clock

    def now() -> float:
        return virtual if clock == "steps" else time.perf_counter() - start

    pending = list(trace)
    requests: dict[int, TimedRequest] = {}
    served: list[ServedRequest] = []
    steps, step_seconds, clock_at_start = [], [], []
    while pending or llm.has_unfinished_requests():
        idle = not llm.has_unfinished_requests()
        if idle and pending[0].arrival > now():
            if clock == "wall":
                time.sleep(pending[0].arrival - now())
            else:
                virtual = pending[0].arrival
        if idle or not static:
            while pending and pending[0].arrival <= now():
                req = pending.pop(0)
                params = SamplingParams(temperature=0.0, max_tokens=req.max_tokens, ignore_eos=True)
                requests[llm.add_request(req.prompt, params)] = req
        step_start[llm.num_steps] = virtual
        clock_at_start.append(now())
        t0 = time.perf_counter()
        outputs = llm.step()
        step_seconds.append(time.perf_counter() - t0)
        virtual += 1
        steps.append(llm.last_step)
        for out in outputs:
            req, m = requests[out.request_id], out.metrics
            if clock == "steps":
                times = [step_start[s] + 1 for s in m.token_steps]
            else:
                times = [m.first_token_time - start]
                for gap in m.inter_token_latencies:
                    times.append(times[-1] + gap)
            served.append(ServedRequest(out.request_id, req.arrival, len(req.prompt), times, list(m.token_steps)))
    served.sort(key=lambda r: r.request_id)
    end = max(r.token_times[-1] for r in served)
    return ServeResult(served, steps, end - min(r.arrival for r in served), step_seconds, clock_at_start)
