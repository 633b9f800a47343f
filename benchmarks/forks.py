"""Forks against independent requests: KV blocks held and throughput, measured side by side.

    .venv/bin/python benchmarks/forks.py                 # ~21M-parameter random Qwen3 (a few minutes)
    .venv/bin/python benchmarks/forks.py --small         # the tiny shipped model (seconds)

Part 1, parallel sampling, n = ``--n`` (4). The same ``n`` seeded completions of each prompt
are produced three ways, and the script checks the tokens are identical:

* **forks**: ``--num-prompts`` requests with ``SamplingParams(n=4)`` -- the prompt computed
  once, its blocks shared, the partial last block copied on write;
* **independent**: ``n`` requests per prompt with seeds ``s + j``, prefix caching off;
* **vLLM v1 style**: the same ``n`` requests with prefix caching on and a token budget of one
  prompt per step, so later requests hit the first one's full blocks.

Part 2, beam search, width ``--beam-width`` (4): distinct blocks the beams hold against their
block-table entries (what the same hypotheses would hold unshared), and the wall time of the
search against ``beam_width`` independent greedy requests of the same length (the same number
of forward-pass tokens per step, without the search).

Printed: peak and mean blocks held (counted after every step), tokens computed, seconds, and
the ratios, all measured in one run.
"""
from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from course_pkg import LLM, SamplingParams  # noqa: E402
from course_pkg.workloads.watch import watch_beam_search, watch_generate  # noqa: E402
from course_pkg.models import build_random_checkpoint  # noqa: E402
from course_pkg.sampling_params import BeamSearchParams  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--small", action="store_true", help="the tiny shipped model instead of the 21M one")
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--beam-width", type=int, default=4)
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=250)   # not a multiple of 16: a partial block to copy
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    with tempfile.TemporaryDirectory() as tmp:
        path = None if args.small else build_random_checkpoint(Path(tmp) / "model", seed=0)
        vocab = 1024 if args.small else 4096
        rng = random.Random(0)
        prompts = [[rng.randrange(1, vocab) for _ in range(args.prompt_len)] for _ in range(args.num_prompts)]
        per_request = -(-(args.prompt_len + args.max_tokens) // args.block_size)
        pool = 2 * args.num_prompts * max(args.n, args.beam_width) * per_request

        def engine(caching=True, budget=8192):
            return LLM(path, block_size=args.block_size, num_kvcache_blocks=pool, enable_prefix_caching=caching,
                       max_num_batched_tokens=budget, device="cpu", dtype=torch.float32, attention_backend="torch")

        def params(seed, n=1):
            return SamplingParams(temperature=1.0, seed=seed, n=n, max_tokens=args.max_tokens, ignore_eos=True)

        print(f"model: {'tiny shipped' if args.small else '~21M random Qwen3'}; {args.num_prompts} prompts of "
              f"{args.prompt_len} tokens, {args.max_tokens} generated, block size {args.block_size}, "
              f"pool {pool} blocks, {torch.get_num_threads()} torch thread(s)")

        # ------------------------------------------------------------ part 1
        n = args.n
        forks = watch_generate(engine(), prompts, [params(100 * i, n) for i in range(len(prompts))])
        singles = [params(100 * i + j) for i in range(len(prompts)) for j in range(n)]
        repeated = [p for p in prompts for _ in range(n)]
        independent = watch_generate(engine(caching=False), repeated, singles)
        v1 = watch_generate(engine(budget=args.prompt_len), repeated, singles)
        tokens_forks = [c.token_ids for out in forks.outputs for c in out.outputs]
        same = tokens_forks == [o.token_ids for o in independent.outputs] == [o.token_ids for o in v1.outputs]
        print(f"\nparallel sampling, n={n}: identical completions in all three runs: {same}")
        print(f"{'':16s} {'peak blocks':>11s} {'mean blocks':>11s} {'computed':>9s} {'copies':>7s} {'seconds':>8s}")
        for name, w in (("forks", forks), ("independent", independent), ("vLLM v1 style", v1)):
            print(f"{name:16s} {w.peak_blocks:11d} {w.mean_blocks:11.1f} {w.computed_tokens:9d} {w.copies:7d} {w.seconds:8.2f}")
        print(f"forks / independent: mean blocks {forks.mean_blocks / independent.mean_blocks:.3f} "
              f"(saved {100 * (1 - forks.mean_blocks / independent.mean_blocks):.1f}%), "
              f"peak {forks.peak_blocks / independent.peak_blocks:.3f}, "
              f"throughput {independent.seconds / forks.seconds:.2f}x")
        print(f"forks / vLLM v1 style: mean blocks {forks.mean_blocks / v1.mean_blocks:.3f}, "
              f"computed tokens {forks.computed_tokens / v1.computed_tokens:.3f}, "
              f"throughput {v1.seconds / forks.seconds:.2f}x")

        # ------------------------------------------------------------ part 2
        k = args.beam_width
        beam_params = BeamSearchParams(beam_width=k, max_tokens=args.max_tokens, ignore_eos=True)
        llm = engine()
        beams = [watch_beam_search(llm, p, beam_params) for p in prompts]
        greedy = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
        baseline = watch_generate(engine(), [p for p in prompts for _ in range(k)], greedy)
        mean_blocks = sum(sum(w.blocks) for w in beams) / sum(len(w.blocks) for w in beams)
        mean_entries = sum(sum(w.entries) for w in beams) / sum(len(w.entries) for w in beams)
        seconds = sum(w.seconds for w in beams)
        print(f"\nbeam search, width {k}, {len(prompts)} prompts one after another:")
        print(f"  peak blocks held {max(w.peak_blocks for w in beams)} vs {max(w.peak_entries for w in beams)} "
              f"block-table entries; mean {mean_blocks:.1f} vs {mean_entries:.1f} "
              f"(saved {100 * (1 - mean_blocks / mean_entries):.1f}%); copies {sum(w.copies for w in beams)}")
        print(f"  {seconds:.2f} s vs {baseline.seconds:.2f} s for {k} independent greedy requests per prompt "
              f"(all at once): {baseline.seconds / seconds:.2f}x")


if __name__ == "__main__":
    main()
