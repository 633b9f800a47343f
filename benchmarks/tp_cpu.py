"""Tensor parallelism on this CPU: what each rank holds, what the ranks exchange, and the speed.

    .venv/bin/python benchmarks/tp_cpu.py                   # the tiny model and the 21M model (~1 min)
    .venv/bin/python benchmarks/tp_cpu.py --models tiny     # the tiny model only

For each model -- the tiny default (4 layers, hidden 128) and a seeded random Qwen3 of ~21M
parameters (``BENCHMARK_CONFIG``: 6 layers, hidden 512) -- one seeded workload of
``--num-requests`` greedy requests runs through

* ``LLM(tensor_parallel_size=1)`` with 1 torch thread, then with ``--threads-k1`` threads (the
  same cores a 2-rank run uses),
* ``LLM(tensor_parallel_size=2)``: two processes, 1 thread each, gloo over loopback TCP,

side by side in this process. Printed: weight and KV-cache bytes per rank (each rank measures
its own), the bytes all-reduced per step by the formula ``(2 * layers + 1) * tokens * hidden
* itemsize`` and as counted by the run, how many outputs are identical across the runs,
tokens/s of each run, and the time per step: rank 0's share inside collectives, and the
average cost of one collective (latency: the tensors are a few kB).
"""
from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from course_pkg import LLM, SamplingParams  # noqa: E402


@dataclass
class Run:
    label: str
    tokens: list[list[int]]
    seconds: float
    generated: int
    weight_bytes: list[int]            # per rank
    kv_cache_bytes: list[int]
    step_log: list[tuple[int, int]]    # (tokens, bytes all-reduced) per step, k > 1 only
    comm_seconds: float                # rank 0, inside collectives during the timed run
    collectives: int                   # rank 0's collective calls during the timed run
    steps: int
    bare_all_reduce: dict[int, float]  # bytes -> seconds per call, k > 1 only

    @property
    def tokens_per_s(self) -> float:
        return self.generated / self.seconds


def make_workload(n: int, vocab: int, seed: int, prompt: tuple[int, int], output: tuple[int, int]):
    rng = random.Random(seed)
    return [([rng.randrange(1, vocab) for _ in range(rng.randint(*prompt))], rng.randint(*output))
            for _ in range(n)]


def serve(path, k: int, workload, label: str, **engine) -> Run:
    """Run ``workload`` through ``LLM(path, tensor_parallel_size=k)``; measured, then closed."""
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for _, n in workload]
    with LLM(str(path), tensor_parallel_size=k, **engine) as llm:
        llm.generate([[1, 2, 3, 4]], SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)  # warm-up
        runner = llm.model_runner
        if k > 1:
            runner.step_log.clear()
            first = runner.report()[0]
        steps_before = llm.num_steps
        if str(engine.get("device", "cpu")).startswith("cuda"):
            torch.cuda.synchronize()
        start = time.perf_counter()
        outputs = llm.generate([p for p, _ in workload], params, use_tqdm=False)
        if str(engine.get("device", "cpu")).startswith("cuda"):
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        steps = llm.num_steps - steps_before
        if k > 1:
            reports = runner.report()
            weights, kv = [r.weight_bytes for r in reports], [r.kv_cache_bytes for r in reports]
            log, comm = list(runner.step_log), reports[0].comm_seconds - first.comm_seconds
            calls = reports[0].collective_calls - first.collective_calls - 1     # not the report's own
            bare = {b: runner.time_all_reduce(b) for b in (512, 8 * 2**10, 256 * 2**10)}
        else:
            weights = [sum(p.numel() * p.element_size() for p in llm.model.parameters())]
            kv, log, comm, calls, bare = [runner.kv_cache_bytes], [], 0.0, 0, {}
    return Run(label, [o.token_ids for o in outputs], seconds, sum(len(o.token_ids) for o in outputs),
               weights, kv, log, comm, calls, steps, bare)


def report(config, runs: list[Run], itemsize: int = 4) -> None:
    """Bytes per rank, all-reduce bytes (formula vs counted), agreement and speed; ``runs[0]``
    is the k=1 baseline, ``runs[-1]`` the tensor-parallel run."""
    one, tp = runs[0], runs[-1]
    mib = 2 ** 20
    print(f"  weights per rank: k=1 {one.weight_bytes[0] / mib:.2f} MiB; k=2 "
          + ", ".join(f"rank {r} {b / mib:.2f} MiB" for r, b in enumerate(tp.weight_bytes))
          + f" ({tp.weight_bytes[0] / one.weight_bytes[0]:.3f} of k=1; the RMSNorm weights are whole on every rank)")
    print(f"  KV cache per rank: k=1 {one.kv_cache_bytes[0] / mib:.2f} MiB; k=2 "
          + ", ".join(f"rank {r} {b / mib:.2f} MiB" for r, b in enumerate(tp.kv_cache_bytes))
          + f" ({tp.kv_cache_bytes[0] / one.kv_cache_bytes[0]:.3f} of k=1, same number of blocks)")
    per_token = (2 * config.num_hidden_layers + 1) * config.hidden_size * itemsize
    formula = sum(n * per_token for n, _ in tp.step_log)
    counted = sum(b for _, b in tp.step_log)
    steps_equal = sum(b == n * per_token for n, b in tp.step_log)
    print(f"  all-reduced per step: formula (2*{config.num_hidden_layers}+1) x tokens x {config.hidden_size} x "
          f"{itemsize} B = {per_token} B per token; {len(tp.step_log)} steps, formula {formula} B, counted "
          f"{counted} B, equal in {steps_equal}/{len(tp.step_log)} steps")
    same = sum(a == b for a, b in zip(one.tokens, tp.tokens))
    first = sum(a[:8] == b[:8] for a, b in zip(one.tokens, tp.tokens))
    print(f"  outputs identical to k=1: {same}/{len(one.tokens)} (first 8 tokens: {first}/{len(one.tokens)})")
    for run in runs:
        print(f"  {run.label:<34} {run.generated:5d} tokens in {run.seconds:6.2f} s = {run.tokens_per_s:8.1f} tok/s"
              f"  ({run.tokens_per_s / one.tokens_per_s:.2f}x k=1)")
    print(f"  per step: {one.label} {1e3 * one.seconds / one.steps:.2f} ms; {tp.label} {1e3 * tp.seconds / tp.steps:.2f} ms, "
          f"of which {1e3 * tp.comm_seconds / tp.steps:.2f} ms ({tp.comm_seconds / tp.seconds:.0%}) inside "
          f"{tp.collectives / tp.steps:.1f} collectives ({1e6 * tp.comm_seconds / max(tp.collectives, 1):.0f} us each, "
          f"waiting for the slower rank included)")
    print("  a bare all-reduce between the ranks (no model): " + ", ".join(
        f"{b} B {1e6 * t:.0f} us" for b, t in tp.bare_all_reduce.items()) + " -- latency, nearly whatever the size")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="+", default=["tiny", "21M"], choices=["tiny", "21M"])
    ap.add_argument("--num-requests", type=int, default=16)
    ap.add_argument("--threads-k1", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    from course_pkg.models import build_random_checkpoint, default_model_path, load_config

    print(f"torch {torch.__version__}, {os.cpu_count()} CPU cores, float32, attention_backend=torch")
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models:
            path = default_model_path() if name == "tiny" else build_random_checkpoint(Path(tmp) / "m21")
            config = load_config(path)
            workload = make_workload(args.num_requests, config.vocab_size, args.seed, (16, 64), (16, 48))
            engine = dict(device="cpu", dtype=torch.float32, attention_backend="torch", block_size=16,
                          num_kvcache_blocks=256, max_num_seqs=args.num_requests)
            print(f"\n{name}: {config.num_hidden_layers} layers, hidden {config.hidden_size}, "
                  f"{config.num_attention_heads} heads / {config.num_key_value_heads} KV heads; "
                  f"{len(workload)} requests, {sum(len(p) for p, _ in workload)} prompt tokens")
            runs = []
            for threads, k, label in ((1, 1, "k=1, 1 thread"), (args.threads_k1, 1, f"k=1, {args.threads_k1} threads"),
                                      (1, 2, "k=2, 1 thread per rank")):
                torch.set_num_threads(threads)
                runs.append(serve(path, k, workload, label, **engine))
            report(config, runs)


if __name__ == "__main__":
    main()
