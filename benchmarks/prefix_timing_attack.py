"""The prefix-cache timing attack, measured on this machine, without and with cache salts (chapter 12).

    .venv/bin/python benchmarks/prefix_timing_attack.py                   # 200 trials, 8 candidates
    .venv/bin/python benchmarks/prefix_timing_attack.py --trials 400 --candidates 16
    .venv/bin/python benchmarks/prefix_timing_attack.py --block-sizes 4 16 64

A victim sends a prompt with a secret in it -- a shared system prompt, then "<one of N names> is
the patient. ..." -- and an attacker, who knows the template but not the name, sends one
probe per candidate name (in random order) and ranks them by the time to first token measured
from the client's side. The probe that repeats the victim's block finds it cached and skips a
block of prefill. Printed per scenario (``course_pkg.workloads.side_channel.SCENARIOS``): the
attacker's accuracy by TTFT and by the ``num_cached_tokens`` the server reports, each with a 95%
Wilson interval, against chance (1 / N), and the ROC AUC of the TTFT signal over all probes.
Then: the same attack by block size, with the secret in the victim's last, partial block (the
victim asks for one token, so that block never fills), and
the price of the fix, the prefix-cache hit rate of a shared-system-prompt workload by salting
rule. The shipped tiny model on the CPU, one torch thread. Timings depend on the machine and its
load; accuracies and AUCs are what to read.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from course_pkg import LLM  # noqa: E402
from course_pkg.workloads.side_channel import (SCENARIOS, accuracy, run_attack, secret_blocks,  # noqa: E402
                                               shared_prompt_hit_rates, ttft_auc, wilson_interval)


def engine(block_size: int) -> LLM:
    return LLM(None, block_size=block_size, num_kvcache_blocks=16384 // block_size * 4,
               device="cpu", dtype=torch.float32, attention_backend="torch")


def report(label: str, trials, candidates: int) -> None:
    n = len(trials)
    cells = []
    for by in ("ttft", "cached_tokens"):
        acc = accuracy(trials, by)
        lo, hi = wilson_interval(round(acc * n), n)
        cells.append(f"{acc:6.3f} [{lo:.3f}, {hi:.3f}]")
    print(f"{label:46s} {n:6d} {1 / candidates:7.3f}   {cells[0]}   {cells[1]}   {ttft_auc(trials):5.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trials", type=int, default=200)
    ap.add_argument("--candidates", type=int, default=8)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--block-sizes", type=int, nargs="*", default=[4, 16, 64])
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(1)

    header = (f"{'scenario':46s} {'trials':>6s} {'chance':>7s}   {'accuracy by TTFT [95% CI]':26s}   "
              f"{'by num_cached_tokens':26s}   {'AUC':>5s}")
    print(f"block size {args.block_size}, {args.candidates} candidates, {args.trials} trials per scenario\n")
    print(header)
    llm = engine(args.block_size)
    blocks = secret_blocks(llm.tokenizer, args.block_size)[:args.candidates]
    for i, (name, (victim, attacker)) in enumerate(SCENARIOS.items()):
        trials = run_attack(llm, blocks, args.trials, victim, attacker, seed=args.seed + i)
        report(name, trials, args.candidates)

    print(f"\nno salts, by block size (the secret's block is full, then in the victim's last, partial block)\n")
    print(header)
    for bs in args.block_sizes:
        llm = engine(bs)
        blocks = secret_blocks(llm.tokenizer, bs)[:args.candidates]
        # the same tokens of system prompt whatever the block size: 64
        system_blocks = max(1, 64 // bs)
        report(f"block size {bs}", run_attack(llm, blocks, args.trials, system_blocks=system_blocks,
                                              seed=args.seed + 10), args.candidates)
        report(f"block size {bs}, secret in a partial block",   # another seed: other system prompts
               run_attack(llm, blocks, args.trials, system_blocks=system_blocks, seed=args.seed + 11,
                          secret_at_end=True), args.candidates)

    print("\nthe price of the fix: prefix-cache hit rate of a shared-system-prompt workload "
          "(2 organisations x 4 users x 6 requests; 512 shared, 256 per organisation, 128 per user, "
          "64 new tokens)\n")
    for rule, rate in shared_prompt_hit_rates().items():
        print(f"  {rule:28s} {rate:6.3f}")


if __name__ == "__main__":
    main()
