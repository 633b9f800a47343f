"""Speculative decoding on this CPU: acceptance and tokens/s for k in {1, 2, 4, 8}, as ratios.

    .venv/bin/python benchmarks/speculative.py              # ~1-2 min on 2 cores
    .venv/bin/python benchmarks/speculative.py --quick      # fewer tokens, one repeat

One seeded workload per kind of prompt runs, side by side in this process, through the tiny
default model with no speculation, with prompt lookup (``"ngram"``, lookup 1..3) and with the
early-exit draft (``"early_exit"``, the target's first 2 of 4 layers), each for
``num_speculative_tokens`` k in {1, 2, 4, 8}. Two kinds of prompts: *repetitive* (passages of the
tiny model's corpus that come back to their own first words; the model recalls its prose, so its
continuation repeats the prompt) and *novel* (random token ids). Two batch shapes: one request at
a time (latency) and all requests at once (throughput).

Printed per run: the drafts proposed, the acceptance rate, the mean acceptance length
(1 + accepted / drafts, vLLM's), engine steps (and without speculation), tokens/s (best of
``--repeats``; and without speculation) and their ratio. Each speculative run alternates with a
run without speculation on a fresh engine, so the ratio is measured under the same load on a
machine shared with other work. Every run's greedy tokens are checked equal to the
non-speculative run's; a difference aborts.
"""
from __future__ import annotations

import argparse
import os
import random
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from course_pkg import LLM, SamplingParams  # noqa: E402

KS = (1, 2, 4, 8)
METHODS = {
    "ngram": {"method": "ngram", "prompt_lookup_max": 3, "prompt_lookup_min": 1},
    "early_exit": {"method": "early_exit", "num_draft_layers": 2},
}


def workloads(num_requests: int, seed: int):
    paras = [p.split() for p in (ROOT / "tools" / "tiny_model_corpus.txt").read_text().split("\n\n") if p.strip()]
    repetitive = [" ".join(p[:60] + p[:3]) for p in paras[:num_requests]]
    rng = random.Random(seed)
    novel = [[rng.randrange(3, 1024) for _ in range(40)] for _ in range(num_requests)]
    return {"repetitive": repetitive, "novel": novel}


def timed(spec, prompts, params, batched: bool):
    """(tokens per prompt, seconds, metrics, steps) of one run on a fresh engine (an empty cache)."""
    llm = LLM(block_size=16, num_kvcache_blocks=512, device="cpu", speculative_config=spec)
    t0 = time.perf_counter()
    if batched:
        outs = llm.generate(prompts, params, use_tqdm=False)
    else:
        outs = [llm.generate(p, params, use_tqdm=False)[0] for p in prompts]
    return [o.token_ids for o in outs], time.perf_counter() - t0, llm.get_metrics(), llm.num_steps


def side_by_side(spec, prompts, params, batched: bool, repeats: int):
    """The speculative run and the run without speculation, alternating, best of ``repeats``
    each: their ratio is measured under the same load. Also checks the tokens are equal."""
    best, best_ref, result = float("inf"), float("inf"), None
    for _ in range(repeats):
        ref_tokens, ref_s, _, ref_steps = timed(None, prompts, params, batched)
        result = timed(spec, prompts, params, batched)
        best_ref, best = min(best_ref, ref_s), min(best, result[1])
        if result[0] != ref_tokens:
            raise SystemExit(f"{spec}: greedy tokens differ from the run without speculation")
    return result[0], best, result[2], result[3], best_ref, ref_steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--num-requests", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=14)
    ap.add_argument("--quick", action="store_true", help="24 tokens per request, one repeat")
    args = ap.parse_args()
    if args.quick:
        args.max_tokens, args.repeats = 24, 1
    torch.set_num_threads(1)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    print(f"tiny model (4 layers), {args.num_requests} requests x {args.max_tokens} greedy tokens, "
          f"best of {args.repeats}; torch threads 1")
    timed(None, workloads(1, args.seed)["repetitive"], params, False)     # warm-up
    for kind, prompts in workloads(args.num_requests, args.seed).items():
        for batched in (False, True):
            shape = "all at once" if batched else "one at a time"
            print(f"\n{kind} prompts, {shape}")
            print(f"  {'method':12s} {'k':>2s} {'drafts':>6s} {'accept':>6s} {'mean len':>8s} {'steps':>5s} "
                  f"{'(none)':>6s} {'tokens/s':>8s} {'(none)':>8s} {'x none':>6s}")
            for name, base in METHODS.items():
                for k in KS:
                    tokens, s, m, steps, ref_s, ref_steps = side_by_side(
                        dict(base, num_speculative_tokens=k), prompts, params, batched, args.repeats)
                    n = sum(map(len, tokens))
                    rate = m.spec_decode_num_accepted_tokens / max(1, m.spec_decode_num_draft_tokens)
                    print(f"  {name:12s} {k:2d} {m.spec_decode_num_drafts:6d} {rate:6.2f} "
                          f"{m.spec_decode_mean_acceptance_length:8.2f} {steps:5d} {ref_steps:6d} {n / s:8.0f} "
                          f"{n / ref_s:8.0f} {ref_s / s:6.2f}")
    print("\nevery speculative run gave the same greedy tokens as the run without speculation")


if __name__ == "__main__":
    main()
