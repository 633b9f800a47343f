"""The line-level fault sweep of issue 28, wider than CI runs it: every engine configuration.

``tests/test_line_faults.py`` faults two configurations at a sample of line events that fits CI's
time. This script runs the same faulted runs (the same ``LineFault`` tracer, the same checks
after every fault: no open step, the pool's invariants, every request exactly once somewhere)
over more configurations -- prefix caching off, block size 1, long chunking, both preemption
modes, mixed scheduling, same-step hits, cache salts, n-gram and draft-model speculation -- and
prints, per configuration and fault kind, the faulted runs and what went wrong:

    half-open / lost / corrupt  an assertion of ``check_after_fault`` failed (the message is printed)
    tokens                      the run finished with other tokens than the fault-free run
    hang                        a run did not finish within its wall-clock limit
    error                       anything else raised out of the engine

    .venv/bin/python tools/line_fault_sweep.py --samples 20        # about 10 minutes on 2 cores

Every sampled line event k is spread evenly over the fault-free run's events, with a seeded
offset, so the runs cover the whole step: the plumbing, the scheduler, the runner, the hand-out.
"""
from __future__ import annotations

import argparse
import random
import signal
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from course_pkg import LLM  # noqa: E402
from tests.test_line_faults import KINDS, LineFault, check_after_fault  # noqa: E402
from tests.test_step_transaction import CONFIGS, CPU, MODEL, PARAMS, PROMPTS, make_llm  # noqa: E402

NGRAM = dict(method="ngram", num_speculative_tokens=3, prompt_lookup_max=3, prompt_lookup_min=1)
DRAFT = dict(method="early_exit", num_speculative_tokens=3, num_draft_layers=2)
SALTED = [{"prompt_token_ids": p, "cache_salt": salt} if salt else p
          for p, salt in zip(PROMPTS, ("alice", None, "alice", "bob"))]

#: name -> (LLM keyword arguments beyond CPU, the prompts)
SWEEP = {
    **{name: (config, PROMPTS) for name, config in CONFIGS.items()},
    "no prefix caching": (dict(block_size=4, num_kvcache_blocks=14, max_num_batched_tokens=20,
                               enable_prefix_caching=False), PROMPTS),
    "block size 1": (dict(block_size=1, num_kvcache_blocks=56, max_num_batched_tokens=20), PROMPTS),
    "chunked, 6 tokens a step": (dict(block_size=4, num_kvcache_blocks=14, max_num_batched_tokens=6), PROMPTS),
    "cache salts": (dict(block_size=4, num_kvcache_blocks=14, max_num_batched_tokens=20), SALTED),
    "n-gram speculation": (dict(block_size=4, num_kvcache_blocks=20, max_num_batched_tokens=20,
                                speculative_config=NGRAM), PROMPTS),
    "draft-model speculation, mixed+swap": (dict(CONFIGS["mixed-swap-same_step"], num_kvcache_blocks=20,
                                                 speculative_config=DRAFT), PROMPTS),
}


class Hang(BaseException):
    """A faulted run ran past its wall-clock limit."""


def serve(llm, prompts, tracer: LineFault | None = None):
    """Serve ``prompts`` step by step with ``PARAMS``; after a fault check the engine and go on."""
    ids = [llm.add_request(p, sp) for p, sp in zip(prompts, PARAMS)]
    returned = {}
    for _ in range(400):
        if not llm.has_unfinished_requests():
            break
        sys.settrace(tracer)
        try:
            finished = llm.step()
        except (RuntimeError, MemoryError, KeyboardInterrupt) as e:
            sys.settrace(None)
            if tracer is None or not tracer.fired or isinstance(e, RuntimeError) and "injected" not in str(e):
                raise
            check_after_fault(llm, ids, returned, tracer)
            continue
        finally:
            sys.settrace(None)
        for out in finished:
            assert out.request_id not in returned, f"request {out.request_id} returned twice"
            returned[out.request_id] = [c.token_ids for c in out.outputs]
    assert not llm.has_unfinished_requests(), "the engine did not finish"
    return [returned[i] for i in ids]


def _alarm(signum, frame):
    raise Hang


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=20, help="faulted runs per configuration and fault kind")
    parser.add_argument("--limit", type=float, default=60.0, help="seconds a faulted run may take")
    parser.add_argument("--only", help="run only the configurations whose name contains this")
    args = parser.parse_args()
    torch.set_num_threads(1)
    signal.signal(signal.SIGALRM, _alarm)
    total = Counter()
    start = time.perf_counter()
    print(f"{'configuration':<38} {'kind':<13} {'line events':>11} {'runs':>5} {'fired':>6} {'failures':>9}")
    for name, (config, prompts) in SWEEP.items():
        if args.only and args.only not in name:
            continue
        clean = LineFault()
        expected = serve(make_llm(config), prompts, clean)
        rng = random.Random(name)
        for kind in KINDS:
            failures, fired = [], 0
            offset = rng.random()
            for i in range(args.samples):
                at = 1 + int((i + offset) * clean.lines / args.samples)
                tracer = LineFault(at, kind)
                llm = make_llm(config)
                signal.setitimer(signal.ITIMER_REAL, args.limit)
                try:
                    tokens = serve(llm, prompts, tracer)
                    if tokens != expected:
                        failures.append(("tokens", f"at {at} ({tracer.where}): other tokens"))
                except Hang:
                    failures.append(("hang", f"at {at}: past {args.limit:g} s"))
                except AssertionError as e:
                    failures.append(("check", str(e).splitlines()[0]))
                except BaseException as e:  # noqa: BLE001 -- whatever escaped the engine
                    failures.append(("error", f"at {at} ({getattr(tracer, 'where', '?')}): {type(e).__name__}: {e}"))
                finally:
                    signal.setitimer(signal.ITIMER_REAL, 0)
                    sys.settrace(None)
                fired += tracer.fired
            total.update(runs=args.samples, fired=fired, failures=len(failures))
            total.update(kind for kind, _ in failures)
            print(f"{name:<38} {kind:<13} {clean.lines:>11,} {args.samples:>5} {fired:>6} {len(failures):>9}")
            for what, message in failures[:5]:
                print(f"    {what}: {message}")
    print(f"\n{total['runs']} faulted runs, {total['fired']} faults fired, {total['failures']} failures "
          f"(check {total['check']}, tokens {total['tokens']}, hang {total['hang']}, error {total['error']}) "
          f"in {time.perf_counter() - start:.0f} s")
    return 1 if total["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
