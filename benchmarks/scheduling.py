"""Scheduling policies on one arrival trace, and swap against recompute (chapter 09), on this CPU.

    .venv/bin/python benchmarks/scheduling.py                 # both parts, a few minutes
    .venv/bin/python benchmarks/scheduling.py --skip-swap     # part 1 only
    .venv/bin/python benchmarks/scheduling.py --num-requests 64 --repeats 3 --budgets 128   # a larger sample

Part 1, policies. One seeded Poisson arrival trace (``--num-requests`` requests at ``--rate``
per second; prompts 16-1,024 tokens, outputs 16-256, ``ignore_eos``) is served on the wall clock
three times by the same engine and checkpoint (a seeded random Qwen3 of ~21M parameters, built
offline): *static* batching (requests that arrive while a batch runs wait for the whole batch),
``scheduling="prefill_first"`` (chapter 06) and ``scheduling="mixed"`` (vLLM v1's policy). Per
policy: output throughput, time to first token p50/p99, inter-token latency p50/p99 and the
longest decode stall (the largest gap between two tokens of one request), then the ratios
mixed / prefill_first measured in the same run. The run is repeated ``--repeats`` times,
interleaved, and every figure is the median over the repeats (this machine is shared: a single
run can be slowed by a neighbour). Latencies count from each request's arrival in the trace.

How close each policy runs to the machine's limit: model FLOPs per step (2 x non-embedding
parameters x tokens computed, plus the logits of sampled tokens, plus attention: 4 x layers x
heads x head_dim x context per token) over the time spent inside steps, as a fraction of the
FLOP/s of one dense matmul of the model's MLP shape ([tokens, hidden] x [hidden, intermediate])
timed in the same run, with the same thread count.

Part 2, swap against recompute, per preempted sequence of 64 to 4,096 tokens, on two model
sizes: recompute = one prefill forward over the sequence's tokens through the ModelRunner;
swap = ``ModelRunner.swap_out`` plus ``swap_in`` of its blocks. On a CPU the "device" cache is in
host memory too, so a swap is a memcpy; ``benchmarks/swap_gpu.py`` measures the host-device
copy where it matters. The crossover is the shortest length at which recompute is cheaper.

The token budget decides what ``mixed`` buys. On a CPU a step's time grows with its tokens, so
under ``mixed`` a decode waits for one whole step of ``max_num_batched_tokens`` tokens whenever a
prompt is being prefilled, while under ``prefill_first`` it waits for every step of that prompt.
A smaller budget shortens the first and lengthens the second (Sarathi-Serve sizes its chunks
from the latency target for this reason). Part 1 runs once per ``--budgets`` value.

The issue's trace is 16-1,024-token prompts at a rate near capacity; the defaults here keep the
whole script to a few minutes on this 2-core CPU (32 requests per run, 2 requests per second,
budgets of 128 and 256 tokens per step); the output says so.
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from course_pkg import LLM  # noqa: E402
from course_pkg.workloads.swap_cost import crossover, measure_swap_vs_recompute  # noqa: E402
from course_pkg.models import build_random_checkpoint, load_model  # noqa: E402
from course_pkg.workloads.arrivals import poisson_trace, serve  # noqa: E402

CPU = dict(device="cpu", dtype=torch.float32, attention_backend="torch")


def percentile(values, q: float) -> float:
    """The q-th percentile (0-100), linear between the two nearest ranks."""
    xs = sorted(values)
    if not xs:
        return float("nan")
    pos = (len(xs) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def model_flops(config, steps) -> float:
    """FLOPs of the forward passes of ``steps`` (StepInfo): matmuls, logits and attention."""
    h, inter, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    heads, kv_heads, dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    per_layer = h * heads * dim + 2 * h * kv_heads * dim + heads * dim * h + 3 * h * inter
    flops = 0.0
    for step in steps:
        tokens = sum(n for _, _, n in step.scheduled)
        context = sum(n * first + n * (n + 1) // 2 for _, first, n in step.scheduled)   # sum of positions + 1
        flops += 2 * layers * per_layer * tokens
        flops += 2 * h * config.vocab_size * len(step.sampled)
        flops += 4 * layers * heads * dim * context
    return flops


def dense_matmul_flops_per_s(config, tokens: int, repeats: int = 10) -> float:
    a = torch.randn(tokens, config.hidden_size)
    b = torch.randn(config.hidden_size, config.intermediate_size)
    torch.matmul(a, b)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        torch.matmul(a, b)
        best = min(best, time.perf_counter() - t)
    return 2 * tokens * config.hidden_size * config.intermediate_size / best


def summarize(result, config) -> dict:
    itl = result.inter_token()
    busy = sum(result.step_seconds)
    return dict(throughput=result.throughput, ttft_p50=percentile(result.ttfts(), 50),
                ttft_p99=percentile(result.ttfts(), 99), itl_p50=percentile(itl, 50), itl_p99=percentile(itl, 99),
                stall=max(itl), flops=model_flops(config, result.steps) / busy, steps=len(result.steps))


def policies(args, path, budget: int) -> None:
    trace = poisson_trace(args.num_requests, args.rate, seed=args.seed, prompt_len=(16, 1024),
                          output_len=(16, 256), vocab_size=args.vocab_size)
    num_prompt = sum(len(r.prompt) for r in trace)
    num_output = sum(r.max_tokens for r in trace)
    print(f"\npart 1: {len(trace)} requests, Poisson arrivals at {args.rate}/s over {trace[-1].arrival:.1f} s, "
          f"prompts 16-1024 tokens ({num_prompt} in all), outputs 16-256 ({num_output} in all); "
          f"max_num_batched_tokens={budget}, max_num_seqs={args.max_num_seqs}")
    print(f"  (scaled down for this CPU: {args.num_requests} requests per run, "
          f"{args.repeats} interleaved repeats, medians reported)")
    _, config, _ = load_model(path, dtype=torch.float32, device="cpu")
    runs = {"static": [], "prefill_first": [], "mixed": []}
    matmul = []
    for rep in range(args.repeats):
        for name in runs:
            llm = LLM(str(path), **CPU, max_num_seqs=args.max_num_seqs,
                      max_num_batched_tokens=budget, kv_cache_memory_bytes=512 * 2**20,
                      scheduling="mixed" if name == "mixed" else "prefill_first")
            result = serve(llm, trace, clock="wall", static=name == "static")
            assert result.num_output_tokens == num_output
            runs[name].append(summarize(result, config))
        matmul.append(dense_matmul_flops_per_s(config, budget))
    peak = statistics.median(matmul)
    med = {name: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for name, rs in runs.items()}
    print(f"  dense matmul [{budget}, {config.hidden_size}] x "
          f"[{config.hidden_size}, {config.intermediate_size}]: {peak / 1e9:.1f} GFLOP/s "
          f"({torch.get_num_threads()} thread(s))")
    print(f"  {'policy':14s} {'steps':>6s} {'tok/s':>7s} {'TTFT p50':>9s} {'TTFT p99':>9s} "
          f"{'ITL p50':>8s} {'ITL p99':>8s} {'stall':>7s} {'GFLOP/s':>8s} {'of matmul':>9s}")
    for name, m in med.items():
        print(f"  {name:14s} {m['steps']:6.0f} {m['throughput']:7.1f} {m['ttft_p50']:8.2f}s {m['ttft_p99']:8.2f}s "
              f"{m['itl_p50'] * 1e3:6.0f}ms {m['itl_p99'] * 1e3:6.0f}ms {m['stall']:6.2f}s "
              f"{m['flops'] / 1e9:8.2f} {m['flops'] / peak:9.1%}")
    mixed, first = med["mixed"], med["prefill_first"]
    print(f"  mixed vs prefill_first: inter-token p99 cut {first['itl_p99'] / mixed['itl_p99']:.2f}x "
          f"(target >= 2x), longest stall cut {first['stall'] / mixed['stall']:.2f}x, "
          f"throughput {mixed['throughput'] / first['throughput']:.2f}x (target >= 0.95x), "
          f"TTFT p50 {mixed['ttft_p50'] / first['ttft_p50']:.2f}x, TTFT p99 {mixed['ttft_p99'] / first['ttft_p99']:.2f}x")
    print(f"  prefill_first vs static: throughput {first['throughput'] / med['static']['throughput']:.2f}x, "
          f"TTFT p99 {med['static']['ttft_p99'] / first['ttft_p99']:.2f}x lower")


# ---------------------------------------------------------------- part 2: swap against recompute

def print_swap_rows(label, config, rows) -> None:
    params = config.num_hidden_layers * (3 * config.hidden_size * config.intermediate_size)
    print(f"  {label}: {config.num_hidden_layers} layers, hidden {config.hidden_size}, "
          f"{config.num_key_value_heads} KV heads x {config.head_dim} (~{params / 1e6:.1f}M MLP parameters)")
    print(f"    {'tokens':>6s} {'recompute':>10s} {'swap out':>9s} {'swap in':>9s} {'out+in':>9s} "
          f"{'GB/s':>6s} {'recompute/swap':>14s}")
    for n, rec, out, back, nbytes in rows:
        swap = out + back
        print(f"    {n:6d} {rec * 1e3:8.2f}ms {out * 1e3:7.3f}ms {back * 1e3:7.3f}ms {swap * 1e3:7.3f}ms "
              f"{2 * nbytes / swap / 1e9:6.1f} {rec / swap:13.1f}x")
    at = crossover(rows)
    lo, hi = rows[0][0], rows[-1][0]
    print("    crossover (recompute cheaper than swap): "
          + (f"from {at} tokens" if at else f"none in {lo}-{hi} tokens: swapping is cheaper at every length"))


def swap_part(args, path, tmp) -> None:
    lengths = [64 * 2**i for i in range(7)]               # 64 .. 4096
    print(f"\npart 2: swap against recompute per preempted sequence, lengths {lengths[0]}-{lengths[-1]} tokens, "
          f"float32 on this CPU (the device cache is host memory here; see benchmarks/swap_gpu.py)")
    small = build_random_checkpoint(Path(tmp) / "small-qwen3", seed=args.seed, vocab_size=args.vocab_size,
                                    hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                                    num_attention_heads=4, num_key_value_heads=2)
    for label, p in (("small model", small), ("benchmark model", path)):
        config, rows = measure_swap_vs_recompute(p, lengths, repeats=args.swap_repeats)
        print_swap_rows(label, config, rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--rate", type=float, default=2.0, help="arrivals per second (Poisson)")
    ap.add_argument("--budgets", default="128,256", help="max_num_batched_tokens values, each a separate part-1 run")
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--swap-repeats", type=int, default=3)
    ap.add_argument("--vocab-size", type=int, default=4096)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (0: torch's default)")
    ap.add_argument("--skip-policies", action="store_true")
    ap.add_argument("--skip-swap", action="store_true")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), float32 on CPU")
    with tempfile.TemporaryDirectory() as tmp:
        path = build_random_checkpoint(Path(tmp) / "bench-qwen3", seed=args.seed, vocab_size=args.vocab_size)
        if not args.skip_policies:
            for budget in (int(b) for b in args.budgets.split(",")):
                policies(args, path, budget)
        if not args.skip_swap:
            swap_part(args, path, tmp)


if __name__ == "__main__":
    main()
