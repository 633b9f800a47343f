"""Host time per engine step outside the forward pass, and what the step's journal records.

    .venv/bin/python benchmarks/step_overhead.py            # ~1 minute on 2 cores
    .venv/bin/python benchmarks/step_overhead.py --quick    # seconds

A step is a transaction (ARCHITECTURE.md, "The journal"): every change the scheduler and the
block manager make is recorded with its inverse, and the model runner notes the sampler's
generators. This script measures what that bookkeeping costs next to the model. For decode batches of 8, 32 and 128 sequences (and one
run of prompts) on the seeded random 21M-parameter Qwen3 of ``engine_vs_hf.py``, it times every
``step()`` and, inside it, the model runner's forward pass and sampling; the rest -- schedule,
``update_from_output``, the journal, the engine's metrics -- is the host time outside the
forward pass. It also counts the journal entries each step recorded.
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from course_pkg import LLM, SamplingParams  # noqa: E402
from course_pkg.models import build_random_checkpoint  # noqa: E402
try:  # (the journal's name; the undo log's before it, so that one script measures both commits)
    from course_pkg.undo import Journal as UndoLog  # noqa: E402
except ImportError:
    from course_pkg.undo import UndoLog  # noqa: E402


def measure(path, batch: int, prompt_len: int, output_len: int, seed: int = 0) -> dict:
    llm = LLM(str(path), device="cpu", dtype=torch.float32, block_size=16, max_num_seqs=batch,
              num_kvcache_blocks=batch * (-(-(prompt_len + output_len) // 16)) + 16)
    rng = random.Random(seed)
    vocab = llm.config.vocab_size
    for _ in range(batch):
        llm.add_request([rng.randrange(1, vocab) for _ in range(prompt_len)],
                        SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True))
    runner = llm.model_runner
    real_run = runner.run_with_logprobs
    inside = []

    def timed_run(*args, **kwargs):
        start = time.perf_counter()
        result = real_run(*args, **kwargs)
        inside.append(time.perf_counter() - start)
        return result

    runner.run_with_logprobs = timed_run
    entries = []
    real_commit = UndoLog.commit

    def counting_commit(log):   # (a step may commit more than once: its own log is the longest)
        entries.append(len(log))
        real_commit(log)

    UndoLog.commit = counting_commit
    rows = []
    try:
        while llm.has_unfinished_requests():
            inside.clear()
            entries.clear()
            start = time.perf_counter()
            llm.step()
            total = time.perf_counter() - start
            rows.append((llm.last_step.is_prefill, total, sum(inside), max(entries, default=0)))
    finally:
        UndoLog.commit = real_commit
    return {"prefill": [r for r in rows if r[0]], "decode": [r for r in rows if not r[0]]}


def report(label: str, rows) -> None:
    total = statistics.median(r[1] for r in rows)
    forward = statistics.median(r[2] for r in rows)
    host = statistics.median(r[1] - r[2] for r in rows)
    log = statistics.median(r[3] for r in rows)
    print(f"{label:<28}{len(rows):>6}{1e3 * total:>11.2f}{1e3 * forward:>11.2f}{1e3 * host:>11.3f}"
          f"{host / total:>10.1%}{log:>12.0f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="small batches and short outputs")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (0: torch's default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    batches = (4, 16) if args.quick else (8, 32, 128)
    output_len = 8 if args.quick else 32
    with tempfile.TemporaryDirectory() as tmp:
        path = build_random_checkpoint(Path(tmp) / "model", seed=0)   # BENCHMARK_CONFIG
        print(f"median per step, {torch.get_num_threads()} torch thread(s); 'outside' = step() minus forward+sampling")
        print(f"{'steps':<28}{'n':>6}{'step ms':>11}{'fwd ms':>11}{'outside ms':>11}{'share':>10}{'log entries':>12}")
        for batch in batches:
            result = measure(path, batch, prompt_len=64, output_len=output_len)
            if batch == batches[-1]:
                report(f"prefill, {batch} prompts of 64", result["prefill"])
            report(f"decode, batch {batch}", result["decode"])


if __name__ == "__main__":
    main()
