"""Hybrid KV cache groups (chapter 16): blocks held and the largest batch at a fixed memory, hybrid vs all-full.

    .venv/bin/python benchmarks/hybrid_kv.py                     # both parts, about a minute here
    .venv/bin/python benchmarks/hybrid_kv.py --lengths 128 256 512 --budget-blocks 400

**Formula** (``kv_cache_spec``, from the published configs of Gemma 3 27B and gpt-oss-120b): K/V
bytes one request holds at 1k-128k tokens, all layers full against the hybrid groups -- the ideal
(``bytes_per_request``) and vLLM's layout of equal-sized groups, padding included
(``bytes_per_request_in_layout``) -- and their ratio, which is the ratio of the largest batches.

**Engine**: the shipped hybrid tiny model (local layers 0 and 2, window 32) in a cache of
``--budget-blocks`` blocks of the all-full layout (the same bytes for both runs), requests of
16 prompt tokens decoded to each of ``--lengths`` tokens, side by side. For each length and for
the hybrid manager on and off (``disable_hybrid_kv_cache_manager``): the most blocks (of the run's
own layout) one request held at once, and the largest batch that runs to the end without a
preemption -- found by bisection, one engine run per probe -- beside what the formula predicts;
then the hybrid/all-full ratio, measured and predicted, from this one run.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from course_pkg import LLM, SamplingParams  # noqa: E402
from course_pkg.kv_cache_spec import (PUBLISHED_CONFIGS, bytes_per_request, bytes_per_request_in_layout,  # noqa: E402
                                      get_kv_cache_config, kv_cache_groups, max_num_requests, published_config)
from course_pkg.models import hybrid_model_path  # noqa: E402

CPU = dict(device="cpu", dtype=torch.float32, attention_backend="torch", block_size=16)
PROMPT = 16


def formula_part() -> None:
    print("K/V per request (bf16, block 16): all-full / hybrid -- ideal, and in vLLM's layout (padding)")
    for name in PUBLISHED_CONFIGS:
        config = published_config(name)
        groups, layout = kv_cache_groups(config, 16, 2), get_kv_cache_config(config, 16, 2)
        print(f"  {name}: {len(layout.kv_cache_groups)} groups of {layout.group_size} layers, "
              f"{layout.padding_layers} padding pages per block id")
        for n in (1024, 8192, 32768, 131072):
            full = bytes_per_request(groups, n, all_full=True)
            ideal, padded = bytes_per_request(groups, n), bytes_per_request_in_layout(layout, n)
            print(f"    {n:>7,} tokens: all-full {full / 2**20:8.1f} MiB  hybrid {ideal / 2**20:7.1f} MiB "
                  f"(x{full / ideal:.2f})  in layout {padded / 2**20:7.1f} MiB (x{full / padded:.2f})")


def run(budget: int, num_tokens: int, disable: bool, n: int) -> tuple[bool, int]:
    """``n`` requests side by side: (no preemption?, the most blocks one request held at once)."""
    llm = LLM(hybrid_model_path(), **CPU, kv_cache_memory_bytes=budget, max_num_seqs=n,
              disable_hybrid_kv_cache_manager=disable)
    params = SamplingParams(max_tokens=num_tokens - PROMPT, temperature=0.0, ignore_eos=True)
    for i in range(n):
        llm.add_request([5 + i % 100] * PROMPT, params)
    bm, peak = llm.block_manager, 0
    while llm.has_unfinished_requests():
        llm.step()
        peak = max(peak, len(bm.used_block_ids))
    return llm.get_metrics().num_preemptions == 0, peak


def largest_batch(budget: int, num_tokens: int, disable: bool, guess: int) -> tuple[int, float]:
    """Bisection for the largest preemption-free batch; and blocks per request at its peak."""
    lo, hi = 1, max(4, 2 * guess)
    while run(budget, num_tokens, disable, hi)[0]:
        lo, hi = hi, 2 * hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if run(budget, num_tokens, disable, mid)[0] else (lo, mid)
    return lo, run(budget, num_tokens, disable, lo)[1] / lo


def engine_part(lengths: list[int], budget_blocks: int) -> None:
    llm = LLM(hybrid_model_path(), **CPU, num_kvcache_blocks=8)
    groups = kv_cache_groups(llm.config, 16, 4)
    all_full_block = 2 * llm.config.num_hidden_layers * 16 * llm.config.num_key_value_heads * llm.config.head_dim * 4
    budget = budget_blocks * all_full_block
    print(f"\nengine: hybrid tiny model, {budget / 2**20:.2f} MiB of K/V ({budget_blocks} all-full blocks), "
          f"{PROMPT}-token prompts")
    for n in lengths:
        stored = n - 1   # the last sampled token is never fed back
        row = {}
        for disable in (False, True):
            predicted = max_num_requests(groups, stored, budget, all_full=disable)
            measured, per_request = largest_batch(budget, n, disable, predicted)
            row[disable] = (measured, predicted)
            print(f"  {n:>4} tokens, {'all-full' if disable else 'hybrid  '}: largest batch {measured:3d} "
                  f"(formula {predicted:3d}), {per_request:5.2f} blocks per request at the peak")
        ratio = row[False][0] / row[True][0]
        formula = row[False][1] / row[True][1]
        print(f"  {n:>4} tokens: hybrid / all-full = x{ratio:.3f} measured, x{formula:.3f} by the formula "
              f"({100 * (ratio / formula - 1):+.1f}%)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--part", choices=("formula", "engine", "both"), default="both")
    parser.add_argument("--lengths", type=int, nargs="+", default=[128, 256, 512])
    parser.add_argument("--budget-blocks", type=int, default=400)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.part in ("formula", "both"):
        formula_part()
    if args.part in ("engine", "both"):
        engine_part(args.lengths, args.budget_blocks)


if __name__ == "__main__":
    main()
