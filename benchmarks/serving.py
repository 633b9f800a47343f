"""The OpenAI-compatible server under load, measured from the client side (chapter 13), on this CPU.

    .venv/bin/python benchmarks/serving.py                       # about two minutes
    .venv/bin/python benchmarks/serving.py --rates 5 20 40 80 --num-requests 100 --max-tokens 32 --rounds 5

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
4. Both engine cores (``--engine-core both``, the default): the server as it starts by default, its
   engine core a thread beside the event loop (one GIL for both), and with
   ``--engine-core-process``, the engine core in a process of its own as vLLM runs it. Each round
   measures both, one after the other; the idle one waits on its sockets.

Every request asks for exactly ``--max-tokens`` tokens (``ignore_eos``), greedy, so the server's
completions can be checked against the offline ones (the script says if any differs). The machine
is shared and a burst lasts a second or two, so one run proves little: ``--rounds`` repeats the
whole sequence -- offline, then every rate and the burst for each server -- and each figure is printed as the
median and the range over the rounds, every ratio taken against the offline run of its own round.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
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


def start_server(port: int, args, engine_core: str) -> subprocess.Popen:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "course_pkg.serve", "--port", str(port),
                             "--num-kvcache-blocks", str(args.num_kvcache_blocks),
                             "--max-num-seqs", str(args.max_num_seqs)]
                            + (["--engine-core-process"] if engine_core == "process" else []),
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


def spread(values) -> str:
    """``median [lowest, highest]`` of a figure measured once per round."""
    values = sorted(values)
    return f"{statistics.median(values):.2f} [{values[0]:.2f}, {values[-1]:.2f}]"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rates", type=float, nargs="+", default=[5, 10, 20, 40, 80])
    parser.add_argument("--num-requests", type=int, default=60)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--num-kvcache-blocks", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=3,
                        help="rounds of offline, burst and every rate, alternating (each figure: median [range])")
    parser.add_argument("--engine-core", choices=["thread", "process", "both"], default="both",
                        help="the server's engine core: a thread of its process (the default server) or a "
                             "process of its own (--engine-core-process); both: each server in every round")
    args = parser.parse_args()
    torch.set_num_threads(1)

    n, k = args.num_requests, args.max_tokens
    prompts = [f"Request {i} of the serving benchmark asks the block manager" for i in range(n)]
    params = SamplingParams(temperature=0.0, max_tokens=k, ignore_eos=True)
    print(f"{n} requests, {k} tokens each (greedy, ignore_eos); tiny model; max_num_seqs={args.max_num_seqs}, "
          f"{args.num_kvcache_blocks} blocks; torch threads: 1; {args.rounds} rounds")

    llm = LLM(device="cpu", num_kvcache_blocks=args.num_kvcache_blocks, max_num_seqs=args.max_num_seqs)
    llm.generate(prompts[:8], params, use_tqdm=False)   # warm-up
    modes = ["thread", "process"] if args.engine_core == "both" else [args.engine_core]
    servers, urls = {}, {}
    bodies = [{"prompt": p, "max_tokens": k, "temperature": 0.0, "ignore_eos": True, "logprobs": 0} for p in prompts]
    rates = args.rates + [float("inf")]
    offline_rates, runs = [], {(mode, rate): [] for mode in modes for rate in rates}
    mismatches = 0
    try:
        for mode in modes:
            port = free_port()
            urls[mode] = f"http://127.0.0.1:{port}"
            servers[mode] = start_server(port, args, mode)
            asyncio.run(run_load(urls[mode], bodies[:8], [0.0] * 8))   # warm-up
        for _ in range(args.rounds):   # the machine's noise falls on every figure of a round alike
            start = time.perf_counter()
            offline = llm.generate(prompts, params, use_tqdm=False)
            offline_rates.append(n / (time.perf_counter() - start))
            for mode in modes:   # (the other server idles meanwhile: it waits on its sockets)
                for rate in rates:
                    arrivals = [0.0] * n if rate == float("inf") else poisson_arrivals(n, rate, seed=int(rate))
                    run = asyncio.run(run_load(urls[mode], bodies, arrivals, rate=rate))
                    mismatches += sum(r.ok and r.text != o.text for r, o in zip(run.results, offline))
                    runs[mode, rate].append((run, offline_rates[-1]))
    finally:
        for proc in servers.values():
            proc.terminate()
            proc.wait(30)

    print(f"\noffline LLM.generate, all {n} at once: {spread(offline_rates)} req/s")
    print("\nserver (its own process), measured at the client; per figure the median [lowest, highest] of the rounds;"
          "\nengine core: 'thread' = a thread of the server's process (the default), 'process' = a process of its own")
    print(f"{'core':>8}{'offered':>8}  {'served req/s':<26}{'served / offline':<26}{'TTFT p50 ms':<26}{'TTFT p99 ms':<26}"
          f"{'ITL p50 ms':<26}{'ITL p99 ms':<26}{'lag p99 ms':<12}statuses")
    for mode, rate in runs:
        rr = runs[mode, rate]
        label = "burst" if rate == float("inf") else f"{rate:g}/s"
        statuses = {}
        for run, _ in rr:
            for code, count in run.statuses().items():
                statuses[code] = statuses.get(code, 0) + count
        print(f"{mode:>8}{label:>8}  {spread([r.throughput for r, _ in rr]):<26}{spread([r.throughput / o for r, o in rr]):<26}"
              f"{spread([1000 * r.ttft(50) for r, _ in rr]):<26}{spread([1000 * r.ttft(99) for r, _ in rr]):<26}"
              f"{spread([1000 * r.itl(50) for r, _ in rr]):<26}{spread([1000 * r.itl(99) for r, _ in rr]):<26}"
              f"{statistics.median(1000 * r.send_lag(99) for r, _ in rr):<12.1f}{statuses}")
    print(f"\ncompletions that differ from LLM.generate's: {mismatches}")
    print("(served / offline pairs each run with the offline run of its round; the burst's is the server's "
          "overhead, a Poisson rate's cannot exceed offered / offline)")


if __name__ == "__main__":
    main()
