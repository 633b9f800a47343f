"""A tier behind the device pool (chapter 15): hit ratios on the traces, and the engine with and without it.

    .venv/bin/python benchmarks/offload.py                        # both parts, about a minute here
    .venv/bin/python benchmarks/offload.py --part replay --requests 2000 --pools 1000 2000 --tiers 2000 8000 30000
    .venv/bin/python benchmarks/offload.py --part engine --engine-requests 600 --rounds 3

**Replay** (``workloads.tier_replay``, block by block, chapter 11's model): the first
``--requests`` requests of Mooncake's conversation trace and of its synthetic trace, a device pool
of each ``--pools`` size (vLLM's BlockManager) with a tier of each ``--tiers`` size behind it -- the
grid of device blocks by tier blocks -- stored on
compute, for LRU, ARC and the reuse gate (LRU storing only blocks asked for twice); each hit ratio
(device and tier hits over full blocks) and its share of the infinite bound, all from one run.

**Engine**: the first ``--engine-requests`` requests of the conversation trace as prompts
(``workloads.trace_engine``: each 512-token trace block becomes 4 tokens, the engine's block size,
so the trace's sharing is kept block for block), served greedy, 4 tokens each, 8 in flight, by the
tiny model on a pool of ``--engine-pool`` blocks, without a tier and with one of ``--engine-tier``
blocks, alternately for ``--rounds`` rounds. Printed: prompt tokens computed and found, time to
first token (p50, p99) and wall time, and the ratios with/without, per round and as the median.
The times vary with the machine and its load; read the ratios of one run.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from course_pkg import LLM  # noqa: E402
from course_pkg.offload import ARCOffloadingManager, FilterReusedOffloadingManager, LRUOffloadingManager  # noqa: E402
from course_pkg.workloads.replay import replay  # noqa: E402
from course_pkg.workloads.tier_replay import replay_with_tier  # noqa: E402
from course_pkg.workloads.trace_engine import prompts_from_trace, serve_trace  # noqa: E402
from course_pkg.workloads.traces import MOONCAKE_CONVERSATION_TRACE, MOONCAKE_TRACE, load_trace  # noqa: E402

TIERS = {"lru": LRUOffloadingManager, "arc": ARCOffloadingManager,
         "gate": lambda n: FilterReusedOffloadingManager(LRUOffloadingManager(n), store_threshold=2)}


def replay_part(args) -> None:
    for name, path in (("conversation", MOONCAKE_CONVERSATION_TRACE), ("synthetic", MOONCAKE_TRACE)):
        trace = load_trace(path, limit=args.requests)
        bound = replay(trace, "infinite", 10**9).hit_ratio
        print(f"\n{name} trace, first {len(trace):,} requests: infinite bound {bound:.2%}")
        for pool in args.pools:
            device = replay(trace, "vllm", pool).hit_ratio
            print(f"device pool of {pool:,} blocks alone {device:.2%}; with a tier:")
            print(f"{'tier blocks':>12} " + " ".join(f"{p:>18}" for p in TIERS))
            for size in args.tiers:
                cells = []
                for make in TIERS.values():
                    r = replay_with_tier(trace, "vllm", pool, make(size))
                    cells.append(f"{r.hit_ratio:6.2%} ({r.hit_ratio / bound:5.1%})")
                print(f"{size:>12,} " + " ".join(f"{c:>18}" for c in cells))
        print("(hit ratio, and in brackets its share of the infinite bound)")


def engine_part(args) -> None:
    torch.set_num_threads(1)
    trace = load_trace(MOONCAKE_CONVERSATION_TRACE, limit=args.engine_requests)
    engine = dict(device="cpu", dtype=torch.float32, attention_backend="torch", block_size=4,
                  num_kvcache_blocks=args.engine_pool, max_num_seqs=8)
    tier = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"num_cpu_blocks": args.engine_tier}}
    prompts = None
    ratios = {"computed": [], "ttft p50": [], "ttft p99": [], "wall": []}
    print(f"\nengine: first {len(trace):,} conversation requests, pool {args.engine_pool:,} blocks of 4 tokens, "
          f"tier {args.engine_tier:,} blocks")
    print(f"{'round':>5} {'tier':>5} {'computed':>9} {'found':>7} {'from tier':>9} {'ttft p50':>9} {'ttft p99':>9} {'wall':>7}")
    for rnd in range(args.rounds):
        row = {}
        for with_tier in (False, True):
            llm = LLM(None, **engine, kv_transfer_config=tier if with_tier else None)
            if prompts is None:
                prompts = prompts_from_trace(trace, 4, llm.config.vocab_size)
            served, wall = serve_trace(llm, prompts, max_tokens=4, concurrency=8)
            ttft = sorted(s.ttft for s in served)
            m = llm.get_metrics()
            row[with_tier] = dict(computed=sum(s.prompt_tokens - s.cached_tokens for s in served),
                                  found=sum(s.cached_tokens for s in served), tier=m.external_prefix_cache_hits,
                                  p50=statistics.median(ttft), p99=ttft[int(0.99 * (len(ttft) - 1))], wall=wall)
            r = row[with_tier]
            print(f"{rnd:>5} {'yes' if with_tier else 'no':>5} {r['computed']:>9,} {r['found']:>7,} {r['tier']:>9,} "
                  f"{r['p50'] * 1e3:>7.1f}ms {r['p99'] * 1e3:>7.1f}ms {r['wall']:>6.2f}s")
        for key, field in (("computed", "computed"), ("ttft p50", "p50"), ("ttft p99", "p99"), ("wall", "wall")):
            ratios[key].append(row[True][field] / row[False][field])
    print("with / without the tier, median [range] over rounds: " + ", ".join(
        f"{k} {statistics.median(v):.3f} [{min(v):.3f}, {max(v):.3f}]" for k, v in ratios.items()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=("replay", "engine", "both"), default="both")
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--pools", type=int, nargs="+", default=[1000, 2000])
    parser.add_argument("--tiers", type=int, nargs="+", default=[2000, 8000, 30000])
    parser.add_argument("--engine-requests", type=int, default=600)
    parser.add_argument("--engine-pool", type=int, default=400)
    parser.add_argument("--engine-tier", type=int, default=8192)
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args()
    if args.part in ("replay", "both"):
        replay_part(args)
    if args.part in ("engine", "both"):
        engine_part(args)


if __name__ == "__main__":
    main()
