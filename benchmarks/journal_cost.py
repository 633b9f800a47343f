"""What the journal costs a step: the scheduler's step loop with it and without it, side by side.

    .venv/bin/python benchmarks/journal_cost.py              # ~5 seconds on 2 cores
    .venv/bin/python benchmarks/journal_cost.py --quick      # ~1 second

A step is a transaction (ARCHITECTURE.md, "The journal"): the scheduler's journal records every
change of the step by itself, so that a fault anywhere undoes it. ``Scheduler(transactional=
False)`` enrols nothing -- the same code, unrecorded. This script times the host side of decode
steps -- ``schedule()`` plus ``update_from_output()`` with the sampled tokens made up, no model --
for batches of 8, 32 and 128 running sequences, both ways. Each measurement runs in a fresh
process (one process running both would share the interpreter's per-site caches between the
journaled and the plain objects and slow both), and the two alternate round by round, so the
machine's noise hits both.

This is the journal's cost with warm caches. In the engine a forward pass runs between two
steps and evicts them; the host time outside the forward pass (``step_overhead.py``) pays more
for each object the journal touches.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def measure(batch: int, transactional: bool, steps: int, prompt_len: int = 64) -> dict:
    """Median microseconds per decode step of ``schedule`` and ``update_from_output``."""
    sys.path.insert(0, str(ROOT))
    from course_pkg import SamplingParams, Scheduler, Sequence

    blocks_per_seq = -(-(prompt_len + steps + 8) // 16)
    sched = Scheduler(batch * blocks_per_seq + 16, 16, max_num_seqs=batch, transactional=transactional)
    rng = random.Random(0)
    params = SamplingParams(temperature=0.0, max_tokens=steps + 8, ignore_eos=True)
    for _ in range(batch):
        sched.add(Sequence([rng.randrange(1, 1000) for _ in range(prompt_len)], params, block_size=16))
    schedule, update = [], []
    for step in range(steps + 6):   # a prefill, five warm-up decode steps, then the timed ones
        start = time.perf_counter()
        out = sched.schedule()
        middle = time.perf_counter()
        sched.update_from_output(out, [[5]] * len(out.seqs))
        end = time.perf_counter()
        if step >= 6:
            schedule.append(middle - start)
            update.append(end - middle)
    return {"schedule": 1e6 * statistics.median(schedule), "update": 1e6 * statistics.median(update)}


def run_child(batch: int, transactional: bool, steps: int) -> dict:
    out = subprocess.run([sys.executable, __file__, "--child", str(batch), str(int(transactional)), str(steps)],
                         capture_output=True, text=True, check=True).stdout
    return json.loads(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="small batches, few steps, one round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--child", nargs=3, type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(measure(args.child[0], bool(args.child[1]), args.child[2])))
        return
    batches, steps, rounds = ((8, 32), 50, 1) if args.quick else ((8, 32, 128), 300, args.rounds)
    print(f"host microseconds per decode step, median over {steps} steps and then over {rounds} round(s); "
          "schedule() + update_from_output(), no model")
    print(f"{'batch':>6}{'journal off':>13}{'journal on':>12}{'on / off':>10}{'per sequence':>14}")
    for batch in batches:
        totals = {False: [], True: []}
        for _ in range(rounds):
            for transactional in (False, True):
                m = run_child(batch, transactional, steps)
                totals[transactional].append(m["schedule"] + m["update"])
        off, on = statistics.median(totals[False]), statistics.median(totals[True])
        print(f"{batch:>6}{off:>13.0f}{on:>12.0f}{on / off:>9.2f}x{(on - off) / batch:>+11.2f} us")


if __name__ == "__main__":
    main()
