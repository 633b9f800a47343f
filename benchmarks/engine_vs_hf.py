"""Our engine vs Hugging Face ``generate`` on the same model and workload, on this machine's CPU.

    .venv/bin/python benchmarks/engine_vs_hf.py                      # the full run (minutes)
    .venv/bin/python benchmarks/engine_vs_hf.py --num-requests 32 --max-output 64   # a quick look
    .venv/bin/python benchmarks/engine_vs_hf.py --threads 0       # torch's default thread count

Part 1, throughput. One seeded workload -- ``--num-requests`` requests (256), prompts of 16 to
512 random tokens, 16 to 256 output tokens each, ``ignore_eos`` so every request produces
exactly its length -- runs through

* our ``LLM.generate`` (continuous batching over the paged cache, at most ``--batch-size``
  sequences at once), and
* ``AutoModelForCausalLM.generate(do_sample=False)`` in batches of ``--batch-size`` requests in
  arrival order (left-padded prompts; each batch decodes until its longest output is done --
  *static* batching, which is what ``generate`` offers),

on the same checkpoint: a seeded random Qwen3 of ~21M parameters (``BENCHMARK_CONFIG``), built
offline in a temporary folder. Both produce greedy tokens; the script counts the requests whose
tokens agree exactly and prints the throughput ratio of the two runs, measured side by side.

Part 2, prefix caching. 64 requests share a 1,024-token system prompt and differ in a 16-64
token question. With caching on and off it prints the prompt tokens the prefill steps actually
computed and the wall time. With a token budget of 1,024 tokens per step the first request's
prefix is computed before the next one is admitted; with a large budget, requests admitted in
the same step as the first cannot hit blocks whose K/V do not exist yet -- both are printed,
and then both again with ``same_step_prefix_hits=True`` (chapter 09), which registers a block
when it is scheduled to be filled, so requests of that same step hit it.
"""
from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from course_pkg import LLM, SamplingParams  # noqa: E402
from course_pkg.models import build_random_checkpoint  # noqa: E402


def make_workload(n: int, vocab: int, seed: int, min_prompt: int, max_prompt: int,
                  min_output: int, max_output: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [([rng.randrange(1, vocab) for _ in range(rng.randint(min_prompt, max_prompt))],
             rng.randint(min_output, max_output)) for _ in range(n)]


def run_engine(path, workload, batch_size: int, **engine_args):
    llm = LLM(str(path), max_num_seqs=batch_size, **engine_args)
    prompts = [p for p, _ in workload]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for _, n in workload]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    return [o.token_ids for o in outputs], elapsed, llm.get_metrics()


def run_hf(path, workload, batch_size: int) -> tuple[list[list[int]], float]:
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None      # ignore_eos: every request runs its length
    pad = 0
    outputs: list[list[int]] = []
    start = time.perf_counter()
    for i in range(0, len(workload), batch_size):
        batch = workload[i:i + batch_size]
        width = max(len(p) for p, _ in batch)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p, _ in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in batch])
        with torch.no_grad():
            out = model.generate(ids, attention_mask=mask, do_sample=False, pad_token_id=pad,
                                 max_new_tokens=max(n for _, n in batch))
        outputs += [out[j, width:width + n].tolist() for j, (_, n) in enumerate(batch)]
    return outputs, time.perf_counter() - start


def throughput(args, path) -> None:
    vocab = args.vocab_size
    workload = make_workload(args.num_requests, vocab, args.seed, args.min_prompt, args.max_prompt,
                             args.min_output, args.max_output)
    num_prompt = sum(len(p) for p, _ in workload)
    num_output = sum(n for _, n in workload)
    print(f"workload: {len(workload)} requests, {num_prompt} prompt tokens "
          f"({args.min_prompt}-{args.max_prompt} each), {num_output} output tokens "
          f"({args.min_output}-{args.max_output} each), ignore_eos, greedy, batch size {args.batch_size}")
    ours, t_ours, m = run_engine(path, workload, args.batch_size, block_size=16,
                                 max_num_batched_tokens=args.max_num_batched_tokens,
                                 kv_cache_memory_bytes=args.kv_cache_mib * 2**20, attention_backend="torch")
    print(f"engine : {t_ours:8.1f} s  {num_output / t_ours:8.1f} output tok/s  "
          f"{(num_prompt + num_output) / t_ours:8.1f} total tok/s  "
          f"({m.num_kvcache_blocks} blocks, {m.num_prefill_steps} prefill + {m.num_decode_steps} decode steps, "
          f"{m.num_preemptions} preemptions)")
    theirs, t_hf = run_hf(path, workload, args.batch_size)
    print(f"HF     : {t_hf:8.1f} s  {num_output / t_hf:8.1f} output tok/s  "
          f"{(num_prompt + num_output) / t_hf:8.1f} total tok/s  "
          f"({(len(workload) + args.batch_size - 1) // args.batch_size} static batches)")
    same = sum(a == b for a, b in zip(ours, theirs))
    agree = sum(sum(x == y for x, y in zip(a, b)) for a, b in zip(ours, theirs))
    print(f"greedy outputs identical for {same}/{len(workload)} requests "
          f"({agree}/{num_output} tokens at equal positions)")
    if same < len(workload):
        first = next(i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b)
        pos = next(j for j, (x, y) in enumerate(zip(ours[first], theirs[first])) if x != y)
        print(f"  first difference: request {first}, output position {pos} "
              f"(HF pads prompts in a batch; padded float32 sums round differently)")
    print(f"throughput ratio engine / HF: {t_hf / t_ours:.2f}x")


def prefix_caching(args, path) -> None:
    rng = random.Random(args.seed + 1)
    vocab = args.vocab_size
    system = [rng.randrange(1, vocab) for _ in range(1024)]
    workload = [(system + [rng.randrange(1, vocab) for _ in range(rng.randint(16, 64))], 16)
                for _ in range(64)]
    num_prompt = sum(len(p) for p, _ in workload)
    print(f"\nprefix caching: 64 requests = one 1024-token system prompt + a 16-64 token question, "
          f"16 output tokens; {num_prompt} prompt tokens in all")
    rows = []
    for caching, budget, same_step in ((False, 1024, False), (True, 1024, False), (True, 8192, False),
                                       (True, 1024, True), (True, 8192, True)):
        _, elapsed, m = run_engine(path, workload, 64, block_size=16, max_num_batched_tokens=budget,
                                   enable_prefix_caching=caching, same_step_prefix_hits=same_step,
                                   kv_cache_memory_bytes=args.kv_cache_mib * 2**20, attention_backend="torch")
        rows.append((caching, budget, same_step, m.prefill_kv_computed_tokens, elapsed))
        print(f"  caching {'on ' if caching else 'off'}{' same-step hits' if same_step else ''} "
              f"budget {budget:5d} tok/step: "
              f"prefill computed {m.prefill_kv_computed_tokens:6d} tokens, {elapsed:6.1f} s, "
              f"prefix-cache hit rate {m.prefix_cache_hit_rate:.3f}")
    off = rows[0]
    for caching, budget, same_step, computed, elapsed in rows[1:]:
        print(f"  on{' (same-step hits)' if same_step else ''} vs off (budget {budget}): prefill tokens cut by "
              f"{1 - computed / off[3]:.1%}, wall time {off[4] / elapsed:.2f}x faster")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--min-prompt", type=int, default=16)
    ap.add_argument("--max-prompt", type=int, default=512)
    ap.add_argument("--min-output", type=int, default=16)
    ap.add_argument("--max-output", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=64, help="max sequences at once, both engines")
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--kv-cache-mib", type=int, default=1024)
    ap.add_argument("--vocab-size", type=int, default=4096)
    ap.add_argument("--seed", type=int, default=0)
    # One thread by default: on a small shared machine, torch's threads oversubscribe the cores
    # and spin (measured here: 2 threads ran decode steps 5-9x slower than 1 under load).
    ap.add_argument("--threads", type=int, default=1, help="torch threads for both engines (0: torch's default)")

    ap.add_argument("--skip-throughput", action="store_true")
    ap.add_argument("--skip-prefix", action="store_true")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, float32 on CPU")
    with tempfile.TemporaryDirectory() as tmp:
        path = build_random_checkpoint(Path(tmp) / "bench-qwen3", seed=args.seed, vocab_size=args.vocab_size)
        n_params = sum(t.numel() for t in __import__("safetensors.torch", fromlist=["load_file"])
                       .load_file(str(path / "model.safetensors")).values())
        print(f"model: random Qwen3, {n_params / 1e6:.1f}M parameters (BENCHMARK_CONFIG)")
        if not args.skip_throughput:
            throughput(args, path)
        if not args.skip_prefix:
            prefix_caching(args, path)


if __name__ == "__main__":
    main()
