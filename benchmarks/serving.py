"""The OpenAI-compatible server under load, measured from the client side (chapter 13), on this CPU.

    .venv/bin/python benchmarks/serving.py                       # about a minute
    .venv/bin/python benchmarks/serving.py --rates 5 20 40 80 --num-requests 100 --max-tokens 32

1. The offline engine (``LLM.generate``) on the prompts, all at once, with the same engine
   arguments: its requests per second are what the engine can do with no server in front.
2. The server (``python -m course_pkg.serve``) started as a process of its own -- so the client
   and the server do not share a GIL -- and, per arrival rate, ``--num-requests`` streaming
   completions sent open loop at seeded Poisson times (``course_pkg.serve.load``). Per rate:
   completed requests per second, time to first token p50/p99 (from each request's planned
   arrival), inter-token latency p50/p99 (from the server-sent events as they arrive), the
   client's own send lag p99 (how late it sent: if it grows, the client is part of what is
   measured), and completed/offline as a ratio.
3. A burst -- every request at once, as ``generate`` gets them -- gives the server's best
   throughput on the same prompts, and its ratio to offline: the price of HTTP, JSON, the SSE
   stream and the output processor in front of the engine.

Every request asks for exactly ``--max-tokens`` tokens (``ignore_eos``), greedy, so the server's
completions can be checked against the offline ones (the script says if any differs). The machine
is shared: timings vary from run to run; the ratios are measured side by side in one run.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402
import torch  # noqa: E402

from course_pkg.engine import LLM  # noqa: E402
from course_pkg.sampling_params import SamplingParams  # noqa: E402
from course_pkg.serve.load import poisson_arrivals, run_load  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(port: int, args) -> subprocess.Popen:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "course_pkg.serve", "--port", str(port),
                             "--num-kvcache-blocks", str(args.num_kvcache_blocks),
                             "--max-num-seqs", str(args.max_num_seqs)],
                            cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while True:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited: {proc.stderr.read()}")
        if time.monotonic() > deadline:
            proc.terminate()
            raise RuntimeError("the server did not come up in 120 s")
        time.sleep(0.2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rates", type=float, nargs="+", default=[5, 10, 20, 40, 80])
    parser.add_argument("--num-requests", type=int, default=60)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--num-kvcache-blocks", type=int, default=512)
    args = parser.parse_args()
    torch.set_num_threads(1)

    n, k = args.num_requests, args.max_tokens
    prompts = [f"Request {i} of the serving benchmark asks the block manager" for i in range(n)]
    params = SamplingParams(temperature=0.0, max_tokens=k, ignore_eos=True)
    print(f"{n} requests, {k} tokens each (greedy, ignore_eos); tiny model; max_num_seqs={args.max_num_seqs}, "
          f"{args.num_kvcache_blocks} blocks; torch threads: 1")

    llm = LLM(device="cpu", num_kvcache_blocks=args.num_kvcache_blocks, max_num_seqs=args.max_num_seqs)
    llm.generate(prompts[:8], params, use_tqdm=False)   # warm-up
    start = time.perf_counter()
    offline = llm.generate(prompts, params, use_tqdm=False)
    offline_rate = n / (time.perf_counter() - start)
    print(f"\noffline LLM.generate, all {n} at once: {offline_rate:.1f} req/s ({offline_rate * k:.0f} tokens/s)")

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start_server(port, args)
    try:
        bodies = [{"prompt": p, "max_tokens": k, "temperature": 0.0, "ignore_eos": True, "logprobs": 0}
                  for p in prompts]
        asyncio.run(run_load(url, bodies[:8], [0.0] * 8))   # warm-up
        print("\nserver (its own process), Poisson arrivals, measured at the client:")
        print(f"{'offered':>9} {'served':>8} {'/offline':>9} {'TTFT p50':>9} {'p99':>8} {'ITL p50':>8} {'p99':>8}"
              f" {'lag p99':>8}  statuses")
        mismatches = 0
        for rate in args.rates + [float("inf")]:
            arrivals = [0.0] * n if rate == float("inf") else poisson_arrivals(n, rate, seed=int(rate))
            run = asyncio.run(run_load(url, bodies, arrivals, rate=rate))
            mismatches += sum(r.ok and r.text != o.text for r, o in zip(run.results, offline))
            label = "burst" if rate == float("inf") else f"{rate:g}/s"
            print(f"{label:>9} {run.throughput:6.1f}/s {run.throughput / offline_rate:8.0%} "
                  f"{1000 * run.ttft(50):7.0f}ms {1000 * run.ttft(99):6.0f}ms "
                  f"{1000 * run.itl(50):6.1f}ms {1000 * run.itl(99):6.1f}ms {1000 * run.send_lag(99):6.1f}ms"
                  f"  {run.statuses()}")
        print(f"\ncompletions that differ from LLM.generate's: {mismatches}")
        print("(the burst's served/offline ratio is the server's overhead; at a Poisson rate the ratio "
              "cannot exceed offered/offline)")
    finally:
        proc.terminate()
        proc.wait(30)


if __name__ == "__main__":
    main()
